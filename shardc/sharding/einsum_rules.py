"""The book's rules for one einsum: the one configuration they pick, chosen without sizes.

Per mesh axis, the role an operand's sharding gives it (an index it shards, or its partial sums passed
through), as the book's four cases of sharded matmul read it; the search of :mod:`shardc.sharding.einsum`
prices that configuration, or decides where the rules cannot reach the requested result.
"""

from __future__ import annotations

from shardc.sharding.einsum import (
    PASS,
    UNUSED,
    EinsumProblem,
    Solution,
    _configuration,
    _evaluate,
    classify,
    is_pass,
    partial_axes,
    solve,
)
from shardc.sharding.layout import CostContext, Value

__all__ = ["rule_config", "solve_rules"]


def solve_rules(ctx: CostContext, problem: EinsumProblem, given: tuple[Value, ...]) -> Solution:
    """The the book's rule-based plan: one configuration, chosen without sizes."""
    roles = rule_config(ctx, problem, given)
    order = _rule_order(problem, roles, given)
    if ctx.places is not None:  # past four axes: the order the search allows, where the spec gives one
        order = {i: _placed_order(ctx, i, axes) for i, axes in order.items()}
    config = _configuration(problem, roles, order)
    sol = None if config is None else _evaluate(ctx, problem, config, None, partial_axes(ctx, problem))
    if sol is None:
        # The rules cannot reach every requested result (e.g. partial sums over an axis
        # the rules gather away); the exact search decides those.
        return solve(ctx, problem)[0]
    return sol


def _placed_order(ctx: CostContext, index: str, axes: tuple[str, ...]) -> tuple[str, ...]:
    """``axes`` as the search may put them on ``index`` (:attr:`CostContext.places`), if it may at all."""
    assert ctx.places is not None
    rank = ctx.places.get(index, (frozenset(), None))[1]
    if ctx.placed(index, axes) or rank is None or not set(axes) <= set(rank):
        return axes
    return tuple(sorted(axes, key=rank.__getitem__))


def _where(problem: EinsumProblem, k: int, value: Value, axis: str) -> str | None:
    for i, axes in zip(problem.operands[k].indices, value.layout, strict=True):
        if axis in axes:
            return i
    return None


def rule_config(ctx: CostContext, problem: EinsumProblem, given: tuple[Value, ...]) -> dict[str, str]:
    """Per axis, the book's rules, from the operands' given values.

    - a contracted index sharded identically in both stays: reduce after the einsum;
    - a contracted index sharded in one operand only: gather that operand;
    - a batch index: keep the sharding (the other operand slices for free);
    - a free index: keep it; if both operands shard free indices over the same axis
      (case 4), keep the one the result keeps and gather the other.
    """
    classes = classify(problem)
    target = problem.target
    roles: dict[str, str] = {}
    for axis in ctx.mesh.names:
        places = [_where(problem, k, v, axis) for k, v in enumerate(given)]
        partial = [k for k, v in enumerate(given) if axis in v.unreduced]
        if partial:
            roles[axis] = f"{PASS}{partial[0]}"  # the left operand's partial sums pass; the other reduces
            continue
        roles[axis] = _rule_role(classes, places, problem, target, axis)
    return roles


def _rule_role(classes: dict[str, str], places: list[str | None], problem: EinsumProblem,
               target: Value | None, axis: str) -> str:
    kept = None
    if target is not None:
        for i, axes in zip(problem.indices, target.layout, strict=True):
            if axis in axes:
                kept = i
    found = [p for p in places if p is not None]
    if not found:
        return UNUSED
    if len(places) == 1:
        return found[0]  # one operand (a sum over some indices): keep its sharding, reduce after
    if len(places) == 2 and places[0] == places[1]:
        return found[0]  # identical in both: contracted or batch, kept
    candidates = []
    for p in found:
        cls = classes[p]
        if cls == "contracted":
            continue  # sharded in one operand only: gather it
        if cls == "batch" and len(set(found)) > 1 and kept != p:
            continue  # batch vs the other operand's free index: the result decides
        candidates.append(p)
    if not candidates:
        return UNUSED
    if len(candidates) > 1:
        for p in candidates:
            if p == kept:
                return p
        return candidates[0]  # neither kept: keep the left operand's
    return candidates[0]


def _rule_order(problem: EinsumProblem, roles: dict[str, str],
                given: tuple[Value, ...]) -> dict[str, tuple[str, ...]]:
    """Axes on one index keep the order the operands (left first) give them."""
    order: dict[str, tuple[str, ...]] = {}
    for op, value in zip(problem.operands, given, strict=True):
        for i, axes in zip(op.indices, value.layout, strict=True):
            picked = tuple(a for a in axes if roles.get(a) == i)
            if picked and i not in order:
                order[i] = picked
    for axis, role in roles.items():
        if role != UNUSED and not is_pass(role) and axis not in order.get(role, ()):
            order[role] = order.get(role, ()) + (axis,)
    return order
