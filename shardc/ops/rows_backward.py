"""The backward of a reduction over an index, in closed form, planned by the forward's rule.

With I the reduced index, rows every other index, and each row on its own:

    softmax     dX = P * (dP - sum(dP * P over I))
    rmsnorm     dX = r * (dY - Y * mean(dY * Y over I)),           r = 1 / sqrt(ms + 1e-6)
    layernorm   dX = r * (dY - mean(dY) - Y * mean(dY * Y over I)), r = 1 / sqrt(var + 1e-5)
    logsumexp   dX = exp(X - L) * dL
    max         dX = (X == M) * dM
    sum, mean   dX = dS spread along I (over I's size for mean)
    sort        dX = dY at each element's rank along I (X's stable argsort, inverted)

Where I is sharded over axes A, the row sums above are local partial sums
all-reduced over A (one AllReduce of rows x 1 each), or I is gathered first (a sort's, which has
no row sums, always is):
the same candidates and the same objective as the forward
(:mod:`shardc.ops.row_plans`).  A norm's backward reads its input X, and makes its
statistics and Y again from it (the same maps and AllReduces as the forward, counted
in the backward): the layer keeps a norm's input and nothing of its own, as
Korthikanti et al. 2022 count it (2sbh a layernorm), and the recomputed statistics are
rows x 1.

What differs between the functions is a table the family owns (:data:`BACKWARD`, one
:class:`RowGradient` a function: what its gradient reads, its row sums, its local maps), never a
comparison of their names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardc.ir.localops import Row
from shardc.names import fresh
from shardc.ops.row_plans import over_of
from shardc.sharding.layout import ZERO, Cost, Move, Value, add_cost
from shardc.sharding.rowwise import (
    Layouts,
    by_index,
    choose,
    in_order,
    local_map,
    moved_onto,
    record,
    statistic,
    stats_cost,
)
from shardc.sharding.search import reshard

if TYPE_CHECKING:
    from shardc.ops.registry import BackwardPass, Node

__all__ = ["rows_backward", "RowGradient", "BACKWARD"]

Reads = tuple[tuple[str, Value], ...]


@dataclass(frozen=True)
class _Grad:
    """One reduction's gradient in the layout chosen (``option``): what its function's maps read and make."""

    bw: BackwardPass
    node: Node
    grad: str  # the result's cotangent
    option: Layouts
    dst: str  # the input's gradient (or a contribution to it)
    reads: Reads  # what the function's gradient reads (:attr:`RowGradient.reads`), moved to the option's layout
    rows_value: Value  # a per-row sum's layout
    row_idx: tuple[str, ...]
    over: str

    @property
    def function(self) -> RowGradient:
        return BACKWARD[self.node.fn or ""]

    def row_sum(self, base: str, suffix: str, fn: Row, reads: Reads) -> tuple[str, Value]:
        """A per-row sum named after ``base``, all-reduced over I's axes."""
        name = _stat_name(self.bw, base, suffix, self.row_idx)
        return name, statistic(self.bw.phase, fn, name, self.rows_value, self.option.axes, reads, self.over, None)

    def finish(self, fn: Row, reads: Reads, shapes: Reads = ()) -> None:
        """The local map that makes the input's gradient."""
        local_map(self.bw.phase, fn, self.dst, self.option.local, reads, self.over, shapes=shapes)


def _closed_form(g: _Grad) -> None:
    g.finish(g.function.vjp, g.reads)


def _spread(g: _Grad) -> None:
    # dS spread along I: the input as declared is read for I's length only
    (x,) = g.node.operands
    g.finish(g.function.vjp, g.reads, shapes=((x, Value.of(g.bw.declared[x])),))


def _softmax(g: _Grad) -> None:
    if not g.option.axes:
        _closed_form(g)
        return
    total = g.row_sum(g.grad, "rowsum", Row.ROW_DOT, g.reads[:2])
    g.finish(Row.SOFTMAX_VJP_APPLY, (*g.reads, total))


def _rms_again(g: _Grad, x: tuple[str, Value]) -> Reads:
    """An rmsnorm's statistic made again from its input: the mean of squares."""
    return (g.row_sum(g.node.result, "ms", Row.ROW_MEANSQ, (x,)),)


def _ln_again(g: _Grad, x: tuple[str, Value]) -> Reads:
    """A layernorm's statistics made again from its input: the mean, then the mean squared deviation."""
    mu = g.row_sum(g.node.result, "mean", Row.ROW_MEAN, (x,))
    return mu, g.row_sum(g.node.result, "var", Row.ROW_MEANDEV, (x, mu))


def _norm(g: _Grad, again: Callable[[_Grad, tuple[str, Value]], Reads], apply: Row, centred: bool) -> None:
    """A norm's gradient: its statistics and output made again (:func:`_norm_again`), the row sums of the
    cotangent (its mean too where the norm is ``centred``), then the closed form."""
    y, stats = _norm_again(g, again, apply)
    reads = (y, g.reads[1], *stats)
    sums = []
    if centred:
        sums.append(g.row_sum(g.grad, "mean", Row.ROW_MEAN, reads[1:2]))
    sums.append(g.row_sum(g.grad, "dot", Row.ROW_MEANDOT, reads[:2]))
    g.finish(g.function.vjp, (*reads, *sums))


def _rmsnorm(g: _Grad) -> None:
    _norm(g, _rms_again, Row.RMSNORM_APPLY, centred=False)


def _layernorm(g: _Grad) -> None:
    _norm(g, _ln_again, Row.LAYERNORM_APPLY, centred=True)


def _result_and_cotangent(node: Node, grad: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (node.result, grad), ()


def _input_and_cotangent(node: Node, grad: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (*node.operands, grad), ()


def _input_and_row_values(node: Node, grad: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return node.operands, (node.result, grad)


def _cotangent(node: Node, grad: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (), (grad,)


@dataclass(frozen=True)
class RowGradient:
    """How one function's gradient over an index is planned."""

    # (full-rank tensors, per-row tensors) the gradient of a node reads, given its cotangent's name
    reads: Callable[[Node, str], tuple[tuple[str, ...], tuple[str, ...]]]
    stats: int  # row sums it all-reduces where I is sharded
    vjp: Row  # the local map of the gradient in closed form (softmax's where its index is whole)
    emit: Callable[[_Grad], None] = _closed_form  # its local maps and row-sum AllReduces
    whole: bool = False  # no row sums to all-reduce: I is whole on a device (gathered where sharded)


# A norm makes its statistics again from its input first: rmsnorm 1 + 1 row sums, layernorm 2 + 2.
BACKWARD: dict[str, RowGradient] = {
    "softmax": RowGradient(_result_and_cotangent, 1, Row.SOFTMAX_VJP, _softmax),
    "rmsnorm": RowGradient(_input_and_cotangent, 2, Row.RMSNORM_VJP, _rmsnorm),
    "layernorm": RowGradient(_input_and_cotangent, 4, Row.LAYERNORM_VJP, _layernorm),
    "logsumexp": RowGradient(_input_and_row_values, 0, Row.LOGSUMEXP_VJP),
    "max": RowGradient(_input_and_row_values, 0, Row.MAX_VJP),
    "sum": RowGradient(_cotangent, 0, Row.SUM_VJP, _spread),
    "mean": RowGradient(_cotangent, 0, Row.MEAN_VJP, _spread),
    "sort": RowGradient(_input_and_cotangent, 0, Row.SORT_VJP, whole=True),
}


def _reads(node: Node, grad: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(full-rank tensors, per-row tensors) the gradient of ``node`` reads."""
    return BACKWARD[node.fn or ""].reads(node, grad)


def _layout_of(bw: BackwardPass, name: str, axes: dict[str, tuple[str, ...]]) -> Value:
    return in_order(bw.phase.indices[name], axes)


def _option(bw: BackwardPass, node: Node, grad: str, local: Value, dst: str) -> Layouts | None:
    (x,) = node.operands
    phase = bw.phase
    idx = phase.indices[x]
    over = over_of(node)
    axes = by_index(idx, local.layout)
    if BACKWARD[node.fn or ""].whole and axes[over]:
        return None
    full, rows = _reads(node, grad)
    total: Cost = ZERO
    moves_in: list[Move] = []
    for name in (*full, *rows):
        want = _layout_of(bw, name, axes if name in full else {**axes, over: ()})
        if name not in phase.held or not any(s.reaches(want) for s in phase.held[name]):
            return None
        cost, moves = reshard(phase.ctx, name, phase.indices[name], phase.held[name], want)
        total = add_cost(total, cost)
        moves_in += moves
    row_idx = tuple(i for i in idx if i != over)
    total = add_cost(total, stats_cost(phase, row_idx, in_order(row_idx, axes), axes[over],
                                       BACKWARD[node.fn or ""].stats))
    if bw.count.get(x, 0) <= 1:
        moved, moves_out = reshard(phase.ctx, dst, idx, (local,), bw.target(x))
        total = add_cost(total, moved)
    else:
        moves_out = ()
    return Layouts(local, axes[over], total, tuple(moves_in), moves_out, local, bw.target(x))


def _candidates(bw: BackwardPass, node: Node, grad: str) -> list[Value]:
    (x,) = node.operands
    idx = bw.phase.indices[x]
    over = over_of(node)
    full, _ = _reads(node, grad)
    found: dict[Value, None] = {bw.target(x): None}
    for name in full:
        for source in bw.phase.held.get(name, []):
            found[in_order(idx, by_index(bw.phase.indices[name], source.layout))] = None
    out: dict[Value, None] = {}
    for value in found:
        out[value] = None
        axes = by_index(idx, value.layout)
        if axes.get(over):
            out[in_order(idx, {**axes, over: ()})] = None
            for moved in (moved_onto(idx, axes, (over,)) if BACKWARD[node.fn or ""].whole else []):
                out[moved] = None
    return list(out)


def rows_backward(bw: BackwardPass, node: Node, grad: str) -> None:
    """Plan dX of one reduction: choose the layout, move the reads there, emit the closed form."""
    (x,) = node.operands
    if x not in bw.needs:
        return
    phase = bw.phase
    dst = bw.part_name(x)
    options = [o for v in _candidates(bw, node, grad) if (o := _option(bw, node, grad, v, dst)) is not None]
    stats = BACKWARD[node.fn or ""].stats
    best, shown = choose(options, stats)
    idx = phase.indices[x]
    over = over_of(node)
    label = f"{phase.text(dst, bw.target(x))} = {node.fn}_vjp({phase.text(grad, phase.held[grad][0])} over {over})"
    record(phase, label, best, shown, stats, idx, over)
    _emit(bw, node, grad, best, dst)
    if bw.count.get(x, 0) > 1:
        bw.parts.setdefault(x, []).append((dst, best.local))
    else:
        phase.moves(dst, best.moves_out)


def _emit(bw: BackwardPass, node: Node, grad: str, option: Layouts, dst: str) -> None:
    phase = bw.phase
    (x,) = node.operands
    idx = phase.indices[x]
    over = over_of(node)
    axes = by_index(idx, option.local.layout)
    full, rows = _reads(node, grad)
    values: dict[str, Value] = {}
    for name in (*full, *rows):
        want = _layout_of(bw, name, axes if name in full else {**axes, over: ()})
        _, moves = reshard(phase.ctx, name, phase.indices[name], phase.held[name], want)
        phase.moves(name, moves, note="residual for the reduction's gradient")
        values[name] = want
    reads = tuple((n, values[n]) for n in (*full, *rows))
    row_idx = tuple(i for i in idx if i != over)
    rows_value = in_order(row_idx, axes | {over: ()})
    BACKWARD[node.fn or ""].emit(_Grad(bw, node, grad, option, dst, reads, rows_value, row_idx, over))


def _norm_again(g: _Grad, again: Callable[[_Grad, tuple[str, Value]], Reads],
                apply: Row) -> tuple[tuple[str, Value], Reads]:
    """A norm's statistics and output made again from its input, in the backward's layout
    (under names of their own: the forward's values are not the backward's to remake)."""
    phase, x = g.bw.phase, g.reads[0]
    stats = again(g, x)
    name = _stat_name(g.bw, g.node.result, "again", phase.indices[g.node.result])
    y = in_order(phase.indices[name], by_index(phase.indices[x[0]], g.option.local.layout))  # the result's order
    local_map(phase, apply, name, y, (x, *stats), g.over)
    return (name, y), stats


def _stat_name(bw: BackwardPass, grad: str, suffix: str, rows: tuple[str, ...]) -> str:
    name = fresh(f"{grad}_{suffix}", bw.taken)
    bw.phase.indices[name] = rows
    return name
