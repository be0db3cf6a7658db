"""``shardc explain`` on the ops a program writes beside its contractions: a square weight read along
one dim twice, a rotary embedding's halves put back together, sorts, gathers and concatenations the
language has no form for.

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


def test_a_square_weight_added_to_its_input_reads_the_product_through_a_rename() -> None:
    """``x + relu(x @ w)``, w[D, D]: w's two dims are two dims of the spec of one size (w[S, T]), and the
    product, of T, is read as x's S through the language's rename before the sum."""
    import jax

    mesh = _mesh((4, 2))
    fn = jax.jit(lambda x, w: x + jax.nn.relu(x @ w))
    e = explain(fn, _arg(mesh, (16, 8), "data"), _arg(mesh, (8, 8), None, "model"))
    spec = shardc.parse(e.spec)
    assert _statements(e) == [
        "Y1[B_{data}, T_{model}] = x[B_{data}, S] · w[S, T_{model}]",
        "H1[B_{data}, T_{model}] = relu(Y1[B_{data}, T_{model}])",
        "C1[B_{data}, S_{model}] = H1[B_{data}, T_{model}]",
        "R1[B_{data}, S_{model}] = x[B_{data}, S] + C1[B_{data}, S_{model}]"], e.spec
    assert spec.sizes["S"] == spec.sizes["T"] == 8
    assert not e.plan and not e.xla
    from shardc.verification.verify import verify

    report = verify(spec)  # the rename holds at verify's sizes too: S and T stay one size
    assert report.ok, [r for r in (*report.values, *report.collectives) if not r.ok]


def _rotate_half(x: Any) -> Any:
    import jax.numpy as jnp

    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)  # rotate-half's line


def test_a_rotary_embeddings_rotate_half_is_a_map_of_its_array() -> None:
    """Rotary embedding on heads reshaped out of the projections, cos and sin given as tables: the halves
    of the head dim put back together move elements along it, no map of the language: refused at the rotation's
    line; approximately a map of q (whole heads on a device, its sharding), times sin, plus q * cos, and a note."""
    import jax
    import jax.numpy as jnp

    mesh = _mesh((4, 2))

    def scores(x: Any, wq: Any, wk: Any, cos: Any, sin: Any) -> Any:
        b, s, _ = x.shape
        q, k = ((x @ w).reshape(b, s, 4, -1) for w in (wq, wk))
        q, k = (y * cos[:, None, :] + _rotate_half(y) * sin[:, None, :] for y in (q, k))
        return jnp.einsum("bsnh,btnh->bnst", q, k)

    args = (_arg(mesh, (4, 8, 16), "data"), *[_arg(mesh, (16, 16), None, "model")] * 2, _arg(mesh, (8, 4)),
            _arg(mesh, (8, 4)))
    with pytest.raises(ShardcError, match=f"^{_line_of(_rotate_half, 'rotate-half')}:.*rotary's rotate_half"):
        explain(jax.jit(scores), *args)
    e = explain(jax.jit(scores), *args, approximate=True)
    assert "# approximate: parts of a dim put back together in another order" in e.spec, e.spec
    texts = _statements(e)
    rotated = [t for t in texts if "= identity(" in t]
    assert rotated == ["H1[B_{data}, S, N_{model}, H] = identity(Y1[B_{data}, S, N_{model}, H])",
                       "H2[B_{data}, S, N_{model}, H] = identity(Y2[B_{data}, S, N_{model}, H])"], e.spec
    assert "Y4[B_{data}, S, N_{model}, H] = H1[B_{data}, S, N_{model}, H] * sin[S, H]" in texts, e.spec
    assert f"# {_line_of(_rotate_half, 'rotate-half')}" in e.spec  # the rotation's line
    assert not e.xla and not e.plan  # heads over model, head dim whole: no collective either way


def test_a_rotary_embedding_computed_in_the_program_is_the_languages_rotary() -> None:
    """cos and sin made in the program from positions (``jnp.arange``: constants, no tensor of the spec): the whole
    rotary embedding, ``x * cos + rotate_half(x) * sin``, is the language's ``rotary`` of q and of k by their
    positions (tests/test_explain_rotary.py checks its values), heads over model and the head dim whole: no
    collective either way."""
    import jax
    import jax.numpy as jnp

    mesh = _mesh((4, 2))

    def rope(x: Any) -> Any:
        s, h = x.shape[1], x.shape[-1]
        freqs = 1.0 / (10000 ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
        angles = jnp.outer(jnp.arange(s, dtype=jnp.float32), freqs)
        angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]
        return x * jnp.cos(angles) + _rotate_half(x) * jnp.sin(angles)  # the rotary embedding

    def scores(x: Any, wq: Any, wk: Any) -> Any:
        b, s, _ = x.shape
        q, k = (rope((x @ w).reshape(b, s, 4, -1)) for w in (wq, wk))
        return jnp.einsum("bsnh,btnh->bnst", q, k)

    args = (_arg(mesh, (4, 8, 16), "data"), *[_arg(mesh, (16, 16), None, "model")] * 2)
    e = explain(jax.jit(scores), *args)
    texts = _statements(e)
    assert texts[2:4] == ["H1[B_{data}, S, N_{model}, H] = rotary(Y1[B_{data}, S, N_{model}, H], S)",
                          "H2[B_{data}, S, N_{model}, H] = rotary(Y2[B_{data}, S, N_{model}, H], S)"], e.spec
    assert len(texts) == 6 and f"# {_line_of(rope, 'the rotary embedding')}" in e.spec, e.spec
    assert not e.xla and not e.plan


@pytest.mark.parametrize(("program", "op", "message"), [
    (lambda x: _rotate_half(x) * 2.0, "concatenate", "sharded over model moves its elements"),
    (lambda x: x[:, ::2] * 2.0, "slice", "a strided slice picks every k-th element"),
    (lambda x: (x[:, :4] @ x[:, 4:].T), "dot_general", r"a part of a dim \(a slice, a split\)"),
    (lambda x: _concat(x) @ x.T, "concatenate", "a concatenation grows a dim"),
    (lambda x: x[:, ::-1] * 2.0, "rev", "a reversal of a dim sharded over model"),
])
def test_slices_and_concatenations_the_language_cannot_write_name_the_op_and_line(program: Any, op: str,
                                                                                  message: str) -> None:
    import jax

    mesh = _mesh((4, 2))
    with pytest.raises(shardc.ShardcError, match=rf"`{op}` \(.*\) at .*test_explain_ops\.py:\d+: .*{message}"):
        explain(jax.jit(program), _arg(mesh, (16, 8), None, "model"))


def _concat(x: Any) -> Any:
    import jax.numpy as jnp

    return jnp.concatenate([x, x], axis=0)  # a cache grown by new rows


def test_a_sort_is_the_languages_sort_its_sharded_index_gathered() -> None:
    """``jnp.sort`` over a dim sharded over `model`: ``sort(Y1 over T)``; shardc gathers T for it (a row's
    order needs all of it), and the sort of a whole dim is local."""
    import jax
    import jax.numpy as jnp

    mesh = _mesh((4, 2))

    def program(x: Any, w: Any, w2: Any) -> Any:
        return jnp.sort(x @ w, axis=-1) @ w2

    e = explain(jax.jit(program), _arg(mesh, (16, 8), "data"), _arg(mesh, (8, 32), None, "model"),
                _arg(mesh, (32, 8), "model"))
    assert "N1[B_{data}, T_{model}] = sort(Y1[B_{data}, T_{model}] over T)" in _statements(e), e.spec
    assert ("AllGather_{model}", "Y1") in [(c.kind, c.tensor) for c in e.plan]
    e = explain(jax.jit(lambda x: jnp.tanh(jnp.sort(x, axis=0))), _arg(mesh, (16, 8), None, "model"))
    assert _statements(e)[0] == "N1[B, S_{model}] = sort(x[B, S_{model}] over B)", e.spec
    assert _statements(e)[1] == "H1[B, S_{model}] = tanh(N1[B, S_{model}])", e.spec
    assert not e.plan and not e.xla  # along a whole dim: local
    descending = explain(jax.jit(lambda x: jnp.tanh(jnp.sort(x, axis=-1, descending=True))),
                         _arg(mesh, (16, 8), "data"))
    assert _statements(descending)[0] == "N1[B_{data}, S] = sort(x[B_{data}, S] over S)", descending.spec
    with pytest.raises(ShardcError, match="a flip"):  # B whole, no data moves, but no map: its values differ
        explain(jax.jit(lambda x: jnp.flip(x, 0)), _arg(mesh, (16, 8), None, "model"))
    flipped = explain(jax.jit(lambda x: jnp.flip(x, 0)), _arg(mesh, (16, 8), None, "model"), approximate=True)
    assert _statements(flipped)[0].endswith("= identity(x[B, S_{model}])"), flipped.spec  # B whole: a map
    assert "# approximate: a flip" in flipped.spec, flipped.spec


@pytest.mark.parametrize(("program", "op"), [
    (lambda x: jax_top_k(x)[0] * 2.0, "top_k"),
    (lambda x: _argsort(x) * 2.0, "jit"),
    (lambda x: _take_along(x) * 2.0, "gather"),
    (lambda x: _take_columns(x) * 2.0, "gather"),
])
def test_top_k_argsort_and_other_gathers_name_the_op_and_line(program: Any, op: str) -> None:
    """Positions along a dim (a top-k, an argsort) and a gather at them (take_along_axis outside the
    loss, a take along another axis than a table's rows) have no tensor in the language."""
    import jax

    mesh = _mesh((4, 2))
    with pytest.raises(shardc.ShardcError, match=rf"`{op}` \(.*\) at .*test_explain_ops\.py:\d+: "):
        explain(jax.jit(program), _arg(mesh, (16, 8), None, "model"))


def jax_top_k(x: Any) -> Any:
    import jax

    return jax.lax.top_k(x, 2)  # an MoE router's top-k


def _argsort(x: Any) -> Any:
    import jax.numpy as jnp

    return jnp.argsort(x, axis=-1)


def _take_along(x: Any) -> Any:
    import jax.numpy as jnp

    return jnp.take_along_axis(x, jnp.zeros((x.shape[0], 1), jnp.int32), axis=-1)


def _take_columns(x: Any) -> Any:
    import jax.numpy as jnp

    return jnp.take(x, jnp.array([0, 2, 4]), axis=1)


@pytest.mark.parametrize("form", ["optax", "squeezed"])
def test_the_mean_negative_log_likelihood_at_labels_is_the_languages_cross_entropy(form: str) -> None:
    """optax's ``softmax_cross_entropy_with_integer_labels(logits, labels).mean()`` (logsumexp less the
    label's logit picked by take_along_axis), and the log-softmax form with the picked values squeezed,
    in a training step: ``cross_entropy(Logits, labels)``, the vocabulary over `model` never gathered."""
    import jax
    import jax.numpy as jnp

    mesh = _mesh((4, 2))

    def loss(w: Any, x: Any, labels: Any) -> Any:
        logits = x @ w
        if form == "optax":
            optax = pytest.importorskip("optax")
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=-1)
        return -jnp.mean(picked.squeeze(-1))

    def step(w: Any, x: Any, labels: Any) -> Any:
        value, grad = jax.value_and_grad(loss)(w, x, labels)
        return w - 0.1 * grad, value

    labels = jax.ShapeDtypeStruct((16,), jnp.int32, sharding=_arg(mesh, (16,), "data").sharding)
    e = explain(jax.jit(step), _arg(mesh, (8, 32), None, "model"), _arg(mesh, (16, 8), "data"), labels)
    assert _statements(e)[-1] == "L1[] = cross_entropy(Y1[B_{data}, T_{model}], labels[B_{data}])", e.spec
    assert "param w" in e.spec.splitlines()
    assert not any(c.tensor == "Y1" and c.kind.startswith("AllGather") for c in e.plan)  # the logits stay sharded
