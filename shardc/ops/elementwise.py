"""The elementwise maps: ``gelu``, ``relu``, ``silu``, ``tanh``, ``sigmoid``, ``exp``, ``square``,
``identity``, ``log``, ``sqrt``, ``rsqrt``, ``abs``, ``sin``, ``cos``, ``negative``, ``reciprocal``, registered once.

A map keeps the sharding: its argument is read reduced, in the result's layout,
index by index (the result's indices may be the argument's permuted: a local
transpose).  Its gradient reads the argument there and the cotangent in the
result's declared sharding (:class:`~shardc.ir.localops.MapVjp`), but for a
linear map, whose gradient is the map of the cotangent (:data:`~shardc.spec.functions.PASS_THROUGH`):
that step reads no argument, so no move makes one.  The JAX expression of each map,
and its forward and derivative over an array module ``xp`` (numpy for the reference,
jax.numpy for the XLA comparison), are written once here (:data:`FUNCTIONS`); the backward
step is ``jax.vjp`` of the forward's own expression.  GELU is the tanh form, ``jax.nn.gelu``'s
default.  Where a map is defined (``log``'s x > 0) is its signature's
(:attr:`~shardc.spec.functions.Signature.domain`): verify draws the inputs it reads there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from shardc.errors import ShardcError
from shardc.ir.localops import LocalOp, Map, MapVjp
from shardc.ir.plan import Op, Step
from shardc.ir.spec import TensorRef
from shardc.ops.registry import Arrays, Family, Namer, Reference, Site, register
from shardc.ops.text import aligned_text
from shardc.sharding.layout import Value
from shardc.sharding.search import reshard
from shardc.spec.functions import ELEMENTWISE, PASS_THROUGH

if TYPE_CHECKING:
    from shardc.ops.registry import BackwardPass, Node
    from shardc.sharding.phase import Phase

__all__ = ["MAPS", "emit", "gradient_layouts", "map_gradient", "map_step", "Function", "FUNCTIONS", "function",
           "TRANSCENDENTAL"]

Array = Any
_C = 0.7978845608028654  # sqrt(2 / pi)


@dataclass(frozen=True)
class Function:
    name: str
    jax: str  # a callable expression in the generated module
    forward: Callable[[Array, Any], Array]
    derivative: Callable[[Array, Any], Array]
    # the terms a derivative's evaluation adds up, in absolute value (numpy): its rounding
    # error is a few units of the last place of this, however much they cancel
    slope_terms: Callable[[Array], Array]
    # whether the backward's jax.vjp evaluates an op XLA's fusion counts expensive for real numbers
    # (``InstructionFusion::IsExpensive``, xla/service/instruction_fusion.cc: exp, log, logistic, tanh,
    # sqrt, rsqrt and a floating-point divide are; add, multiply, negate, abs, sin, cos, select are not)
    expensive: bool = False


def _gelu(x: Array, xp: Any) -> Array:
    return 0.5 * x * (1.0 + xp.tanh(_C * (x + 0.044715 * x**3)))


def _gelu_prime(x: Array, xp: Any) -> Array:
    t = xp.tanh(_C * (x + 0.044715 * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _C * (1.0 + 3 * 0.044715 * x * x)


def _sigmoid(x: Array, xp: Any) -> Array:
    return 1.0 / (1.0 + xp.exp(-x))


def _silu_prime(x: Array, xp: Any) -> Array:
    s = _sigmoid(x, xp)
    return s * (1.0 + x * (1.0 - s))


def _gelu_terms(x: Array) -> Array:
    t = np.tanh(_C * (x + 0.044715 * x**3))
    return 0.5 * (1.0 + np.abs(t)) + 0.5 * np.abs(x) * (1.0 + t * t) * _C * (1.0 + 3 * 0.044715 * x * x)


def _silu_terms(x: Array) -> Array:
    s = _sigmoid(x, np)
    return s * (1.0 + np.abs(x) * (1.0 + s))


def _ones(x: Array) -> Array:
    return np.ones_like(x)


FUNCTIONS: dict[str, Function] = {f.name: f for f in (
    Function("gelu", "jax.nn.gelu", _gelu, _gelu_prime, _gelu_terms, expensive=True),
    Function("relu", "jax.nn.relu", lambda x, xp: xp.maximum(x, 0.0), lambda x, xp: (x > 0) * 1.0, _ones),
    Function("silu", "jax.nn.silu", lambda x, xp: x * _sigmoid(x, xp), _silu_prime, _silu_terms, expensive=True),
    Function("swish", "jax.nn.silu", lambda x, xp: x * _sigmoid(x, xp), _silu_prime, _silu_terms, expensive=True),
    Function("sigmoid", "jax.nn.sigmoid", _sigmoid,
             lambda x, xp: _sigmoid(x, xp) * (1.0 - _sigmoid(x, xp)),
             lambda x: _sigmoid(x, np) * (1.0 + _sigmoid(x, np)), expensive=True),
    Function("tanh", "jnp.tanh", lambda x, xp: xp.tanh(x), lambda x, xp: 1.0 - xp.tanh(x) ** 2,
             lambda x: 1.0 + np.tanh(x) ** 2, expensive=True),
    Function("exp", "jnp.exp", lambda x, xp: xp.exp(x), lambda x, xp: xp.exp(x), lambda x: np.exp(x), expensive=True),
    Function("square", "jnp.square", lambda x, xp: x * x, lambda x, xp: 2.0 * x, lambda x: 2.0 * np.abs(x)),
    Function("identity", "(lambda x: x)", lambda x, xp: x, lambda x, xp: x * 0.0 + 1.0, _ones),
    # jax's derivatives: log's g / x, sqrt's g * 0.5 / sqrt(x), rsqrt's g * -0.5 * rsqrt(x) / x, reciprocal's
    # g * -(x ** -2): each a divide; abs's select(x >= 0, g, -g) (+1 at 0), sin's g * cos(x), cos's -g * sin(x)
    Function("log", "jnp.log", lambda x, xp: xp.log(x), lambda x, xp: 1.0 / x, lambda x: 1.0 / np.abs(x),
             expensive=True),
    Function("sqrt", "jnp.sqrt", lambda x, xp: xp.sqrt(x), lambda x, xp: 0.5 / xp.sqrt(x),
             lambda x: 0.5 / np.sqrt(np.abs(x)), expensive=True),
    Function("rsqrt", "jax.lax.rsqrt", lambda x, xp: 1.0 / xp.sqrt(x), lambda x, xp: -0.5 / (x * xp.sqrt(x)),
             lambda x: 0.5 / np.abs(x * np.sqrt(np.abs(x))), expensive=True),
    Function("reciprocal", "jnp.reciprocal", lambda x, xp: 1.0 / x, lambda x, xp: -1.0 / (x * x),
             lambda x: 1.0 / (x * x), expensive=True),
    Function("abs", "jnp.abs", lambda x, xp: xp.abs(x), lambda x, xp: xp.where(x >= 0, 1.0, -1.0), _ones),
    Function("sin", "jnp.sin", lambda x, xp: xp.sin(x), lambda x, xp: xp.cos(x), _ones),
    Function("cos", "jnp.cos", lambda x, xp: xp.cos(x), lambda x, xp: -xp.sin(x), _ones),
    Function("negative", "jnp.negative", lambda x, xp: -x, lambda x, xp: x * 0.0 - 1.0, _ones),
)}


# the maps whose derivative XLA's fusion counts as expensive (gelu's tanh, silu's exp, log's divide): it makes it
# once, never again inside each of several consumers (``IsExpensive``, xla/service/instruction_fusion.cc)
TRANSCENDENTAL = frozenset(f.name for f in FUNCTIONS.values() if f.expensive)


def function(name: str) -> Function:
    """The function called ``name``; a ShardcError names the ones lowering knows."""
    try:
        return FUNCTIONS[name]
    except KeyError:
        known = ", ".join(sorted(FUNCTIONS))
        raise ShardcError(f"lowering does not know the elementwise function {name!r}",
                          fix=f"use one of {known}") from None


def _plan(phase: Phase, node: Node, declared: dict[str, TensorRef], target: Value | None, label: str) -> None:
    """``f`` keeps the sharding; its argument must be reduced, in the result's layout (read index
    by index, never position by position)."""
    (arg,) = node.operands
    target, want = phase.map_argument(arg, node.result, node.indices, target, declared.get(arg),
                                      "an elementwise function", node.statement.span)
    map_step(phase, node, declared, target, want, Map(node.fn or ""))


def map_step(phase: Phase, node: Node, declared: dict[str, TensorRef], target: Value, want: Value,
             fn: LocalOp) -> None:
    """A map's one step: its result made in ``target`` of its argument read in ``want``, each declared so
    where the spec did not (the layouts the next statements read them in)."""
    (arg,) = node.operands
    phase.emit(Step(Op.ELEMENTWISE, node.result, phase.ref(node.result, target), operands=(phase.ref(arg, want),),
                    fn=fn), target)
    declared.setdefault(node.result, phase.ref(node.result, target))
    declared.setdefault(arg, phase.ref(arg, want))


def gradient_layouts(bw: BackwardPass, node: Node) -> tuple[Value, Value]:
    """(the cotangent's layout, the argument's gradient's) of a map's backward: the result's layout, and it
    read index by index in the argument's order (a map keeps the sharding)."""
    value = bw.target(node.result)
    by_index = dict(zip(node.indices, value.layout, strict=True))
    return value, Value(tuple(by_index[i] for i in bw.phase.indices[node.operands[0]]), ())


def map_gradient(bw: BackwardPass, node: Node) -> tuple[str, Value, Value] | None:
    """(the argument, and :func:`gradient_layouts`) of a map's backward; None where its argument needs no
    gradient."""
    (z,) = node.operands
    if z not in bw.needs:
        return None
    return (z, *gradient_layouts(bw, node))


def _backward(bw: BackwardPass, node: Node, grad: str) -> None:
    """dZ = f'(Z) dY, in the result's layout read index by index (the cotangent alone for a pass-through)."""
    if (found := map_gradient(bw, node)) is None:
        return
    z, value, want = found
    dst = bw.part_name(z)
    cotangent = bw.phase.ref(grad, value)
    if node.fn in PASS_THROUGH:  # the gradient is the cotangent, in the argument's index order
        bw.phase.emit(Step(Op.ELEMENTWISE, dst, bw.phase.ref(dst, want), operands=(cotangent,), fn=Map(node.fn)))
    else:
        _, moves = reshard(bw.phase.ctx, z, bw.phase.indices[z], bw.phase.held[z], want)
        bw.phase.moves(z, moves, note="residual for the elementwise gradient")
        bw.phase.emit(Step(Op.ELEMENTWISE, dst, bw.phase.ref(dst, want),
                           operands=(bw.phase.ref(z, want), cotangent), fn=MapVjp(node.fn or "")))
    bw.settle(z, dst, want)


def emit(step: Step, var: Namer, sizes: dict[str, int] | None = None) -> str:
    """``f(x)``, or ``jax.vjp`` of that same ``f`` applied to the cotangent, operands in the result's order."""
    fn = step.fn
    assert isinstance(fn, (Map, MapVjp))
    args = [aligned_text(var(ref), ref.indices, step.dst.indices) for ref in step.operands]
    if isinstance(fn, MapVjp):
        return f"jax.vjp({function(fn.name).jax}, {args[0]})[1]({args[1]})[0]"
    return f"{function(fn.name).jax}({args[0]})"


def _forward(site: Site, xs: Arrays, xp: Any) -> Array:
    return function(site.func.func).forward(xs[0], xp)


def _vjp(site: Site, xs: Arrays, d: Array, xp: Any) -> Arrays:
    return (d * function(site.func.func).derivative(xs[0], xp),)


def _magnitude(site: Site, xs: Arrays, mags: Arrays, y: Array) -> Array:
    """``|f(x)| + |f'(x)| mag``: the value, plus how far the argument's terms move it."""
    f, (x,), (mag,) = function(site.func.func), xs, mags
    return np.abs(f.forward(x, np)) + np.abs(f.derivative(x, np)) * mag


def _slope(f: Function, z: np.ndarray, m: np.ndarray) -> np.ndarray:
    """What the backward's ``f'(z)`` may err by, in the units of the magnitudes.

    The terms its evaluation adds (``slope_terms``), plus how far ``f'`` moves when ``z``
    moves by its own magnitude ``m`` (``|f''| m``, by a float64 difference quotient).
    """
    h = 1e-4
    moved = np.abs(f.derivative(z + h * m, np) - f.derivative(z, np)) / h
    return np.abs(f.derivative(z, np)) + f.slope_terms(z) + moved  # type: ignore[no-any-return]


def _grad_magnitude(site: Site, xs: Arrays, mags: Arrays, d: Array) -> Arrays:
    """The cotangent's magnitude scaled by the bound on ``f'(x)`` (not linear: vjp's would miss it)."""
    return (d * _slope(function(site.func.func), xs[0], mags[0]),)


MAPS = register(Family(name="elementwise", calls=ELEMENTWISE, ops=(Map, MapVjp), plan=_plan, backward=_backward,
                       emit=emit, reference=Reference(_forward, _vjp, _magnitude, _grad_magnitude,
                                                      nonlinear=lambda func: func not in PASS_THROUGH),
                       # a map of the attention scores (a scale, an exp) stays in their region
                       scores=lambda node: True))
