"""The reductions and norms family: ``softmax``, ``rmsnorm``, ``layernorm`` (the argument's indices)
and ``sum``, ``mean``, ``max``, ``logsumexp`` (the reduced index dropped), each ``over`` one index.

:mod:`shardc.planner.rows` plans the forward (the reduced index gathered, or per-row
statistics all-reduced) and :mod:`shardc.planner.rows_backward` the closed-form
backward; the node makes its row statistics on the way (:func:`stat_names`, one value
a row each, of the argument's indices less the reduced one).  Each step carries a
:class:`~shardc.ir.localops.Row` (a statistic's AllReduce names a
:class:`~shardc.ir.localops.Combine` where it is not a sum), written as one line
of JAX by :func:`shardc.lowering.row_code.row_code`.  Its meaning on whole arrays (:func:`forward`,
:func:`vjp`; ``xp`` numpy or jax.numpy), and the bounds on the terms behind its value and its
gradient (:func:`magnitude`, :func:`grad_magnitude`), are written here along the reduced index.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from shardc.errors import InternalError
from shardc.ir.localops import Combine, Row
from shardc.ir.plan import Step
from shardc.ir.spec import Call, Expr
from shardc.lowering import row_code as rows
from shardc.lowering.row_code import LN_EPS, RMS_EPS
from shardc.names import fresh
from shardc.ops.registry import Arrays, Builder, Family, Namer, Reference, Site, register
from shardc.planner.rows import plan_rows
from shardc.planner.rows_backward import rows_backward
from shardc.planner.rowstats import stat_names
from shardc.spec.functions import signature

if TYPE_CHECKING:
    from shardc.planner.graph import Node

__all__ = ["REDUCTIONS", "emit", "forward", "vjp", "magnitude", "grad_magnitude"]

Array = Any


def _argument(call: Call, indices: tuple[str, ...]) -> tuple[str, ...]:
    """The result's indices, and the reduced one where the result drops it."""
    assert call.over is not None
    return indices if call.over in indices else indices + (call.over,)


def _aux(call: Call, result: str) -> tuple[str, ...]:
    """The forward's row statistics (``max`` is its own, so it makes none)."""
    return stat_names(call.func, result)


def _operands(builder: Builder, call: Call, result: str, indices: tuple[str, ...]) -> tuple[tuple[str, ...],
                                                                                        tuple[str, ...]]:
    """The argument, computed towards :func:`_argument`'s indices in a layout of its own, and the row
    statistics, named uniquely, of the argument's indices less the reduced one."""
    arg = builder.argument(call.arg, result, _argument(call, indices))
    rows_of = tuple(i for i in builder.indices[arg] if i != call.over)
    aux = tuple(fresh(base, builder.names) for base in _aux(call, result))
    builder.indices.update({a: rows_of for a in aux})
    return (arg,), aux


def emit(step: Step, var: Namer, sizes: dict[str, int] | None = None) -> str:
    """One row step (shape-generic: a mean divides by the reduced index's global length)."""
    return rows.row_code(step, var)


# --- whole arrays: the reference ---------------------------------------------------------

def forward(fn: str, x: Array, axis: int, xp: Any) -> Array:
    """``fn`` of ``x`` along ``axis`` (reductions drop it)."""
    if fn == "softmax":
        z = xp.exp(x - xp.max(x, axis=axis, keepdims=True))
        return z / xp.sum(z, axis=axis, keepdims=True)
    if fn == "logsumexp":
        m = xp.max(x, axis=axis, keepdims=True)
        return xp.squeeze(m, axis) + xp.log(xp.sum(xp.exp(x - m), axis=axis))
    if fn == "rmsnorm":
        return x / xp.sqrt(xp.mean(x * x, axis=axis, keepdims=True) + RMS_EPS)
    if fn == "layernorm":
        mu = xp.mean(x, axis=axis, keepdims=True)
        return (x - mu) / xp.sqrt(xp.mean((x - mu) ** 2, axis=axis, keepdims=True) + LN_EPS)
    if fn == "sum":
        return xp.sum(x, axis=axis)
    if fn == "mean":
        return xp.mean(x, axis=axis)
    if fn == "max":
        return xp.max(x, axis=axis)
    raise InternalError(f"the reference does not know the reduction {fn!r}",
                        fix="this is a shardc bug: please report the spec")


def vjp(fn: str, x: Array, y: Array, dy: Array, axis: int, xp: Any) -> Array:
    """The gradient of ``fn`` at ``x`` (result ``y``) for the cotangent ``dy``, in closed form."""
    if fn in ("sum", "mean", "max", "logsumexp"):
        dy_, y_ = xp.expand_dims(dy, axis), xp.expand_dims(y, axis)
        n = x.shape[axis]
        if fn == "sum":
            return xp.broadcast_to(dy_, x.shape) + 0.0 * x
        if fn == "mean":
            return xp.broadcast_to(dy_, x.shape) / n + 0.0 * x
        if fn == "max":
            return xp.where(x == y_, dy_, 0.0 * x)
        return xp.exp(x - y_) * dy_
    if fn == "softmax":
        return y * (dy - xp.sum(dy * y, axis=axis, keepdims=True))
    if fn == "rmsnorm":
        r = 1.0 / xp.sqrt(xp.mean(x * x, axis=axis, keepdims=True) + RMS_EPS)
        return r * (dy - y * xp.mean(dy * y, axis=axis, keepdims=True))
    if fn == "layernorm":
        mu = xp.mean(x, axis=axis, keepdims=True)
        r = 1.0 / xp.sqrt(xp.mean((x - mu) ** 2, axis=axis, keepdims=True) + LN_EPS)
        return r * (dy - xp.mean(dy, axis=axis, keepdims=True) - y * xp.mean(dy * y, axis=axis, keepdims=True))
    raise InternalError(f"the reference does not know the reduction {fn!r}",
                        fix="this is a shardc bug: please report the spec")


def magnitude(fn: str, x: Any, mag: Any, axis: int) -> Any:
    """A bound on the terms behind ``fn(x)`` (numpy), for verify's tolerance (see reference.magnitudes).

    Every output of a row reads the whole row: the row's largest input magnitude, scaled by
    how much the function can amplify it (a norm divides by the row's RMS).
    """
    y = forward(fn, x, axis, np)
    row = np.max(mag, axis=axis, keepdims=True)
    if fn in ("sum", "mean"):
        return np.sum(mag, axis=axis) / (x.shape[axis] if fn == "mean" else 1)
    if fn in ("max", "logsumexp"):
        return np.squeeze(row, axis) + np.abs(y)
    if fn == "softmax":
        return np.abs(y) * (1.0 + 2.0 * row)
    scale = 1.0 / np.sqrt(np.mean(x * x, axis=axis, keepdims=True) + RMS_EPS)
    return np.abs(y) + 2.0 * row * scale


def grad_magnitude(fn: str, x: Any, mag: Any, d: Any, axis: int) -> Any:
    """A bound on the terms behind the gradient of ``fn`` for a cotangent of magnitude ``d`` (numpy)."""
    y = forward(fn, x, axis, np)
    if fn in ("sum", "mean", "max", "logsumexp"):
        spread = np.broadcast_to(np.expand_dims(d, axis), x.shape)
        return spread * (1.0 + np.max(mag, axis=axis, keepdims=True)) / (x.shape[axis] if fn == "mean" else 1)
    total = np.sum(d * np.abs(y), axis=axis, keepdims=True)
    if fn == "softmax":
        return np.abs(y) * (d + total) * (1.0 + np.max(mag, axis=axis, keepdims=True))
    scale = 1.0 / np.sqrt(np.mean(x * x, axis=axis, keepdims=True) + RMS_EPS)
    return 2.0 * scale * (d + np.abs(y) * total / x.shape[axis] + np.sum(d, axis=axis, keepdims=True) / x.shape[axis])


def _axis(site: Site) -> int:
    assert site.func.over is not None
    return site.labels[0].index(site.func.over)


def _forward(site: Site, xs: Arrays, xp: Any) -> Array:
    return forward(site.func.func, xs[0], _axis(site), xp)


def _vjp(site: Site, xs: Arrays, d: Array, xp: Any) -> Arrays:
    """The closed-form gradient, at the argument and the result the forward made."""
    return (vjp(site.func.func, xs[0], site.result, d, _axis(site), xp),)


def _magnitude(site: Site, xs: Arrays, mags: Arrays, y: Array) -> Array:
    return magnitude(site.func.func, xs[0], mags[0], _axis(site))


def _grad_magnitude(site: Site, xs: Arrays, mags: Arrays, d: Array) -> Arrays:
    """Not linear: the bound reads the row's largest magnitude (:func:`grad_magnitude`)."""
    return (grad_magnitude(site.func.func, xs[0], mags[0], d, _axis(site)),)


def _arguments(call: Call, keep: tuple[str, ...]) -> tuple[tuple[Expr, tuple[str, ...]], ...]:
    return ((call.arg, _argument(call, keep)),)


def _indices(call: Call, operands: tuple[tuple[str, ...], ...]) -> tuple[str, ...]:
    """The argument's indices, less the reduced one for a reduction (``sum``, ``max``, ...)."""
    (labels,) = operands
    reduces = signature(call.func).kind == "reduce"
    return tuple(i for i in labels if i != call.over) if reduces else labels


def _softmax(node: Node) -> bool:
    """A softmax of attention scores stays in their region (selective recomputation reruns it)."""
    return node.call is not None and node.call.func == "softmax"


REDUCTIONS = register(Family(
    name="reductions", calls=frozenset({"softmax", "rmsnorm", "layernorm", "sum", "mean", "max", "logsumexp"}),
    ops=(Row, Combine), plan=plan_rows, backward=rows_backward, emit=emit,
    reference=Reference(_forward, _vjp, _magnitude, grad_magnitude=_grad_magnitude, arguments=_arguments,
                        indices=_indices),
    argument=_argument, aux=_aux, operands=_operands, scores=_softmax))
