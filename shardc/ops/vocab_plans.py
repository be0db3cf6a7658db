"""Vocabulary ops: ``embed(Tok, W_emb)`` and ``cross_entropy(Logits, Tok)``, forward and backward.

Megatron-LM's vocab parallelism (Shoeybi et al. 2019), with the vocabulary index V
sharded over axes A:

* embed: each device looks its token ids up in its own rows of the table (ids
  another shard holds give 0), so the result is a partial sum over A, which the
  ordinary moves reduce to the declared sharding (AllReduce, or ReduceScatter onto
  the sequence).  Its gradient is a scatter-add of the result's cotangent rows into
  the local vocabulary shard: no communication beyond what that cotangent needs
  (it must be whole over A) and what the table's own sharding needs (partial sums
  over the tokens' axes, as any weight gradient).
* cross_entropy: the row max (an AllReduce taking the max), the sum of exponentials
  and each token's target logit (picked on the shard that holds it) are all-reduced
  over A, rows x 1 each; the logits are never gathered.  The mean over the tokens is
  a partial sum over the tokens' axes, reduced once (a scalar AllReduce).  Its
  gradient, ``(softmax - onehot) / tokens``, is local to each V shard from the
  logits, the row logsumexp and the ids, which the forward keeps.

Token ids are integers and get no gradient.  The local maps are free in the cost
model, as every elementwise step is; the collectives are priced from the table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardc.errors import ShardcError
from shardc.ir.localops import Combine, Row, Vocab
from shardc.ir.plan import Op, Step
from shardc.ir.spec import TensorRef
from shardc.sharding.layout import ZERO, Cost, Move, Value, add_cost
from shardc.sharding.phase import Phase
from shardc.sharding.rowwise import (
    Layouts,
    all_reduce,
    by_index,
    choose,
    in_order,
    local_map,
    record,
    statistic,
    stats_cost,
)
from shardc.sharding.search import reshard

if TYPE_CHECKING:
    from shardc.ops.registry import BackwardPass, Node

__all__ = ["plan_embed", "plan_loss", "embed_backward", "loss_backward", "vocab_index"]


def vocab_index(phase: Phase, node: Node) -> str:
    """A loss's vocabulary index: the index of Logits that Tok lacks."""
    logits, tok = node.operands
    return next(i for i in phase.indices[logits] if i not in phase.indices[tok])


def _axes(value: Value) -> set[str]:
    return {a for axes in value.layout for a in axes}


def _without(value: Value, used: set[str]) -> Value:
    return Value(tuple(tuple(a for a in axes if a not in used) for axes in value.layout), ())


def _move(phase: Phase, name: str, want: Value) -> tuple[Cost, tuple[Move, ...]] | None:
    if not any(s.reaches(want) for s in phase.held[name]):
        return None
    return reshard(phase.ctx, name, phase.indices[name], phase.held[name], want)


def _pairs(ids: list[Value], tables: list[Value]) -> list[tuple[Value, Value]]:
    """Local (ids, table) layouts that share no axis: each as given, or one of them gathered off the other's."""
    out: dict[tuple[Value, Value], None] = {}
    for t in ids:
        for w in tables:
            for pair in ((t, w), (_without(t, _axes(w)), w), (t, _without(w, _axes(t)))):
                if not _axes(pair[0]) & _axes(pair[1]):
                    out[pair] = None
    return list(out)


def _reduced(values: list[Value]) -> list[Value]:
    return list(dict.fromkeys(Value(v.layout, ()) for v in values))


def plan_embed(phase: Phase, node: Node, declared: dict[str, TensorRef], target: Value | None,
               label: str) -> None:
    """A masked local lookup in each vocabulary shard, then the moves that reduce its partial sums."""
    tok, table = node.operands
    tok_idx, w_idx = phase.indices[tok], phase.indices[table]
    options = []
    for t, w in _pairs(_reduced(phase.held[tok]), _reduced(phase.held[table])):
        found = [_move(phase, tok, t), _move(phase, table, w)]
        axes = {**by_index(tok_idx, t.layout), **by_index(w_idx[1:], w.layout[1:])}
        made = in_order(node.indices, axes, w.layout[0])
        want = target if target is not None else Value(made.layout, ())
        if found[0] is None or found[1] is None or not made.reaches(want):
            continue
        out_cost, moves_out = reshard(phase.ctx, node.result, node.indices, (made,), want)
        cost = add_cost(add_cost(found[0][0], found[1][0]), out_cost)
        option = Layouts(w, w.layout[0], cost, found[0][1] + found[1][1], moves_out, made, want)
        options.append((option, t, found[0][1], found[1][1]))
    if not options:
        raise ShardcError(f"no sharding of {tok} and {table} makes {label.split(' = ')[0]}", node.statement.span,
                          fix="a partial sum {U_..} of a lookup needs the table's first index sharded over those axes")
    best, shown = choose([o[0] for o in options], 0)
    _, t, tok_moves, table_moves = next(o for o in options if o[0] is best)
    record(phase, f"{label.split(' = ')[0]} = embed({phase.text(tok, t)}, {phase.text(table, best.local)})",
           best, shown, 0, w_idx, "")
    phase.moves(tok, tok_moves)
    phase.moves(table, table_moves)
    phase.emit(Step(Op.ELEMENTWISE, node.result, phase.ref(node.result, best.result),
                    operands=(phase.ref(tok, t), phase.ref(table, best.local)), fn=Vocab.EMBED), best.result)
    phase.moves(node.result, best.moves_out)
    declared.setdefault(node.result, phase.ref(node.result, best.final))


def plan_loss(phase: Phase, node: Node, declared: dict[str, TensorRef], target: Value | None,
              label: str) -> None:
    """Cross entropy in each vocabulary shard from three all-reduced row statistics; the logits stay put."""
    logits, tok = node.operands
    idx, tok_idx = phase.indices[logits], phase.indices[tok]
    vocab = vocab_index(phase, node)
    if target is not None and target.unreduced:
        raise ShardcError(f"{node.result} is a loss, not a partial sum", node.statement.span,
                          fix="drop the {U_...} suffix")
    options = []
    for value in _reduced(phase.held[logits]):
        axes = by_index(idx, value.layout)
        t = in_order(tok_idx, axes)
        found = [_move(phase, logits, value), _move(phase, tok, t)]
        if None in found:
            continue
        token_axes = tuple(sorted(a for i in tok_idx for a in axes[i]))
        made = Value((), token_axes)
        want = target if target is not None else Value((), ())
        moved, moves_out = reshard(phase.ctx, node.result, node.indices, (made,), want)
        cost = add_cost(add_cost(found[0][0], found[1][0]), moved)  # type: ignore[index]
        cost = add_cost(cost, stats_cost(phase, tok_idx, t, axes[vocab], 3))
        options.append(Layouts(value, axes[vocab], cost, found[0][1] + found[1][1], moves_out, made, want))  # type: ignore[index]
    if not options:
        raise ShardcError(f"no sharding of {logits} makes {node.result}", node.statement.span,
                          fix="the loss is a reduced scalar: declare it without {U_...}")
    best, shown = choose(options, 3)
    axes = by_index(idx, best.local.layout)
    t = in_order(tok_idx, axes)
    record(phase, f"{label.split(' = ')[0]} = cross_entropy({phase.text(logits, best.local)}, {phase.text(tok, t)})",
           best, shown, 3, idx, vocab)
    phase.moves(logits, _move(phase, logits, best.local)[1])  # type: ignore[index]
    phase.moves(tok, _move(phase, tok, t)[1])  # type: ignore[index]
    _emit_loss(phase, node, best, t, vocab)
    phase.moves(node.result, best.moves_out)
    declared.setdefault(node.result, phase.ref(node.result, best.final))


def _emit_loss(phase: Phase, node: Node, best: Layouts, rows_value: Value, vocab: str) -> None:
    """The row logsumexp (from the all-reduced max and sum of exponentials), the target logits, the mean."""
    logits, tok = node.operands
    m_name, z_name, lse_name, tgt_name = node.aux
    for name in node.aux:
        phase.indices.setdefault(name, phase.indices[tok])
    x = (logits, best.local)
    a = best.axes
    if a:
        m = statistic(phase, Row.ROW_MAX, m_name, rows_value, a, (x,), vocab, Combine.MAX)
        z = statistic(phase, Row.ROW_SUMEXP, z_name, rows_value, a, (x, (m_name, m)), vocab, None)
        local_map(phase, Row.LSE_APPLY, lse_name, rows_value, ((m_name, m), (z_name, z)), vocab)
    else:
        local_map(phase, Row.LOGSUMEXP, lse_name, rows_value, (x,), vocab)
    picked = Value(rows_value.layout, tuple(sorted(a)))
    local_map(phase, Vocab.VOCAB_PICK, tgt_name, picked, (x, (tok, rows_value)), vocab)
    if a:
        all_reduce(phase, tgt_name, picked, a, None)
    local_map(phase, Vocab.CE_APPLY, node.result, best.result, ((lse_name, rows_value), (tgt_name, rows_value)), vocab)


def _hold_kept(bw: BackwardPass, names: tuple[str, ...]) -> None:
    """The forward's per-row statistics are kept under every residual policy (rows x 1 each)."""
    for name in names:
        for value in bw.forward.held.get(name, []):
            if (name, value) in bw.forward.made and not value.unreduced:
                bw.phase.hold(name, value)


def embed_backward(bw: BackwardPass, node: Node, grad: str) -> None:
    """dW_emb: each device scatter-adds its tokens' cotangent rows into its vocabulary shard."""
    tok, table = node.operands
    if table not in bw.needs:
        return
    phase = bw.phase
    tok_idx, w_idx = phase.indices[tok], phase.indices[table]
    dst = bw.part_name(table)
    target = bw.target(table)
    options = []
    for t, w in _pairs(_reduced(phase.held[tok]), [target]):
        axes = {**by_index(tok_idx, t.layout), **by_index(w_idx[1:], w.layout[1:])}
        d_local = in_order(node.indices, axes)
        found = [_move(phase, tok, t), _move(phase, grad, d_local)]
        if None in found:
            continue
        made = Value(w.layout, tuple(sorted(_axes(t))))
        cost: Cost = add_cost(found[0][0], found[1][0])  # type: ignore[index]
        moves_out: tuple[Move, ...] = ()
        if bw.count.get(table, 0) <= 1:
            moved, moves_out = reshard(phase.ctx, dst, w_idx, (made,), target)
            cost = add_cost(cost, moved)
        options.append((Layouts(w, (), cost, found[0][1] + found[1][1], moves_out, made, target), t, d_local))  # type: ignore[index]
    best, shown = choose([o for o, _, _ in options], 0)
    _, t, d_local = next(o for o in options if o[0] is best)
    record(phase, f"{phase.text(dst, target)} = embed_vjp({phase.text(tok, t)}, {phase.text(grad, d_local)})",
           best, shown, 0, w_idx, "")
    phase.moves(tok, _move(phase, tok, t)[1], note="residual for the lookup's gradient")  # type: ignore[index]
    phase.moves(grad, _move(phase, grad, d_local)[1])  # type: ignore[index]
    phase.emit(Step(Op.ELEMENTWISE, dst, phase.ref(dst, best.result),
                    operands=(phase.ref(tok, t), phase.ref(grad, d_local)),
                    shapes=(phase.ref(table, Value.of(bw.declared[table])),),  # the table's rows: no data
                    fn=Vocab.EMBED_VJP), best.result)
    if bw.count.get(table, 0) > 1:
        bw.parts.setdefault(table, []).append((dst, best.result))
    else:
        phase.moves(dst, best.moves_out)


def loss_backward(bw: BackwardPass, node: Node, grad: str) -> None:
    """dLogits = (softmax - onehot) * dLoss / tokens, local to each vocabulary shard."""
    logits, tok = node.operands
    if logits not in bw.needs:
        return
    phase = bw.phase
    _hold_kept(bw, node.aux)
    idx, tok_idx = phase.indices[logits], phase.indices[tok]
    vocab = vocab_index(phase, node)
    lse = node.aux[2]
    dst = bw.part_name(logits)
    target = bw.target(logits)
    options = []
    for value in dict.fromkeys([*_reduced(phase.held[logits]), target]):
        axes = by_index(idx, value.layout)
        rows = in_order(tok_idx, axes)
        reads = [(logits, value), (lse, rows), (tok, rows), (grad, Value((), ()))]
        found = [_move(phase, n, v) for n, v in reads]
        if None in found:
            continue
        cost: Cost = ZERO
        moves_in: tuple[Move, ...] = ()
        for f in found:
            cost, moves_in = add_cost(cost, f[0]), moves_in + f[1]  # type: ignore[index]
        moves_out: tuple[Move, ...] = ()
        if bw.count.get(logits, 0) <= 1:
            moved, moves_out = reshard(phase.ctx, dst, idx, (value,), target)
            cost = add_cost(cost, moved)
        options.append((Layouts(value, axes[vocab], cost, moves_in, moves_out, value, target), reads))
    best, shown = choose([o for o, _ in options], 0)
    reads = next(r for o, r in options if o is best)
    record(phase, f"{phase.text(dst, target)} = cross_entropy_vjp({phase.text(grad, Value((), ()))})",
           best, shown, 0, idx, vocab)
    for name, value in reads:
        phase.moves(name, _move(phase, name, value)[1], note="residual for the loss's gradient")  # type: ignore[index]
    local_map(phase, Vocab.CE_VJP, dst, best.local, tuple(reads), vocab)
    if bw.count.get(logits, 0) > 1:
        bw.parts.setdefault(logits, []).append((dst, best.local))
    else:
        phase.moves(dst, best.moves_out)
