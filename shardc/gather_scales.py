"""The scales of params gathered in float8 (``param_gather in f8``): one AllReduce of their amaxes a step.

torchao's float8 all-gather under FSDP2 casts each weight's shard at a tensorwise scale, the float8 maximum
over the weight's amax, before the gather (``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather``).  With
``precompute_float8_dynamic_scale_for_fsdp``, which torchtitan runs after each optimizer step when
``--float8.precompute_float8_dynamic_scale_for_fsdp`` is set, every weight's amax is taken on its shard
(``torch._foreach_norm(weights, ord=inf)``, partial over the mesh the weights are sharded on), the amaxes are
stacked into one tensor, and a single all-reduce (max) makes them whole (torchao/float8/fsdp_utils.py): one
AllReduce a step of one float32 a gathered weight (a layer's weights each), over the axes the weights are
gathered over, exposed between the update and the next forward's first gather, which needs its scale.
Without the precompute each gather reduces its own amax (``reduce_amax=True``); shardc costs the precompute,
the path torchtitan's float8 documentation gives for FSDP.  A gather in a type wider than float8 (bf16 of an
f32 param, FSDP2's ``param_dtype``) is a plain cast: no scale, nothing reduced.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from shardc.collectives import Layout, Op, collective_time
from shardc.hardware import Hardware
from shardc.ir.plan import Plan, Step
from shardc.ir.spec import DType
from shardc.layer_counts import step_count

__all__ = ["AMAX_BYTES", "scale_reduction", "scale_seconds"]

AMAX_BYTES = 4  # one float32 amax a weight (torchao's scales are float32: fsdp_utils.py casts them so)


def scale_reduction(plan: Plan, counts: Sequence[int]) -> tuple[float, tuple[str, ...]]:
    """The amaxes' AllReduce a step: its bytes (one float32 a gathered param, a block's once a layer) and the
    mesh axes the params are gathered over (in mesh order); (0, ()) where no param is gathered in float8."""
    if plan.spec.param_gather_dtype is not DType.F8:
        return 0.0, ()
    first: dict[str, Step] = {}  # each param's first gather (gathered again in the backward: counted once)
    axes: set[str] = set()
    for step in plan.forward + plan.backward + plan.optimizer:
        if step.op is Op.ALL_GATHER and plan.moved_nbytes(step) < plan.nbytes(step.tensor):
            first.setdefault(step.tensor, step)
            axes.update(step.axes)
    weights = sum(step_count(s, counts) for s in first.values())
    return float(AMAX_BYTES * weights), tuple(a for a in plan.spec.mesh.names if a in axes)


def scale_seconds(plan: Plan, sizes: Mapping[str, int], hw: Hardware, counts: Sequence[int],
                  links: Layout | None = None) -> float:
    """Time of :func:`scale_reduction`'s AllReduce on ``hw`` (its latency, mostly: a few KB); 0 under the
    book's model or where there is none."""
    nbytes, axes = scale_reduction(plan, counts)
    if hw.book or not axes:
        return 0.0
    return collective_time(Op.ALL_REDUCE, nbytes, axes, plan.spec.mesh, sizes, hw, links).seconds
