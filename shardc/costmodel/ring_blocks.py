"""The buffers a collective matmul's ring holds beyond its operands and result while it runs
(:mod:`shardc.planner.collective_matmul`, lowered by :func:`shardc.lowering.runtime_collective`), and the
residuals a backend slices out of a ring's slot: temporaries of a phase
(:func:`shardc.costmodel.phase_memory.phase_memory`)."""

from __future__ import annotations

from math import prod
from typing import TYPE_CHECKING

from shardc.collectives import Op
from shardc.costmodel.heap import Span
from shardc.fusion import fusible
from shardc.ir.plan import Step
from shardc.ir.spec import TensorRef

if TYPE_CHECKING:
    from shardc.costmodel.phase_memory import _Copies

__all__ = ["matmul_ring_buffers", "ring_slices", "ring_sliced", "rings_together", "sums_blocks"]


def ring_slices(steps: tuple[Step, ...], residuals: set[TensorRef], last: dict[TensorRef, int],
                early: dict[TensorRef, Span], copies: _Copies) -> dict[TensorRef, Span]:
    """The ``residuals`` sliced out of their rings (:attr:`shardc.costmodel.phase_memory.Buffers.ring_slices`):
    each a step other than a map reads (a dot, a collective, a kernel) and no layout copy in ``early`` holds,
    alive to its last reader from its first, or from the phase's start where the backend runs first what
    reads only the loop's state."""
    first = {ref: k for k in reversed(range(len(steps))) for ref in steps[k].reads if not fusible(steps[k])}
    return {ref: (0 if copies.buffers.arguments_first else first[ref], last[ref],
                  copies.buffers.rounded(copies.nbytes(ref))) for ref in residuals - early.keys() if ref in first}


def sums_blocks(step: Step) -> bool:
    """Whether ``step`` is a collective matmul whose ring gathers an operand's blocks into products its result does
    not keep the ring's index of: the products are summed into the result after the last, by one fusion reading
    them all, so the result is not alive beside them (XLA's CPU backend: tp.shard's backward at verify's sizes,
    dTmp's add_add_fusion at instruction 28, where its four block products die; fsdp_tp.shard's at 32)."""
    c = step.collective
    return c is not None and c.op is Op.ALL_GATHER and _ring_index(step) not in [d.name for d in step.dst.dims]


def rings_together(steps: tuple[Step, ...]) -> dict[int, int]:
    """Per collective matmul whose ring gathers a value that a later one's gathers again over the same axes, the
    step of the last such: XLA's common-subexpression elimination merges their identical collective-permutes
    (one received block a hop, read by both rings' block matmuls) and its scheduler runs the rings' block
    matmuls block by block together."""
    gathered: dict[tuple[TensorRef, tuple[str, ...]], list[int]] = {}
    for k, step in enumerate(steps):
        c = step.collective
        if c is not None and c.op is Op.ALL_GATHER and c.src is not None:
            gathered.setdefault((c.src, tuple(c.axes)), []).append(k)
    return {k: ks[-1] for ks in gathered.values() for k in ks[:-1]}


def matmul_ring_buffers(k: int, step: Step, since: dict[TensorRef, int], dying: set[TensorRef],
                        copies: _Copies, until: int | None = None) -> list[Span]:
    """The buffers a collective matmul at step ``k`` (:mod:`shardc.planner.collective_matmul`) holds beyond
    its operands and result, as :func:`shardc.lowering.runtime_collective` runs its ring of n blocks: the
    blocks it receives (the gathered operand's, or the partial sums passed on), the block matmuls'
    products, and the blocks of the other operands along the ring's index.

    A TPU or GPU (a latency-hiding scheduler issuing each send under the block matmul before it) holds the
    block it computes with and the next one arriving, a double buffer (one where the ring has two devices,
    as :func:`shardc.costmodel.memory.ring_buffers` counts them), and one block's product; a block of
    another operand is read in place.  With ``ring_blocks_first`` (XLA's CPU backend, nothing to hide)
    every block of the other operands is sliced into a buffer of its own as soon as the operand is there
    (``since``: the step a value is made at, or the phase's start) and lives to its block matmul; an
    operand ``dying`` at the ring dies into its blocks: they add their padding to its own bytes, and at
    the ring's last block only that block is left of it, but it dies only when the last is sliced, each
    block a fusion's result in a buffer of its own (a slice is never made in its operand's place), so it
    is alive beside all n at the step before the ring (``fsdp_tp.shard``'s backward at 16x its sizes:
    the gathered W_in beside its four blocks for dIn's ring, XLA's peak).  The n block matmuls run before their products
    are added up or sent around: all n products are alive at the last (where the result keeps the gathered
    index, each block's product is written into it as the next is made: two alive), beside the last
    block's slices and the received block it reads; a ring passing partial sums on receives its first after
    the last block matmul, the last slices dead by then."""
    c = step.collective
    assert c is not None and c.src is not None
    n = prod(copies.sizes[a] for a in c.axes)
    gathered = c.op is Op.ALL_GATHER
    keeps = gathered and not sums_blocks(step)  # a block's product: the result's
    product = copies.nbytes(step.dst) / (n if keeps else 1)
    rounded = copies.buffers.rounded
    received_block = rounded(copies.nbytes(c.src if gathered else step.dst))
    if not copies.buffers.ring_blocks_first:
        return [(k, k, min(2, n - 1) * received_block + rounded(product))]
    blocks = {ref: rounded(copies.nbytes(ref) / n) for ref in ring_sliced(step)}
    # a value the ring reads last dies into its blocks: beyond the last slice they add only their padding
    freed = {ref: rounded(copies.nbytes(ref)) if ref in dying else 0.0 for ref in blocks}
    # each block a buffer of its own, at its own bytes (the heap aligns it: shardc.costmodel.heap.packed), but those
    # of an operand dying into them, counted as their padding beyond its bytes
    early = [ref for ref in blocks if since.get(ref, k) < k]
    spans: list[Span] = [(since[ref], k - 1, copies.nbytes(ref) / n) for ref in early if not freed[ref]
                         for _ in range(n)]
    spans += [(since[ref], k - 1, n * blocks[ref] - freed[ref]) for ref in early if freed[ref]]
    spans += [(k - 1, k - 1, freed[ref]) for ref in early if freed[ref]]  # the last slice
    # a gathered ring's block matmuls read the blocks received, the next arriving beside the one read; a ring
    # passing partial sums on receives the first only after its last block matmul, when that block's slices
    # have died (tp.shard's forward at verify's sizes: XLA's ppermutes after all four dots, each slice freed at
    # its dot): at its first block matmul, its blocks and that matmul's product
    first = min(2, n - 1) * received_block if gathered else rounded(product)
    at_start = sum(n * blocks[ref] - freed[ref] for ref in blocks) + first
    last_blocks = sum(blocks[ref] - freed[ref] for ref in blocks)
    held = last_blocks + received_block if gathered else max(sum(blocks.values()), received_block) - sum(freed.values())
    at_last = (2 if keeps else n) * rounded(product) + held
    if until is not None:  # run with a later ring receiving the same blocks (rings_together): it holds them
        return spans + [(k, until, max(at_start, at_last) - received_block)]
    return spans + [(k, k, max(at_start, at_last))]


def _ring_index(step: Step) -> str:
    """The index a collective matmul's ring runs along: its collective's dim."""
    c = step.collective
    assert c is not None and c.src is not None and c.dim is not None
    return (c.src if c.op is Op.ALL_GATHER else c.dst).dims[c.dim].name


def ring_sliced(step: Step) -> list[TensorRef]:
    """A collective matmul's operands its ring slices into blocks: those with its index but the one gathered."""
    c = step.collective
    assert c is not None
    index = _ring_index(step)
    return [ref for ref in step.operands
            if not (c.op is Op.ALL_GATHER and ref == c.src) and index in [d.name for d in ref.dims]]

