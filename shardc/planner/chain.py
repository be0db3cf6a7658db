"""The layouts of a chain's intermediates, by dynamic programming over them.

A chain ``A · B · C -> R`` is planned left to right and its intermediates'
layouts are the planner's to choose.  The state is the accumulated
intermediate's layout; each step costs the exact einsum search from each state
to each candidate next layout (the last step to the declared result, where a
statement declares it).

Done naively that is one einsum search per (state, target) pair, hundreds of
thousands of configurations on a three-axis mesh.  But a configuration's cost
splits into three independent parts,

    reshard(state -> its local first operand)
    + reshards of the other operand (which the state does not change)
    + reshard(its local result -> target)

so each configuration is costed once, keyed by its (local first operand, local
result), and the table is filled from those distinct values.  The minimum is the
same as the einsum search's (:func:`shardc.sharding.einsum.solve`), which stays the
one that plans the step once the layouts are chosen.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from shardc.ir.spec import TensorRef
from shardc.ops.registry import Node
from shardc.sharding.einsum import EinsumProblem, Operand, compute_cost, configurations
from shardc.sharding.layout import INFINITE, ZERO, Cost, CostContext, Value, add_cost
from shardc.sharding.phase import Phase
from shardc.sharding.reverse import costs_to
from shardc.sharding.search import least_costs, reshard

__all__ = ["choose_chain"]

State = Value | None  # None: before the first step, the operands as the phase holds them
Path = tuple[float, tuple[Value, ...]]


def choose_chain(phase: Phase, chain: list[Node], declared: dict[str, TensorRef]) -> None:
    """Declare each intermediate of ``chain`` with the layouts of least total forward time.

    The last step's result is the statement's, in its declared layout; a chain inside an expression
    (``X + A · B · C``, ``silu(A · B · C)``) ends in one of the expression's own intermediates, which no
    statement declares: it ends in any layout, as a product there does."""
    ctx = phase.ctx
    states: dict[State, Path] = {None: (0.0, ())}
    for k, node in enumerate(chain):
        result = declared.get(node.result) if k == len(chain) - 1 else None
        targets = [Value.of(result)] if result is not None else list(layouts(ctx, node.indices))
        starts = list(states)
        first = starts[0]
        operands = tuple(
            Operand(name, phase.indices[name], (first,) if first is not None and j == 0 else tuple(phase.held[name]))
            for j, name in enumerate(node.operands))
        table = step_costs(ctx, EinsumProblem(operands, node.result, node.indices, None), starts, targets)
        new_states: dict[State, Path] = {}
        for (state, target), step in table.items():
            cost, path = states[state]
            total = cost + step[0] + 1e-30 * step[1]
            if target not in new_states or total < new_states[target][0]:
                new_states[target] = (total, path + (target,))
        states = new_states
    _, best = min(states.values(), key=lambda t: t[0])
    for node, value in zip(chain[:-1], best, strict=False):
        declared[node.result] = value.ref(node.result, node.indices)


def step_costs(ctx: CostContext, problem: EinsumProblem, starts: list[State],
               targets: list[Value]) -> dict[tuple[State, Value], Cost]:
    """The least cost of this einsum from each start (its first operand's source) to each target.

    Every state after the first is a reduced layout, so the configurations that
    are valid are the same for all of them.  Each entry equals one exact
    :func:`shardc.sharding.einsum.solve` of the pair, which the tests check.
    """
    head = problem.operands[0]
    rest = _rest_costs(ctx, problem, skip_head=starts[0] is not None)
    if len(targets) == 1:
        return _to_one(ctx, problem, rest, starts, targets[0])
    table: dict[tuple[State, Value], Cost] = {}
    for state in starts:
        ctx.tick()
        by_result: dict[Value, Cost] = {}
        for (local_head, local_result), cost in rest.items():
            if local_head is not None:
                assert state is not None
                moved, _ = reshard(ctx, head.name, head.indices, (state,), local_head)
                cost = add_cost(moved, cost)
            if cost < by_result.get(local_result, INFINITE):
                by_result[local_result] = cost
        for target, best in _least_to(ctx, problem, by_result, targets).items():
            table[(state, target)] = best
    return table


def _rest_costs(ctx: CostContext, problem: EinsumProblem,
                skip_head: bool) -> dict[tuple[Value | None, Value], Cost]:
    """Per (local first operand, or None without ``skip_head``; local result): the least operand cost."""
    rest: dict[tuple[Value | None, Value], Cost] = {}
    for locals_, local_result, _ in configurations(ctx, problem):
        ctx.tick()
        cost = _operands_cost(ctx, problem, locals_, skip_head)
        if cost is None:
            continue
        cost = add_cost(cost, compute_cost(ctx, problem, locals_, local_result))
        key = (locals_[0] if skip_head else None, local_result)
        if cost < rest.get(key, INFINITE):
            rest[key] = cost
    return rest


def _to_one(ctx: CostContext, problem: EinsumProblem, rest: dict[tuple[Value | None, Value], Cost],
            starts: list[State], target: Value) -> dict[tuple[State, Value], Cost]:
    """One target (a chain's last step): two searches over reversed moves answer every state.

    The first costs each local result to the target; the second, from the local
    first operands with what follows them as their costs, reaches every state.
    """
    results = {r for _, r in rest if r.reaches(target)}
    to_target = costs_to(ctx, problem.result, problem.indices, results, {target: ZERO})
    after: dict[Value | None, Cost] = {}
    for (local_head, local_result), cost in rest.items():
        if local_result in to_target:
            total = add_cost(cost, to_target[local_result])
            if total < after.get(local_head, INFINITE):
                after[local_head] = total
    if starts == [None]:
        return {(None, target): after[None]} if None in after else {}
    head = problem.operands[0]
    heads = {v: c for v, c in after.items() if v is not None}
    reached = costs_to(ctx, head.name, head.indices, [s for s in starts if s is not None], heads)
    return {(state, target): cost for state, cost in reached.items()}


def _least_to(ctx: CostContext, problem: EinsumProblem, by_result: dict[Value, Cost],
              targets: list[Value]) -> dict[Value, Cost]:
    """Each target's least cost over the local results that can reach it: one search a group."""
    out: dict[Value, Cost] = {}
    for unreduced in {t.unreduced for t in targets}:
        wanted = [t for t in targets if t.unreduced == unreduced]
        spent = {r: c for r, c in by_result.items() if r.reaches(wanted[0])}
        out.update(least_costs(ctx, problem.result, problem.indices, spent, wanted))
    return out


def _operands_cost(ctx: CostContext, problem: EinsumProblem, locals_: tuple[Value, ...],
                   skip_head: bool) -> Cost | None:
    """The operands' reshards to their local values (all but the first with ``skip_head``)."""
    total = ZERO
    for j, (op, local) in enumerate(zip(problem.operands, locals_, strict=True)):
        if not any(s.reaches(local) for s in op.sources):
            return None
        if j == 0 and skip_head:
            continue
        cost, _ = reshard(ctx, op.name, op.indices, op.sources, local)
        total = add_cost(total, cost)
    return total


def layouts(ctx: CostContext, indices: tuple[str, ...]) -> Iterator[Value]:
    """Every reduced layout of a tensor with these indices on the mesh."""
    units = ctx.unit_list()
    options = [[None, *range(len(indices))] for _ in units]
    for combo in itertools.product(*options):
        groups: dict[int, list[tuple[str, ...]]] = {}
        for unit, d in zip(units, combo, strict=True):
            if d is not None:
                groups.setdefault(d, []).append(unit)
        keys = sorted(groups)
        for perms in itertools.product(*(itertools.permutations(groups[d]) for d in keys)):
            layout: list[tuple[str, ...]] = [()] * len(indices)
            for d, perm in zip(keys, perms, strict=True):
                layout[d] = tuple(a for u in perm for a in u)
            if all(ctx.divides(i, axes) for i, axes in zip(indices, layout, strict=True)):
                yield Value(tuple(layout), ())
