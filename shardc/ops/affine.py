"""The affine maps: ``scale(X, a)`` (x * a) and ``shift(X, b)`` (x + b), registered once.

A program's constants: a query's 1 / sqrt(H) before its softmax (flax's attention), a norm's
``1 + w`` offset, a ``2 - x``.  Each is a map, planned as ``gelu`` is: it keeps the sharding, its
argument read reduced, in the result's layout, index by index.  Its gradient is the cotangent times
the scale (a shift's is the cotangent itself): it reads no argument, so no move makes one, as
``identity``'s.  One memory-bound step each way, which XLA fuses with its neighbouring maps as any
other elementwise op (:attr:`~shardc.ops.registry.Family.fusible`, the default).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from shardc.ir.localops import Affine, AffineVjp
from shardc.ir.plan import Op, Step
from shardc.ir.spec import Call, TensorRef
from shardc.ops.elementwise import map_gradient, map_step
from shardc.ops.registry import Arrays, Family, Namer, Reference, Site, register
from shardc.ops.text import aligned_text
from shardc.sharding.layout import Value

if TYPE_CHECKING:
    from shardc.ops.registry import BackwardPass, Node
    from shardc.sharding.phase import Phase

__all__ = ["AFFINE", "affine_of", "emit"]

Array = Any


def affine_of(call: Call) -> Affine:
    """The call's map: ``scale(X, a)`` is x * a, ``shift(X, b)`` x + b."""
    (number,) = call.numbers
    return Affine(scale=number) if call.func == "scale" else Affine(shift=number)


def _plan(phase: Phase, node: Node, declared: dict[str, TensorRef], target: Value | None, label: str) -> None:
    """The argument reduced, in the result's layout (read index by index), then the map."""
    assert node.call is not None
    (arg,) = node.operands
    target, want = phase.map_argument(arg, node.result, node.indices, target, declared.get(arg),
                                      f"a {node.fn}", node.statement.span)
    map_step(phase, node, declared, target, want, affine_of(node.call))


def _backward(bw: BackwardPass, node: Node, grad: str) -> None:
    """dX = a dY, in the argument's index order: the cotangent alone is read."""
    assert node.call is not None
    if (found := map_gradient(bw, node)) is None:
        return
    z, value, want = found
    dst = bw.part_name(z)
    bw.phase.emit(Step(Op.ELEMENTWISE, dst, bw.phase.ref(dst, want), operands=(bw.phase.ref(grad, value),),
                       fn=AffineVjp(affine_of(node.call).scale)), want)
    bw.settle(z, dst, want)


def emit(step: Step, var: Namer, sizes: dict[str, int] | None = None) -> str:
    """``x * a + b`` (a term left out where it does nothing), the operand in the result's order."""
    fn = step.fn
    assert isinstance(fn, (Affine, AffineVjp))
    (ref,) = step.operands
    x = aligned_text(var(ref), ref.indices, step.dst.indices)
    shift = fn.shift if isinstance(fn, Affine) else 0.0
    return f"{x}{f' * {fn.scale!r}' if fn.scale != 1.0 else ''}{f' + {shift!r}' if shift else ''}"


def _forward(site: Site, xs: Arrays, xp: Any) -> Array:
    fn = affine_of(site.func)
    return xs[0] * fn.scale + fn.shift


def _vjp(site: Site, xs: Arrays, d: Array, xp: Any) -> Arrays:
    return (d * affine_of(site.func).scale,)


def _magnitude(site: Site, xs: Arrays, mags: Arrays, y: Array) -> Array:
    """The terms behind ``x * a + b``: the argument's scaled by ``|a|``, and ``|b|``."""
    fn = affine_of(site.func)
    return mags[0] * abs(fn.scale) + abs(fn.shift) + np.zeros_like(y)


def _grad_magnitude(site: Site, xs: Arrays, mags: Arrays, d: Array) -> Arrays:
    return (d * abs(affine_of(site.func).scale),)


AFFINE = register(Family(name="affine", calls=frozenset({"scale", "shift"}), ops=(Affine, AffineVjp), plan=_plan,
                         backward=_backward, emit=emit,
                         # a shift's value is not linear in its argument's size: verify brings that to unit size
                         reference=Reference(_forward, _vjp, _magnitude, _grad_magnitude,
                                             nonlinear=lambda func: func == "shift"),
                         # a scale of the attention scores (their 1 / sqrt(H)) stays in their region
                         scores=lambda node: True))
