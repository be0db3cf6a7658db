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
  one pass of E[x**2] - mean**2 cancels to nonsense in 16-bit floats); max its maximum.  ``sort``
  has no statistics (a row's order needs every element of it): only the gather plans it.  ``sum`` and
  ``mean`` are linear: their local result is a partial sum over A ({U_A}), which
  the ordinary moves reduce later (AllReduce, ReduceScatter) or never.

Every function but ``sum`` and ``mean`` is nonlinear: its input is reduced first.
The candidate input layouts are those the phase holds, the requested result's,
and each of them with I gathered; ``shardc plan --explain`` lists them.  The
steps are local maps (``Op.ELEMENTWISE`` with a
:class:`~shardc.ir.localops.Row`; ``dim`` is the position of I in the frame, see
:func:`~shardc.sharding.rowwise.frame_of`) and AllReduces (``fn=Combine.MAX`` for a maximum).  Local maps are
free in the cost model, as every elementwise step is.

What differs between the functions is a table the family owns (:data:`FORWARD`, one
:class:`RowFunction` a function: its statistics, whether it is linear, its local maps), never a
comparison of their names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from shardc.errors import ShardcError
from shardc.ir.localops import Combine, Row, Vocab
from shardc.ir.plan import Step
from shardc.ir.spec import TensorRef
from shardc.sharding.einsum import Reader, read_after
from shardc.sharding.layout import Cost, Value, add_cost
from shardc.sharding.phase import Phase
from shardc.sharding.rowwise import (
    Layouts,
    by_index,
    candidates,
    choose,
    in_order,
    local_map,
    record,
    statistic,
    stats_cost,
)
from shardc.sharding.search import reshard
from shardc.spec.functions import signature

if TYPE_CHECKING:
    from shardc.ops.registry import Node

__all__ = ["over_of", "check_row_step", "RowFunction", "FORWARD", "stat_names", "plan_rows"]


@dataclass(frozen=True)
class _Rows:
    """One reduction's forward in the layout chosen (``option``): what its function's maps read and make."""

    phase: Phase
    node: Node
    option: Layouts
    over: str
    rows_value: Value  # a per-row statistic's layout

    @property
    def x(self) -> tuple[str, Value]:
        """The input, as the option reads it."""
        return self.node.operands[0], self.option.local

    def stat(self, k: int, fn: Row, reads: tuple[tuple[str, Value], ...],
             combine: Combine | None = None) -> tuple[str, Value]:
        """The node's ``k``-th row statistic (:attr:`Node.aux`), all-reduced over I's axes (``combine`` None sums)."""
        name = self.node.aux[k]
        return name, statistic(self.phase, fn, name, self.rows_value, self.option.axes, reads, self.over, combine)

    def finish(self, fn: Row, reads: tuple[tuple[str, Value], ...]) -> None:
        """The local map that makes the node's result."""
        local_map(self.phase, fn, self.node.result, self.option.result, reads, self.over)


def _sum(r: _Rows) -> None:
    r.finish(Row.ROW_SUM, (r.x,))


def _mean(r: _Rows) -> None:
    r.finish(Row.ROW_MEAN, (r.x,))


def _max(r: _Rows) -> None:
    # its one statistic is its result
    value = statistic(r.phase, Row.ROW_MAX, r.node.result, r.option.result, r.option.axes, (r.x,), r.over,
                      Combine.MAX)
    assert value == r.option.result or not r.option.axes


def _max_and_sumexp(r: _Rows) -> tuple[tuple[str, Value], tuple[str, Value]]:
    """The row max, then the sum of exponentials after it (Megatron-LM's vocab-parallel cross entropy)."""
    m = r.stat(0, Row.ROW_MAX, (r.x,), Combine.MAX)
    return m, r.stat(1, Row.ROW_SUMEXP, (r.x, m))


def _softmax(r: _Rows) -> None:
    if not r.option.axes:
        r.finish(Row.SOFTMAX, (r.x,))
        return
    m, z = _max_and_sumexp(r)
    r.finish(Row.SOFTMAX_APPLY, (r.x, m, z))


def _logsumexp(r: _Rows) -> None:
    if not r.option.axes:
        r.finish(Row.LOGSUMEXP, (r.x,))
        return
    m, z = _max_and_sumexp(r)
    r.finish(Row.LSE_APPLY, (m, z))


def _rmsnorm(r: _Rows) -> None:
    q = r.stat(0, Row.ROW_MEANSQ, (r.x,))
    r.finish(Row.RMSNORM_APPLY, (r.x, q))


def _sort(r: _Rows) -> None:
    assert not r.option.axes  # a row's order needs every element of it: I is whole (RowFunction.whole)
    r.finish(Row.SORT, (r.x,))


def _layernorm(r: _Rows) -> None:
    # two passes: the mean, then mean((x - mean)**2) (one pass of E[x**2] - mean**2 cancels in 16-bit floats)
    mu = r.stat(0, Row.ROW_MEAN, (r.x,))
    var = r.stat(1, Row.ROW_MEANDEV, (r.x, mu))
    r.finish(Row.LAYERNORM_APPLY, (r.x, mu, var))


@dataclass(frozen=True)
class RowFunction:
    """How one function over an index is planned forward."""

    stats: tuple[str, ...]  # its row statistics, by name suffix, all-reduced where I is sharded
    emit: Callable[[_Rows], None]  # its local maps and statistic AllReduces, in the layout chosen
    linear: bool = False  # partial sums in, partial sums out: its local result stays partial over I's axes
    named: bool = True  # its statistics are tensors of their own (max's one statistic is its result)
    whole: bool = False  # it has no statistics to all-reduce: I is whole on a device (gathered where sharded)


FORWARD: dict[str, RowFunction] = {
    "softmax": RowFunction(("max", "sum"), _softmax),
    "logsumexp": RowFunction(("max", "sum"), _logsumexp),
    "rmsnorm": RowFunction(("ms",), _rmsnorm),
    "layernorm": RowFunction(("mean", "var"), _layernorm),
    "max": RowFunction(("max",), _max, named=False),
    "sum": RowFunction((), _sum, linear=True),
    "mean": RowFunction((), _mean, linear=True),
    "sort": RowFunction((), _sort, whole=True),
}


def stat_names(func: str, result: str) -> tuple[str, ...]:
    """The names the forward statistics of ``func`` take (before making them unique)."""
    function = FORWARD[func]
    return tuple(f"{result}_{suffix}" for suffix in function.stats) if function.named else ()


def _option(phase: Phase, node: Node, local: Value, target: Value | None, stats: int,
            whole_first: bool = False) -> Layouts | None:
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
    extra = axes[over] if reduces and FORWARD[node.fn or ""].linear else ()
    if reduces:
        result = in_order(node.indices, axes, tuple(local.unreduced) + extra)
    else:
        result = in_order(node.indices, axes)
    want = target if target is not None and not node.partial else Value(result.layout, ())
    if not result.reaches(want):
        return None
    moved, moves_out = reshard(phase.ctx, node.result, node.indices, (result,), want)
    if whole_first and result.unreduced and want.unreduced != result.unreduced:  # reduced in place, then moved
        reduced = Value(result.layout, want.unreduced)
        first, second = (reshard(phase.ctx, node.result, node.indices, (v,), w)
                         for v, w in ((result, reduced), (reduced, want)))
        moved, moves_out = add_cost(first[0], second[0]), first[1] + second[1]
    # handed on unreduced (graph.handed_on): ranked as if reduced here, where its reader may reduce it
    return Layouts(local, axes[over], add_cost(cost, moved), moves_in, moves_out, result,
                   result if node.partial else want, node.partial)


def _read_on(phase: Phase, node: Node, option: Layouts, reader: Reader) -> Cost:
    """What ``reader`` moves after ``option``, reading the cheapest of the values the option holds on the way
    (its local result, each value its moves pass through): ``M1[S_X]`` reduced whole, then sliced, leaves a
    whole ``M1[S]`` a sum over S reads for free."""
    held = (option.result, *(m.dst for m in option.moves_out))
    return min(read_after(phase.ctx, reader, node.indices, v, None)[0] for v in held)


def reader_of(node: Node | None, declared: dict[str, TensorRef]) -> Reader | None:
    """The sum or mean ``node`` a result is handed on to (or, declared, read by), as a search weighs it: its result
    as declared, or reduced in place where it is handed on in turn (to its own reader) or has no layout asked."""
    if node is None:
        return None
    wanted = None if node.partial else declared.get(node.result, node.target)
    return Reader(over_of(node), node.result, node.indices, None if wanted is None else Value.of(wanted),
                  reader_of(node.reader, declared))


def over_of(node: Node) -> str:
    """The index a reduction node runs over."""
    assert node.call is not None and node.call.over is not None
    return node.call.over


def plan_rows(phase: Phase, node: Node, declared: dict[str, TensorRef], target: Value | None,
              label: str) -> None:
    """Plan a reduction node: cost each candidate, emit the cheapest, record the choice."""
    fn = node.fn or ""
    function = FORWARD[fn]
    (arg,) = node.operands
    if target is not None and target.unreduced and not function.linear:
        raise ShardcError(f"{node.result} is {fn} of partial sums, which is not a partial sum",
                          node.statement.span, fix="drop the {U_...} suffix: the function needs reduced values")
    stats = len(function.stats)
    options = [o for v in candidates(phase, arg, (over_of(node),), node.indices, target, function.linear,
                                     moved=function.whole)
               if (o := _option(phase, node, v, target, stats)) is not None and not (function.whole and o.axes)]
    if not options:
        raise ShardcError(f"no sharding of {arg} makes {label.split(' = ')[0]}", node.statement.span,
                          fix="a partial sum {U_..} of a reduction needs its index sharded over those axes")
    reader = reader_of(node.reader, declared) if not node.partial else None
    if reader is not None:  # declared, one sum or mean reads it after: each value it is moved through weighed
        options += [o for v in candidates(phase, arg, (over_of(node),), node.indices, target, function.linear)
                    if (o := _option(phase, node, v, target, stats, whole_first=True)) is not None]
    best, shown = choose(options, stats)
    alone = best
    if reader is not None:
        best = min(options, key=lambda o: add_cost(o.cost, _read_on(phase, node, o, reader)))
    head = label.split(" = ")[0]
    record(phase, f"{head} = {fn}({phase.text(arg, phase.held[arg][0])} over {over_of(node)})", best, shown, stats,
           phase.indices[arg], over_of(node))
    # ranked with its reader's moves, which the times shown do not hold: the reason says so
    if reader is not None and best is not alone and phase.ctx.explain:
        phase.choices[-1] = replace(phase.choices[-1], reason=f"least time with what {reader.result} moves "
                                    "after it, reading any value this one is moved through")
    phase.moves(arg, best.moves_in)
    emit_forward(phase, node, best)
    phase.moves(node.result, () if best.handed else best.moves_out)
    if node.partial:  # a plain intermediate handed on unreduced: held so (graph.handed_on)
        declared[node.result] = phase.ref(node.result, best.final)
    declared.setdefault(node.result, phase.ref(node.result, best.final))


def emit_forward(phase: Phase, node: Node, option: Layouts) -> None:
    """The local maps and statistic AllReduces of one reduction, in the option's layout."""
    (arg,) = node.operands
    idx = phase.indices[arg]
    over = over_of(node)
    rows = tuple(i for i in idx if i != over)
    for name in node.aux:
        phase.indices.setdefault(name, rows)
    rows_value = in_order(rows, by_index(idx, option.local.layout))
    FORWARD[node.fn or ""].emit(_Rows(phase, node, option, over, rows_value))


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
