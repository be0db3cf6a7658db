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

from typing import TYPE_CHECKING, Any

import numpy as np

from shardc.ir.localops import Vocab
from shardc.ir.plan import Step
from shardc.ir.spec import Call, Expr, TensorRef
from shardc.names import fresh
from shardc.ops.reductions import aligned_to, forward, local_length, row_code
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
    return tuple(f"{result}_{suffix}" for suffix in _LOSS_VALUES) if call.func == "cross_entropy" else ()


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
    (plan_embed if node.call.func == "embed" else plan_loss)(phase, node, declared, target, label)


def _backward(bw: BackwardPass, node: Node, grad: str) -> None:
    assert node.call is not None
    (embed_backward if node.call.func == "embed" else loss_backward)(bw, node, grad)


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


def _embeds(site: Site) -> bool:
    return site.func.func == "embed"


def _axis(site: Site) -> int:
    """The vocabulary's position: the table's first index (embed), the logits' index the ids lack."""
    if _embeds(site):
        return 0
    logits, ids = site.labels
    return logits.index(next(i for i in logits if i not in ids))


def _ids(site: Site, xs: Arrays, xp: Any) -> Array:
    """The ids: as they are (embed), in the order of the logits' other indices (cross_entropy)."""
    ids = xs[1]
    if _embeds(site):
        return ids
    logits, labels = site.labels
    vocab = logits[_axis(site)]
    order = tuple(i for i in logits if i != vocab)
    return xp.transpose(ids, tuple(labels.index(i) for i in order)) if order != labels else ids


def _forward(site: Site, xs: Arrays, xp: Any) -> Array:
    return lookup_forward(site.func.func, xs[0], _ids(site, xs, xp), _axis(site), xp)


def _to_operand(site: Site, g: Array) -> tuple[Array | None, ...]:
    """The gradient at the table (embed's second argument) or the logits (cross_entropy's first):
    never at the ids."""
    return (None, g) if _embeds(site) else (g, None)


def _vjp(site: Site, xs: Arrays, d: Array, xp: Any) -> tuple[Array | None, ...]:
    """The table's gradient (embed) or the logits' (cross_entropy)."""
    return _to_operand(site, lookup_vjp(site.func.func, xs[0], _ids(site, xs, xp), d, _axis(site), xp))


def _magnitude(site: Site, xs: Arrays, mags: Arrays, y: Array) -> Array:
    """Embed: the table's magnitudes looked up; the loss: each token's row max of magnitudes, twice,
    plus its logsumexp, averaged."""
    if _embeds(site):
        return lookup_forward("embed", xs[0], mags[1], 0, np)
    axis = _axis(site)
    row = np.max(np.moveaxis(mags[0], axis, -1), axis=-1)
    lse = forward("logsumexp", np.moveaxis(xs[0], axis, -1), -1, np)
    return np.asarray(np.mean(2.0 * row + np.abs(lse)))


def _grad_magnitude(site: Site, xs: Arrays, mags: Arrays, d: Array) -> tuple[Array | None, ...]:
    """A bound on the terms behind the table's or the logits' gradient for a cotangent of magnitude ``d``."""
    if _embeds(site):
        return _to_operand(site, lookup_vjp("embed", xs[0], xs[1], np.abs(d), 0, np))
    axis, logits = _axis(site), xs[0]
    p = forward("softmax", np.moveaxis(logits, axis, -1), -1, np)
    hot = lookup_vjp("cross_entropy", logits, _ids(site, xs, np), np.ones_like(d), axis, np)  # (p - onehot) / tokens
    spread = np.abs(hot) + np.moveaxis(p, -1, axis) / (p.size // p.shape[-1])
    return _to_operand(site, np.abs(d) * spread * (1.0 + np.max(mags[0])))


def _arguments(call: Call, keep: tuple[str, ...]) -> tuple[tuple[Expr, tuple[str, ...]], ...]:
    return tuple((arg, chain_indices(arg, ())) for arg in call.args)


def _indices(call: Call, operands: tuple[tuple[str, ...], ...]) -> tuple[str, ...]:
    """The ids' indices then the table's others (embed); none, a scalar (cross_entropy)."""
    first, second = operands
    return first + second[1:] if call.func == "embed" else ()


def _traffic(step: Step, nbytes: Sizer) -> tuple[tuple[float, ...], float]:
    """An embedding reads its ids and only the table rows they pick (its result's bytes); its gradient
    scatter-adds into a zeroed table of the table's shape; the loss's maps read and write whole."""
    if step.fn is Vocab.EMBED:
        ids, _ = step.operands
        return (nbytes(ids), nbytes(step.dst)), nbytes(step.dst)
    if step.fn is Vocab.EMBED_VJP:
        return tuple(nbytes(o) for o in step.operands), nbytes(step.shapes[0])
    return all_traffic(step, nbytes)


VOCABULARY = register(Family(
    name="vocabulary", calls=frozenset({"embed", "cross_entropy"}), ops=(Vocab,), plan=_plan, backward=_backward,
    emit=emit, reference=Reference(_forward, _vjp, _magnitude, _grad_magnitude, _arguments, _indices,
                                   nonlinear=lambda func: func == "cross_entropy"),
    argument=_argument, aux=_aux, operands=_operands, traffic=_traffic))
