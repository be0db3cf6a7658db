"""One einsum: classify its indices, enumerate valid local layouts, pick the cheapest.

Following PyTorch DTensor's einsum strategy, every index is first put in a
class, and the rules are stated per class (the four cases of sharded matmul):

    contracted   in both operands, not the result  same axes in both; result unreduced over them
    batch        in both operands and the result   same axes in both and in the result
    left/right   in one operand and the result     that operand's axes, which the other must not use

A *local configuration* gives every mesh axis one role: unused, or sharding one
index, or passing one operand's partial sums through (the other operand, if it is
unreduced over the same axis, is reduced first: of a product of two partial sums the
search reduces the cheaper operand).  Each configuration
fixes the operands' local values and the local result; its cost is the cheapest
reshard of each operand to its local value plus the cheapest reshard of the
local result to the requested one.  With sizes the search is exhaustive over
configurations (and each reshard is exact), so it is never worse than the rules.
Without sizes the book's rules pick the one configuration (:mod:`shardc.sharding.einsum_rules`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from shardc.ir.precision import pass_bytes, tiled_along
from shardc.ir.spec import DType
from shardc.sharding.layout import INFINITE, ZERO, Cost, CostContext, Move, Value, add_cost
from shardc.sharding.reverse import reshard_to
from shardc.sharding.search import reshard

__all__ = ["Operand", "EinsumProblem", "Reader", "Solution", "NoPlan", "solve", "classify", "configurations",
           "room", "compute_cost", "quantize_bytes"]


class NoPlan(Exception):
    """No local layout reaches the requested result (raised as a ShardcError by the phase)."""

UNUSED = "-"
PASS = "+"  # "+k": the axis stays unreduced in operand k and in the result


def is_pass(role: str) -> bool:
    """Whether a role passes an operand's partial sums through ("+k"; an index's role is its name)."""
    return role.startswith(PASS)


def passes(role: str) -> int | None:
    """The operand whose partial sums a role passes through, or None."""
    return int(role[1:]) if is_pass(role) else None


@dataclass(frozen=True)
class Operand:
    """An operand: its tensor name, indices, and the values of it the phase holds; of a GEMM's operand that
    a ``gemm`` line quantizes (:mod:`shardc.quantize`), the value the phase's last step made, where a
    quantize pass fuses into it (``fresh``), and the values of it the phase's GEMMs have quantized already
    for the same contraction and type (``quantized``)."""

    name: str
    indices: tuple[str, ...]
    sources: tuple[Value, ...]
    fresh: Value | None = None
    quantized: frozenset[Value] = frozenset()


@dataclass(frozen=True)
class Reader:
    """The one sum or mean an einsum's result is handed to unreduced (``graph.handed_on``): the index it sums
    over, its result, and the value that result is asked in (None: reduced in place).  An option's result is
    moved as asked, or handed on as made where moving the reader's smaller result after is cheaper (the
    reader then weighs reducing its input first against its result after)."""

    over: str
    result: str
    indices: tuple[str, ...]
    target: Value | None
    then: Reader | None = None  # the sum or mean the reader's result is handed on to in turn


@dataclass(frozen=True)
class EinsumProblem:
    operands: tuple[Operand, ...]  # one (a transpose) or two
    result: str
    indices: tuple[str, ...]
    target: Value | None  # None: any reduced result layout (the planner then picks)
    partial: bool = False  # without a target, the result may stay partial sums (a term of a sum)
    reader: Reader | None = None  # the result is handed on to it unreduced


@dataclass(frozen=True)
class Solution:
    cost: Cost
    operand_moves: tuple[tuple[Move, ...], ...]
    locals: tuple[Value, ...]  # the local operand values the einsum reads
    local_result: Value
    result_moves: tuple[Move, ...]
    roles: tuple[tuple[str, str], ...]  # (axis, index or UNUSED/PASS)
    # what its readers move after (EinsumProblem.reader), counted in ``cost``: --explain shows them as theirs
    reader_moves: tuple[Move, ...] = ()

    @property
    def final(self) -> Value:  # the result as moved; as made where handed on to its reader (Reader)
        return self.result_moves[-1].dst if self.result_moves else self.local_result


def classify(problem: EinsumProblem) -> dict[str, str]:
    """index -> "contracted" | "batch" | "left" | "right" (for one operand: "free")."""
    ops = problem.operands
    result = set(problem.indices)
    classes: dict[str, str] = {}
    for i in dict.fromkeys(x for op in ops for x in op.indices):
        inside = [i in op.indices for op in ops]
        if all(inside) and len(ops) == 2:
            classes[i] = "batch" if i in result else "contracted"
        elif len(ops) == 1:  # a copy, or a sum over the indices the result lacks
            classes[i] = "free" if i in result else "contracted"
        else:
            classes[i] = "left" if inside[0] else "right"
    return classes


def _local_values(problem: EinsumProblem, roles: dict[str, str], orders: dict[str, tuple[str, ...]],
                  classes: dict[str, str] | None = None) -> tuple[tuple[Value, ...], Value]:
    """The operands' and result's local values for one assignment of axes (``classes``: the problem's)."""
    if classes is None:
        classes = classify(problem)
    passing = sorted(a for a, r in roles.items() if is_pass(r))
    locals_ = tuple(Value(tuple(orders.get(i, ()) for i in op.indices),
                          tuple(a for a in passing if passes(roles[a]) == k))
                    for k, op in enumerate(problem.operands))
    contracted = tuple(a for a, r in roles.items() if classes.get(r) == "contracted")
    result = Value(tuple(orders.get(i, ()) for i in problem.indices),
                   tuple(sorted(contracted + tuple(passing))))
    return locals_, result


def _assignments(ctx: CostContext, problem: EinsumProblem) -> Iterator[dict[str, str]]:
    """Every role per mesh axis: unused, an index, or pass-through of partial sums."""
    indices = list(classify(problem))
    units = ctx.unit_list()  # the axes of a unit take one role
    options: list[list[str]] = []
    for unit in units:
        choices = [UNUSED] + [i for i in indices if ctx.divides(i, unit)]
        for k, op in enumerate(problem.operands):
            if any(unit[0] in s.unreduced for s in op.sources):
                choices.append(f"{PASS}{k}")
        options.append(choices)
    for combo in itertools.product(*options):
        yield {a: role for unit, role in zip(units, combo, strict=True) for a in unit}


def _orders(ctx: CostContext, roles: dict[str, str], units: tuple[tuple[str, ...], ...] | None = None,
            divides: dict[tuple[str, tuple[str, ...]], bool] | None = None) -> Iterator[dict[str, tuple[str, ...]]]:
    """Every major-to-minor order of the axes that share an index (``units``: the context's;
    ``divides``: :meth:`CostContext.divides` answers kept across one solve's roles)."""
    by_index: dict[str, list[tuple[str, ...]]] = {}
    for unit in ctx.unit_list() if units is None else units:
        role = roles[unit[0]]
        if role != UNUSED and not is_pass(role):
            by_index.setdefault(role, []).append(unit)
    known = {} if divides is None else divides
    groups = [(i, list(itertools.permutations(group))) for i, group in by_index.items()]
    for combo in itertools.product(*(perms for _, perms in groups)):
        order = {i: tuple(a for u in p for a in u) for (i, _), p in zip(groups, combo, strict=True)}
        if all(_divides(ctx, i, axes, known) for i, axes in order.items()):
            yield order


def _divides(ctx: CostContext, index: str, axes: tuple[str, ...], known: dict[tuple[str, tuple[str, ...]], bool]
             ) -> bool:
    hit = known.get((index, axes))
    if hit is None:
        hit = known[(index, axes)] = ctx.divides(index, axes)
    return hit


Config = tuple[tuple[Value, ...], Value, dict[str, str]]  # local operands, local result, roles


def configurations(ctx: CostContext, problem: EinsumProblem) -> Iterator[Config]:
    """Every valid local configuration, in a fixed order (ties go to the first)."""
    classes, units = classify(problem), ctx.unit_list()
    divides: dict[tuple[str, tuple[str, ...]], bool] = {}
    for roles in _assignments(ctx, problem):
        for order in _orders(ctx, roles, units, divides):
            config = _configuration(problem, roles, order, classes)
            if config is not None:
                yield config


def _configuration(problem: EinsumProblem, roles: dict[str, str], order: dict[str, tuple[str, ...]],
                   classes: dict[str, str] | None = None) -> Config | None:
    # partial sums pass through one operand only (a product of two is not a partial sum):
    # the roles say which, and the other operand is reduced over that axis first
    locals_, local_result = _local_values(problem, roles, order, classes)
    return locals_, local_result, roles


def partial_axes(ctx: CostContext, problem: EinsumProblem) -> frozenset[str]:
    """The axes a local result of ``problem`` may be unreduced over: those that may shard a
    contracted index, and those an operand's partial sums pass through (see :func:`_assignments`)."""
    contracted = [i for i, c in classify(problem).items() if c == "contracted"]
    out: set[str] = set()
    for unit in ctx.unit_list():
        if any(ctx.divides(i, unit) for i in contracted) or any(
                unit[0] in s.unreduced for op in problem.operands for s in op.sources):
            out.update(unit)
    return frozenset(out)


def _charge(ctx: CostContext, tensor: str, cost: Cost) -> Cost:
    """What a reshard of ``tensor`` costs the objective: its collectives' seconds, those issued ahead
    (:meth:`CostContext.ahead`) weighted as the phase counts them (:attr:`CostContext.ahead_weight`)."""
    if not ctx.ahead(tensor) or ctx.ahead_weight == 1.0:
        return cost
    return (cost[0] * ctx.ahead_weight, cost[1], cost[2])


def _room(ctx: CostContext, tensor: str, bound: Cost | None, spent: Cost) -> Cost | None:
    """:func:`room` for a reshard of ``tensor``, in its own seconds (before :func:`_charge` weights them)."""
    left = room(bound, spent)
    if left is None or not ctx.ahead(tensor) or ctx.ahead_weight == 1.0:
        return left
    if ctx.ahead_weight == 0.0:
        return None  # hidden under the phase's compute: no bound on its own seconds
    return (left[0] / ctx.ahead_weight, left[1], left[2])


# per (operand, local value): (cost, moves) found; (bound, None) dearer than bound; None unreachable
Reached = dict[tuple[int, Value], tuple[Cost, tuple[Move, ...] | None] | None]


def _evaluate(ctx: CostContext, problem: EinsumProblem, config: Config, best: Cost | None,
              partial: frozenset[str] | None = None, terms: Terms | None = None,
              reached: Reached | None = None) -> Solution | None:
    locals_, local_result, roles = config
    total: Cost = compute_cost(ctx, problem, locals_, local_result, terms)
    operand_moves = []
    for k, (op, local) in enumerate(zip(problem.operands, locals_, strict=True)):
        found = _operand(ctx, k, op, local, _room(ctx, op.name, best, total), {} if reached is None else reached)
        if found is None:
            return None
        total = add_cost(total, _charge(ctx, op.name, found[0]))
        if best is not None and total > best:
            return None
        operand_moves.append(found[1])
    result_moves: tuple[Move, ...] = ()
    reader_moves: tuple[Move, ...] = ()
    target = problem.target
    if target is None and local_result.unreduced and not problem.partial:
        target = Value(local_result.layout, ())  # an intermediate the caller lays out: reduce in place
    if target is not None:
        if not local_result.reaches(target):
            return None  # partial sums cannot be made from reduced values
        bound = _room(ctx, problem.result, best, total)
        if problem.target is not None:  # one search back from it answers every configuration
            if partial is not None and not partial.issuperset(local_result.unreduced):
                partial = None  # a local result the search's roles do not make (the rules')
            result = reshard_to(ctx, problem.result, problem.indices, local_result, target, bound, partial)
        else:
            result = reshard(ctx, problem.result, problem.indices, (local_result,), target, bound)
        here = INFINITE if result is None or result[0] == INFINITE else _charge(ctx, problem.result, result[0])
        later: tuple[Cost, tuple[Move, ...]] = (INFINITE, ())
        after: tuple[Move, ...] = ()
        if problem.reader is not None:  # what its readers move after, from the target or handed the result as made
            if here != INFINITE:
                cost, after = read_after(ctx, problem.reader, problem.indices, target, bound)
                here = add_cost(here, cost)
            later = read_after(ctx, problem.reader, problem.indices, local_result, bound)
        if later[0] <= here:  # handed on as made: its readers move their own results
            total, reader_moves = add_cost(total, later[0]), later[1]
        elif result is None or here == INFINITE:
            return None
        else:
            total, result_moves, reader_moves = add_cost(total, here), result[1], after
    if best is not None and total > best:
        return None
    return Solution(total, tuple(operand_moves), locals_, local_result, result_moves,
                    tuple(sorted(roles.items())), reader_moves)


def read_after(ctx: CostContext, reader: Reader | None, indices: tuple[str, ...], local: Value,
               bound: Cost | None) -> tuple[Cost, tuple[Move, ...]]:
    """What ``reader`` and the readers after it move, handed ``local``, and those moves (:data:`INFINITE`: no way
    found within ``bound``): its local result is ``local`` less the summed index, whose axes join the partial
    sums, moved as asked (and its own reader's after, from there) or handed on as made, the cheaper.  A result
    declared with an axis is moved as declared, and its own reader reads it as made or as declared (both held)."""
    if reader is None:
        return ZERO, ()
    axes = dict(zip(indices, local.layout, strict=True))
    made = Value(tuple(axes[i] for i in reader.indices), tuple(sorted({*local.unreduced, *axes[reader.over]})))
    target = reader.target if reader.target is not None else Value(made.layout, ())
    found = reshard(ctx, reader.result, reader.indices, (made,), target, bound) if made.reaches(target) else None
    here = (INFINITE, ()) if found is None or found[0] == INFINITE else (_charge(ctx, reader.result, found[0]),
                                                                         found[1])
    if reader.then is None:
        return here
    after = read_after(ctx, reader.then, reader.indices, made, bound)
    if reader.target is not None:  # declared: moved as declared whichever value its reader reads
        if here[0] == INFINITE:
            return INFINITE, ()
        rest = min(after, read_after(ctx, reader.then, reader.indices, target, bound), key=lambda r: r[0])
        return add_cost(here[0], rest[0]), here[1] + rest[1]
    if here[0] != INFINITE:
        rest = read_after(ctx, reader.then, reader.indices, target, bound)
        here = (add_cost(here[0], rest[0]), here[1] + rest[1])
    return min(here, after, key=lambda r: r[0])


def _operand(ctx: CostContext, k: int, op: Operand, local: Value, bound: Cost | None,
             reached: Reached) -> tuple[Cost, tuple[Move, ...]] | None:
    """The cheapest reshard of operand ``k`` to ``local`` (:data:`INFINITE` above ``bound``); None: its
    sources cannot reach it.  Many configurations read the same local value: ``reached`` keeps, per
    (operand, local), what the search answered (its cost and moves) or the bound it lay above, so a
    query whose answer that settles asks nothing (a search asked again would step no further)."""
    key = (k, local)
    if key not in reached:
        if not any(s.reaches(local) for s in op.sources):
            reached[key] = None
            return None
    else:
        hit = reached[key]
        if hit is None:
            return None
        cost, moves = hit
        if moves is not None:  # found: the search settled it, at this cost
            return (INFINITE, ()) if bound is not None and cost > bound else (cost, moves)
        if bound is not None and bound <= cost:  # dearer than a bound at least as large
            return INFINITE, ()
    found = reshard(ctx, op.name, op.indices, op.sources, local, bound)
    if found[0] != INFINITE:
        reached[key] = found
    elif bound is not None:
        reached[key] = (bound, None)
    return found


Terms = tuple[tuple[int, ...], int, str, DType | None]  # operands' and result's element bytes, dtype, GEMM type


def einsum_terms(ctx: CostContext, problem: EinsumProblem) -> Terms:
    """What :func:`compute_cost` reads of ``problem`` beside its local values: the same for every configuration."""
    names = [op.name for op in problem.operands]
    contracts = bool({i for op in problem.operands for i in op.indices} - set(problem.indices))
    dtype = ctx.einsum_dtype(problem.result, names, contracts)
    kind = ctx.gemm_kind(problem.result, names) if contracts else None
    return tuple(ctx.nbytes(name) for name in names), ctx.nbytes(problem.result), dtype, kind


def compute_cost(ctx: CostContext, problem: EinsumProblem, locals_: tuple[Value, ...], local_result: Value,
                 terms: Terms | None = None) -> Cost:
    """The local einsum's time on the plan's chip, as cost prices it: part of the objective (see layout);
    a GEMM's quantize passes beside it (:func:`quantize_bytes`).  ``terms``: :func:`einsum_terms` of it."""
    nbytes, result_bytes, dtype, kind = terms or einsum_terms(ctx, problem)
    operands = ((op.indices, local, size) for op, local, size in zip(problem.operands, locals_, nbytes, strict=True))
    seconds = ctx.einsum_seconds(operands, (problem.indices, local_result, result_bytes), dtype)
    if kind is not None:
        seconds += ctx.quantize_seconds(quantize_bytes(ctx, problem, locals_, kind))
    return (seconds, 0, 0)


def quantize_bytes(ctx: CostContext, problem: EinsumProblem, locals_: tuple[Value, ...], kind: DType) -> float:
    """The HBM bytes of the quantize passes a GEMM in ``kind`` runs on its operands read as ``locals_``, by
    :mod:`shardc.quantize`'s rule as ``shardc cost`` prices it (:func:`shardc.ir.precision.pass_bytes`): none
    for a param read as held, nor for a value and contraction the phase quantized already; a pass fuses
    into the step just before where that made the operand (``Operand.fresh``) and no operand moves; a param
    gathered over the ZeRO axes in the GEMM's type (``param_gather in f8``) is quantized as held, before the
    gather (:func:`shardc.quantize.quantize_passes`)."""
    total = 0.0
    for op, local in zip(problem.operands, locals_, strict=True):
        held = ctx.held.get(op.name)
        if held is not None and held.layout == local.layout or local in op.quantized:
            continue
        if held is not None and ctx.gathered_bytes(tuple(held.used() - local.used()), None,
                                                   ctx.gathered.get(op.name)) == kind.nbytes:
            local = held  # the shard, cast before its gather: never fused into the step before
        key = (op.name, op.indices, problem.indices, local, kind)
        hit = ctx.passes.get(key)
        if hit is None:  # configurations and candidate plans read the same operand values again and again
            along = frozenset(i for i in op.indices if i not in problem.indices)
            elements, stored, tiled = ctx.local_elements(op.indices, local), ctx.dtype_of(op.name), \
                tiled_along(op.indices, along, held is not None)
            hit = ctx.passes[key] = (pass_bytes(elements, stored, ctx.nbytes(op.name), kind, tiled, False),
                                     pass_bytes(elements, stored, ctx.nbytes(op.name), kind, tiled, True))
        unfused, fused = hit
        total += fused if op.fresh == local and _unmoved(problem, locals_) else unfused
    return total


def _unmoved(problem: EinsumProblem, locals_: tuple[Value, ...]) -> bool:
    """Whether the einsum reads every operand as the phase holds it (no move runs between it and the step
    before it)."""
    return all(local in op.sources for op, local in zip(problem.operands, locals_, strict=True))


# How many of the cheapest configurations the search keeps for ``--explain`` (it
# shows six distinct ones); dearer configurations are pruned unexplored.  Without
# --explain only the cheapest is kept, so the search prunes at it.
KEEP = 24


def room(bound: Cost | None, spent: Cost) -> Cost | None:
    """The seconds a reshard may still cost without the configuration losing to ``bound``."""
    if bound is None:
        return None
    room = bound[0] - spent[0]
    return (room + abs(room) * 1e-9 + 1e-18, 1 << 30, 1 << 30)  # ties in seconds are kept


def solve(ctx: CostContext, problem: EinsumProblem) -> tuple[Solution, list[Solution]]:
    """The cheapest solution and, with ``ctx.explain``, the ``KEEP`` cheapest alternatives.

    Exact: a configuration is pruned only once ``KEEP`` others (one without
    ``ctx.explain``) are known to cost no less, so the cheapest one is always found,
    the first of equals as configurations come, whatever is kept.
    """
    keep = KEEP if ctx.explain else 1
    best: Solution | None = None
    seen: list[Solution] = []
    bound: Cost | None = None
    partial, terms = partial_axes(ctx, problem), einsum_terms(ctx, problem)
    reached: Reached = {}
    for config in configurations(ctx, problem):
        ctx.tick()
        sol = _evaluate(ctx, problem, config, bound, partial, terms, reached)
        if sol is None:
            continue
        seen.append(sol)
        if best is None or sol.cost < best.cost:
            best = sol
        if len(seen) >= keep:
            seen = sorted(seen, key=lambda s: s.cost)[:keep]
            bound = seen[-1].cost
    if best is None:
        raise NoPlan(problem.result)
    return best, seen
