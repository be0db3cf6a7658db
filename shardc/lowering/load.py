"""Running a plan's module: the mesh and sizes it runs at, the devices it needs, the module loaded.

Both the plain lowering (:mod:`shardc.lowering.api`) and the pipelined one
(:mod:`shardc.lowering.pipeline_lowering`) lower and load through these.
"""

from __future__ import annotations

import linecache
import types

import numpy as np

from shardc.collectives import share
from shardc.errors import ShardcError
from shardc.ir.plan import Plan

__all__ = ["lowered_mesh", "lowered_sizes", "check_devices", "load_module"]


def lowered_mesh(plan: Plan, sizes: dict[str, int] | None) -> tuple[tuple[str, int], ...]:
    """The plan's mesh with axis sizes taken from ``sizes`` where given."""
    sizes = sizes or {}
    return tuple((a.name, int(sizes.get(a.name, a.size))) for a in plan.spec.mesh.axes)


def lowered_sizes(plan: Plan, sizes: dict[str, int] | None,
                  mesh: tuple[tuple[str, int], ...]) -> dict[str, int] | None:
    """Dims and mesh sizes: the plan's, overridden by ``sizes`` (dims may be missing)."""
    axis_names = {name for name, _ in mesh}
    dims = dict(plan.spec.dims)
    dims.update({k: v for k, v in (plan.sizes or ()) if k not in axis_names})
    dims.update({k: int(v) for k, v in (sizes or {}).items() if k not in axis_names})
    merged = {**dims, **dict(mesh)}
    _check_divisible(plan, merged)
    return merged


def _check_divisible(plan: Plan, sizes: dict[str, int]) -> None:
    for step in plan.forward + plan.backward:
        for ref in (step.dst, *step.operands, *([step.src] if step.src else [])):
            for d in ref.dims:
                if d.name not in sizes:
                    continue
                shards = int(np.prod([sizes[a] for a in d.axes])) if d.axes else 1
                if sizes[d.name] % shards:
                    even = share(sizes[d.name], shards) * shards
                    raise ShardcError(
                        f"{d.name}={sizes[d.name]} is not divisible by the {shards} shards of {ref}: "
                        "shard_map needs even blocks, and this lowering does not pad them as XLA's "
                        "partitioner would", fix=f"lower at sizes that divide (e.g. --set {d.name}={even}); "
                        "`shardc verify` picks such sizes itself")


def check_devices(mesh: tuple[tuple[str, int], ...]) -> None:
    """A mesh larger than the devices present is an error that says how to emulate them."""
    import jax

    needed = int(np.prod([size for _, size in mesh]))
    present = jax.device_count()
    if present < needed:
        text = ", ".join(f"{n}={s}" for n, s in mesh)
        raise ShardcError(
            f"the mesh {text} needs {needed} devices but jax sees {present} "
            f"({jax.default_backend()})",
            fix=f"on a CPU, emulate devices: set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{needed} in the environment before jax is imported (e.g. `XLA_FLAGS=... python ...`), "
                "or shrink the mesh with --set AXIS=SIZE")


_loaded = 0


def load_module(source: str, name: str) -> types.ModuleType:
    """Execute generated source as a module; its lines show in tracebacks."""
    global _loaded
    _loaded += 1
    filename = f"<shardc-lowered-{_loaded}:{name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(f"shardc_lowered_{_loaded}")
    module.__file__ = filename
    exec(compile(source, filename, "exec"), module.__dict__)
    return module
