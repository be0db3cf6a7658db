"""The backward of a reduction over an index, in closed form, planned by the forward's rule.

With I the reduced index, rows every other index, and each row on its own:

    softmax     dX = P * (dP - sum(dP * P over I))
    rmsnorm     dX = r * (dY - Y * mean(dY * Y over I)),           r = 1 / sqrt(ms + 1e-6)
    layernorm   dX = r * (dY - mean(dY) - Y * mean(dY * Y over I)), r = 1 / sqrt(var + 1e-5)
    logsumexp   dX = exp(X - L) * dL
    max         dX = (X == M) * dM
    sum, mean   dX = dS spread along I (over I's size for mean)

Where I is sharded over axes A, the row sums above are local partial sums
all-reduced over A (one AllReduce of rows x 1 each), or I is gathered first:
the same candidates and the same objective as the forward
(:mod:`shardc.ops.row_plans`).  A norm's backward reads its input X, and makes its
statistics and Y again from it (the same maps and AllReduces as the forward, counted
in the backward): the layer keeps a norm's input and nothing of its own, as
Korthikanti et al. 2022 count it (2sbh a layernorm), and the recomputed statistics are
rows x 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardc.ir.localops import Row
from shardc.names import fresh
from shardc.ops.row_plans import APPLY, BACKWARD_STATS, VJP, over_of
from shardc.sharding.layout import ZERO, Cost, Move, Value, add_cost
from shardc.sharding.rowwise import Layouts, by_index, choose, in_order, local_map, record, statistic, stats_cost
from shardc.sharding.search import reshard

if TYPE_CHECKING:
    from shardc.ops.registry import BackwardPass, Node

__all__ = ["rows_backward"]


def _reads(node: Node, grad: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(full-rank tensors, per-row tensors) the gradient of ``node`` reads, besides nothing else."""
    fn = node.fn or ""
    (x,) = node.operands
    if fn == "softmax":
        return (node.result, grad), ()
    if fn in ("rmsnorm", "layernorm"):
        return (x, grad), ()
    if fn in ("logsumexp", "max"):
        return (x,), (node.result, grad)
    return (), (grad,)


def _layout_of(bw: BackwardPass, name: str, axes: dict[str, tuple[str, ...]]) -> Value:
    return in_order(bw.phase.indices[name], axes)


def _option(bw: BackwardPass, node: Node, grad: str, local: Value, dst: str) -> Layouts | None:
    (x,) = node.operands
    phase = bw.phase
    idx = phase.indices[x]
    over = over_of(node)
    axes = by_index(idx, local.layout)
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
                                       BACKWARD_STATS[node.fn or ""]))
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
    return list(out)


def rows_backward(bw: BackwardPass, node: Node, grad: str) -> None:
    """Plan dX of one reduction: choose the layout, move the reads there, emit the closed form."""
    (x,) = node.operands
    if x not in bw.needs:
        return
    phase = bw.phase
    dst = bw.part_name(x)
    options = [o for v in _candidates(bw, node, grad) if (o := _option(bw, node, grad, v, dst)) is not None]
    stats = BACKWARD_STATS[node.fn or ""]
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
    fn = node.fn or ""
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
    if fn == "softmax" and option.axes:
        name = _stat_name(bw, grad, "rowsum", row_idx)
        total = statistic(phase, Row.ROW_DOT, name, rows_value, option.axes, reads[:2], over, None)
        local_map(phase, Row.SOFTMAX_VJP_APPLY, dst, option.local, (*reads, (name, total)), over)
    elif fn in ("rmsnorm", "layernorm"):
        again, stats = _norm_again(bw, node, reads[0], option, rows_value, row_idx)
        reads = (again, reads[1], *stats)
        sums: list[tuple[str, Value]] = []
        if fn == "layernorm":
            name = _stat_name(bw, grad, "mean", row_idx)
            sums.append((name, statistic(phase, Row.ROW_MEAN, name, rows_value, option.axes, reads[1:2], over, None)))
        name = _stat_name(bw, grad, "dot", row_idx)
        sums.append((name, statistic(phase, Row.ROW_MEANDOT, name, rows_value, option.axes, reads[:2], over, None)))
        local_map(phase, VJP[fn], dst, option.local, (*reads, *sums), over)
    elif fn in ("sum", "mean"):  # dS spread along I: the input as declared is read for I's length only
        local_map(phase, VJP[fn], dst, option.local, reads, over, shapes=((x, Value.of(bw.declared[x])),))
    else:
        local_map(phase, VJP[fn], dst, option.local, reads, over)


def _norm_again(bw: BackwardPass, node: Node, x: tuple[str, Value], option: Layouts, rows_value: Value,
                row_idx: tuple[str, ...]) -> tuple[tuple[str, Value], tuple[tuple[str, Value], ...]]:
    """A norm's statistics and output made again from its input, in the backward's layout
    (under names of their own: the forward's values are not the backward's to remake)."""
    phase, over = bw.phase, over_of(node)
    first = _stat_name(bw, node.result, "mean" if node.fn == "layernorm" else "ms", row_idx)
    stats: tuple[tuple[str, Value], ...]
    if node.fn == "rmsnorm":
        stats = ((first, statistic(phase, Row.ROW_MEANSQ, first, rows_value, option.axes, (x,), over, None)),)
    else:
        mu = statistic(phase, Row.ROW_MEAN, first, rows_value, option.axes, (x,), over, None)
        second = _stat_name(bw, node.result, "var", row_idx)
        var = statistic(phase, Row.ROW_MEANDEV, second, rows_value, option.axes, (x, (first, mu)), over, None)
        stats = ((first, mu), (second, var))
    name = _stat_name(bw, node.result, "again", phase.indices[node.result])
    y = in_order(phase.indices[name], by_index(phase.indices[x[0]], option.local.layout))  # the result's order
    local_map(phase, APPLY[node.fn or ""], name, y, (x, *stats), over)
    return (name, y), stats


def _stat_name(bw: BackwardPass, grad: str, suffix: str, rows: tuple[str, ...]) -> str:
    name = fresh(f"{grad}_{suffix}", bw.taken)
    bw.phase.indices[name] = rows
    return name
