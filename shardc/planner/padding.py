"""Uneven shards: the declared dims whose devices do not divide them, which XLA pads to the ceiling,
and the ZeRO-1/2 shards of the optimizer state that are padded so (:func:`shardc.planner.zero.zero_layout`).

The planner's search prices a padded dim's pieces at the ceiling, and each one a plan holds is noted,
so that plan and cost say they use the padded size.
"""

from __future__ import annotations

import math

from shardc.collectives import share
from shardc.ir.plan import Step
from shardc.ir.spec import Spec
from shardc.planner.zero import zero_axes, zero_layout
from shardc.spec.walk import leaves, spec_params

__all__ = ["uneven_dims", "padding_notes"]


def uneven_dims(spec: Spec) -> list[tuple[str, int]]:
    """(dim, devices) for every declared sharding whose devices do not divide the dim, in order; then those
    of the ZeRO-1/2 shards the optimizer phase moves gradients and params onto (stage 3's are declared)."""
    if not spec.dims:
        return []
    sizes = spec.sizes
    found: dict[tuple[str, int], None] = {}
    shards = spec.zero is not None and spec.zero.stage < 3 and zero_axes(spec)
    params = spec_params(spec) if shards else frozenset()
    seen: set[str] = set()
    for statement in spec.statements:
        for ref in (statement.result, *leaves(statement.expr)):
            layouts = [tuple(d.axes for d in ref.dims)]
            if ref.name in params and ref.name not in seen:
                seen.add(ref.name)
                layouts.append(zero_layout(ref, zero_axes(spec), spec) or layouts[0])
            for layout in layouts:
                for dim, axes in zip(ref.dims, layout, strict=True):
                    devices = math.prod(spec.mesh.size(a) for a in axes)
                    if dim.name in sizes and sizes[dim.name] % devices:
                        found[(dim.name, devices)] = None
    return list(found)


def padding_notes(spec: Spec, steps: tuple[Step, ...]) -> tuple[str, ...]:
    """One note per uneven (dim, devices) the plan holds: XLA pads each device's piece to the ceiling."""
    sizes = spec.sizes
    found: dict[tuple[str, int], None] = {}
    seen: set[object] = set()  # dims recur in every layer's steps
    for step in steps:
        for ref in (step.dst, *step.operands, *((step.src,) if step.src else ())):
            for dim in ref.dims:
                if dim in seen:
                    continue
                seen.add(dim)
                devices = math.prod(spec.mesh.size(a) for a in dim.axes)
                if sizes.get(dim.name, 0) % devices:
                    found[(dim.name, devices)] = None
    notes = []
    for name, devices in found:
        n = sizes[name]
        each = share(n, devices)
        notes.append(f"{name}={n} over {devices} devices is padded to {each * devices} ({each} a device, "
                     f"as XLA pads uneven shards): plan and cost use the padded size")
    return tuple(notes)
