"""How often a plan's steps run: each ``layers`` block's layer count at given sizes, on a pipeline the device
holding the most layers' share (:func:`shardc.pipeline.block_split.counted_device`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from shardc.collectives import share
from shardc.errors import ShardcError
from shardc.ir.plan import Plan, Step
from shardc.pipeline.block_split import counted_device
from shardc.spec.stages import pipeline_of

__all__ = ["runs", "step_count", "resolve_layers", "block_counts"]


def runs(once: bool, block: int, counts: Sequence[int]) -> int:
    """How often a step runs in a training step: once a layer of its block (``counts``: every block's
    layers, :func:`block_counts`), or once (outside every ``layers`` block)."""
    return 1 if once else counts[block]


def step_count(step: Step, counts: Sequence[int]) -> int:
    """:func:`runs` of a plan's step."""
    return runs(step.once, step.block, counts)


def resolve_layers(plan: Plan, sizes: Mapping[str, int]) -> tuple[int, str | None]:
    """The layer count, and its symbol when the spec names a dim (``layers L``).

    A pipelined plan is one stage's (:mod:`shardc.spec.stages`): its count is the
    slowest stage's, ceil(L / P), with no symbol; with several blocks, the first block's
    layers on the device :func:`block_counts` counts.
    """
    counted = _stage_counts(plan, sizes)
    if counted is not None:
        return counted[0], None
    layers, symbol = _all_layers(plan, sizes)
    axis = plan.spec.mesh.pipeline_axis
    if axis is not None:
        return share(layers, sizes.get(axis.name, axis.size)), None
    return layers, symbol


def block_counts(plan: Plan, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """Every ``layers`` block's count, by :attr:`Step.block`: the first :func:`resolve_layers`'s, the
    others their own; a pipeline with several blocks: each block's layers on one device, the one
    holding the most layers (:func:`~shardc.pipeline.block_split.counted_device`)."""
    counted = _stage_counts(plan, sizes)
    if counted is not None:
        return counted
    first, _ = resolve_layers(plan, sizes)
    return (first, *(_count_of(layers, sizes) for layers in plan.spec.layer_counts()[1:]))


def _stage_counts(plan: Plan, sizes: Mapping[str, int]) -> tuple[int, ...] | None:
    """A pipeline's counted device's layers of each block, where the spec has several blocks; else None."""
    axis, written = plan.spec.mesh.pipeline_axis, plan.spec.layer_counts()
    if axis is None or len(written) < 2:
        return None
    pipe = pipeline_of(plan.spec, {str(n): _count_of(n, sizes) for n in written if isinstance(n, str)})
    assert pipe is not None
    return counted_device(replace(pipe, stages=sizes.get(axis.name, axis.size)))


def _count_of(layers: int | str, sizes: Mapping[str, int]) -> int:
    if isinstance(layers, int):
        return layers
    if layers not in sizes:
        raise ShardcError(f"`layers {layers}` names no known size",
                          fix=f"add {layers}=... to the `dims` line, or pass --set {layers}=...")
    return sizes[layers]


def _all_layers(plan: Plan, sizes: Mapping[str, int]) -> tuple[int, str | None]:
    layers = plan.spec.layers
    if layers is None:
        indices = {d.name for info in plan.tensors for d in info.ref.dims}
        if "L" in sizes and "L" not in indices:  # --set L=40 without a `layers` line
            return sizes["L"], "L"
        return 1, None
    return _count_of(layers, sizes), layers if isinstance(layers, str) else None
