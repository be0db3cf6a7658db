"""``shardc explain`` on the idioms transformer code is written in (flax, MaxText, nanoGPT style): the
cross entropy of a one-hot, a causal mask made with ``jnp.where``, a fused QKV projection split in three.

Each program builds its mesh over the 8 emulated CPU devices (conftest) and is compiled, not run.
"""

from __future__ import annotations

from typing import Any

import pytest

import shardc
from shardc.errors import ShardcError
from shardc.explanation.explain_report import explain
from tests.test_explain import _arg, _line_of, _mesh

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
        elif mask == "window":  # Mistral's sliding window of 4 keys, the query's own among them
            distance = jnp.arange(16)[:, None] - jnp.arange(16)[None, :]
            scores = jnp.where((distance >= 0) & (distance < 4), scores, -jnp.inf)
        elif mask == "strict":  # the query's own key masked too: not the language's causal
            scores = jnp.where(jnp.arange(16)[:, None] > jnp.arange(16)[None, :], scores, -jnp.inf)
        return jnp.einsum("bnst,btnh,nhd->bsd", jax.nn.softmax(scores, -1), v, wo)

    return layer


@pytest.mark.parametrize("mask", ["tril", "arange", "float tril", "window"])
def test_a_where_at_a_causal_mask_before_the_softmax_is_the_languages_causal(mask: str) -> None:
    """``jnp.where(mask, scores, -inf)`` with the mask made of positions (``jnp.tril``, an ``arange``
    comparison, a float ``tril`` compared with 0) is ``causal(Sc[B, N, S, T], S, T)`` before the softmax, a
    sliding window of 4 keys ``causal(Sc, S, T, window 4)``;
    a finite fill (-1e9) is said in a ``#`` line; XLA's one AllReduce pairs with the plan's."""
    import jax

    mesh = _mesh((2, 4))
    weight = _arg(mesh, (16, 8, 4), None, "model")
    e = explain(jax.jit(_attention(mask)), _arg(mesh, (4, 16, 16), "data"), weight, weight, weight,
                _arg(mesh, (8, 4, 16), "model"))
    masked = [s for s in _statements(e) if "causal(" in s]
    assert len(masked) == 1 and masked[0].endswith(", S, T, window 4)" if mask == "window" else ", S, T)"), e.spec
    assert any(s.startswith("N1[") and f"softmax({masked[0].split(' =')[0]} over T)" in s for s in _statements(e))
    assert ("fills -1e+09 where the language writes -inf" in e.spec) == (mask == "arange")
    shardc.plan(shardc.parse(e.spec))
    assert [(c.kind, c.axes) for c in e.xla] == [("AllReduce", "model")] and not e.not_needed and not e.differently


def test_a_mask_other_than_causal_is_refused_or_approximately_a_map_of_the_scores() -> None:
    """A strictly causal mask (the query's own key masked too, which the language's causal keeps) is not
    read as causal: no map of the language (its values are not the scores'), refused at its line; approximately,
    a map of the scores, its sharding all the spec needs of it, and a note saying so."""
    import jax

    mesh = _mesh((2, 4))
    weight = _arg(mesh, (16, 8, 4), None, "model")
    args = (_arg(mesh, (4, 16, 16), "data"), weight, weight, weight, _arg(mesh, (8, 4, 16), "model"))
    line = _line_of(_attention, "jnp.arange(16)[:, None] > jnp.arange(16)")
    with pytest.raises(ShardcError, match=f"a run of maps reading a constant array .* at {line} "):
        explain(jax.jit(_attention("strict")), *args)
    e = explain(jax.jit(_attention("strict")), *args, approximate=True)
    assert "causal(" not in e.spec and any("identity(" in s for s in _statements(e)), e.spec
    assert "# approximate: a run of maps reading a constant array" in e.spec, e.spec


def _fused_qkv(x: Any, w_qkv: Any, wo: Any) -> Any:
    """nanoGPT's attention: one projection to q, k and v side by side, split, each reshaped into heads."""
    import jax
    import jax.numpy as jnp

    q, k, v = (a.reshape(4, 16, 4, 8) for a in jnp.split(x @ w_qkv, 3, axis=-1))
    scores = jax.nn.softmax(jnp.einsum("bshd,bthd->bhst", q, k), -1)
    return jnp.einsum("bhst,bthd->bshd", scores, v).reshape(4, 16, 32) @ wo


def test_a_fused_qkv_split_in_three_is_one_contraction_a_part() -> None:
    """``q, k, v = jnp.split(x @ w_qkv, 3, -1)`` with w_qkv sharded along D (FSDP) is three contractions
    with the weight's parts, each reshaped into heads; XLA's one AllGather of the whole weight pairs with
    the plan's of its three parts."""
    import jax

    mesh = _mesh((2, 4))
    e = explain(jax.jit(_fused_qkv), _arg(mesh, (4, 16, 32), "data"), _arg(mesh, (32, 96), "model"),
                _arg(mesh, (32, 32)))
    projections = [s for s in _statements(e) if "w_qkv_" in s]
    assert [s.split("· ")[1].split("[")[0] for s in projections] == ["w_qkv_q", "w_qkv_k", "w_qkv_v"], e.spec
    assert all(s.startswith(("Y1[B_{data}, S, ", "Y2[", "Y3[")) and "_{model}, " in s.split("· ")[1]
               for s in projections), e.spec
    assert "w_qkv_q, w_qkv_k, w_qkv_v are w_qkv's parts along its dim of 96" in e.spec
    shardc.plan(shardc.parse(e.spec))
    assert [(c.kind, c.axes) for c in e.xla] == [("AllGather", "model")], e.xla
    assert [c.tensor for c in e.plan] == ["w_qkv_q", "w_qkv_k", "w_qkv_v"]
    assert not e.not_needed and not e.differently


def test_a_fused_qkv_split_along_its_sharded_dim_names_the_weight_and_the_fix() -> None:
    """The same weight sharded along its 3F dim (blocks of 24 columns straddling parts of 32): XLA moves
    them between devices, which no spec writes; the error names the weight, the axis and the layout to use."""
    import jax

    mesh = _mesh((2, 4))
    with pytest.raises(shardc.ShardcError, match=r"w_qkv is split in 3 along a dim sharded over model[^\n]*\n"
                                                 r"fix: shard the fused weight along another dim"):
        explain(jax.jit(_fused_qkv), _arg(mesh, (4, 16, 32), "data"), _arg(mesh, (32, 96), None, "model"),
                _arg(mesh, (32, 32), "model"))


def test_maxtexts_fused_kernel_with_its_heads_sharded_is_read_as_three_projections() -> None:
    """MaxText's fused kernel ``[D, 3, N, H]``, N over `model`: the split along the dim of 3 is one
    contraction a part, each part's heads over `model`; the output projection's AllReduce pairs."""
    import jax
    import jax.numpy as jnp

    def layer(x: Any, w_qkv: Any, wo: Any) -> Any:
        q, k, v = (a[:, :, 0] for a in jnp.split(jnp.einsum("bsd,dknh->bsknh", x, w_qkv), 3, axis=2))
        scores = jax.nn.softmax(jnp.einsum("bsnh,btnh->bnst", q, k), -1)
        return jnp.einsum("bnst,btnh,nhd->bsd", scores, v, wo)

    mesh = _mesh((2, 4))
    e = explain(jax.jit(layer), _arg(mesh, (4, 16, 32), "data"), _arg(mesh, (32, 3, 4, 8), None, None, "model"),
                _arg(mesh, (4, 8, 32), "model"))
    assert "Y1[B_{data}, S, N_{model}, H] = x[B_{data}, S, D] · w_qkv_q[D, N_{model}, H]" in _statements(e), e.spec
    shardc.plan(shardc.parse(e.spec))
    assert [(c.kind, c.axes) for c in e.xla] == [("AllReduce", "model")] and not e.not_needed and not e.differently


def test_a_training_step_in_the_three_idioms_reads_each_and_the_parts_as_parameters() -> None:
    """A causal attention layer of a fused QKV (FSDP) and a one-hot cross entropy, in a training step: the
    parts are the spec's parameters, and XLA's one gradient AllReduce of the whole fused weight pairs with
    the plan's three of its parts."""
    import jax
    import jax.numpy as jnp

    def loss(p: Any, x: Any, labels: Any) -> Any:
        q, k, v = (a.reshape(4, 16, 4, 8) for a in jnp.split(x @ p["w_qkv"], 3, axis=-1))
        scores = jnp.where(jnp.tril(jnp.ones((16, 16), bool)), jnp.einsum("bshd,bthd->bhst", q, k), -jnp.inf)
        logits = jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(scores, -1), v).reshape(4, 16, 32) @ p["wo"]
        return -jnp.mean(jnp.sum(jax.nn.one_hot(labels, 32) * jax.nn.log_softmax(logits), -1))

    def step(p: Any, x: Any, labels: Any) -> Any:
        value, grad = jax.value_and_grad(loss)(p, x, labels)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, grad), value

    mesh = _mesh((2, 4))
    labels = jax.ShapeDtypeStruct((4, 16), jnp.int32, sharding=_arg(mesh, (4, 16), "data").sharding)
    e = explain(jax.jit(step), {"w_qkv": _arg(mesh, (32, 96), "model"), "wo": _arg(mesh, (32, 32), None, "model")},
                _arg(mesh, (4, 16, 32), "data"), labels)
    assert "param p_wo, p_w_qkv_q, p_w_qkv_k, p_w_qkv_v" in e.spec.splitlines(), e.spec
    assert any("= causal(" in s for s in _statements(e)) and "= cross_entropy(" in _statements(e)[-1], e.spec
    shardc.plan(shardc.parse(e.spec))
    gradients = [c for c in e.plan if c.phase == "backward" and c.tensor.startswith("dp_w_qkv_")]
    assert len(gradients) == 3 and not set(gradients) & set(e.differently)
    assert not [c for c in e.not_needed if c.phase == "backward" and c.axes == "data"]


def test_a_one_hot_times_a_table_is_the_languages_embed() -> None:
    """``jax.nn.one_hot(ids, V) @ table`` with V over `model` is ``embed(ids, table)``, the vocabulary-parallel
    lookup: XLA's AllReduce of the partial rows pairs with the plan's."""
    import jax

    mesh = _mesh((2, 4))
    e = explain(jax.jit(lambda ids, table: jax.nn.one_hot(ids, 32) @ table), _labels(mesh),
                _arg(mesh, (32, 8), "model"))
    assert _statements(e) == ["E1[B_{data}, S] = embed(ids[B_{data}], table[V_{model}, S])"], e.spec
    shardc.plan(shardc.parse(e.spec))
    assert [(c.kind, c.axes) for c in e.xla] == [("AllReduce", "model")] and not e.not_needed and not e.differently


def _noise(x: Any) -> Any:
    import jax

    return x + jax.random.normal(jax.random.key(0), x.shape)


def _cond(x: Any) -> Any:
    import jax

    return jax.lax.cond(x.sum() > 0, lambda a: a * 2, lambda a: a, x)


def _pad(x: Any) -> Any:
    import jax.numpy as jnp

    return jnp.pad(x, ((0, 0), (1, 1)))


@pytest.mark.parametrize(("program", "op", "fix"), [
    (_noise, "random_", r"a random draw other than a dropout's keep-mask"),
    (_cond, "cond", "explain each branch as a program of its own"),
    (_pad, "pad", "pad the input before the program")])
def test_an_op_the_language_has_no_form_for_names_itself_and_what_to_write(program: Any, op: str, fix: str) -> None:
    """Random noise, a cond and a pad: each refusal names the op and its line, and its fix says what the
    spec can say instead (a dropout's keep-mask is read) or how to explain the rest."""
    import jax

    with pytest.raises(shardc.ShardcError, match=rf"(?s)the program has `{op}\w*` at {__file__}:\d+.*fix: .*{fix}"):
        explain(jax.jit(program), _arg(_mesh((2, 4)), (16, 8), "data"))


def test_a_fused_product_read_whole_beside_its_parts_is_an_error() -> None:
    """``qkv`` returned beside ``q * k + v``: the spec writes no whole product once it reads the parts, so
    explain refuses rather than leave the result out."""
    import jax
    import jax.numpy as jnp

    def program(x: Any, w: Any) -> Any:
        qkv = x @ w
        q, k, v = jnp.split(qkv, 3, -1)
        return q * k + v, qkv

    mesh = _mesh((2, 4))
    with pytest.raises(shardc.ShardcError, match=r"product \(of w\) is read whole beside its parts"):
        explain(jax.jit(program), _arg(mesh, (16, 8), "data"), _arg(mesh, (8, 96), "model"))


def test_megatrons_interleaved_qkv_split_after_its_heads_reshape_keeps_the_heads_sharded() -> None:
    """Megatron's fused weight ``[D, N * 3 * H]`` over `model` (a device's block is its heads' q, k and v),
    reshaped to ``[..., N, 3, H]`` and split along the 3: the parts are ``[D, N_{model}, H]``, no data
    moves, and XLA's one AllReduce (the output projection's) pairs with the plan's."""
    import jax
    import jax.numpy as jnp

    def layer(x: Any, w_qkv: Any, wo: Any) -> Any:
        q, k, v = (a[:, :, :, 0] for a in jnp.split((x @ w_qkv).reshape(4, 16, 4, 3, 8), 3, axis=3))
        scores = jax.nn.softmax(jnp.einsum("bsnh,btnh->bnst", q, k), -1)
        return jnp.einsum("bnst,btnh->bsnh", scores, v).reshape(4, 16, 32) @ wo

    mesh = _mesh((2, 4))
    e = explain(jax.jit(layer), _arg(mesh, (4, 16, 32), "data"), _arg(mesh, (32, 96), None, "model"),
                _arg(mesh, (32, 32), "model"))
    assert "Y1[B_{data}, S, N_{model}, H] = x[B_{data}, S, D] · w_qkv_q[D, N_{model}, H]" in _statements(e), e.spec
    shardc.plan(shardc.parse(e.spec))
    assert [(c.kind, c.axes) for c in e.xla] == [("AllReduce", "model")] and not e.not_needed and not e.differently


@pytest.mark.parametrize("key", ["made in the program", "an argument"])
def test_a_dropout_written_with_a_bernoulli_keep_mask_is_the_languages_dropout(key: str) -> None:
    """``jnp.where(jax.random.bernoulli(key, 0.8, h.shape), h / 0.8, 0)`` (flax's Dropout), the key made in
    the program or passed in, is ``dropout(H, 0.2)``; the product after it all-reduces as the plan's does.
    Kept values not scaled by 1 / p are no dropout of the language's, nor is the keep-mask multiplied in:
    an error names the op (the mask once read as an input of the spec with no name: a traceback)."""
    import jax
    import jax.numpy as jnp

    def layer(x: Any, w: Any, rng: Any = None, scale: float = 0.8) -> Any:
        h = jax.nn.relu(x @ w)
        keep = jax.random.bernoulli(jax.random.key(0) if rng is None else rng, 0.8, h.shape)
        return jnp.where(keep, h / scale, 0) @ w.T

    mesh = _mesh((2, 4))
    args = (_arg(mesh, (16, 8), "data"), _arg(mesh, (8, 32), None, "model"))
    given = (jax.random.key(1),) if key == "an argument" else ()
    e = explain(jax.jit(layer), *args, *given)
    assert "Dr1[B_{data}, T_{model}] = dropout(H1[B_{data}, T_{model}], 0.2)" in _statements(e), e.spec
    shardc.plan(shardc.parse(e.spec))
    assert [(c.kind, c.axes) for c in e.xla] == [("AllReduce", "model")] and not e.not_needed and not e.differently
    if not given:
        with pytest.raises(shardc.ShardcError, match="a random mask other than a dropout's"):
            explain(jax.jit(lambda x, w: layer(x, w, scale=1.0)), *args)
        with pytest.raises(shardc.ShardcError, match=r"`mul` .* a random keep-mask is read other than by a dropout"):
            explain(jax.jit(lambda x, w: x @ w * jax.random.bernoulli(jax.random.key(0), 0.8, (16, 32)) / 0.8), *args)
