"""Sums and renames: ``R = A ± B ± ...`` and ``Kx[B, T, D] = X[B, S, D]``, registered once.

Neither is a spec function: the graph gives a sum's node the family of the form
:data:`~shardc.ops.registry.SUM` and a rename's that of :data:`~shardc.ops.registry.RENAME`.
:mod:`shardc.ops.sum_plans` plans their forward (a sum's local value searched, a rename
an alias of its source's value); their backward is here:

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

from typing import TYPE_CHECKING, Any

import numpy as np

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
from shardc.ops.sum_plans import guard_axes, plan_add, plan_rename
from shardc.ops.text import broadcast_text
from shardc.sharding.layout import Value

if TYPE_CHECKING:
    from shardc.ops.registry import BackwardPass, Node
    from shardc.sharding.phase import Phase

__all__ = ["SUMS", "emit"]

Array = Any


def _is_rename(node: Node) -> bool:
    """A rename's node has one operand and no signs (a sum has a sign per term)."""
    return not node.signs


def _plan(phase: Phase, node: Node, declared: dict[str, TensorRef], target: Value | None, label: str) -> None:
    (plan_rename if _is_rename(node) else plan_add)(phase, node, declared, target)


def _alias(bw: BackwardPass, primal: str, grad: str, value: Value) -> None:
    """``grad`` (held as ``value``) is a contribution to ``primal``'s gradient as it is: an alias step."""
    dst = bw.part_name(primal)
    bw.phase.emit(Step(Op.ELEMENTWISE, dst, bw.phase.ref(dst, value), operands=(bw.phase.ref(grad, value),),
                       fn=ALIAS), value)
    bw.settle(primal, dst, value)


def _add_backward(bw: BackwardPass, node: Node, grad: str) -> None:
    """``R = A ± B``: dA = ±dR, summed over the indices A lacks (the einsum ``dR[B, S, D] -> dA[D]``)."""
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
            _alias(bw, term, source, bw.target(node.result))  # dA is dR itself: no copy
        else:
            bw.contribute(term, (source,), (source,))


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
