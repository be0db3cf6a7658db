"""What a compiler's fusion makes again inside each reader, or once in a buffer of its own, beyond the
plan's values (:func:`shardc.costmodel.phase_memory.phase_memory` counts these buffers, or none)."""

from __future__ import annotations

from collections.abc import Callable

from shardc.collectives import Op
from shardc.costmodel.heap import Span
from shardc.device_pieces import local_elements
from shardc.fusion import is_product
from shardc.ir.localops import MapVjp, Row
from shardc.ir.plan import Step
from shardc.ir.spec import TensorRef
from shardc.ops.elementwise import TRANSCENDENTAL

__all__ = ["summed_into", "derivatives", "exponentials"]


def summed_into(steps: tuple[Step, ...], sizes: dict[str, int], least: int) -> dict[int, int]:
    """Per dot whose only reader is a dot with no free index (an elementwise product summed over the
    indices the result lacks), the reader's step, where the product has at least ``least`` elements
    (0: none).

    XLA's algebraic simplifier runs a dot with no free index as a multiply and a reduce, and XLA's CPU
    backend grows the YNNPACK fusion of the dot making its operand over them, as it does over every
    elementwise op and reduction with at least 4096 elements in its result or an operand
    (``IsInstructionPreferredByYnn`` in ``xla/backends/cpu/ynn_support.cc``): the dot's result is never
    written (``moe_layer.shard``'s backward at 16x its sizes: dComb = dOut · Ex, 604 MB, summed with
    the dispatch mask over C into dGate inside one fusion; at verify's sizes, 2304 elements, it is)."""
    if not least:
        return {}
    made = {s.dst: j for j, s in enumerate(steps)}
    readers: dict[int, list[int]] = {}
    for k, step in enumerate(steps):
        for ref in dict.fromkeys(step.reads):
            if made.get(ref, k) < k:
                readers.setdefault(made[ref], []).append(k)
    out = {}
    for j, k in ((j, ks[0]) for j, ks in readers.items() if len(ks) == 1):
        dot, reader = steps[j], steps[k]
        if dot.op is Op.EINSUM and not is_product(dot) and _no_free(reader) \
                and local_elements(dot.dst, sizes) >= least:
            out[j] = k
    return out


def _no_free(step: Step) -> bool:
    """Whether a dot of two operands has no free index: each operand's indices are all the other's."""
    if step.op is not Op.EINSUM or is_product(step) or len(step.operands) != 2:
        return False
    a, b = ({d.name for d in ref.dims} for ref in step.operands)
    return a == b


def derivatives(steps: tuple[Step, ...], copied: Callable[[Step], list[TensorRef]], first: set[TensorRef],
                nbytes: Callable[[TensorRef], float]) -> list[Span]:
    """Per map's gradient whose derivative is transcendental (gelu's tanh, silu's exp) and whose result two
    or more readers copy for their layout (``copied``: a step's layout copies), the derivative's buffer
    (the map's input's bytes), from the start where that input is in ``first`` (a value the phase takes,
    under :attr:`~shardc.costmodel.phase_memory.Buffers.arguments_first`), else its step, to the gradient's.

    XLA's fusion makes the gradient again inside each copy's fusion (it reads the cotangent and the input
    once an element), but not the derivative, which it counts expensive (``IsExpensive``,
    ``xla/service/instruction_fusion.cc``) and makes once in a buffer of its own; reading only the saved
    input, it is scheduled first (``moe_dispatch.shard``'s backward at 16x its sizes: gelu's derivative of
    H_t1, 176 MB, alive from the start to dH_t1, which dW_1's and dIn's dots each copy)."""
    spans: list[Span] = []
    for k, step in enumerate(steps):
        if not isinstance(step.fn, MapVjp) or step.fn.name not in TRANSCENDENTAL:
            continue
        if sum(step.dst in copied(r) for r in steps[k + 1:] if step.dst in r.operands) > 1:
            spans.append((0 if step.operands[0] in first else k, k, nbytes(step.operands[0])))
    return spans


def exponentials(steps: tuple[Step, ...], readers: dict[TensorRef, list[Step]], last: dict[TensorRef, int],
                 nbytes: Callable[[TensorRef], float], copied: Callable[[Step], list[TensorRef]],
                 outs: set[TensorRef], sizes: dict[str, int], least: int) -> list[Span]:
    """Per softmax that a product reads after another step does, its exponentials (its result's bytes),
    alive from the softmax to its last reader: the softmax's last division, a multiply an element, is
    made again inside the product's fusion (as :attr:`~shardc.costmodel.phase_memory.Buffers.products_again`
    makes a product again), so the exponentials it divides live to it (``moe_layer.shard``'s forward: the
    gates' exponentials alive to the combine weights, Gate · Disp, and the copy of them XLA makes for the
    combine's dot).  So is the division made again inside the copy a dot takes of the softmax for its layout
    (``copied``: a step's layout copies) where the softmax is also written for another reader or returned
    (``outs``) and its rows (one reciprocal of their sum each) are fewer than ``least`` (YNNPACK's
    fewest elements, :attr:`~shardc.costmodel.phase_memory.Buffers.dot_sums`): the exponentials live to
    that dot (``moe_transformer.shard``'s forward at verify's sizes: P's exponentials, 51 kB, alive beside
    P's copy for At's dot, XLA's peak).  From ``least`` rows the reciprocal joins YNNPACK's fusion of the
    exponentials and their sums, which writes the softmax whole, and the copy reads it (the same at 16x
    its sizes: P made in one fusion, 54 GB, its copy made from it)."""
    spans: list[Span] = []
    for k, s in enumerate(steps):
        if s.fn is not Row.SOFTMAX:
            continue
        reads = readers.get(s.dst, [])
        copying = [j for j in range(k + 1, len(steps)) if s.dst in steps[j].operands and s.dst in copied(steps[j])]
        if any(is_product(r) for r in reads[1:]):
            spans.append((k, last[s.dst], nbytes(s.dst)))
        elif copying and (s.dst in outs or len(reads) > 1) and _rows(s, sizes) < least:
            spans.append((k, max(copying), nbytes(s.dst)))
    return spans


def _rows(step: Step, sizes: dict[str, int]) -> float:
    """A row reduction's rows on one device: its result's elements over those of the dim it reduces."""
    assert step.dim is not None
    reduced = TensorRef("", (step.dst.dims[step.dim],))
    return float(local_elements(step.dst, sizes)) / float(local_elements(reduced, sizes))
