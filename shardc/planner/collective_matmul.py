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
the axis), on a dim the axis divides, and nothing else reads the gathered operand or the partial
result; and only where the fused step's time is less than the pair's, on the plan's chip.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace

from shardc.fusion import is_product
from shardc.hardware import Hardware
from shardc.ir.plan import Op, Plan, Sections, Step
from shardc.ir.spec import TensorRef
from shardc.timing import StepCost, cost_step, plan_dtype, plan_links, plan_sizes

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
    """``plan`` with each critical-path AllGather feeding only an einsum, and each einsum whose partial
    result only a critical-path ReduceScatter reads, fused into a collective matmul where that is faster
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


def _reads(steps: Iterable[Step]) -> Counter[TensorRef]:
    return Counter(ref for s in steps for ref in (*s.operands, *s.shapes, *((s.src,) if s.src else ())))


def _fuse(plan: Plan, steps: tuple[Step, ...], kept: set[TensorRef]) -> tuple[Step, ...]:
    out = list(steps)
    k = 0
    while k < len(out):
        fused = _pair(plan, out, k, kept)
        if fused is not None:
            i, j, step = fused
            out[i] = step
            del out[j]
            if j <= k:  # the gather fused into its einsum: the step now at k is the next one
                continue
        k += 1
    return tuple(out)


def _pair(plan: Plan, steps: list[Step], k: int, kept: set[TensorRef]) -> tuple[int, int, Step] | None:
    """(where the fused step goes, the step it absorbs, the fused step) for the collective or einsum at
    ``k`` and its only reader, or None."""
    sizes = plan_sizes(plan)
    reads = _reads(steps)
    first = steps[k]
    if first.op is Op.ALL_GATHER and not first.ahead and ring_dim(first, sizes):
        value = first.dst
    elif first.op is Op.EINSUM and first.collective is None and first.dst.unreduced:
        value = first.dst
    else:
        return None
    if value in kept or reads[value] != 1 or value.unreduced and first.op is Op.ALL_GATHER:
        return None
    j = next((j for j in range(k + 1, len(steps)) if value in _reads((steps[j],))), None)
    if j is None:
        return None
    second = steps[j]
    if first.op is Op.ALL_GATHER:
        assert first.src is not None
        if second.op is not Op.EINSUM or second.collective is not None or second.operands.count(value) != 1 \
                or first.src in second.operands:
            return None
        k_op = second.operands.index(value)
        fused = replace(second, operands=second.operands[:k_op] + (first.src,) + second.operands[k_op + 1:],
                        axes=first.axes, collective=first)
        return (j, k, fused) if _faster(plan, fused, (first, second)) else None
    if second.op is not Op.REDUCE_SCATTER or second.ahead or not ring_dim(second, sizes) or second.src != value:
        return None
    fused = replace(first, dst=second.dst, axes=second.axes, collective=second)
    return (k, j, fused) if _faster(plan, fused, (first, second)) else None


def _faster(plan: Plan, fused: Step, pair: tuple[Step, Step]) -> bool:
    """Whether the fused step takes less time than the pair it replaces (both on the critical path)."""
    einsum = next(s for s in pair if s.op is Op.EINSUM)
    if is_product(einsum):  # an elementwise product is memory-bound: nothing to hide the transfer under
        return False
    hw: Hardware = plan.chip
    sizes = plan_sizes(plan)
    links = plan_links(plan, hw, sizes)[0]
    dtype = plan_dtype(plan)

    def seconds(row: StepCost) -> float:
        return row.compute_s + row.memory_s + row.exposed_comm_s + (row.comm_s if row.is_collective else 0.0)

    def cost(step: Step) -> StepCost:
        return cost_step(0, step, plan.spec.mesh, sizes, hw, links, dtype, text="")

    return seconds(cost(fused)) < math.fsum(seconds(cost(s)) for s in pair)
