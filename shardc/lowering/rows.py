"""Reductions over an index, as lowering and the numpy reference see them.

:func:`row_code` writes one planned row step (:mod:`shardc.planner.rows`) as one
line of JAX: ``jax.nn.softmax`` / ``jax.nn.logsumexp`` where the reduced index I
is whole on the device, else the local statistic, the finishing map, or the
closed-form gradient.  Each step computes in its frame (its result's index order
if that has every index, else its first operand's) with I at ``step.dim``;
per-row operands are aligned to the frame without I and expanded back at I.
A mean divides by I's global length: the local length times the devices sharding
I (``jax.lax.axis_size``), so the module stays shape-generic.

:func:`forward` and :func:`vjp` are the same functions on whole arrays (``xp`` is
numpy or jax.numpy), for the reference of the reductions' and the vocabulary ops' families
(:mod:`shardc.ops.reductions`, :mod:`shardc.ops.vocabulary`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from shardc.errors import InternalError
from shardc.planner.ir import Step
from shardc.planner.localops import Row, Vocab
from shardc.spec.ir import TensorRef
from shardc.spec.walk import id_vocabulary

__all__ = ["row_code", "lookup_code", "forward", "vjp", "magnitude", "grad_magnitude", "RMS_EPS", "LN_EPS",
           "id_inputs", "lookup_forward", "lookup_vjp"]

Array = Any
RMS_EPS = 1e-6
LN_EPS = 1e-5


def _frame(step: Step) -> tuple[str, ...]:
    widest = max(len(r.indices) for r in (*step.operands, step.dst))
    return step.dst.indices if len(step.dst.indices) == widest else step.operands[0].indices


def _aligned(code: str, have: tuple[str, ...], want: tuple[str, ...]) -> str:
    if have == want or len(have) != len(want):  # a scalar (a loss's cotangent) broadcasts as it is
        return code
    return f"jnp.transpose({code}, {tuple(have.index(i) for i in want)})"


def row_code(step: Step, var: Callable[[TensorRef], str]) -> str:
    """One row step as one line of Python (its right-hand side)."""
    frame = _frame(step)
    d = step.dim
    over = frame[d] if d is not None else None
    rows = tuple(i for i in frame if i != over)
    args = []
    for ref in step.operands:
        full = over is not None and over in ref.indices
        args.append(_aligned(var(ref), ref.indices, frame if full else rows))
    wide = next((r for r in (*step.operands, step.dst) if over is not None and over in r.indices), None)
    axes = wide.dims[wide.indices.index(over)].axes if wide is not None and over is not None else ()

    def e(k: int) -> str:  # a per-row operand, broadcast along I
        return f"jnp.expand_dims({args[k]}, {d})"

    n = f"({args[0]}.shape[{d}] * jax.lax.axis_size({axes!r}))" if axes else f"{args[0]}.shape[{d}]"
    code = _expression(step, args, e, n, d, var, axes)
    out = frame if len(step.dst.indices) == len(frame) else rows
    return _aligned(code if out == step.dst.indices else f"({code})", out, step.dst.indices)


def _expression(step: Step, a: list[str], e: Callable[[int], str], n: str, d: int | None,
                var: Callable[[TensorRef], str], axes: tuple[str, ...]) -> str:
    fn = step.fn
    simple = {
        Row.SOFTMAX: f"jax.nn.softmax({a[0]}, axis={d})",
        Row.LOGSUMEXP: f"jax.nn.logsumexp({a[0]}, axis={d})",
        Row.ROW_MAX: f"jnp.max({a[0]}, axis={d})",
        Row.ROW_SUMEXP: f"jnp.sum(jnp.exp({a[0]} - {e(1) if len(a) > 1 else ''}), axis={d})",
        Row.ROW_SUM: f"jnp.sum({a[0]}, axis={d})",
        Row.ROW_MEAN: f"jnp.sum({a[0]}, axis={d}) / {n}",
        Row.ROW_MEANSQ: f"jnp.sum(jnp.square({a[0]}), axis={d}) / {n}",
        Row.ROW_MEANDEV: f"jnp.sum(jnp.square({a[0]} - {e(1) if len(a) > 1 else ''}), axis={d}) / {n}",
        Row.ROW_MEANDOT: f"jnp.sum({a[0]} * {a[1] if len(a) > 1 else ''}, axis={d}) / {n}",
        Row.ROW_DOT: f"jnp.sum({a[0]} * {a[1] if len(a) > 1 else ''}, axis={d})",
        Row.SOFTMAX_VJP: f"{a[0]} * ({a[1] if len(a) > 1 else ''} - jnp.sum({a[0]} * {a[1] if len(a) > 1 else ''}, "
                         f"axis={d}, keepdims=True))",
    }
    if isinstance(fn, Row) and fn in simple:
        return simple[fn]
    finishing = _finishing(fn, a, e) if isinstance(fn, Row) else None
    if finishing is not None:
        return finishing
    if fn in (Row.SUM_VJP, Row.MEAN_VJP):
        return _spread(step, e(0), var, fn is Row.MEAN_VJP)
    if fn is Vocab.VOCAB_PICK:
        return f"vocab_pick({a[0]}, {a[1]}, {d}, {axes!r})"
    tokens = tuple(x for ref in step.operands[1:2] for dim in ref.dims for x in dim.axes)
    if fn is Vocab.CE_APPLY:
        tokens = tuple(x for dim in step.operands[0].dims for x in dim.axes)
        count = f"({a[0]}.size * jax.lax.axis_size({tokens!r}))" if tokens else f"{a[0]}.size"
        return f"jnp.sum({a[0]} - {a[1]}) / {count}"
    if fn is Vocab.CE_VJP:
        return f"vocab_ce_grad({a[0]}, {a[1]}, {a[2]}, {a[3]}, {d}, {axes!r}, {tokens!r})"
    raise InternalError(f"lowering does not know the row function {fn}",
                        fix="this is a shardc bug: please report the spec")


def _finishing(fn: Row, a: list[str], e: Callable[[int], str]) -> str | None:
    """The maps that finish a reduction from its statistics, and the closed-form gradients."""
    if fn is Row.SOFTMAX_APPLY:
        return f"jnp.exp({a[0]} - {e(1)}) / {e(2)}"
    if fn is Row.LSE_APPLY:
        return f"{a[0]} + jnp.log({a[1]})"
    if fn is Row.RMSNORM_APPLY:
        return f"{a[0]} * jax.lax.rsqrt({e(1)} + {RMS_EPS})"
    if fn is Row.LAYERNORM_APPLY:
        return f"({a[0]} - {e(1)}) * jax.lax.rsqrt({e(2)} + {LN_EPS})"
    return _gradient(fn, a, e)


def _gradient(fn: Row, a: list[str], e: Callable[[int], str]) -> str | None:
    """The closed-form gradients that read per-row statistics."""
    if fn is Row.SOFTMAX_VJP_APPLY:
        return f"{a[0]} * ({a[1]} - {e(2)})"
    if fn is Row.LOGSUMEXP_VJP:
        return f"jnp.exp({a[0]} - {e(1)}) * {e(2)}"
    if fn is Row.MAX_VJP:
        return f"jnp.where({a[0]} == {e(1)}, {e(2)}, jnp.zeros_like({a[0]}))"
    if fn is Row.RMSNORM_VJP:
        return f"jax.lax.rsqrt({e(2)} + {RMS_EPS}) * ({a[1]} - {a[0]} * {e(3)})"
    if fn is Row.LAYERNORM_VJP:
        return f"jax.lax.rsqrt({e(3)} + {LN_EPS}) * ({a[1]} - {e(4)} - {a[0]} * {e(5)})"
    return None


def _length(ref: TensorRef, code: str, index: str, axes: tuple[str, ...]) -> str:
    """The local length of ``index`` when sharded over ``axes``, from a value ``code`` of ``ref`` (its shape)."""
    have = ref.dims[ref.indices.index(index)].axes
    length = f"{code}.shape[{ref.indices.index(index)}]"
    if have == axes:
        return length
    scale = f" * jax.lax.axis_size({have!r})" if have else ""
    return f"{length}{scale} // jax.lax.axis_size({axes!r})" if axes else f"{length}{scale}"


def _spread(step: Step, row: str, var: Callable[[TensorRef], str], mean: bool) -> str:
    """dS repeated along I to the gradient's local shape (over I's global length for a mean).

    The input as declared is read for its shape only (:attr:`Step.shapes`: no data is kept)."""
    (x,) = step.shapes
    d = step.dim or 0
    over = step.dst.indices[d]
    axes = step.dst.dims[d].axes
    spread = f"jnp.repeat({row}, {_length(x, var(x), over, axes)}, axis={d})"
    return f"{spread} / ({_length(x, var(x), over, ())})" if mean else spread


def lookup_code(step: Step, var: Callable[[TensorRef], str]) -> str:
    """``embed`` (a masked lookup in the local vocabulary shard) and its scatter-add gradient."""
    tok, other = step.operands[:2]
    if step.fn is Vocab.EMBED:
        axes = other.dims[0].axes
        made = tok.indices + other.indices[1:]
        code = (f"vocab_lookup({var(other)}, {var(tok)}, {axes!r})" if axes
                else f"jnp.take({var(other)}, {var(tok)}, axis=0)")
        return _aligned(code, made, step.dst.indices)
    table = step.dst
    axes = table.dims[0].axes
    order = tok.indices + table.indices[1:]
    (declared,) = step.shapes  # the table as declared, read for its shape only
    rows = _length(declared, var(declared), table.indices[0], axes)
    return f"vocab_scatter({var(tok)}, {_aligned(var(other), other.indices, order)}, {rows}, {axes!r})"


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


def _onehot(ids: Array, n: int, xp: Any) -> Array:
    return (xp.expand_dims(xp.asarray(ids).astype(int), -1) == xp.arange(n)) * 1.0


def lookup_forward(fn: str, a: Array, b: Array, vocab_axis: int, xp: Any) -> Array:
    """``embed(Tok=a, W=b)``: rows of b at a (Tok's indices, then b's others); ``cross_entropy(Logits=a,
    Tok=b)``: the mean over tokens of logsumexp(a along ``vocab_axis``) - a at the target."""
    if fn == "embed":
        return xp.take(b, xp.asarray(a).astype(int), axis=0)
    logits = xp.moveaxis(a, vocab_axis, -1)
    lse = forward("logsumexp", logits, -1, xp)
    target = xp.sum(logits * _onehot(b, logits.shape[-1], xp), axis=-1)
    return xp.mean(lse - target)


def lookup_vjp(fn: str, a: Array, b: Array, d: Array, vocab_axis: int, xp: Any) -> Array:
    """The gradient of the table (embed) or of the logits (cross_entropy); token ids have none."""
    if fn == "embed":
        hot = _onehot(a, b.shape[0], xp)
        flat_hot = xp.reshape(hot, (-1, b.shape[0]))
        return xp.reshape(xp.einsum("tv,tr->vr", flat_hot, xp.reshape(d, (flat_hot.shape[0], -1))), b.shape)
    logits = xp.moveaxis(a, vocab_axis, -1)
    p = forward("softmax", logits, -1, xp)
    grad = (p - _onehot(b, logits.shape[-1], xp)) * d / (p.size // p.shape[-1])
    return xp.moveaxis(grad, -1, vocab_axis)


def id_inputs(spec: Any) -> dict[str, str]:
    """Token-id tensors (integers in [0, vocabulary), ID_DTYPE) and their vocabulary index, from the spec."""
    return id_vocabulary(spec)
