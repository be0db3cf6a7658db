"""Small sizes for running a plan: a mesh that fits the devices, dims that divide.

Used by verification (runs on a few emulated CPU devices) and by the demo of a
generated module.  The plan's steps are symbolic in the sizes, so the same plan
lowers unchanged at any sizes its shardings divide: a shrunk axis need not
divide the spec's axis, it only has to stay above 1 for its collectives to run.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

from shardc.ir.localops import Rotary
from shardc.ir.plan import Plan
from shardc.ir.spec import TensorRef
from shardc.ops.registry import of_call
from shardc.ops.route import ROUTING
from shardc.planner.zigzag_order import sequence_order
from shardc.spec.walk import calls, node_limits, renamed_indices

__all__ = ["shrink_mesh", "small_sizes", "proportional_sizes", "spec_sizes", "devices_to_check", "collapsed_axes",
           "MAX_SMALL_DIM", "MAX_DEVICES", "MAX_SCALED_ELEMENTS"]

MAX_SMALL_DIM = 64  # the spec's own dims are used when every one is at most this
# Emulated CPU devices start in about 2 s at 256; far more makes XLA's start-up crawl
# (100000 never finishes), so a larger request is an error rather than a hang.
MAX_DEVICES = 256
# The most elements one tensor of proportional_sizes' may hold: 2^18 (1 MiB in f32) keeps a program's buffers
# far below the machine's memory and its CPU run short beside XLA's compile, at any spec's sizes.
MAX_SCALED_ELEMENTS = 2 ** 18


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
    mesh, need, same = _needs(plan, devices)
    own = plan.spec.sizes
    if _own_fit(own, need):
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


def _own_fit(own: dict[str, int], need: dict[str, int]) -> bool:
    """Whether the spec's own dims are small already and divide by their shardings: then they are used."""
    return bool(own) and all(0 < own.get(n, 0) <= MAX_SMALL_DIM and own[n] % m == 0 for n, m in need.items())


def proportional_sizes(plan: Plan, devices: int | None = 8) -> dict[str, int]:
    """Small sizes that keep the spec's proportions: every tensor of the plan shrunk by about one factor.

    ``shardc compare`` judges the plan, chosen at the spec's sizes, by the bytes it moves beside the bytes
    XLA's choice moves at small sizes.  That judges the plan fairly only where the tensors keep their
    relative sizes: StarCoder's plan moves its query gradient dQ[B, S, N, H] rather than all-reducing
    dX[B, S, D] because N·H = D, and :func:`small_sizes`, which sizes each dim on its own, gives D=12
    beside N·H=100.  verify needs no proportions: it checks values, which any sizes the shardings divide
    check as well (and its figures and tests are made at :func:`small_sizes`'s).

    Each dim is the spec's divided by a power of two, rounded up to a multiple of the mesh axes that split
    it (and at least 2, and at least a route's k), no tensor over :data:`MAX_SCALED_ELEMENTS`.  One common
    power for every dim would keep the ratios between dims but not those between a product of dims and one
    dim (N·H against D), so from each common power the dims' powers move one dim at a time while that
    brings the tensors' shrinks nearer one factor (least squares in log2), the weights' among themselves
    and the activations' among themselves; the weights against the activations (B·S tokens against a
    weight's rows) come second, as the bound keeps far fewer tokens than a step has.  The common power
    whose result is nearest wins.
    """
    mesh, need, same = _needs(plan, devices)
    own = plan.spec.sizes
    if _own_fit(own, need):
        return {**{n: own[n] for n in need}, **mesh}
    least = _least(plan, same)
    reps = sorted(set(same.values()))
    full = {r: own.get(r, need[r]) for r in reps}
    floor = {r: need[r] * -(-max(min(2, full[r]), least.get(r, 1)) // need[r]) for r in reps}
    shapes = {tuple(same[d.name] for d in ref.dims) for ref in _refs(plan) if ref.dims}
    weights = {tuple(same[d.name] for d in i.ref.dims) for i in plan.tensors if i.role == "param"}
    groups = [shapes & weights, shapes - weights]

    def sized(power: dict[str, int]) -> dict[str, int]:
        return {r: max(floor[r], need[r] * -(-full[r] // (need[r] << power[r]))) for r in reps}

    def fits(sizes: dict[str, int]) -> bool:
        return all(math.prod(sizes[r] for r in shape) <= MAX_SCALED_ELEMENTS for shape in shapes)

    least_common = 0
    while not fits(sized(dict.fromkeys(reps, least_common))) and any(full[r] >> least_common for r in reps):
        least_common += 1
    commons = range(least_common, max(full.values()).bit_length() + 1)
    tried = [_even_shrink(dict.fromkeys(reps, common), groups, full, sized, fits) for common in commons
             if common == least_common or sized(dict.fromkeys(reps, common - 1)) != floor]  # past: all floors
    sizes = min((sized(power) for power in tried), key=lambda s: (*_spread(groups, full, s), -sum(s.values())))
    return {**{n: sizes[same[n]] for n in need}, **mesh}


def spec_sizes(plan: Plan, devices: int | None = 8) -> dict[str, int] | None:
    """The sizes the plan was chosen at on the small mesh: each dim the spec's (the plan's), rounded up to a
    multiple of the shrunk mesh's shardings of it (a halved axis still divides a dim its whole axis did);
    None when the spec gives no size to some dim.  ``shardc compare`` counts the bytes here, where the plan
    was chosen, as only XLA's compile (from abstract arguments, no buffers) has to see them."""
    mesh, need, same = _needs(plan, devices)
    own = {k: v for k, v in (plan.sizes or tuple(plan.spec.sizes.items())) if k not in mesh}
    if any(same[n] not in own and n not in own for n in need):
        return None
    return {**{n: need[n] * -(-own.get(n, own.get(same[n], 0)) // need[n]) for n in need}, **mesh}


def _even_shrink(power: dict[str, int], groups: list[set[tuple[str, ...]]], full: dict[str, int],
                 sized: Callable[[dict[str, int]], dict[str, int]],
                 fits: Callable[[dict[str, int]], bool]) -> dict[str, int]:
    """Each dim's power of two moved by one at a time, the move that most evens the tensors' shrinks first, while
    one does and the sizes still fit."""

    best = _spread(groups, full, sized(power))
    for _ in range(4 * sum(max(1, full[r].bit_length()) for r in power)):  # each power moves a bounded way
        # any power of one dim (rounding up to the shardings leaves runs of powers that give one size), or two
        # dims a power each (a product against a dim: N·H against D moves N or H with F against D)
        moves = [{**power, r: p} for r in power for p in range(full[r].bit_length() + 1) if p != power[r]]
        moves += [{**power, r: power[r] + a, q: power[q] + b} for r, q in itertools.combinations(power, 2)
                  for a in (-1, 1) for b in (-1, 1)
                  if 0 <= power[r] + a <= full[r].bit_length() and 0 <= power[q] + b <= full[q].bit_length()]
        scored = [(_spread(groups, full, sizes), move) for move in moves if fits(sizes := sized(move))]
        if not scored or min(s for s, _ in scored) >= best:
            break
        best, power = min(scored, key=lambda item: item[0])
    return power


def _spread(groups: list[set[tuple[str, ...]]], full: dict[str, int], sizes: dict[str, int]) -> tuple[float, float]:
    """How far the tensors of each group are from shrinking by one factor (the sum of squared deviations of
    their log2 shrinks from the group's mean), then how far the groups' means are apart (squared)."""
    total, means = 0.0, []
    for shapes in (g for g in groups if g):
        shrink = [sum(math.log2(sizes[r] / full[r]) for r in shape) for shape in shapes]
        means.append(sum(shrink) / len(shrink))
        total += sum((s - means[-1]) ** 2 for s in shrink)
    return round(total, 9), round((max(means) - min(means)) ** 2 if means else 0.0, 9)


def _needs(plan: Plan, devices: int | None) -> tuple[dict[str, int], dict[str, int], dict[str, str]]:
    """The small mesh; what each dim's size must be a multiple of there (the product of the mesh axes that split it,
    whole expert groups, whole zig-zag chunks, a rotation's pairs); each dim's representative among those renames
    tie."""
    axes = [(a.name, a.size) for a in plan.spec.mesh.axes]
    mesh = dict(axes if devices is None else shrink_mesh(axes, devices))
    need: dict[str, int] = {}
    for ref in _refs(plan):
        for d in ref.dims:
            need[d.name] = math.lcm(need.get(d.name, 1), math.prod(mesh[a] for a in d.axes))
    for (experts, _), (_, _, groups) in node_limits(plan.spec).items():  # whole groups of experts
        need[experts] = math.lcm(need.get(experts, 1), groups)
    for step in plan.forward:  # a rotation's pairs: its head dim's halves (ops/rotary.py), an even size
        if isinstance(step.fn, Rotary):
            need[step.fn.head] = math.lcm(need.get(step.fn.head, 1), 2)
    zigzag, chunks = sequence_order(plan, mesh) or (frozenset(), 1)
    for name in zigzag:  # whole zig-zag chunks: 2n of them over a ring of n (runtime_ring.zigzag_order)
        need[name] = math.lcm(need.get(name, 1), chunks)
    same = _same_size(plan, need)
    for name in need:  # a renamed index has its source's size: both divide by every sharding of either
        need[name] = math.lcm(*(need[n] for n in need if same[n] == same[name]))
    return mesh, need, same


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
