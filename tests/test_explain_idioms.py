"""``shardc explain`` on the idioms transformer code is written in (flax, MaxText, nanoGPT style): the
cross entropy of a one-hot, a causal mask made with ``jnp.where``, a fused QKV projection split in three.

Each program builds its mesh over the 8 emulated CPU devices (conftest) and is compiled, not run.
"""

from __future__ import annotations

from typing import Any

import pytest

import shardc
from shardc.explanation.explain_report import explain
from tests.test_explain import _arg, _mesh

pytestmark = pytest.mark.slow


def _statements(e: Any) -> list[str]:
    return [f"{s.result} = {s.expr}" for s in shardc.parse(e.spec).statements]


def _labels(mesh: Any) -> Any:
    import jax
    import jax.numpy as jnp

    return jax.ShapeDtypeStruct((16,), jnp.int32, sharding=_arg(mesh, (16,), "data").sharding)


@pytest.mark.parametrize("form", ["mean of sums", "optax", "sum over tokens"])
def test_a_one_hot_times_the_log_softmax_is_the_languages_cross_entropy(form: str) -> None:
    """``-mean(sum(one_hot(labels, V) * log_softmax(logits), -1))`` in the orders users write it (optax's
    ``softmax_cross_entropy(logits, one_hot).mean()``, a sum over all tokens divided by their count) is
    ``cross_entropy(Logits, labels)``; the vocabulary over `model` stays sharded, and each of XLA's
    collectives pairs with one of the plan's."""
    import jax
    import jax.numpy as jnp

    def loss(x: Any, w: Any, labels: Any) -> Any:
        one_hot, log_p = jax.nn.one_hot(labels, 32), jax.nn.log_softmax(x @ w)
        if form == "mean of sums":
            return -jnp.mean(jnp.sum(one_hot * log_p, -1))
        if form == "optax":
            return (-jnp.sum(log_p * one_hot, axis=-1)).mean()
        return -jnp.sum(one_hot * log_p) / 16

    mesh = _mesh((2, 4))
    e = explain(jax.jit(loss), _arg(mesh, (16, 8), "data"), _arg(mesh, (8, 32), None, "model"), _labels(mesh))
    assert _statements(e)[-1] == "L1[] = cross_entropy(Y1[B_{data}, T_{model}], labels[B_{data}])", e.spec
    shardc.plan(shardc.parse(e.spec))
    assert not any(c.kind.startswith("AllGather") for c in e.plan)
    if form != "sum over tokens":  # there XLA sums the label's logit to a scalar before its AllReduce
        assert not e.not_needed and not e.differently
    assert len(e.xla) == len(e.plan) == 4


def test_a_one_hot_not_over_the_log_softmaxs_axis_stays_an_error() -> None:
    """A one-hot along the batch (``one_hot(labels, 16, axis=0)``) times a log-softmax is no cross entropy:
    the error names the one-hot's ``eq`` and the fix."""
    import jax
    import jax.numpy as jnp

    def loss(x: Any, labels: Any) -> Any:
        return -jnp.mean(jnp.sum(jax.nn.one_hot(labels, 16, axis=0) * jax.nn.log_softmax(x, axis=0), 0))

    mesh = _mesh((2, 4))
    with pytest.raises(shardc.ShardcError, match="`eq`"):
        explain(jax.jit(loss), _arg(mesh, (16, 16), "data"), _labels(mesh))


def _attention(mask: str) -> Any:
    """Heads projected out of x, scores masked by ``mask``, the softmax's output projected back (an
    AllReduce over `model`, where the heads are)."""
    import jax
    import jax.numpy as jnp

    def layer(x: Any, wq: Any, wk: Any, wv: Any, wo: Any) -> Any:
        q, k, v = (jnp.einsum("bsd,dnh->bsnh", x, w) for w in (wq, wk, wv))
        scores = jnp.einsum("bsnh,btnh->bnst", q, k) / 2.0
        if mask == "tril":
            scores = jnp.where(jnp.tril(jnp.ones((16, 16), bool)), scores, -jnp.inf)
        elif mask == "arange":
            scores = jnp.where(jnp.arange(16)[:, None] >= jnp.arange(16)[None, :], scores, -1e9)
        elif mask == "float tril":
            scores = jnp.where(jnp.tril(jnp.ones((16, 16))) == 0, -jnp.inf, scores)
        elif mask == "banded":  # a window of 4: no causal mask of the language's without `window`
            keep = jnp.arange(16)[:, None] - jnp.arange(16)[None, :]
            scores = jnp.where((keep >= 0) & (keep < 4), scores, -jnp.inf)
        return jnp.einsum("bnst,btnh,nhd->bsd", jax.nn.softmax(scores, -1), v, wo)

    return layer


@pytest.mark.parametrize("mask", ["tril", "arange", "float tril"])
def test_a_where_at_a_causal_mask_before_the_softmax_is_the_languages_causal(mask: str) -> None:
    """``jnp.where(mask, scores, -inf)`` with the mask made of positions (``jnp.tril``, an ``arange``
    comparison, a float ``tril`` compared with 0) is ``causal(Sc[B, N, S, T], S, T)`` before the softmax;
    a finite fill (-1e9) is said in a ``#`` line; XLA's one AllReduce pairs with the plan's."""
    import jax

    mesh = _mesh((2, 4))
    weight = _arg(mesh, (16, 8, 4), None, "model")
    e = explain(jax.jit(_attention(mask)), _arg(mesh, (4, 16, 16), "data"), weight, weight, weight,
                _arg(mesh, (8, 4, 16), "model"))
    masked = [s for s in _statements(e) if "causal(" in s]
    assert len(masked) == 1 and masked[0].endswith(", S, T)"), e.spec
    assert any(s.startswith("N1[") and f"softmax({masked[0].split(' =')[0]} over T)" in s for s in _statements(e))
    assert ("fills -1e+09 where the language writes -inf" in e.spec) == (mask == "arange")
    shardc.plan(shardc.parse(e.spec))
    assert [(c.kind, c.axes) for c in e.xla] == [("AllReduce", "model")] and not e.not_needed and not e.differently


def test_a_mask_other_than_causal_stays_a_map_of_the_scores() -> None:
    """A banded mask (a window the ``where`` writes, not ``causal``'s) is not read as causal: it stays a map
    of the scores, its sharding all the spec needs of it."""
    import jax

    mesh = _mesh((2, 4))
    weight = _arg(mesh, (16, 8, 4), None, "model")
    e = explain(jax.jit(_attention("banded")), _arg(mesh, (4, 16, 16), "data"), weight, weight, weight,
                _arg(mesh, (8, 4, 16), "model"))
    assert "causal(" not in e.spec and any("identity(" in s for s in _statements(e)), e.spec
