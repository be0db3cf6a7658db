"""The vocabulary ops: ``embed(Tok, W_emb)`` and ``cross_entropy(Logits, Tok)``, registered once.

:mod:`shardc.ops.vocab_plans` plans both, forward and backward, with the vocabulary
index sharded as Megatron-LM shards it.  A node reads two tensors, each computed
towards its own indices; the token ids are integers and get no gradient, so the
gradient reaches the table (``embed``) or the logits (``cross_entropy``).  A loss
keeps four per-token values on the way (the row max, the sum of exponentials, the
logsumexp and the target logit, of the ids' indices).  Its steps carry a
:class:`~shardc.ir.localops.Vocab` (and the reductions' row statistics), written
as one line of JAX: a lookup or a scatter-add for ``embed`` (:func:`lookup_code`),
a row map for the rest (:func:`shardc.ops.reductions.row_code`).  Its meaning on whole arrays:

- ``embed``: the table's rows at the ids (the ids' indices, then the table's others);
  the table's gradient scatter-adds the cotangent's rows at the ids.
- ``cross_entropy``: the mean over tokens of logsumexp(logits along the vocabulary)
  minus the target logit; the logits' gradient is (softmax - onehot) / tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from shardc.ir.localops import Vocab
from shardc.ir.plan import Step
from shardc.ir.spec import Call, Expr, TensorRef
from shardc.names import fresh
from shardc.ops.reductions import aligned_to, local_length, row_code
from shardc.ops.reductions_reference import forward
from shardc.ops.registry import Arrays, Builder, Family, Namer, Reference, Site, Sizer, all_traffic, register
from shardc.ops.vocab_plans import embed_backward, loss_backward, plan_embed, plan_loss
from shardc.spec.walk import chain_indices

if TYPE_CHECKING:
    from shardc.ops.registry import BackwardPass, Node
    from shardc.sharding.layout import Value
    from shardc.sharding.phase import Phase

__all__ = ["VOCABULARY", "emit", "lookup_forward", "lookup_vjp"]

Array = Any
_LOSS_VALUES = ("max", "sum", "lse", "target")  # what a loss keeps a token, as name suffixes


def _argument(call: Call, indices: tuple[str, ...]) -> tuple[str, ...]:
    """The first argument's own indices (each argument is computed towards its own)."""
    return chain_indices(call.arg, ())


def _aux(call: Call, result: str) -> tuple[str, ...]:
    return tuple(f"{result}_{suffix}" for suffix in _FUNCTIONS[call.func].kept)


def _operands(builder: Builder, call: Call, result: str, indices: tuple[str, ...]) -> tuple[tuple[str, ...],
                                                                                        tuple[str, ...]]:
    """Both arguments, each towards its own indices in a layout of its own, and a loss's per-token
    values, named uniquely, of the ids' indices."""
    args = tuple(builder.argument(arg, result, chain_indices(arg, ())) for arg in call.args)
    aux = tuple(fresh(base, builder.names) for base in _aux(call, result))
    builder.indices.update({a: builder.indices[args[1]] for a in aux})
    return args, aux


def _plan(phase: Phase, node: Node, declared: dict[str, TensorRef], target: Value | None, label: str) -> None:
    assert node.call is not None
    _FUNCTIONS[node.call.func].plan(phase, node, declared, target, label)


def _backward(bw: BackwardPass, node: Node, grad: str) -> None:
    assert node.call is not None
    _FUNCTIONS[node.call.func].backward(bw, node, grad)


def emit(step: Step, var: Namer, sizes: dict[str, int] | None = None) -> str:
    """A lookup or its scatter-add, else a row map of the loss (any sizes)."""
    if step.fn in (Vocab.EMBED, Vocab.EMBED_VJP):
        return lookup_code(step, var)
    return row_code(step, var)


def lookup_code(step: Step, var: Namer) -> str:
    """``embed`` (a masked lookup in the local vocabulary shard) and its scatter-add gradient."""
    tok, other = step.operands[:2]
    if step.fn is Vocab.EMBED:
        axes = other.dims[0].axes
        made = tok.indices + other.indices[1:]
        code = (f"vocab_lookup({var(other)}, {var(tok)}, {axes!r})" if axes
                else f"jnp.take({var(other)}, {var(tok)}, axis=0)")
        return aligned_to(code, made, step.dst.indices)
    table = step.dst
    axes = table.dims[0].axes
    order = tok.indices + table.indices[1:]
    (declared,) = step.shapes  # the table as declared, read for its shape only
    rows = local_length(declared, var(declared), table.indices[0], axes)
    return f"vocab_scatter({var(tok)}, {aligned_to(var(other), other.indices, order)}, {rows}, {axes!r})"


# --- whole arrays: the reference -------------------------------------------------------------

def _onehot(ids: Array, n: int, xp: Any) -> Array:
    return (xp.expand_dims(xp.asarray(ids).astype(int), -1) == xp.arange(n)) * 1.0


def _embed_value(a: Array, b: Array, vocab_axis: int, xp: Any) -> Array:
    """``embed(Tok=a, W=b)``: rows of b at a (Tok's indices, then b's others)."""
    return xp.take(b, xp.asarray(a).astype(int), axis=0)


def _loss_value(a: Array, b: Array, vocab_axis: int, xp: Any) -> Array:
    """``cross_entropy(Logits=a, Tok=b)``: the mean over tokens of logsumexp(a along ``vocab_axis``) - a at
    the target."""
    logits = xp.moveaxis(a, vocab_axis, -1)
    lse = forward("logsumexp", logits, -1, xp)
    target = xp.sum(logits * _onehot(b, logits.shape[-1], xp), axis=-1)
    return xp.mean(lse - target)


def _embed_vjp(a: Array, b: Array, d: Array, vocab_axis: int, xp: Any) -> Array:
    """The table's gradient: the cotangent's rows scatter-added at the ids."""
    hot = _onehot(a, b.shape[0], xp)
    flat_hot = xp.reshape(hot, (-1, b.shape[0]))
    return xp.reshape(xp.einsum("tv,tr->vr", flat_hot, xp.reshape(d, (flat_hot.shape[0], -1))), b.shape)


def _loss_vjp(a: Array, b: Array, d: Array, vocab_axis: int, xp: Any) -> Array:
    """The logits' gradient: (softmax - onehot) / tokens, times the cotangent."""
    logits = xp.moveaxis(a, vocab_axis, -1)
    p = forward("softmax", logits, -1, xp)
    grad = (p - _onehot(b, logits.shape[-1], xp)) * d / (p.size // p.shape[-1])
    return xp.moveaxis(grad, -1, vocab_axis)


def lookup_forward(fn: str, a: Array, b: Array, vocab_axis: int, xp: Any) -> Array:
    """``fn``'s value on whole arrays: ``embed(Tok=a, W=b)``, ``cross_entropy(Logits=a, Tok=b)``."""
    return _FUNCTIONS[fn].value(a, b, vocab_axis, xp)


def lookup_vjp(fn: str, a: Array, b: Array, d: Array, vocab_axis: int, xp: Any) -> Array:
    """The gradient of the table (embed) or of the logits (cross_entropy); token ids have none."""
    return _FUNCTIONS[fn].vjp(a, b, d, vocab_axis, xp)


def _vocab_axis(site: Site) -> int:
    """The vocabulary's position among the logits' indices: the one the ids lack."""
    logits, ids = site.labels
    return logits.index(next(i for i in logits if i not in ids))


def _loss_ids(site: Site, xs: Arrays, xp: Any) -> Array:
    """The targets, in the order of the logits' other indices."""
    ids = xs[1]
    logits, labels = site.labels
    vocab = logits[_vocab_axis(site)]
    order = tuple(i for i in logits if i != vocab)
    return xp.transpose(ids, tuple(labels.index(i) for i in order)) if order != labels else ids


def _embed_magnitude(site: Site, xs: Arrays, mags: Arrays) -> Array:
    """The table's magnitudes looked up."""
    return _embed_value(xs[0], mags[1], 0, np)


def _loss_magnitude(site: Site, xs: Arrays, mags: Arrays) -> Array:
    """Each token's row max of magnitudes, twice, plus its logsumexp, averaged."""
    axis = _vocab_axis(site)
    row = np.max(np.moveaxis(mags[0], axis, -1), axis=-1)
    lse = forward("logsumexp", np.moveaxis(xs[0], axis, -1), -1, np)
    return np.asarray(np.mean(2.0 * row + np.abs(lse)))


def _embed_grad_magnitude(site: Site, xs: Arrays, mags: Arrays, d: Array) -> Array:
    """The cotangent's magnitudes scatter-added as its rows are."""
    return _embed_vjp(xs[0], xs[1], np.abs(d), 0, np)


def _loss_grad_magnitude(site: Site, xs: Arrays, mags: Arrays, d: Array) -> Array:
    """The terms behind (softmax - onehot) / tokens, times the logits' largest magnitude."""
    axis, logits = _vocab_axis(site), xs[0]
    p = forward("softmax", np.moveaxis(logits, axis, -1), -1, np)
    hot = _loss_vjp(logits, _loss_ids(site, xs, np), np.ones_like(d), axis, np)  # (p - onehot) / tokens
    spread = np.abs(hot) + np.moveaxis(p, -1, axis) / (p.size // p.shape[-1])
    return np.abs(d) * spread * (1.0 + np.max(mags[0]))


@dataclass(frozen=True)
class _Function:
    """One function of the family, what the passes read of it by its name (see the module's docstring):
    the per-token values a node keeps (name suffixes), its forward's and backward's plans, which argument
    its gradient reaches (the table, embed's second; the logits, cross_entropy's first), the vocabulary's
    position and the ids as its value reads them, its value, gradient and their bounds on whole arrays,
    its result's indices given its arguments', and whether it is nonlinear in its first argument."""

    kept: tuple[str, ...]
    plan: Callable[[Phase, Node, dict[str, TensorRef], Value | None, str], None]
    backward: Callable[[BackwardPass, Node, str], None]
    grad_at: int
    axis: Callable[[Site], int]
    ids: Callable[[Site, Arrays, Any], Array]
    value: Callable[[Array, Array, int, Any], Array]
    vjp: Callable[[Array, Array, Array, int, Any], Array]
    magnitude: Callable[[Site, Arrays, Arrays], Array]
    grad_magnitude: Callable[[Site, Arrays, Arrays, Array], Array]
    indices: Callable[[tuple[str, ...], tuple[str, ...]], tuple[str, ...]]
    nonlinear: bool


_FUNCTIONS = {
    "embed": _Function((), plan_embed, embed_backward, 1, lambda site: 0, lambda site, xs, xp: xs[1],
                       _embed_value, _embed_vjp, _embed_magnitude, _embed_grad_magnitude,
                       lambda ids, table: ids + table[1:], nonlinear=False),
    "cross_entropy": _Function(_LOSS_VALUES, plan_loss, loss_backward, 0, _vocab_axis, _loss_ids,
                               _loss_value, _loss_vjp, _loss_magnitude, _loss_grad_magnitude,
                               lambda logits, ids: (), nonlinear=True),
}


def _to_operand(site: Site, g: Array) -> tuple[Array | None, ...]:
    """The gradient at the argument it reaches (the table or the logits): never at the ids."""
    return tuple(g if k == _FUNCTIONS[site.func.func].grad_at else None for k in range(2))


def _forward(site: Site, xs: Arrays, xp: Any) -> Array:
    f = _FUNCTIONS[site.func.func]
    return f.value(xs[0], f.ids(site, xs, xp), f.axis(site), xp)


def _vjp(site: Site, xs: Arrays, d: Array, xp: Any) -> tuple[Array | None, ...]:
    """The table's gradient (embed) or the logits' (cross_entropy)."""
    f = _FUNCTIONS[site.func.func]
    return _to_operand(site, f.vjp(xs[0], f.ids(site, xs, xp), d, f.axis(site), xp))


def _magnitude(site: Site, xs: Arrays, mags: Arrays, y: Array) -> Array:
    return _FUNCTIONS[site.func.func].magnitude(site, xs, mags)


def _grad_magnitude(site: Site, xs: Arrays, mags: Arrays, d: Array) -> tuple[Array | None, ...]:
    """A bound on the terms behind the table's or the logits' gradient for a cotangent of magnitude ``d``."""
    return _to_operand(site, _FUNCTIONS[site.func.func].grad_magnitude(site, xs, mags, d))


def _arguments(call: Call, keep: tuple[str, ...]) -> tuple[tuple[Expr, tuple[str, ...]], ...]:
    return tuple((arg, chain_indices(arg, ())) for arg in call.args)


def _indices(call: Call, operands: tuple[tuple[str, ...], ...]) -> tuple[str, ...]:
    """The ids' indices then the table's others (embed); none, a scalar (cross_entropy)."""
    first, second = operands
    return _FUNCTIONS[call.func].indices(first, second)


def _traffic(step: Step, nbytes: Sizer) -> tuple[tuple[float, ...], float]:
    """An embedding reads its ids and only the table rows they pick (its result's bytes); its gradient
    scatter-adds into a zeroed table of the table's shape; the loss's maps read and write whole."""
    if step.fn is Vocab.EMBED:
        ids, _ = step.operands
        return (nbytes(ids), nbytes(step.dst)), nbytes(step.dst)
    if step.fn is Vocab.EMBED_VJP:
        return tuple(nbytes(o) for o in step.operands), nbytes(step.shapes[0])
    return all_traffic(step, nbytes)


def _eager(step: Step, nbytes: Sizer) -> tuple[tuple[float, ...], float]:
    """A step as PyTorch eager runs it (``fusion none``): the loss's gradient, where the vocabulary is whole on
    the device (``F.cross_entropy``), is two kernels.  ``nll_loss_backward`` zeroes the log-probabilities'
    gradient, [rows, V], and writes each row's target element (LossNLL.cu: ``grad_input.zero_()``, then a
    kernel reading the ids and the cotangent); ``_log_softmax_backward_data`` reads that gradient and the
    log-probabilities the forward saved (the logits' shape and type, read here as the logits) and writes
    dLogits.  So the logits' bytes are read once and dLogits' written three times (the zeroed gradient written
    and read back, dLogits written; the target elements, one a row, left out); the logsumexp is not read, the
    log-probabilities hold it.  The forward's ``log_softmax`` and ``nll_loss`` (the logits read, the
    log-probabilities written, one a row picked) move the bytes its steps price already."""
    if step.fn is not Vocab.CE_VJP:
        return _traffic(step, nbytes)
    logits, _, ids, cotangent = step.operands
    whole = {d.name for d in ids.dims}
    if any(d.axes for d in logits.dims if d.name not in whole):  # a vocabulary-parallel loss: not PyTorch's
        return _traffic(step, nbytes)
    return (nbytes(logits), 0.0, nbytes(ids), nbytes(cotangent)), 3 * nbytes(step.dst)


VOCABULARY = register(Family(
    name="vocabulary", calls=frozenset(_FUNCTIONS), ops=(Vocab,), plan=_plan, backward=_backward,
    emit=emit, reference=Reference(_forward, _vjp, _magnitude, _grad_magnitude, _arguments, _indices,
                                   nonlinear=lambda func: _FUNCTIONS[func].nonlinear),
    argument=_argument, aux=_aux, operands=_operands, traffic=_traffic, eager=_eager))
