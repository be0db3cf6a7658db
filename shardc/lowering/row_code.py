"""Reductions over an index and the vocabulary ops, as lowering writes them.

:func:`row_code` writes one planned row step (:mod:`shardc.planner.rows`) as one
line of JAX: ``jax.nn.softmax`` / ``jax.nn.logsumexp`` where the reduced index I
is whole on the device, else the local statistic, the finishing map, or the
closed-form gradient.  Each step computes in its frame (its result's index order
if that has every index, else its first operand's) with I at ``step.dim``;
per-row operands are aligned to the frame without I and expanded back at I.
A mean divides by I's global length: the local length times the devices sharding
I (``jax.lax.axis_size``), so the module stays shape-generic.
The same functions on whole arrays, for the reference, are their families'
(:mod:`shardc.ops.reductions`, :mod:`shardc.ops.vocabulary`), with the same epsilons.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardc.errors import InternalError
from shardc.ir.localops import Row, Vocab
from shardc.ir.plan import Step
from shardc.ir.spec import TensorRef
from shardc.spec.walk import id_vocabulary

__all__ = ["row_code", "lookup_code", "RMS_EPS", "LN_EPS", "id_inputs"]

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


def id_inputs(spec: Any) -> dict[str, str]:
    """Token-id tensors (integers in [0, vocabulary), ID_DTYPE) and their vocabulary index, from the spec."""
    return id_vocabulary(spec)
