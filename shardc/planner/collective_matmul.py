"""Collective matmul: an einsum and the AllGather before it, or the ReduceScatter after it, as one ring.

An activation gathered over a mesh axis just before an einsum reads it (the sequence-parallel gather
entering a tensor-parallel block), or an einsum's partial result reduce-scattered just after (the one
leaving it), waits for the whole collective: it sits on the critical path.  Decomposed into n steps
around the axis's ring of n devices, the transfers overlap the matmuls (Wang et al. 2023,
"Overlap Communication with Dependent Computation via Decomposition in Large Deep Learning Models";
the "Collective matmul" example of JAX's shard_map documentation; the sharded-matmul chapter of "How
To Scale Your Model"):

- gathered: each device multiplies the block of the operand it holds while it sends that block on to
  the next device with ``jax.lax.ppermute``; after n - 1 sends every block has been multiplied;
- reduce-scattered: each device computes the partial result of one block, adds it to the accumulator
  it received and sends the sum on; after n - 1 sends each device holds its block, summed.

n matmuls of one block each, n - 1 transfers of one block each: only the part of a transfer its block's
matmul does not hide stays exposed (:func:`shardc.steptime.ring_time`).  The pass fuses such a pair
where the collective is on the critical path (an ahead-of-time weight gather is hidden already), runs
over one axis that is the minor-most of its dim's (so a device's block along the dim is its index on
the axis), on a dim the axis divides, and nothing but einsums reads the gathered operand (each of them
then runs its own ring of block matmuls; their sends are the same blocks the same way, which the compiled
program makes once: the first ring's sends, under its block matmuls, :func:`shardc.ring_sends.shared_rings`),
or nothing but the ReduceScatter the partial result; and only where the fused steps' time is less than
the steps they replace, on the plan's chip.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import replace

from shardc.fusion import is_product
from shardc.hardware import Hardware
from shardc.ir.plan import Op, Plan, Sections, Step
from shardc.ir.spec import TensorRef
from shardc.ring_sends import shared_rings
from shardc.step_cost import cost_step
from shardc.timing import plan_dtype, plan_links, plan_sizes

__all__ = ["fuse_collective_matmuls", "ring_dim"]


def ring_dim(c: Step, sizes: dict[str, int]) -> bool:
    """Whether collective ``c`` can run as a ring over its one axis: an AllGather or ReduceScatter of one
    dim whose axes gain (or lose) only that axis, the minor-most, and whose size the dim's devices divide."""
    if c.op not in (Op.ALL_GATHER, Op.REDUCE_SCATTER) or c.src is None or c.dim is None or len(c.axes) != 1:
        return False
    (axis,) = c.axes
    whole, cut = (c.dst, c.src) if c.op is Op.ALL_GATHER else (c.src, c.dst)
    if [d for d in range(len(whole.dims)) if whole.dims[d] != cut.dims[d]] != [c.dim]:
        return False
    dim = cut.dims[c.dim]
    devices = math.prod(sizes[a] for a in dim.axes)
    return dim.axes == whole.dims[c.dim].axes + (axis,) and sizes[axis] > 1 and sizes[dim.name] % devices == 0


def fuse_collective_matmuls(plan: Plan) -> Plan:
    """``plan`` with each critical-path AllGather read only by einsums, and each einsum whose partial
    result only a critical-path ReduceScatter reads, fused into collective matmuls where that is faster
    on the plan's chip; the forward and the backward (what the backward recomputes is left as it is)."""
    if plan.sizes is None or plan.chip.book or plan.spec.mesh.pipeline_axis is not None:
        return plan
    # what a phase hands on (the values the backward keeps from the forward, the gradients, the declared
    # tensors): another phase reads only these of a phase's values
    kept = {*plan.residuals, *plan.grads, *plan.cotangents, *(t.ref for t in plan.tensors)}
    forward = _fuse(plan, plan.forward, kept)
    backward = _fuse(plan, plan.backward, kept)
    if forward == plan.forward and backward == plan.backward:
        return plan
    return replace(plan, forward=forward, backward=backward,
                   sections=None if plan.sections is None else Sections.of(forward, backward, plan.recomputed))


def _reads(step: Step) -> Iterable[TensorRef]:
    """The values ``step`` reads, once for each time it reads them (its data's and its shapes')."""
    return step.reads_with_shapes


class _Readers:
    """Who reads each value of a phase: value -> {step's index: how many times it reads it}, kept as steps
    are fused, so that each question costs the readers it has, not a scan of the phase (which made the pass
    grow with the square of the steps)."""

    def __init__(self, steps: list[Step | None]) -> None:
        self.of: dict[TensorRef, dict[int, int]] = defaultdict(dict)
        for i, step in enumerate(steps):
            if step is not None:
                self.add(i, step)

    def add(self, i: int, step: Step) -> None:
        for ref in _reads(step):
            self.of[ref][i] = self.of[ref].get(i, 0) + 1

    def drop(self, i: int, step: Step) -> None:
        for ref in _reads(step):
            self.of[ref].pop(i, None)

    def sole(self, ref: TensorRef, after: int) -> list[int] | None:
        """The steps after ``after`` that read ``ref``, in order, where they read it once each and nothing
        else (``after`` included) reads it; else None."""
        where = self.of.get(ref, {})
        if any(i <= after or n != 1 for i, n in where.items()):
            return None
        return sorted(where)


def _fuse(plan: Plan, steps: tuple[Step, ...], kept: set[TensorRef]) -> tuple[Step, ...]:
    out: list[Step | None] = list(steps)  # None: a step fused into another; indices stay the steps'
    readers = _Readers(out)
    sizes = plan_sizes(plan)
    for k in range(len(out)):
        step = out[k]
        if step is None:
            continue
        find = _gather if step.op is Op.ALL_GATHER else _scatter
        # each index changed: its fused step, or None where the step is absorbed
        for i, fused in find(plan, sizes, out, k, kept, readers).items():
            if (old := out[i]) is not None:
                readers.drop(i, old)
            out[i] = fused
            if fused is not None:
                readers.add(i, fused)
    return tuple(s for s in out if s is not None)


def _gather(plan: Plan, sizes: dict[str, int], steps: list[Step | None], k: int, kept: set[TensorRef],
            index: _Readers) -> dict[int, Step | None]:
    """The AllGather at ``k`` run as a ring inside each einsum that reads its result, where every reader is
    such an einsum (each runs its own ring; the first one's sends bring the blocks to all)."""
    c = steps[k]
    assert c is not None
    if c.ahead or c.src is None or c.dst in kept or c.dst.unreduced or not ring_dim(c, sizes):
        return {}
    readers = index.sole(c.dst, k)
    if not readers:
        return {}
    fused: dict[int, Step | None] = {k: None}
    plain = [c]
    for j in readers:
        e = steps[j]
        assert e is not None
        if e.op is not Op.EINSUM or e.collective is not None or c.src in e.operands or c.dst not in e.operands:
            return {}
        i = e.operands.index(c.dst)
        fused[j] = replace(e, operands=e.operands[:i] + (c.src,) + e.operands[i + 1:], axes=c.axes, collective=c)
        plain.append(e)
    return fused if _faster(plan, [s for s in fused.values() if s is not None], plain) else {}


def _scatter(plan: Plan, sizes: dict[str, int], steps: list[Step | None], k: int, kept: set[TensorRef],
             index: _Readers) -> dict[int, Step | None]:
    """The einsum at ``k`` and the ReduceScatter of its partial result, its only reader, as one ring."""
    e = steps[k]
    assert e is not None
    if e.op is not Op.EINSUM or e.collective is not None or not e.dst.unreduced or e.dst in kept:
        return {}
    reader = index.sole(e.dst, k)
    if reader is None or len(reader) != 1:
        return {}
    (j,) = reader
    c = steps[j]
    assert c is not None
    if c.op is not Op.REDUCE_SCATTER or c.ahead or c.src != e.dst or not ring_dim(c, sizes):
        return {}
    fused = replace(e, dst=c.dst, axes=c.axes, collective=c)
    return {k: fused, j: None} if _faster(plan, [fused], [e, c]) else {}


def _faster(plan: Plan, fused: list[Step], plain: list[Step]) -> bool:
    """Whether the fused steps take less time than the steps they replace (all on the critical path)."""
    if any(is_product(s) for s in plain if s.op is Op.EINSUM):  # memory-bound: nothing hides a transfer
        return False
    hw: Hardware = plan.chip
    sizes = plan_sizes(plan)
    links = plan_links(plan, hw, sizes)[0]
    dtype = plan_dtype(plan)

    def seconds(step: Step, shared: bool) -> float:
        row = cost_step(0, step, plan.spec.mesh, sizes, hw, links, dtype, text="", shared=shared)
        return row.compute_s + row.memory_s + row.exposed_comm_s + (row.comm_s if row.is_collective else 0.0)

    return math.fsum(map(seconds, fused, shared_rings(fused))) < math.fsum(map(seconds, plain, shared_rings(plain)))
