"""The reductions and norms family: ``softmax``, ``rmsnorm``, ``layernorm``, ``sort`` (the argument's indices)
and ``sum``, ``mean``, ``max``, ``logsumexp`` (the reduced index dropped), each ``over`` one index.

:mod:`shardc.ops.row_plans` plans the forward (the reduced index gathered, or per-row
statistics all-reduced) and :mod:`shardc.ops.rows_backward` the closed-form
backward; the node makes its row statistics on the way (:func:`stat_names`, one value
a row each, of the argument's indices less the reduced one).  Each step carries a
:class:`~shardc.ir.localops.Row` (a statistic's AllReduce names a
:class:`~shardc.ir.localops.Combine` where it is not a sum), written as one line
of JAX by :func:`row_code` (the vocabulary family's row steps too).  Its meaning on whole
arrays, and the bounds on the terms behind its value and its gradient, are :mod:`shardc.ops.reductions_reference`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shardc.errors import InternalError
from shardc.ir.localops import Combine, Row, Vocab
from shardc.ir.plan import Step
from shardc.ir.spec import Call, Expr, TensorRef
from shardc.names import fresh
from shardc.ops.reductions_reference import FUNCTIONS, LN_EPS, RMS_EPS, forward, grad_magnitude, magnitude, vjp, whole
from shardc.ops.registry import Arrays, Builder, Family, Namer, Reference, Site, register
from shardc.ops.row_plans import FORWARD, plan_rows, stat_names
from shardc.ops.rows_backward import rows_backward
from shardc.spec.functions import signature

if TYPE_CHECKING:
    from shardc.ops.registry import Node

__all__ = ["REDUCTIONS", "emit", "row_code", "aligned_to", "local_length", "RMS_EPS", "LN_EPS"]

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
    return row_code(step, var)


# --- one step as one line of JAX -------------------------------------------------------------
# :func:`row_code` writes one planned row step (:mod:`shardc.ops.row_plans`) as one line of JAX:
# ``jax.nn.softmax`` / ``jax.nn.logsumexp`` where the reduced index I is whole on the device, else
# the local statistic, the finishing map, or the closed-form gradient.  Each step computes in its
# frame (its result's index order if that has every index, else its first operand's) with I at
# ``step.dim``; per-row operands are aligned to the frame without I and expanded back at I.  A mean
# divides by I's global length: the local length times the devices sharding I
# (``jax.lax.axis_size``), so the module stays shape-generic.

def _frame(step: Step) -> tuple[str, ...]:
    widest = max(len(r.indices) for r in (*step.operands, step.dst))
    return step.dst.indices if len(step.dst.indices) == widest else step.operands[0].indices


def aligned_to(code: str, have: tuple[str, ...], want: tuple[str, ...]) -> str:
    if have == want or len(have) != len(want):  # a scalar (a loss's cotangent) broadcasts as it is
        return code
    return f"jnp.transpose({code}, {tuple(have.index(i) for i in want)})"


def row_code(step: Step, var: Namer) -> str:
    """One row step as one line of Python (its right-hand side)."""
    frame = _frame(step)
    d = step.dim
    over = frame[d] if d is not None else None
    rows = tuple(i for i in frame if i != over)
    args = []
    for ref in step.operands:
        full = over is not None and over in ref.indices
        args.append(aligned_to(var(ref), ref.indices, frame if full else rows))
    wide = next((r for r in (*step.operands, step.dst) if over is not None and over in r.indices), None)
    axes = wide.dims[wide.indices.index(over)].axes if wide is not None and over is not None else ()

    def e(k: int) -> str:  # a per-row operand, broadcast along I
        return f"jnp.expand_dims({args[k]}, {d})"

    n = f"({args[0]}.shape[{d}] * jax.lax.axis_size({axes!r}))" if axes else f"{args[0]}.shape[{d}]"
    code = _expression(step, args, e, n, d, var, axes)
    out = frame if len(step.dst.indices) == len(frame) else rows
    return aligned_to(code if out == step.dst.indices else f"({code})", out, step.dst.indices)


def _expression(step: Step, a: list[str], e: Callable[[int], str], n: str, d: int | None,
                var: Namer, axes: tuple[str, ...]) -> str:
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
        Row.SORT: f"jnp.sort({a[0]}, axis={d})",
        Row.SORT_VJP: f"jnp.take_along_axis({a[1] if len(a) > 1 else ''}, jnp.argsort(jnp.argsort({a[0]}, axis={d}), "
                      f"axis={d}), axis={d})",
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


def local_length(ref: TensorRef, code: str, index: str, axes: tuple[str, ...]) -> str:
    """The local length of ``index`` when sharded over ``axes``, from a value ``code`` of ``ref`` (its shape)."""
    have = ref.dims[ref.indices.index(index)].axes
    length = f"{code}.shape[{ref.indices.index(index)}]"
    if have == axes:
        return length
    scale = f" * jax.lax.axis_size({have!r})" if have else ""
    return f"{length}{scale} // jax.lax.axis_size({axes!r})" if axes else f"{length}{scale}"


def _spread(step: Step, row: str, var: Namer, mean: bool) -> str:
    """dS repeated along I to the gradient's local shape (over I's global length for a mean), typed as varying
    over I's axes (:func:`shardc.lowering.runtime.varying`).

    The input as declared is read for its shape only (:attr:`Step.shapes`: no data is kept)."""
    (x,) = step.shapes
    d = step.dim or 0
    over = step.dst.indices[d]
    axes = step.dst.dims[d].axes
    spread = f"jnp.repeat({row}, {local_length(x, var(x), over, axes)}, axis={d})"
    if axes:  # the same numbers on each device of the axes, but laid out sharded over them
        spread = f"varying({spread}, {axes!r})"
    return f"{spread} / ({local_length(x, var(x), over, ())})" if mean else spread


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


def _scores(node: Node) -> bool:
    """Whether the node normalises attention scores and so stays in their region (its function's entry)."""
    return node.call is not None and whole(node.call.func).scores


# Under ``fusion none`` (PyTorch eager) a layernorm is one ATen kernel each way: ``native_layer_norm``
# (aten/src/ATen/native/layer_norm.cpp, cuda/layer_norm_kernel.cu) reads X once and writes Y with each row's
# mean and rstd, which autograd saves (tools/autograd/derivatives.yaml: ``native_layer_norm_backward(grad,
# input, normalized_shape, result1, result2, weight, bias, ...)``); the backward kernel reads dY, X and those
# two and writes dX, making neither the statistics nor Y again.  Its steps here (the statistics, the apply;
# in the backward the statistics and Y made again, dY's row sums and the closed form) are that one kernel.
# An rmsnorm likewise, as ``F.rms_norm`` / ``nn.RMSNorm`` run it on CUDA since the fused kernel landed
# (``_fused_rms_norm``, pytorch/pytorch#153666; its backward ``_fused_rms_norm_backward(grad_out, input,
# normalized_shape, rstd, weight, output_mask)``, in PyTorch 2.9); a hand-written RMSNorm (pow, mean, rsqrt,
# mul: HF's LlamaRMSNorm) is several kernels, and more passes than priced here.  The others are not one
# kernel more than planned: softmax already plans as one step each way (``_softmax`` and
# ``_softmax_backward_data``) where its index is whole; cross entropy's backward is two kernels, which the
# vocabulary family prices (its ``eager`` traffic).
# The statistics both kernels of a norm pass between them (its apply step's operands but X) are float32 for a
# 16-bit X: ``at::toAccumulateType`` in layer_norm_kernel.cu's ``layer_norm_cuda``, apex's
# ``fused_layer_norm_cuda`` (mean and invvar float for half and bfloat16; ``FusedLayerNormAffineFunction`` and
# ``FusedRMSNormAffineFunction`` ``save_for_backward`` them beside the input), as under ``fusion statement``.
_STAT_BYTES = 4
_NATIVE = frozenset({Row.ROW_MEAN, Row.ROW_MEANDEV, Row.LAYERNORM_APPLY, Row.ROW_MEANDOT, Row.LAYERNORM_VJP,
                     Row.ROW_MEANSQ, Row.RMSNORM_APPLY, Row.RMSNORM_VJP})


def _native(step: Step) -> bool:
    return step.fn in _NATIVE


def _native_last(step: Step) -> bool:
    return step.fn in (Row.LAYERNORM_VJP, Row.RMSNORM_VJP)


def _saved(step: Step) -> tuple[tuple[TensorRef, int], ...]:
    """The statistics a norm's apply step reads (its operands but X): what the native kernel keeps."""
    if step.fn not in (Row.LAYERNORM_APPLY, Row.RMSNORM_APPLY):
        return ()
    return tuple((ref, _STAT_BYTES) for ref in step.operands[1:])


REDUCTIONS = register(Family(
    name="reductions", calls=frozenset(FUNCTIONS),
    ops=(Row, Combine), plan=plan_rows, backward=rows_backward, emit=emit,
    reference=Reference(_forward, _vjp, _magnitude, grad_magnitude=_grad_magnitude, arguments=_arguments,
                        indices=_indices, nonlinear=lambda func: FUNCTIONS[func].nonlinear),
    argument=_argument, aux=_aux, operands=_operands, scores=_scores, native=_native, native_last=_native_last,
    saved=_saved, held_cotangent=True, linear=lambda node: FORWARD[node.fn or ""].linear))
