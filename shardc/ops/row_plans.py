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

from typing import TYPE_CHECKING

from shardc.errors import InternalError, ShardcError
from shardc.ir.localops import Combine, Row, Vocab
from shardc.ir.plan import Step
from shardc.ir.spec import TensorRef
from shardc.sharding.layout import Value, add_cost
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

__all__ = ["over_of", "check_row_step", "STATS", "BACKWARD_STATS", "VJP", "APPLY", "stat_names", "plan_rows"]

# Per function, the statistics the forward all-reduces when I is sharded (name suffix, combiner).
STATS: dict[str, tuple[tuple[str, str], ...]] = {
    "softmax": (("max", "max"), ("sum", "sum")),
    "logsumexp": (("max", "max"), ("sum", "sum")),
    "rmsnorm": (("ms", "sum"),),
    "layernorm": (("mean", "sum"), ("var", "sum")),  # two passes: mean, then mean((x - mean)**2)
    "max": (("max", "max"),),
    "sum": (),
    "mean": (),
}
# Per function, how many row sums its backward all-reduces when I is sharded.
# (A norm makes its statistics again from its input first: rmsnorm 1 + 1, layernorm 2 + 2.)
BACKWARD_STATS = {"softmax": 1, "rmsnorm": 2, "layernorm": 4, "logsumexp": 0, "max": 0, "sum": 0, "mean": 0}
# Per function, the local map of its gradient in closed form (softmax's when its index is whole).
VJP = {"softmax": Row.SOFTMAX_VJP, "logsumexp": Row.LOGSUMEXP_VJP, "max": Row.MAX_VJP, "sum": Row.SUM_VJP,
       "mean": Row.MEAN_VJP, "rmsnorm": Row.RMSNORM_VJP, "layernorm": Row.LAYERNORM_VJP}
# Per norm, the local map that finishes it from its input and its statistics.
APPLY = {"rmsnorm": Row.RMSNORM_APPLY, "layernorm": Row.LAYERNORM_APPLY}


def stat_names(func: str, result: str) -> tuple[str, ...]:
    """The names the forward statistics of ``func`` take (before making them unique); ``max`` is its own."""
    return () if func == "max" else tuple(f"{result}_{suffix}" for suffix, _ in STATS[func])


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
