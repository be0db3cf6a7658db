"""Sums and renames: ``R = A ± B ± ...`` and ``Kx[B, T, D] = X[B, S, D]``, registered once.

Neither is a spec function: the graph gives a sum's node the family of the form
:data:`~shardc.ops.registry.SUM` and a rename's that of :data:`~shardc.ops.registry.RENAME`.
A sum adds its terms elementwise on each device; a term whose indices are a subset
of the result's broadcasts over the others.  Its local configuration is the result's
local value: a layout, and the axes it stays unreduced over.  Each term is read in
that layout restricted to its indices (a broadcast term is replicated over the axes of
indices it lacks, and sliced for free where the result shards one of its own).
Partial sums add without communication (``{U_X} + {U_X}`` is ``{U_X}``): a term that
is partial over an axis the result stays unreduced over is added as it is; a reduced
term there is added on the devices of coordinate 0 along those axes only (zero
elsewhere), so the partial sums still add up to the sum, and nothing is counted twice.
So ``A · W1 + C · W2`` (both partial over Y) adds the partial products and reduces the
sum once; with a reduced term beside them (``X + A · W1 + C · W2``, X sharded as the result)
the partial products may be added first and X added after their one reduction, where cheaper.
With sizes every configuration is costed exactly (the reshards of the terms
into it, plus the result's reshard to its declared sharding); without, the result
keeps its declared layout (else its first term's) and every partial sum the terms hold.
A rename is an alias: its source's value read under new index names (by position), no
copy, no FLOPs; only a declared sharding that differs from the source's moves the alias
after it.  Their backward:

- a sum's term gets ±dR, summed over the indices it lacks (an einsum), or dR itself
  (an alias step) where it has the result's indices; a ``-`` term negates dR first;
- a rename passes each contribution to its gradient on, as made, to its source's
  (so X's partial gradients from its own readers and from its alias's are added
  before one reduction: self-attention's dX from queries, keys and values).

Lowered, a sum's term is laid out in the result's index order (``jnp.transpose``) and
given a size-1 axis where it broadcasts (``Bias[None, None, :]``); a reduced term added
to a sum that stays partial over axes ``U`` is added on the devices of coordinate 0
along ``U`` only (``jnp.where(jax.lax.axis_index(U) == 0, x, 0)``), so the partial sums
add up to the sum once.  A rename is the same array under a new name.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from shardc.errors import ShardcError
from shardc.ir.localops import ALIAS, NEG, Add, Alias, Neg
from shardc.ir.plan import Op, Step
from shardc.ir.spec import TensorRef
from shardc.names import fresh
from shardc.ops.arrays import contract
from shardc.ops.registry import (
    RENAME,
    SUM,
    Arrays,
    Family,
    Namer,
    Reference,
    Site,
    Sizer,
    all_traffic,
    no_traffic,
    register,
)
from shardc.ops.text import broadcast_text
from shardc.sharding.einsum import room
from shardc.sharding.layout import INFINITE, ZERO, Cost, CostContext, Move, Value, add_cost
from shardc.sharding.phase import Phase
from shardc.sharding.search import reshard

if TYPE_CHECKING:
    from shardc.ops.registry import BackwardPass, Node

__all__ = ["SUMS", "emit"]

Array = Any


Term = tuple[str, tuple[str, ...], tuple[Value, ...]]  # name, indices, the values the phase holds


def guard_axes(operand: TensorRef, result: TensorRef) -> tuple[str, ...]:
    """Axes a sum's result is unreduced over but this term is not: it is added on coordinate 0 only."""
    return tuple(a for a in result.unreduced if a not in operand.unreduced)


def plan_add(phase: Phase, node: Node, declared: dict[str, TensorRef], target: Value | None) -> None:
    """Plan one sum into moves of its terms, one local add, and the result's moves."""
    terms: list[Term] = [(t, phase.indices[t], tuple(phase.held[t])) for t in node.operands]
    if target is not None and not set(target.unreduced) <= _available(terms):
        raise ShardcError(f"{node.result} is declared partial sums over {', '.join(target.unreduced)}, "
                          "but no term of the sum is", node.statement.span,
                          fix="drop the {U_...} suffix, or make a term partial over those axes")
    # Layers repeat: the same sum (up to names) is searched once a phase.
    kind = phase.ctx.kind  # weight or not, element bytes: what a tensor's moves cost
    key = ("add", tuple((idx, sources, kind(name)) for name, idx, sources in terms), node.indices, target,
           node.partial, kind(node.result), phase.sized)
    best = phase.sums.get(key)
    if best is None:
        best = phase.sums[key] = _search(phase, node, terms, target)
    solution: Solution = best  # type: ignore[assignment]
    _, local, reads, result_moves, first = solution
    signs = node.signs
    if first is not None:  # the terms held alike as partial sums, added first into one term
        terms, signs = _add_first(phase, node, terms, first)
    operands = []
    for (name, _, _), (value, moves) in zip(terms, reads, strict=True):
        phase.moves(name, moves)
        operands.append(phase.ref(name, value))
    phase.emit(Step(Op.ELEMENTWISE, node.result, phase.ref(node.result, local), operands=tuple(operands),
                    fn=Add(signs)), local)
    phase.moves(node.result, result_moves)
    final = result_moves[-1].dst if result_moves else local
    declared.setdefault(node.result, phase.ref(node.result, final))


def _add_first(phase: Phase, node: Node, terms: list[Term], first: First) -> tuple[list[Term], tuple[int, ...]]:
    """Emit the first sum (``first``'s terms, as held) into a fresh tensor: it and the other terms are
    the terms left, with their signs."""
    group, value = first
    idx = terms[group[0]][1]
    name = fresh(f"{node.result}_part", set(phase.indices))
    phase.indices[name] = idx
    phase.emit(Step(Op.ELEMENTWISE, name, phase.ref(name, value),
                    operands=tuple(phase.ref(terms[k][0], value) for k in group),
                    fn=Add(tuple(node.signs[k] for k in group))), value)
    rest = [k for k in range(len(terms)) if k not in group]
    return ([(name, idx, (value,))] + [terms[k] for k in rest], (1,) + tuple(node.signs[k] for k in rest))


First = tuple[tuple[int, ...], Value]  # terms added first, as they are held alike, into one term
Solution = tuple[Cost, Value, list[tuple[Value, tuple[Move, ...]]], tuple[Move, ...], First | None]


def _search(phase: Phase, node: Node, terms: list[Term], target: Value | None) -> Solution:
    """The least-cost local result value and the moves around it (one value without sizes).

    With sizes, also the sums whose terms held alike as partial sums are added first, without
    communication, and the other terms added to that sum after its reduction: PaLM's parallel layer
    ``X + C · W_o + A · W_down`` with X sharded reduce-scatters the two partial products once, where one
    sum reads X as partial sums (gathered) or reduces each product apart.  Taken only where cheaper."""
    def among(terms: list[Term]) -> Iterable[Value]:
        return _candidates(phase.ctx, node, terms) if phase.sized else [_rule_local(node, terms, target)]

    best = _best(phase, node, terms, target, among(terms))
    if best is None:
        raise ShardcError(f"no sharding of the terms makes {node.result}", node.statement.span,
                          fix="declare the result reduced, or shard the terms alike")
    for first in _alike(phase.ctx, node, terms):
        group, value = first
        rest = [terms[k] for k in range(len(terms)) if k not in group]
        inner = [(node.result, terms[group[0]][1], (value,))] + rest  # the first sum priced as the result
        found = _best(phase, node, inner, target, among(inner))
        if found is not None and found[0][0] < best[0][0]:
            best = (found[0], found[1], found[2], found[3], first)
    return best


def _best(phase: Phase, node: Node, terms: list[Term], target: Value | None,
          candidates: Iterable[Value]) -> Solution | None:
    """The least-cost of ``candidates`` as the sum's local value, the terms read in as they are."""
    best: Solution | None = None
    for local in candidates:
        phase.ctx.tick()
        found = _evaluate(phase.ctx, node, terms, local, target, best[0] if best is not None else None)
        if found is not None and (best is None or found[0] < best[0]):
            best = (found[0], local, found[1], found[2], None)
    return best


def _alike(ctx: CostContext, node: Node, terms: list[Term]) -> Iterator[First]:
    """Groups of two or more terms (not all of them) with the same indices holding the same partial sums;
    none where a term or the sum has an element type of its own (the first sum is a tensor of the spec's)."""
    if any(ctx.nbytes(name) != ctx.dtype.nbytes for name in (node.result, *(t[0] for t in terms))):
        return
    groups: dict[tuple[tuple[str, ...], Value], list[int]] = {}
    for k, (_, idx, sources) in enumerate(terms):
        for value in sources:
            if value.unreduced:
                groups.setdefault((idx, value), []).append(k)
    for (_, value), group in groups.items():
        if 1 < len(group) < len(terms):
            yield tuple(group), value


def _available(terms: list[Term]) -> set[str]:
    """Axes some term holds partial sums over."""
    return {a for _, _, sources in terms for s in sources for a in s.unreduced}


def _evaluate(ctx: CostContext, node: Node, terms: list[Term], local: Value, target: Value | None,
              bound: Cost | None = None) -> tuple[Cost, list[tuple[Value, tuple[Move, ...]]], tuple[Move, ...]] | None:
    """The cost of one local result value: each term read into it, the result moved to its target.

    None when it cannot be made, or costs more than ``bound`` (the search stops exploring there).
    """
    by_index = dict(zip(node.indices, local.layout, strict=True))
    total: Cost = ZERO
    reads = []
    for name, idx, sources in terms:
        layout = tuple(by_index[i] for i in idx)
        partial = tuple(a for a in local.unreduced if any(a in s.unreduced for s in sources))
        options = [Value(layout, partial)] + ([Value(layout, ())] if partial else [])
        best: tuple[Cost, Value, tuple[Move, ...]] | None = None
        for want in options:
            if not any(s.reaches(want) for s in sources):
                continue
            cost, path = reshard(ctx, name, idx, sources, want, room(bound, total))
            if cost != INFINITE and (best is None or cost < best[0]):
                best = (cost, want, path)
        if best is None:
            return None
        total = add_cost(total, best[0])
        if bound is not None and total > bound:
            return None
        reads.append((best[1], best[2]))
    if target is None and local.unreduced and not node.partial:
        target = Value(local.layout, ())  # an intermediate the caller lays out: reduce the sum in place
    moves: tuple[Move, ...] = ()
    if target is not None:
        if not local.reaches(target):
            return None
        cost, moves = reshard(ctx, node.result, node.indices, (local,), target, room(bound, total))
        if cost == INFINITE:
            return None
        total = add_cost(total, cost)
        if bound is not None and total > bound:
            return None
    return total, reads, moves


def _rule_local(node: Node, terms: list[Term], target: Value | None) -> Value:
    """Without sizes: the declared layout (else the first full term's), every partial sum kept."""
    if target is not None:
        layout = target.layout
    else:
        full = next((t for t in terms if set(t[1]) == set(node.indices)), terms[0])
        held = dict(zip(full[1], full[2][0].layout, strict=True))
        layout = tuple(held.get(i, ()) for i in node.indices)
    used = {a for axes in layout for a in axes}
    return Value(layout, tuple(sorted(_available(terms) - used)))


def _candidates(ctx: CostContext, node: Node, terms: list[Term]) -> Iterator[Value]:
    """Every local result value: per unit of axes, unused, an index, or kept unreduced."""
    partial = _available(terms)
    units = ctx.unit_list()
    options = []
    for unit in units:
        choices: list[str | None] = [None] + [i for i in node.indices if ctx.divides(i, unit)]
        if unit[0] in partial:
            choices.append("+")
        options.append(choices)
    for combo in itertools.product(*options):
        by_index: dict[str, list[tuple[str, ...]]] = {}
        for unit, role in zip(units, combo, strict=True):
            if role is not None and role != "+":
                by_index.setdefault(role, []).append(unit)
        unreduced = tuple(sorted(a for unit, role in zip(units, combo, strict=True) if role == "+" for a in unit))
        groups = [(i, list(itertools.permutations(us))) for i, us in by_index.items()]
        for perms in itertools.product(*(p for _, p in groups)):
            order = {i: tuple(a for u in p for a in u) for (i, _), p in zip(groups, perms, strict=True)}
            if all(ctx.divides(i, axes) for i, axes in order.items()):
                yield Value(tuple(order.get(i, ()) for i in node.indices), unreduced)


def plan_rename(phase: Phase, node: Node, declared: dict[str, TensorRef], target: Value | None) -> None:
    """``Kx[B, T, D] = X[B, S, D]``: an alias of a value of X (layouts are by position), then the
    moves its declared sharding needs, on Kx."""
    (src,) = node.operands
    held = tuple(phase.held[src])
    moves: tuple[Move, ...] = ()
    start = held[0]
    if target is not None:
        _, moves = reshard(phase.ctx, node.result, node.indices, held, target)
        start = moves[0].src if moves else target
    phase.emit(Step(Op.ELEMENTWISE, node.result, phase.ref(node.result, start),
                    operands=(phase.ref(src, start),), fn=ALIAS), start)
    phase.moves(node.result, moves)
    phase.link(src, node.result)  # values made later of either are the other's (one gather for Q and K)
    declared.setdefault(node.result, phase.ref(node.result, moves[-1].dst if moves else start))


def _is_rename(node: Node) -> bool:
    """A rename's node has one operand and no signs (a sum has a sign per term)."""
    return not node.signs


def _plan(phase: Phase, node: Node, declared: dict[str, TensorRef], target: Value | None, label: str) -> None:
    (plan_rename if _is_rename(node) else plan_add)(phase, node, declared, target)


def _alias(bw: BackwardPass, primal: str, grad: str, value: Value) -> str:
    """``grad`` (held as ``value``) is a contribution to ``primal``'s gradient as it is: an alias step."""
    dst = bw.part_name(primal)
    bw.phase.emit(Step(Op.ELEMENTWISE, dst, bw.phase.ref(dst, value), operands=(bw.phase.ref(grad, value),),
                       fn=ALIAS), value)
    bw.settle(primal, dst, value)
    return dst


def _add_backward(bw: BackwardPass, node: Node, grad: str) -> None:
    """``R = A ± B``: dA = ±dR, summed over the indices A lacks (the einsum ``dR[B, S, D] -> dA[D]``)."""
    same: dict[str, list[str]] = {}  # dR, or -dR: the terms' gradients that are it
    for term, sign in zip(node.operands, node.signs, strict=True):
        if term not in bw.needs:
            continue
        source = grad
        if sign < 0:  # -dR, once for every term it feeds
            source = fresh(f"{grad}_neg", bw.taken)
            bw.phase.indices[source] = node.indices
            value = bw.target(node.result)
            bw.phase.emit(Step(Op.ELEMENTWISE, source, bw.phase.ref(source, value),
                               operands=(bw.phase.ref(grad, value),), fn=NEG), value)
        if bw.phase.indices[term] == node.indices:
            dst = _alias(bw, term, source, bw.target(node.result))  # dA is dR itself: no copy
            if bw.count.get(term, 0) <= 1:  # a gradient read as it is (not a contribution summed later)
                same.setdefault(source, []).append(dst)
        else:
            bw.contribute(term, (source,), (source,))
    for first, *others in same.values():  # one array: a value later made of one is the others'
        for other in others:  # (dZ_t1 gathered for one einsum is dZ_t2 gathered for the next)
            bw.phase.link(first, other)


def _rename_backward(bw: BackwardPass, node: Node, grad: str) -> None:
    """``Kx[B, T, D] = X[B, S, D]``: each contribution to dKx, as made, is one to dX renamed back."""
    (src,) = node.operands
    parts = bw.parts.pop(node.result, [])
    if not parts:  # an output: its cotangent, in its declared sharding
        parts = [(grad, bw.target(node.result))]
    if src in bw.needs:
        for part, value in parts:
            _alias(bw, src, part, value)


def _backward(bw: BackwardPass, node: Node, grad: str) -> None:
    (_rename_backward if _is_rename(node) else _add_backward)(bw, node, grad)


def _axes_entry(axes: tuple[str, ...]) -> str:
    return repr(axes[0]) if len(axes) == 1 else "(" + ", ".join(repr(a) for a in axes) + ")"


def _term_code(ref: TensorRef, dst: TensorRef, var: Namer) -> str:
    text = broadcast_text(var(ref), ref.indices, dst.indices)
    guard = guard_axes(ref, dst)
    if guard:
        text = f"jnp.where(jax.lax.axis_index({_axes_entry(guard)}) == 0, {text}, 0)"
    return text


def emit(step: Step, var: Namer, sizes: dict[str, int] | None = None) -> str:
    """The right-hand side of a sum, a negation or an alias (any sizes)."""
    fn = step.fn
    if isinstance(fn, Alias):
        return var(step.operands[0])
    if isinstance(fn, Neg):
        return "-" + var(step.operands[0])
    assert isinstance(fn, Add)
    parts = []
    for k, (sign, ref) in enumerate(zip(fn.signs, step.operands, strict=True)):
        text = _term_code(ref, step.dst, var)
        parts.append(("-" if sign < 0 else "") + text if k == 0 else f"{'+' if sign > 0 else '-'} {text}")
    return " ".join(parts)


def _term(xp: Any, site: Site, x: Array, labels: tuple[str, ...], out: tuple[str, ...], sign: int) -> Array:
    value = contract(xp, [x], [labels], out, site.shape)
    return value if sign > 0 else -value


def _forward(site: Site, xs: Arrays, xp: Any, absolute: bool = False) -> Array:
    """A sum: each term broadcast to the result's indices, signed; a rename: the same array."""
    if not site.signs:
        site.shape.update(zip(site.out, xs[0].shape, strict=True))
        return xs[0]
    total = None
    for x, labels, sign in zip(xs, site.labels, site.signs, strict=True):
        term = _term(xp, site, x, labels, site.out, 1 if absolute else sign)
        total = term if total is None else total + term
    return total


def _vjp(site: Site, xs: Arrays, d: Array, xp: Any, absolute: bool = False) -> Arrays:
    """Each term's gradient: ±d summed over the indices it lacks; a rename's is d itself."""
    if not site.signs:
        return (d,)
    return tuple(_term(xp, site, d, site.out, labels, 1 if absolute else sign)
                 for labels, sign in zip(site.labels, site.signs, strict=True))


def _magnitude(site: Site, xs: Arrays, mags: Arrays, y: Array) -> Array:
    """Linear: the magnitudes add alike, signs dropped."""
    return _forward(site, mags, np, absolute=True)


def _grad_magnitude(site: Site, xs: Arrays, mags: Arrays, d: Array) -> Arrays:
    return _vjp(site, xs, d, np, absolute=True)


def _traffic(step: Step, nbytes: Sizer) -> tuple[tuple[float, ...], float]:
    """A sum or a negation reads its terms and writes the result; an alias is the same array, no traffic."""
    return (no_traffic if isinstance(step.fn, Alias) else all_traffic)(step, nbytes)


SUMS = register(Family(name="sums", calls=frozenset({SUM, RENAME}), ops=(Add, Neg, Alias), plan=_plan,
                       backward=_backward, emit=emit,
                       reference=Reference(_forward, _vjp, _magnitude, _grad_magnitude), aliases=_is_rename,
                       # a sum continues an attention-score region (a bias or mask added to the scores)
                       scores=lambda node: not _is_rename(node), traffic=_traffic))
