"""The reductions and norms on whole arrays: the reference the reductions family is verified against.

Each function's meaning along ``axis`` (``xp`` numpy or jax.numpy), its closed-form gradient at ``x``
(result ``y``) for the cotangent ``dy``, and bounds (numpy) on the terms behind both, for verify's
tolerance (see reference.magnitudes).  Every output of a row reads the whole row: a bound is the
row's largest input magnitude, scaled by how much the function can amplify it (a norm divides by
the row's RMS).  What differs between the functions is the table :data:`FUNCTIONS`.  The family itself,
its planning and its JAX lines, is :mod:`shardc.ops.reductions`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardc.errors import InternalError

__all__ = ["FUNCTIONS", "Whole", "whole", "forward", "vjp", "magnitude", "grad_magnitude", "RMS_EPS", "LN_EPS"]

Array = Any
RMS_EPS = 1e-6
LN_EPS = 1e-5


def _softmax_value(x: Array, axis: int, xp: Any) -> Array:
    z = xp.exp(x - xp.max(x, axis=axis, keepdims=True))
    return z / xp.sum(z, axis=axis, keepdims=True)


def _logsumexp_value(x: Array, axis: int, xp: Any) -> Array:
    m = xp.max(x, axis=axis, keepdims=True)
    return xp.squeeze(m, axis) + xp.log(xp.sum(xp.exp(x - m), axis=axis))


def _rmsnorm_value(x: Array, axis: int, xp: Any) -> Array:
    return x / xp.sqrt(xp.mean(x * x, axis=axis, keepdims=True) + RMS_EPS)


def _layernorm_value(x: Array, axis: int, xp: Any) -> Array:
    mu = xp.mean(x, axis=axis, keepdims=True)
    return (x - mu) / xp.sqrt(xp.mean((x - mu) ** 2, axis=axis, keepdims=True) + LN_EPS)


def _sum_value(x: Array, axis: int, xp: Any) -> Array:
    return xp.sum(x, axis=axis)


def _mean_value(x: Array, axis: int, xp: Any) -> Array:
    return xp.mean(x, axis=axis)


def _max_value(x: Array, axis: int, xp: Any) -> Array:
    return xp.max(x, axis=axis)


def _sort_value(x: Array, axis: int, xp: Any) -> Array:
    return xp.sort(x, axis=axis)


def _softmax_vjp(x: Array, y: Array, dy: Array, axis: int, xp: Any) -> Array:
    return y * (dy - xp.sum(dy * y, axis=axis, keepdims=True))


def _logsumexp_vjp(x: Array, y: Array, dy: Array, axis: int, xp: Any) -> Array:
    return xp.exp(x - xp.expand_dims(y, axis)) * xp.expand_dims(dy, axis)


def _rmsnorm_vjp(x: Array, y: Array, dy: Array, axis: int, xp: Any) -> Array:
    r = 1.0 / xp.sqrt(xp.mean(x * x, axis=axis, keepdims=True) + RMS_EPS)
    return r * (dy - y * xp.mean(dy * y, axis=axis, keepdims=True))


def _layernorm_vjp(x: Array, y: Array, dy: Array, axis: int, xp: Any) -> Array:
    mu = xp.mean(x, axis=axis, keepdims=True)
    r = 1.0 / xp.sqrt(xp.mean((x - mu) ** 2, axis=axis, keepdims=True) + LN_EPS)
    return r * (dy - xp.mean(dy, axis=axis, keepdims=True) - y * xp.mean(dy * y, axis=axis, keepdims=True))


def _sum_vjp(x: Array, y: Array, dy: Array, axis: int, xp: Any) -> Array:
    return xp.broadcast_to(xp.expand_dims(dy, axis), x.shape) + 0.0 * x


def _mean_vjp(x: Array, y: Array, dy: Array, axis: int, xp: Any) -> Array:
    return xp.broadcast_to(xp.expand_dims(dy, axis), x.shape) / x.shape[axis] + 0.0 * x


def _max_vjp(x: Array, y: Array, dy: Array, axis: int, xp: Any) -> Array:
    return xp.where(x == xp.expand_dims(y, axis), xp.expand_dims(dy, axis), 0.0 * x)


def _sort_vjp(x: Array, y: Array, dy: Array, axis: int, xp: Any) -> Array:
    """Each element's cotangent is that of its place in the sorted row: dY at its rank (ties by position,
    as a stable sort orders them)."""
    rank = xp.argsort(xp.argsort(x, axis=axis, stable=True), axis=axis, stable=True)
    return xp.take_along_axis(dy, rank, axis=axis)


def _row_peak(mag: Any, axis: int) -> Any:
    return np.max(mag, axis=axis, keepdims=True)


def _rms_scale(x: Any, axis: int) -> Any:
    return 1.0 / np.sqrt(np.mean(x * x, axis=axis, keepdims=True) + RMS_EPS)


def _softmax_bound(x: Any, y: Any, mag: Any, axis: int) -> Any:
    return np.abs(y) * (1.0 + 2.0 * _row_peak(mag, axis))


def _peak_bound(x: Any, y: Any, mag: Any, axis: int) -> Any:
    """A max or a logsumexp: the row's peak, plus the value."""
    return np.squeeze(_row_peak(mag, axis), axis) + np.abs(y)


def _norm_bound(x: Any, y: Any, mag: Any, axis: int) -> Any:
    return np.abs(y) + 2.0 * _row_peak(mag, axis) * _rms_scale(x, axis)


def _sum_bound(x: Any, y: Any, mag: Any, axis: int) -> Any:
    return np.sum(mag, axis=axis)


def _mean_bound(x: Any, y: Any, mag: Any, axis: int) -> Any:
    return np.sum(mag, axis=axis) / x.shape[axis]


def _sort_bound(x: Any, y: Any, mag: Any, axis: int) -> Any:
    """A sorted element is one of its row's: the row's peak magnitude bounds it."""
    return np.broadcast_to(_row_peak(mag, axis), x.shape)


def _sort_grad_bound(x: Any, y: Any, mag: Any, d: Any, axis: int) -> Any:
    return np.broadcast_to(_row_peak(d, axis), x.shape)


def _softmax_grad_bound(x: Any, y: Any, mag: Any, d: Any, axis: int) -> Any:
    total = np.sum(d * np.abs(y), axis=axis, keepdims=True)
    return np.abs(y) * (d + total) * (1.0 + _row_peak(mag, axis))


def _norm_grad_bound(x: Any, y: Any, mag: Any, d: Any, axis: int) -> Any:
    total = np.sum(d * np.abs(y), axis=axis, keepdims=True)
    n = x.shape[axis]
    return 2.0 * _rms_scale(x, axis) * (d + np.abs(y) * total / n + np.sum(d, axis=axis, keepdims=True) / n)


def _spread_grad_bound(x: Any, y: Any, mag: Any, d: Any, axis: int) -> Any:
    """A sum, a max or a logsumexp: the cotangent spread along the row, times its peak."""
    return np.broadcast_to(np.expand_dims(d, axis), x.shape) * (1.0 + _row_peak(mag, axis))


def _mean_grad_bound(x: Any, y: Any, mag: Any, d: Any, axis: int) -> Any:
    return _spread_grad_bound(x, y, mag, d, axis) / x.shape[axis]


@dataclass(frozen=True)
class Whole:
    """One function of the reductions family on whole arrays (see the module's doc)."""

    value: Callable[[Array, int, Any], Array]
    vjp: Callable[[Array, Array, Array, int, Any], Array]
    bound: Callable[[Any, Any, Any, int], Any]
    grad_bound: Callable[[Any, Any, Any, Any, int], Any]
    # its value depends on its argument's size other than linearly (a sum, a mean and a max scale with it),
    # so verify brings the argument to unit size
    nonlinear: bool
    # it normalises attention scores (a softmax), so it stays in their region: selective recomputation
    # reruns it (:attr:`shardc.ops.registry.Family.scores`)
    scores: bool = False


FUNCTIONS: dict[str, Whole] = {
    "softmax": Whole(_softmax_value, _softmax_vjp, _softmax_bound, _softmax_grad_bound, True, scores=True),
    "logsumexp": Whole(_logsumexp_value, _logsumexp_vjp, _peak_bound, _spread_grad_bound, True),
    "rmsnorm": Whole(_rmsnorm_value, _rmsnorm_vjp, _norm_bound, _norm_grad_bound, True),
    "layernorm": Whole(_layernorm_value, _layernorm_vjp, _norm_bound, _norm_grad_bound, True),
    "sum": Whole(_sum_value, _sum_vjp, _sum_bound, _spread_grad_bound, False),
    "mean": Whole(_mean_value, _mean_vjp, _mean_bound, _mean_grad_bound, False),
    "max": Whole(_max_value, _max_vjp, _peak_bound, _spread_grad_bound, False),
    "sort": Whole(_sort_value, _sort_vjp, _sort_bound, _sort_grad_bound, False),
}


def whole(fn: str) -> Whole:
    if fn not in FUNCTIONS:
        raise InternalError(f"the reference does not know the reduction {fn!r}",
                            fix="this is a shardc bug: please report the spec")
    return FUNCTIONS[fn]


def forward(fn: str, x: Array, axis: int, xp: Any) -> Array:
    """``fn`` of ``x`` along ``axis`` (reductions drop it)."""
    return whole(fn).value(x, axis, xp)


def vjp(fn: str, x: Array, y: Array, dy: Array, axis: int, xp: Any) -> Array:
    """The gradient of ``fn`` at ``x`` (result ``y``) for the cotangent ``dy``, in closed form."""
    return whole(fn).vjp(x, y, dy, axis, xp)


def magnitude(fn: str, x: Any, mag: Any, axis: int) -> Any:
    """A bound on the terms behind ``fn(x)`` (numpy), for verify's tolerance (see reference.magnitudes)."""
    return whole(fn).bound(x, forward(fn, x, axis, np), mag, axis)


def grad_magnitude(fn: str, x: Any, mag: Any, d: Any, axis: int) -> Any:
    """A bound on the terms behind the gradient of ``fn`` for a cotangent of magnitude ``d`` (numpy)."""
    return whole(fn).grad_bound(x, forward(fn, x, axis, np), mag, d, axis)


