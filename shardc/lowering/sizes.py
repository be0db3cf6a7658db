"""Small sizes for running a plan: a mesh that fits the devices, dims that divide.

Used by verification (runs on a few emulated CPU devices) and by the demo of a
generated module.  The plan's steps are symbolic in the sizes, so the same plan
lowers unchanged at any sizes its shardings divide.
"""

from __future__ import annotations

import math

from shardc.planner.ir import Plan
from shardc.spec.ir import TensorRef

__all__ = ["shrink_mesh", "small_sizes", "MAX_SMALL_DIM"]

MAX_SMALL_DIM = 64  # the spec's own dims are used when every one is at most this


def shrink_mesh(mesh: list[tuple[str, int]], devices: int) -> list[tuple[str, int]]:
    """Divide the largest axis by its smallest prime factor until the mesh fits."""
    mesh = list(mesh)
    while math.prod(s for _, s in mesh) > devices:
        k = max(range(len(mesh)), key=lambda j: (mesh[j][1], -j))
        name, size = mesh[k]
        factor = next(p for p in range(2, size + 1) if size % p == 0)
        mesh[k] = (name, size // factor)
    return mesh


def _refs(plan: Plan) -> list[TensorRef]:
    refs = [info.ref for info in plan.tensors] + list(plan.cotangents + plan.grads)
    for step in plan.forward + plan.backward:
        refs += [step.dst, *step.operands] + ([step.src] if step.src else [])
    return refs


def small_sizes(plan: Plan, devices: int | None = 8) -> dict[str, int]:
    """Dims and mesh sizes for a run on ``devices`` devices (None: keep the mesh)."""
    axes = [(a.name, a.size) for a in plan.spec.mesh.axes]
    mesh = dict(axes if devices is None else shrink_mesh(axes, devices))
    need: dict[str, int] = {}
    for ref in _refs(plan):
        for d in ref.dims:
            need[d.name] = math.lcm(need.get(d.name, 1), math.prod(mesh[a] for a in d.axes))
    own = plan.spec.sizes
    if own and all(0 < own.get(n, 0) <= MAX_SMALL_DIM and own[n] % m == 0 for n, m in need.items()):
        return {**{n: own[n] for n in need}, **mesh}
    sizes: dict[str, int] = {}
    for name, base in need.items():
        factor = max(2, -(-4 // base))  # at least 4 elements, at least 2 per shard
        while base * factor in sizes.values():  # distinct sizes catch transposed dims
            factor += 1
        sizes[name] = base * factor
    return {**sizes, **mesh}
