"""The index-based expert routing family: ``dispatch``, ``combine`` and ``collect``, registered once.

``In[G, E, C, D] = dispatch(Gate[G, S, E], X[G, S, D], S, C, k over E)`` writes each token's row into
its slot of each of its k experts, and ``Y[G, S, D] = combine(Gate[G, S, E], Ex[G, E, C, D], S, C, k
over E)`` sums each token's k expert rows weighted by its gates: the routing of ``route`` (GShard,
Lepikhin et al. 2020; Switch, Fedus et al. 2021) held as indices, as MegaBlocks (Gale et al. 2023)
and DeepSeek-V3's expert parallelism move tokens, rather than as a one-hot mask ``[G, S, E, C]``
contracted with the tokens.  Its steps are data movement: no FLOPs, their HBM bytes memory-bound
(:func:`~shardc.ops.registry.all_traffic`), each a kernel of its own (a scatter or a gather); the
expert-parallel AllToAll is the move of ``In`` (and of ``Ex``) between the gates' batch sharding and
the experts' axis, tokens x k x D bytes.  The backward keeps the gates, never a mask.

Planned forward, a device reads its gates with S and E whole and its tokens with S whole, batch
indices (G) sharded as the gates', and writes its tokens' rows into their slots, ``In[G, E, C, D]``
with E and C whole; the AllToAll is the move of that result to its declared sharding (E over the
expert axis), and ``combine`` reads the expert outputs back with E and C whole (the inverse
AllToAll).  Features (D) keep their sharding throughout.  Backward: the tokens' gradient gathers
each token's k slot rows of ``dIn``; the expert outputs' gradient scatters each token's
gate-weighted ``dY`` row into its slots; the gates' gradient is, at each chosen expert, the dot
product of ``dY`` and that expert's output row: a partial sum over the axes sharding D, which the
ordinary moves reduce.  Gates read by ``dispatch`` get no gradient through it (as through
``route``'s mask); they get one through ``combine``.

``collect`` is ``combine`` unweighted (the same routing, each token's k rows summed; its gradient
writes ``dY``'s rows into the slots, the gates none), and a ``dispatch`` of a tensor carrying the
expert index too (``dispatch(Gate, Gate, ...)``, ``each``) gives each slot its own expert's value:
with them a spec weighs the experts' rows at the experts, as DeepEP carries each token's top-k
weights with its dispatch and sums the rows in its combine, and the gates' gradient needs no
expert output kept.

:mod:`shardc.ops.dispatch_code` writes their steps as calls of :mod:`shardc.lowering.runtime`'s
``expert_*`` helpers and gives their meaning on whole arrays (the dense mask form, an independent
program for the reference).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from shardc.errors import ShardcError
from shardc.ir.localops import Dispatch
from shardc.ir.plan import Op, Step
from shardc.ir.spec import Call, Expr, TensorRef
from shardc.ops.dispatch_code import canonical, dispatch_code, whole_forward, whole_vjp
from shardc.ops.registry import Arrays, Builder, Family, Reference, Site, register
from shardc.ops.route import capacity
from shardc.sharding.layout import ZERO, Cost, Move, Value, add_cost
from shardc.sharding.phase import Phase
from shardc.sharding.rowwise import Layouts, by_index, choose, in_order, record
from shardc.sharding.search import reshard
from shardc.spec.functions import INDEXED
from shardc.spec.walk import chain_indices

if TYPE_CHECKING:
    from shardc.ops.registry import BackwardPass, Node

__all__ = ["DISPATCH"]

Array = Any


def _operands(builder: Builder, call: Call, result: str, indices: tuple[str, ...]) -> tuple[tuple[str, ...],
                                                                                        tuple[str, ...]]:
    """The gates and the tokens (or expert rows), each towards its own indices; nothing else is kept."""
    return tuple(builder.argument(arg, result, chain_indices(arg, ())) for arg in call.args), ()


def dispatch_op(call: Call, part: str) -> Dispatch:
    """The local operation ``part`` of a dispatch or combine ``call``."""
    assert call.over is not None
    order, slots = call.names
    limit, groups = (int(n) for n in call.numbers[1:]) if len(call.numbers) == 3 else (0, 0)
    each = call.func == "dispatch" and call.over in chain_indices(call.more[0], ())  # a value per expert
    return Dispatch(part, order, call.over, slots, int(call.numbers[0]), limit, groups, each)


def _orders(site: Site) -> tuple[Dispatch, tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """The call's operation, the gates' canonical order, the other operand's, the result's."""
    fn = dispatch_op(site.func, site.func.func)
    gates, tokens, experts = canonical(fn, *site.labels)
    return (fn, gates, tokens, experts) if fn.part == "dispatch" else (fn, gates, experts, tokens)


def _to(x: Array, have: tuple[str, ...], want: tuple[str, ...], xp: Any) -> Array:
    return xp.transpose(x, tuple(have.index(i) for i in want)) if have != want else x


def _canonical(site: Site, xs: Arrays, xp: Any) -> tuple[Dispatch, Array, Array, int]:
    fn, gates, other, _ = _orders(site)
    if fn.slots not in site.shape:
        raise ShardcError(f"{fn.part}'s capacity index {fn.slots} has no size", fix=f"give {fn.slots} a size in dims")
    return (fn, _to(xs[0], site.labels[0], gates, xp), _to(xs[1], site.labels[1], other, xp),
            site.shape[fn.slots])


def _forward(site: Site, xs: Arrays, xp: Any) -> Array:
    fn, gates, other, capacity = _canonical(site, xs, xp)
    return whole_forward(fn.part, gates, other, fn.k, capacity, xp, nodes=(fn.limit, fn.groups), each=fn.each)


def _back(site: Site, grads: tuple[Array | None, Array], xp: Any) -> tuple[Array | None, ...]:
    """The gradients, from canonical order to each operand's."""
    _, gates, other, _ = _orders(site)
    d_gates, d_other = grads
    return (None if d_gates is None else _to(d_gates, gates, site.labels[0], xp),
            _to(d_other, other, site.labels[1], xp))


def _vjp(site: Site, xs: Arrays, d: Array, xp: Any) -> tuple[Array | None, ...]:
    fn, gates, other, capacity = _canonical(site, xs, xp)
    return _back(site, whole_vjp(fn.part, gates, other, d, fn.k, capacity, xp, nodes=(fn.limit, fn.groups),
                                 each=fn.each), xp)


def _magnitude(site: Site, xs: Arrays, mags: Arrays, y: Array) -> Array:
    """The rows' magnitudes moved (dispatch) or summed with the gates' magnitudes as weights (combine)."""
    fn, gates, other, capacity = _canonical(site, xs, np)
    _, mag_gates, mag_other, _ = _canonical(site, mags, np)
    return whole_forward(fn.part, gates, mag_other, fn.k, capacity, np, weights=mag_gates,
                         nodes=(fn.limit, fn.groups), each=fn.each)


def _grad_magnitude(site: Site, xs: Arrays, mags: Arrays, d: Array) -> tuple[Array | None, ...]:
    fn, gates, other, capacity = _canonical(site, xs, np)
    _, mag_gates, mag_other, _ = _canonical(site, mags, np)
    grads = whole_vjp(fn.part, gates, mag_other, np.abs(d), fn.k, capacity, np, weights=mag_gates,
                      nodes=(fn.limit, fn.groups), each=fn.each)
    return _back(site, grads, np)


def _arguments(call: Call, keep: tuple[str, ...]) -> tuple[tuple[Expr, tuple[str, ...]], ...]:
    return tuple((arg, chain_indices(arg, ())) for arg in call.args)


def _indices(call: Call, operands: tuple[tuple[str, ...], ...]) -> tuple[str, ...]:
    """The result in the helpers' order: batch, E, C, features (dispatch); batch, S, features (combine)."""
    _, tokens, experts = canonical(dispatch_op(call, call.func), *operands)
    return experts if call.func == "dispatch" else tokens


def _reaches(node: Node) -> tuple[bool, ...]:
    """dispatch's and collect's gradient reaches the tokens (expert rows), not the gates (a routing is 0/1,
    as route's mask); combine's reaches both."""
    return (node.fn == "combine", True)


# (name, value) of each tensor a local step reads
Reads = tuple[tuple[str, Value], ...]


def _axes(value: Value) -> set[str]:
    return {a for axes in value.layout for a in axes}


def _gate_values(phase: Phase, gate: str, whole: tuple[str, ...], target_axes: dict[str, tuple[str, ...]]) \
        -> list[Value]:
    """The gates' layouts worth costing: each held one, and the one whose batch indices are sharded as
    the result wants them, with S and E gathered (the routing needs them whole)."""
    idx = phase.indices[gate]
    gathered = dict.fromkeys(whole, ())
    found: dict[Value, None] = {}
    for held in phase.held[gate]:
        found[in_order(idx, {**by_index(idx, held.layout), **gathered})] = None
    if target_axes:
        found[in_order(idx, {**{i: target_axes.get(i, ()) for i in idx}, **gathered})] = None
    return list(found)


def _like(phase: Phase, name: str, axes: dict[str, tuple[str, ...]]) -> Value:
    return in_order(phase.indices[name], axes)


def _feature_axes(phase: Phase, name: str, gate: Value, gate_idx: tuple[str, ...], whole: tuple[str, ...]) \
        -> list[dict[str, tuple[str, ...]]]:
    """Index -> axes for the operands that go with the gates' ``gate``: batch indices sharded as there,
    ``whole`` gathered, features as ``name`` holds them (less the gates' axes)."""
    idx, batch, used = phase.indices[name], by_index(gate_idx, gate.layout), _axes(gate)
    found: dict[tuple[tuple[str, tuple[str, ...]], ...], None] = {}
    for held in phase.held[name]:
        axes = {i: tuple(a for a in ax if a not in used) for i, ax in by_index(idx, held.layout).items()}
        axes.update({i: ax for i, ax in batch.items() if i not in whole})
        axes.update(dict.fromkeys(whole, ()))
        found[tuple(sorted(axes.items()))] = None
    return [dict(f) for f in found]


def _fetch(phase: Phase, reads: Reads) -> tuple[Cost, tuple[Move, ...]]:
    cost: Cost = ZERO
    moves: tuple[Move, ...] = ()
    for name, value in reads:
        moved, path = reshard(phase.ctx, name, phase.indices[name], phase.held[name], value)
        cost, moves = add_cost(cost, moved), moves + path
    return cost, moves


def _options(phase: Phase, gate: str, others: tuple[str, ...], whole: tuple[str, ...], result: str,
             indices: tuple[str, ...], target: Value | None, settle: bool) -> list[tuple[Layouts, Reads]]:
    """Every pairing of a gates' layout with the others' (the first's features; the rest alike), costed
    with the result's move to ``target`` (``settle`` False: the result is left as made, a contribution to
    sum later).  Features the result lacks (the gates' gradient's D) leave it a partial sum over their axes."""
    gate_idx = phase.indices[gate]
    target_axes = by_index(indices, target.layout) if target is not None else {}
    options = []
    for g in _gate_values(phase, gate, whole, target_axes):
        for axes in _feature_axes(phase, others[0], g, gate_idx, whole):
            axes = {**by_index(gate_idx, g.layout), **axes}
            reads: Reads = ((gate, g), *((o, _like(phase, o, axes)) for o in others))
            cost, moves_in = _fetch(phase, reads)
            summed = tuple(a for i, ax in axes.items() if i not in indices and i not in gate_idx for a in ax)
            made = in_order(indices, axes, summed)
            want = target if target is not None and settle else made
            if not made.reaches(want):
                continue
            moved, moves_out = reshard(phase.ctx, result, indices, (made,), want)
            options.append((Layouts(g, (), add_cost(cost, moved), moves_in, moves_out, made, want), reads))
    return options


def _whole(call: Call) -> tuple[str, ...]:
    assert call.over is not None
    return (call.names[0], call.over, call.names[1])


def _emit(phase: Phase, dst: str, made: Value, reads: Reads, op: Dispatch) -> None:
    phase.emit(Step(Op.ELEMENTWISE, dst, phase.ref(dst, made), operands=tuple(phase.ref(n, v) for n, v in reads),
                    fn=op), made)


def _pick(phase: Phase, options: list[tuple[Layouts, Reads]], label: str, node: Node) -> tuple[Layouts, Reads]:
    if not options:
        raise ShardcError(f"no sharding of {', '.join(node.operands)} makes {label}", node.statement.span,
                          fix="dispatch and combine need the token and expert indices S, E and C whole on a "
                              "device, and reduced (not partial-sum) operands")
    best, shown = choose([o for o, _ in options], 0)
    record(phase, label, best, shown, 0, phase.indices[node.operands[0]], "")
    return best, next(r for o, r in options if o is best)


def plan_dispatch(phase: Phase, node: Node, declared: dict[str, TensorRef], target: Value | None,
                  label: str) -> None:
    """A dispatch or combine node: its operands to the layouts it reads, one local step, the result's moves."""
    call = node.call
    assert call is not None
    gate, other = node.operands
    if target is not None and target.unreduced:
        raise ShardcError(f"{node.result} is made by {call.func}, which is not a partial sum", node.statement.span,
                          fix="drop the {U_...} suffix")
    options = _options(phase, gate, (other,), _whole(call), node.result, node.indices, target, True)
    best, reads = _pick(phase, options, label, node)
    for name, value in reads:
        phase.moves(name, _fetch(phase, ((name, value),))[1])
    _emit(phase, node.result, best.result, reads, dispatch_op(call, call.func))
    phase.moves(node.result, best.moves_out)
    declared.setdefault(node.result, phase.ref(node.result, best.final))


def _contribute(bw: BackwardPass, node: Node, primal: str, reads_of: tuple[str, ...], part: str, label: str) -> None:
    """One gradient step of ``part`` to ``primal``, reading the gates and ``reads_of``; settled or kept."""
    call = node.call
    assert call is not None
    phase = bw.phase
    dst = bw.part_name(primal)
    settle = bw.count.get(primal, 0) <= 1
    options = _options(phase, node.operands[0], reads_of, _whole(call), dst, phase.indices[primal],
                       bw.target(primal), settle)
    best, reads = _pick(phase, options, f"{phase.text(dst, bw.target(primal))} = {label}", node)
    for name, value in reads:
        phase.moves(name, _fetch(phase, ((name, value),))[1], note=f"residual for {call.func}'s gradient")
    _emit(phase, dst, best.result, reads, dispatch_op(call, part))
    if settle:
        phase.moves(dst, best.moves_out)
    else:
        bw.parts.setdefault(primal, []).append((dst, best.result))


def dispatch_backward(bw: BackwardPass, node: Node, grad: str) -> None:
    """dispatch: the tokens' rows gathered back from ``dIn``; combine: the expert outputs' gradient (a
    scatter of gate-weighted ``dY`` rows) and the gates' (``dY`` dotted with each chosen expert's row)."""
    call = node.call
    assert call is not None
    gate, other = node.operands
    if call.func != "combine":  # dispatch, collect: the gates get no gradient
        if other in bw.needs:
            part = f"{call.func}_vjp"
            _contribute(bw, node, other, (grad,), part, f"{part}({grad})")
        return
    if other in bw.needs:
        _contribute(bw, node, other, (grad,), "combine_vjp", f"combine_vjp({grad})")
    if gate in bw.needs:
        _contribute(bw, node, gate, (grad, other), "combine_gate_vjp", f"combine_gate_vjp({grad}, {other})")


DISPATCH = register(Family(
    name="dispatch", calls=INDEXED, ops=(Dispatch,), plan=plan_dispatch,
    backward=dispatch_backward, emit=dispatch_code,
    reference=Reference(_forward, _vjp, _magnitude, _grad_magnitude, _arguments, _indices),
    operands=_operands, reaches=_reaches, capacity=capacity, fusible=False))
