"""Reductions over a named index: ``softmax``, ``rmsnorm``, ``layernorm`` (same indices) and ``sum``,
``mean``, ``max``, ``logsumexp`` (the index dropped), planned forward.

Each row (every index but the reduced one, I) is reduced on its own.  When I is
sharded over axes A, two plans can compute it, and the planner costs both with
the same objective as everything else (:meth:`CostContext.seconds`, the table of
collectives):

* gather: AllGather I's shards (V = the whole input over A), then reduce locally;
* statistics: reduce each shard locally to per-row statistics and AllReduce those
  over A (V = rows x 1 per statistic), then finish locally.  Softmax needs the row
  max (an AllReduce taking the max) and the sum of exponentials after it, as
  Megatron-LM's vocab-parallel cross entropy does; rmsnorm the mean of squares;
  layernorm the mean, then the mean squared deviation from it (two passes:
  one pass of E[x**2] - mean**2 cancels to nonsense in 16-bit floats); max its maximum.  ``sum`` and
  ``mean`` are linear: their local result is a partial sum over A ({U_A}), which
  the ordinary moves reduce later (AllReduce, ReduceScatter) or never.

Every function but ``sum`` and ``mean`` is nonlinear: its input is reduced first.
The candidate input layouts are those the phase holds, the requested result's,
and each of them with I gathered; ``shardc plan --explain`` lists them.  The
steps are local maps (``Op.ELEMENTWISE`` with a
:class:`~shardc.ir.localops.Row`; ``dim`` is the position of I in the frame, see
:func:`frame_of`) and AllReduces (``fn=Combine.MAX`` for a maximum).  Local maps are
free in the cost model, as every elementwise step is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from shardc.collectives import FACTOR
from shardc.errors import InternalError, ShardcError
from shardc.ir.localops import Combine, Row, Vocab
from shardc.ir.plan import Alternative, Choice, Op, Step, sum_formula
from shardc.ir.spec import TensorRef
from shardc.planner.rowstats import BACKWARD_STATS, STATS
from shardc.sharding.layout import ZERO, Cost, Layout, Move, Value, add_cost
from shardc.sharding.phase import Phase
from shardc.sharding.search import reshard
from shardc.spec.functions import signature

if TYPE_CHECKING:
    from shardc.ops.registry import Node

__all__ = ["over_of", "check_row_step", "STATS", "BACKWARD_STATS", "plan_rows", "by_index",
           "in_order", "frame_of", "Layouts", "stats_cost", "choose", "candidates", "record"]


def by_index(indices: tuple[str, ...], layout: Layout) -> dict[str, tuple[str, ...]]:
    return dict(zip(indices, layout, strict=True))


def in_order(indices: tuple[str, ...], axes: dict[str, tuple[str, ...]], unreduced: tuple[str, ...] = ()) -> Value:
    """A value laid out index by index (indices absent from ``axes`` replicated)."""
    return Value(tuple(axes.get(i, ()) for i in indices), tuple(sorted(unreduced)))


def frame_of(step: Step) -> tuple[str, ...]:
    """The index order a row step computes in: its result's if that has every index, else its first operand's."""
    widest = max(len(r.indices) for r in (*step.operands, step.dst))
    return step.dst.indices if len(step.dst.indices) == widest else step.operands[0].indices


@dataclass(frozen=True)
class Layouts:
    """One candidate: the input's local value and what the plan does with it."""

    local: Value  # the input as the row function reads it (I's axes: ``axes``)
    axes: tuple[str, ...]  # the mesh axes sharding I there (statistics all-reduced over them)
    cost: Cost
    moves_in: tuple[Move, ...]
    moves_out: tuple[Move, ...]
    result: Value  # the local result
    final: Value  # the result after moves_out

    def describe(self, stats: int) -> str:
        parts = [f"{m.op.title}_{''.join(m.axes)}" for m in self.moves_in if m.op is not Op.SLICE]
        if self.axes and stats:
            parts.append(f"{stats} row statistic{'s' if stats > 1 else ''} AllReduce_{''.join(self.axes)}")
        parts += [f"{m.op.title}_{''.join(m.axes)}" for m in self.moves_out if m.op is not Op.SLICE]
        return ", ".join(parts) if parts else "no communication"


def stats_cost(phase: Phase, rows: tuple[str, ...], value: Value, axes: tuple[str, ...], count: int) -> Cost:
    """``count`` AllReduces over ``axes`` of one statistic per row (rows laid out as ``value``)."""
    if not axes or not count:
        return ZERO
    volume = phase.ctx.local_bytes(rows, value)
    seconds = phase.ctx.seconds(Op.ALL_REDUCE, volume, axes)
    return (seconds * count, count, count)


def choose(options: list[Layouts], stats: int) -> tuple[Layouts, list[Layouts]]:
    """The cheapest option (ties: the first) and the distinct others, for ``--explain``."""
    best = min(options, key=lambda o: o.cost)
    seen: dict[str, Layouts] = {}
    for o in sorted(options, key=lambda o: o.cost):
        seen.setdefault(o.describe(stats), o)
    return best, list(seen.values())


def record(phase: Phase, label: str, best: Layouts, options: list[Layouts], stats: int,
           idx: tuple[str, ...], over: str) -> None:
    """A ``--explain`` entry: each way the reduction could run (``idx``: the indices of an option's
    ``local`` value, ``over`` the reduced one), and why the chosen one won; only when asked
    (:attr:`CostContext.explain`)."""
    if not phase.ctx.explain:
        return
    rows = []
    for o in options:
        vol = _volume(phase, o, stats, idx, over)
        time = o.cost[0] if phase.sized else None
        rows.append(Alternative(o.describe(stats), time, vol, o.cost[1], o is best or
                                o.describe(stats) == best.describe(stats)))
    others = [o for o in options if o.describe(stats) != best.describe(stats)]
    if not others:
        reason = "the only valid local layout"
    elif not phase.sized:
        reason = "no sizes: every dim costed at 2**20, the least time of these"
    else:
        runner = min(others, key=lambda o: o.cost)
        what = ("all-reduce row statistics rather than gather the reduced index" if best.axes and stats else
                "gather the reduced index rather than all-reduce row statistics" if stats and runner.axes else
                "fewer or smaller collectives")
        if runner.cost[0] > best.cost[0] * (1 + 1e-9):
            reason = f"least time ({best.cost[0]:.3g} s vs {runner.cost[0]:.3g} s next): {what}"
        else:
            reason = f"tie in time ({best.cost[0]:.3g} s): fewer collectives, then the first listed"
    phase.choices.append(Choice(phase.name, label, tuple(rows), reason))


def _volume(phase: Phase, o: Layouts, stats: int, idx: tuple[str, ...], over: str) -> str:
    """An option's weighted bytes: its moves', and its statistics' AllReduces (rows x 1 each, counted twice)."""
    terms = [m.volume.scale(FACTOR[m.op]) for m in (*o.moves_in, *o.moves_out) if m.volume is not None]
    if o.axes and stats:
        rows = tuple(i for i in idx if i != over)
        value = in_order(rows, by_index(idx, o.local.layout))
        terms += [phase.ctx.local_bytes(rows, value).scale(FACTOR[Op.ALL_REDUCE])] * stats
    return sum_formula(terms)


def candidates(phase: Phase, arg: str, whole: tuple[str, ...], result_idx: tuple[str, ...], target: Value | None,
               linear: bool) -> list[Value]:
    """Input layouts worth costing: held values (reduced first unless linear), the target's, and each of
    them with the indices ``whole`` gathered (a reduction's I; ``route``'s expert and token indices)."""
    idx = phase.indices[arg]
    found: dict[Value, None] = {}
    for source in phase.held[arg]:
        found[Value(source.layout, source.unreduced if linear else ())] = None
    if target is not None:
        axes = by_index(result_idx, target.layout)
        found[in_order(idx, axes, target.unreduced if linear else ())] = None
    out: dict[Value, None] = {}
    for value in found:
        out[value] = None
        axes = by_index(idx, value.layout)
        if any(axes.get(i) for i in whole):
            out[in_order(idx, {**axes, **dict.fromkeys(whole, ())}, value.unreduced)] = None
    return list(out)


def _option(phase: Phase, node: Node, local: Value, target: Value | None, stats: int) -> Layouts | None:
    (arg,) = node.operands
    idx = phase.indices[arg]
    over = over_of(node)
    if not any(s.reaches(local) for s in phase.held[arg]):
        return None
    cost, moves_in = reshard(phase.ctx, arg, idx, phase.held[arg], local)
    axes = by_index(idx, local.layout)
    rows = tuple(i for i in idx if i != over)
    cost = add_cost(cost, stats_cost(phase, rows, in_order(rows, axes), axes[over], stats))
    reduces = signature(node.fn or "").kind == "reduce"
    extra = axes[over] if reduces and node.fn in ("sum", "mean") else ()
    if reduces:
        result = in_order(node.indices, axes, tuple(local.unreduced) + extra)
    else:
        result = in_order(node.indices, axes)
    want = target if target is not None else Value(result.layout, ())
    if not result.reaches(want):
        return None
    moved, moves_out = reshard(phase.ctx, node.result, node.indices, (result,), want)
    return Layouts(local, axes[over], add_cost(cost, moved), moves_in, moves_out, result, want)


def over_of(node: Node) -> str:
    """The index a reduction node runs over."""
    assert node.call is not None and node.call.over is not None
    return node.call.over


def plan_rows(phase: Phase, node: Node, declared: dict[str, TensorRef], target: Value | None,
              label: str) -> None:
    """Plan a reduction node: cost each candidate, emit the cheapest, record the choice."""
    fn = node.fn or ""
    (arg,) = node.operands
    if target is not None and target.unreduced and fn not in ("sum", "mean"):
        raise ShardcError(f"{node.result} is {fn} of partial sums, which is not a partial sum",
                          node.statement.span, fix="drop the {U_...} suffix: the function needs reduced values")
    stats = len(STATS[fn])
    linear = fn in ("sum", "mean")
    options = [o for v in candidates(phase, arg, (over_of(node),), node.indices, target, linear)
               if (o := _option(phase, node, v, target, stats)) is not None]
    if not options:
        raise ShardcError(f"no sharding of {arg} makes {label.split(' = ')[0]}", node.statement.span,
                          fix="a partial sum {U_..} of a reduction needs its index sharded over those axes")
    best, shown = choose(options, stats)
    head = label.split(" = ")[0]
    record(phase, f"{head} = {fn}({phase.text(arg, phase.held[arg][0])} over {over_of(node)})", best, shown, stats,
           phase.indices[arg], over_of(node))
    phase.moves(arg, best.moves_in)
    emit_forward(phase, node, best)
    phase.moves(node.result, best.moves_out)
    declared.setdefault(node.result, phase.ref(node.result, best.final))


def local_map(phase: Phase, fn: Row | Vocab, dst: str, value: Value, operands: tuple[tuple[str, Value], ...],
              over: str, shapes: tuple[tuple[str, Value], ...] = ()) -> None:
    """One local row map; its ``dim`` is I's position in its frame (:func:`frame_of`); ``shapes``
    are read for their shape only (:class:`Step`)."""
    step = Step(Op.ELEMENTWISE, dst, phase.ref(dst, value), operands=tuple(phase.ref(n, v) for n, v in operands),
                fn=fn, shapes=tuple(phase.ref(n, v) for n, v in shapes))
    frame = frame_of(step)
    phase.emit(replace(step, dim=frame.index(over) if over in frame else None), value)


def all_reduce(phase: Phase, name: str, value: Value, axes: tuple[str, ...], combine: Combine | None) -> Value:
    """One AllReduce of a statistic (partial over ``axes``); ``combine`` None sums."""
    done = Value(value.layout, tuple(a for a in value.unreduced if a not in axes))
    volume = phase.ctx.local_bytes(phase.indices[name], value, phase.ctx.nbytes(name))
    phase.emit(Step(Op.ALL_REDUCE, name, phase.ref(name, done), phase.ref(name, value), axes,
                    fn=combine, volume=volume,
                    note="row statistic"), done)
    return done


def statistic(phase: Phase, fn: Row, name: str, rows_value: Value, axes: tuple[str, ...],
              operands: tuple[tuple[str, Value], ...], over: str, combine: Combine | None) -> Value:
    """A per-row statistic: local over this shard (partial over ``axes``), then all-reduced."""
    partial = Value(rows_value.layout, tuple(sorted(axes)))
    local_map(phase, fn, name, partial, operands, over)
    return all_reduce(phase, name, partial, axes, combine) if axes else partial


def emit_forward(phase: Phase, node: Node, option: Layouts) -> None:
    """The local maps and statistic AllReduces of one reduction, in the option's layout."""
    fn = node.fn or ""
    (arg,) = node.operands
    idx = phase.indices[arg]
    over = over_of(node)
    x = (arg, option.local)
    axes = option.axes
    rows = tuple(i for i in idx if i != over)
    rows_value = in_order(rows, by_index(idx, option.local.layout))
    names = node.aux
    for name in names:
        phase.indices.setdefault(name, rows)
    out = (node.result, option.result)
    if fn in ("sum", "mean"):
        local_map(phase, Row.ROW_SUM if fn == "sum" else Row.ROW_MEAN, node.result, option.result, (x,), over)
    elif fn == "max":
        value = statistic(phase, Row.ROW_MAX, node.result, option.result, axes, (x,), over, Combine.MAX)
        assert value == option.result or not axes
    elif fn in ("softmax", "logsumexp") and not axes:
        local_map(phase, Row.SOFTMAX if fn == "softmax" else Row.LOGSUMEXP, node.result, option.result, (x,), over)
    elif fn in ("softmax", "logsumexp"):
        m = statistic(phase, Row.ROW_MAX, names[0], rows_value, axes, (x,), over, Combine.MAX)
        z = statistic(phase, Row.ROW_SUMEXP, names[1], rows_value, axes, (x, (names[0], m)), over, None)
        if fn == "softmax":
            local_map(phase, Row.SOFTMAX_APPLY, *out, (x, (names[0], m), (names[1], z)), over)
        else:
            local_map(phase, Row.LSE_APPLY, *out, ((names[0], m), (names[1], z)), over)
    elif fn == "rmsnorm":
        q = statistic(phase, Row.ROW_MEANSQ, names[0], rows_value, axes, (x,), over, None)
        local_map(phase, Row.RMSNORM_APPLY, *out, (x, (names[0], q)), over)
    elif fn == "layernorm":
        mu = statistic(phase, Row.ROW_MEAN, names[0], rows_value, axes, (x,), over, None)
        var = statistic(phase, Row.ROW_MEANDEV, names[1], rows_value, axes, (x, (names[0], mu)), over, None)
        local_map(phase, Row.LAYERNORM_APPLY, *out, (x, (names[0], mu), (names[1], var)), over)
    else:
        raise InternalError(f"`{fn}` is not a reduction over an index",
                            fix="this is a shardc bug: please report the spec")


def check_row_step(step: Step) -> list[str]:
    """Why a local row step is invalid: its operands must shard each index as its frame does
    (what it reads for the shape only, :attr:`Step.shapes`, may be sharded any way)."""
    operands = step.operands
    if step.fn in (Vocab.EMBED, Vocab.EMBED_VJP):
        tok, other = operands
        table = other if step.fn is Vocab.EMBED else step.dst
        if {a for d in tok.dims for a in d.axes} & {a for d in table.dims for a in d.axes}:
            return [f"{step.fn} {step.dst}: the ids and the table {table.name} share a mesh axis"]
        rows = step.dst if step.fn is Vocab.EMBED else other  # the looked-up rows: the ids' indices, the table's others
        axes = {d.name: d.axes for d in (*tok.dims, *table.dims[1:])}
        return [f"{step.fn} {step.dst}: {rows.name} shards {d.name} unlike the ids and the table"
                for d in rows.dims if axes.get(d.name) != d.axes]
    widest = max((*operands, step.dst), key=lambda r: len(r.indices))
    axes = {d.name: d.axes for d in widest.dims}
    problems = []
    for ref in (*operands, step.dst):
        for d in ref.dims:
            if axes.get(d.name, d.axes) != d.axes:
                problems.append(f"row step {step.fn} {step.dst}: {ref.name} shards {d.name} over {d.axes}, "
                                f"its frame over {axes[d.name]}")
    return problems
