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
from dataclasses import dataclass, replace

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


def choose_chain(phase: Phase, chain: list[Node], declared: dict[str, TensorRef]) -> float:
    """Declare each intermediate of ``chain`` with the layouts of least total forward time; returns that time
    (the search's estimate of the chain's steps).

    The last step's result is the statement's, in its declared layout; a chain inside an expression
    (``X + A · B · C``, ``silu(A · B · C)``) ends in one of the expression's own intermediates, which no
    statement declares: it ends in any layout, as a product there does.  Each step's operands are as a
    two-operand einsum's (:meth:`shardc.sharding.phase.Phase.operand`: of a quantizing GEMM, the value a
    pass fuses into and those the phase quantized already), and an intermediate the step before made where
    it stands (no move after it) is one its quantize pass fuses into: ``made`` keeps those states apart."""
    ctx = phase.ctx
    states: dict[State, Path] = {None: (0.0, ())}
    made: dict[State, Path] = {}
    for k, node in enumerate(chain):
        result = declared.get(node.result) if k == len(chain) - 1 else None
        targets = [Value.of(result)] if result is not None else list(layouts(ctx, node.indices))
        starts = list(states)
        problem = EinsumProblem(_operands(phase, node, starts[0]), node.result, node.indices, None)
        table = step_costs(ctx, problem, starts, targets, fuse=bool(made) and _fuses(phase, node))
        new_states: dict[State, Path] = {}
        new_made: dict[State, Path] = {}
        for into, entries in ((new_states, table.costs), (new_made, table.direct)):
            for (state, target), (step, fused) in entries.items():
                _relax(into, states[state], step, target)
                if fused is not None and state in made:
                    _relax(into, made[state], fused, target)
        states, made = new_states, new_made
    total, best = min(states.values(), key=lambda t: t[0])
    for node, value in zip(chain[:-1], best, strict=False):
        declared[node.result] = value.ref(node.result, node.indices)
    return total


def _relax(states: dict[State, Path], start: Path, step: Cost, target: Value) -> None:
    cost, path = start
    total = cost + step[0] + 1e-30 * step[1]
    if target not in states or total < states[target][0]:
        states[target] = (total, path + (target,))


def _operands(phase: Phase, node: Node, first: State) -> tuple[Operand, ...]:
    """The step's operands as a two-operand einsum's (:meth:`~shardc.sharding.phase.Phase.operand`); after the
    chain's first step its head is the intermediate, held in ``first`` (the others as :func:`step_costs` reads
    them), with no pass done, and the step before the others is the chain's own."""
    gemm = phase.gemm(node.result, node.operands)
    if first is None:
        return tuple(phase.operand(name, gemm) for name in node.operands)
    head = Operand(node.operands[0], phase.indices[node.operands[0]], (first,))
    return (head, *(replace(phase.operand(name, gemm), fresh=None) for name in node.operands[1:]))


def _fuses(phase: Phase, node: Node) -> bool:
    """Whether a quantize pass of the step's head fuses into the einsum that made it (:mod:`shardc.quantize`)."""
    return phase.ctx.fusible is not None and phase.gemm(node.result, node.operands) is not None


@dataclass(frozen=True)
class StepTable:
    """A step's least costs per (state, target): ``costs`` to the target; ``direct``, into it with no move after
    the einsum.  Each with the cost where the state is one the step before made where it stands (its head's
    quantize pass fused into that einsum), or None where that changes nothing."""

    costs: dict[tuple[State, Value], tuple[Cost, Cost | None]]
    direct: dict[tuple[State, Value], tuple[Cost, Cost | None]]


def step_costs(ctx: CostContext, problem: EinsumProblem, starts: list[State],
               targets: list[Value], fuse: bool = False) -> StepTable:
    """The least cost of this einsum from each start (its first operand's source) to each target; with ``fuse``,
    also where the start is the value the step before made, its head's quantize pass fused into it.

    Every state after the first is a reduced layout, so the configurations that
    are valid are the same for all of them.  Each entry equals one exact
    :func:`shardc.sharding.einsum.solve` of the pair, which the tests check.
    """
    head = problem.operands[0]
    rest, fused = _rest_costs(ctx, problem, skip_head=starts[0] is not None, fuse=fuse)
    if len(targets) == 1:
        return _to_one(ctx, problem, rest, fused, starts, targets[0])
    costs: dict[tuple[State, Value], tuple[Cost, Cost | None]] = {}
    direct: dict[tuple[State, Value], tuple[Cost, Cost | None]] = {}
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
        in_place = {r: c for (h, r), c in fused.items() if h == state}  # the head read where it was made
        least = _least_to(ctx, problem, by_result, targets)
        least_fused = _least_to(ctx, problem, in_place, targets) if in_place else {}
        for target, best in least.items():
            costs[(state, target)] = (best, least_fused.get(target))
            if target in by_result:
                direct[(state, target)] = (by_result[target], in_place.get(target))
    return StepTable(costs, direct)


def _rest_costs(ctx: CostContext, problem: EinsumProblem, skip_head: bool, fuse: bool = False
                ) -> tuple[dict[tuple[Value | None, Value], Cost], dict[tuple[Value | None, Value], Cost]]:
    """Per (local first operand, or None without ``skip_head``; local result): the least operand cost; and with
    ``fuse``, where the first operand is read where the step before made it (its quantize pass fused)."""
    rest: dict[tuple[Value | None, Value], Cost] = {}
    fused: dict[tuple[Value | None, Value], Cost] = {}
    for locals_, local_result, _ in configurations(ctx, problem):
        ctx.tick()
        cost = _operands_cost(ctx, problem, locals_, skip_head)
        if cost is None:
            continue
        key = (locals_[0] if skip_head else None, local_result)
        plain = add_cost(cost, compute_cost(ctx, problem, locals_, local_result))
        if plain < rest.get(key, INFINITE):
            rest[key] = plain
        if fuse and skip_head:
            made = replace(problem.operands[0], sources=(locals_[0],), fresh=locals_[0])
            again = EinsumProblem((made, *problem.operands[1:]), problem.result, problem.indices, problem.target)
            cost = add_cost(cost, compute_cost(ctx, again, locals_, local_result))
            if cost < plain and cost < fused.get(key, INFINITE):
                fused[key] = cost
    return rest, fused


def _to_one(ctx: CostContext, problem: EinsumProblem, rest: dict[tuple[Value | None, Value], Cost],
            fused: dict[tuple[Value | None, Value], Cost], starts: list[State], target: Value) -> StepTable:
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
    in_place: dict[Value | None, Cost] = {}  # the head read where the step before made it
    for (local_head, local_result), cost in fused.items():
        if local_result in to_target:
            in_place[local_head] = min(in_place.get(local_head, INFINITE), add_cost(cost, to_target[local_result]))
    if starts == [None]:
        return StepTable({(None, target): (after[None], None)} if None in after else {},
                         {(None, target): (rest[(None, target)], None)} if (None, target) in rest else {})
    head = problem.operands[0]
    heads = {v: c for v, c in after.items() if v is not None}
    reached = costs_to(ctx, head.name, head.indices, [s for s in starts if s is not None], heads)
    made = {v: c for (v, r), c in rest.items() if r == target and v is not None}  # the einsum makes the target
    into = costs_to(ctx, head.name, head.indices, [s for s in starts if s is not None], made) if made else {}
    return StepTable({(state, target): (cost, in_place.get(state)) for state, cost in reached.items()},
                     {(state, target): (cost, fused.get((state, target))) for state, cost in into.items()})


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
