"""Small sizes for running a plan: a mesh that fits the devices, dims that divide.

Used by verification (runs on a few emulated CPU devices) and by the demo of a
generated module.  The plan's steps are symbolic in the sizes, so the same plan
lowers unchanged at any sizes its shardings divide: a shrunk axis need not
divide the spec's axis, it only has to stay above 1 for its collectives to run.
"""

from __future__ import annotations

import math

from shardc.ir.plan import Plan
from shardc.ir.spec import TensorRef
from shardc.ops.registry import of_call
from shardc.ops.route import ROUTING
from shardc.planner.zigzag_order import sequence_order
from shardc.spec.walk import calls, node_limits, renamed_indices

__all__ = ["shrink_mesh", "small_sizes", "devices_to_check", "collapsed_axes", "MAX_SMALL_DIM",
           "MAX_DEVICES"]

MAX_SMALL_DIM = 64  # the spec's own dims are used when every one is at most this
# Emulated CPU devices start in about 2 s at 256; far more makes XLA's start-up crawl
# (100000 never finishes), so a larger request is an error rather than a hang.
MAX_DEVICES = 256


def shrink_mesh(mesh: list[tuple[str, int]], devices: int, keep: str | None = None) -> list[tuple[str, int]]:
    """The mesh cut down to at most ``devices`` devices, every axis kept at 2 or more while possible.

    The largest axis is halved first (never below 2); when even a mesh of 2s does not
    fit, the minor-most axes fall to 1 until it does.  Size-1 axes stay 1.  ``keep`` (a
    pipeline's stage axis) is halved only once every other axis is 2, and never falls to 1:
    the stage count is what a pipeline's schedule is about.
    """
    mesh = list(mesh)
    while math.prod(s for _, s in mesh) > devices:
        big = [k for k, (n, s) in enumerate(mesh) if s > 2 and n != keep]
        kept = [k for k, (n, s) in enumerate(mesh) if s > 2 and n == keep]
        small = [k for k, (n, s) in enumerate(mesh) if s > 1 and n != keep]
        if big or kept:
            k = max(big, key=lambda j: (mesh[j][1], -j)) if big else kept[0]
            mesh[k] = (mesh[k][0], max(2, mesh[k][1] // 2))
        elif small:
            k = max(small)  # all 2s: drop the minor-most
            mesh[k] = (mesh[k][0], 1)
        else:
            break  # the stage axis alone is more than the devices: the caller says so
    return mesh


def devices_to_check(plan: Plan, available: int | None = None) -> int:
    """Devices that run every axis of the plan's mesh at size 2 or more, at least 8 when the mesh has them;
    a pipeline's stage axis counts at its own size.

    ``available`` caps the count (the devices jax has); so does :data:`MAX_DEVICES`.
    """
    axes = plan.spec.mesh.axes
    stages = math.prod(a.size for a in axes if a.pipeline)
    others = sum(1 for a in axes if a.size > 1 and not a.pipeline)
    need = min(math.prod(a.size for a in axes), max(8, stages * 2 ** others))
    return max(1, min(need, MAX_DEVICES, available or MAX_DEVICES))


def collapsed_axes(plan: Plan, mesh: dict[str, int]) -> tuple[str, ...]:
    """Axes of more than one device in the spec that the run's mesh has cut to 1."""
    return tuple(a.name for a in plan.spec.mesh.axes if a.size > 1 and mesh.get(a.name, a.size) == 1)


def _refs(plan: Plan) -> list[TensorRef]:
    refs = [info.ref for info in plan.tensors] + list(plan.cotangents + plan.grads)
    for step in plan.forward + plan.backward + plan.optimizer:
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
    for (experts, _), (_, _, groups) in node_limits(plan.spec).items():  # whole groups of experts
        need[experts] = math.lcm(need.get(experts, 1), groups)
    zigzag, chunks = sequence_order(plan, mesh) or (frozenset(), 1)
    for name in zigzag:  # whole zig-zag chunks: 2n of them over a ring of n (runtime_ring.zigzag_order)
        need[name] = math.lcm(need.get(name, 1), chunks)
    same = _same_size(plan, need)
    for name in need:  # a renamed index has its source's size: both divide by every sharding of either
        need[name] = math.lcm(*(need[n] for n in need if same[n] == same[name]))
    own = plan.spec.sizes
    if own and all(0 < own.get(n, 0) <= MAX_SMALL_DIM and own[n] % m == 0 for n, m in need.items()):
        return {**{n: own[n] for n in need}, **mesh}
    sizes: dict[str, int] = {}
    least = _least(plan, same)
    for name, base in need.items():
        if same[name] in sizes:
            sizes[name] = sizes[same[name]]
            continue
        # at least 4 elements, at least 2 per shard, at least the k experts a route picks
        factor = max(2, -(-4 // base), -(-least.get(same[name], 1) // base))
        while base * factor in sizes.values():  # distinct sizes catch transposed dims
            factor += 1
        sizes[name] = base * factor
        sizes.setdefault(same[name], sizes[name])
    return {**sizes, **mesh}


def _least(plan: Plan, same: dict[str, str]) -> dict[str, int]:
    """The least size of each representative index: a route's expert index has its k at least, a
    node-limited one k in its limit's groups."""
    least: dict[str, int] = {}
    for call in (c for s in plan.spec.statements for c in calls(s.expr) if of_call(c.func) is ROUTING):
        rep = same.get(call.over or "", call.over or "")
        least[rep] = max(least.get(rep, 1), int(call.numbers[0]))
    for (experts, _), (k, limit, groups) in node_limits(plan.spec).items():  # k experts in the limit's groups
        rep = same.get(experts, experts)
        least[rep] = max(least.get(rep, 1), groups * -(-k // limit))
    return least


def _same_size(plan: Plan, need: dict[str, int]) -> dict[str, str]:
    """Each index's representative among the indices renames tie to one size (union-find)."""
    parent = {n: n for n in need}

    def find(n: str) -> str:
        while parent.setdefault(n, n) != n:
            n = parent[n]
        return n

    for new, old in renamed_indices(plan.spec):
        parent[find(new)] = find(old)
    return {n: find(n) for n in need}
