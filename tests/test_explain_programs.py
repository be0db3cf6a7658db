"""``shardc explain`` on whole programs: multi-head attention written with reshapes, an embedding, a
training step (its forward read as the spec, its backward's collectives beside shardc's backward),
a reshard XLA can only make by gathering, and a flax model.

Each program builds its mesh over the 8 emulated CPU devices (conftest) and is compiled, not run.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import shardc
from shardc.explanation.explain_report import explain, render_explanation
from shardc.spec.walk import leaves
from tests.test_cli import fails_clearly
from tests.test_explain import _arg, _line_of, _mesh

pytestmark = pytest.mark.slow


def _statements(e: Any) -> dict[str, str]:
    return {s.result.name: f"{s.result} = {s.expr}" for s in shardc.parse(e.spec).statements}


def attention_layer() -> tuple[Any, tuple[Any, ...]]:
    """A pre-norm transformer layer as jax users write it: the heads split off the projections by
    reshapes and merged back before the output projection, heads and MLP over `model`."""
    import jax
    import jax.numpy as jnp

    mesh = _mesh((4, 2))
    heads = 4

    def rmsnorm(x: Any) -> Any:
        return x * jax.lax.rsqrt(jnp.mean(x**2, axis=-1, keepdims=True) + 1e-6)

    def layer(x: Any, wq: Any, wk: Any, wv: Any, wo: Any, w1: Any, w2: Any) -> Any:
        b, s, d = x.shape
        h = rmsnorm(x)
        q, k, v = ((h @ w).reshape(b, s, heads, -1) for w in (wq, wk, wv))
        p = jax.nn.softmax(jnp.einsum("bsnh,btnh->bnst", q, k), axis=-1)
        o = jnp.einsum("bnst,btnh->bsnh", p, v).reshape(b, s, -1)
        x = x + o @ wo  # the attention's AllReduce
        return x + jax.nn.gelu(rmsnorm(x) @ w1) @ w2  # the MLP's AllReduce

    d, f = 16, 32
    return jax.jit(layer), (_arg(mesh, (4, 8, d), "data"), *[_arg(mesh, (d, d), None, "model")] * 3,
                            _arg(mesh, (d, d), "model", None), _arg(mesh, (d, f), None, "model"),
                            _arg(mesh, (f, d), "model", None))


def test_multi_head_attention_written_with_reshapes_is_read_with_its_heads() -> None:
    fn, args = attention_layer()
    e = explain(fn, *args)
    spec = shardc.parse(e.spec)
    weights = {r.name: r for s in spec.statements for r in leaves(s.expr) if r.name.startswith("w")}
    # wq[16, 16] reshaped after the product is wq[D, N, H] in the spec, its columns' sharding on the heads
    assert [(d.axes, dict(spec.dims)[d.name]) for d in weights["wq"].dims][1:] == [(("model",), 4), ((), 4)], e.spec
    assert [(d.axes, dict(spec.dims)[d.name]) for d in weights["wo"].dims][:2] == [(("model",), 4), ((), 4)], e.spec
    assert sum(str(s.expr).startswith("softmax(") for s in spec.statements) == 1
    assert sum(str(s.expr).startswith("rmsnorm(") for s in spec.statements) == 2
    # Megatron's two AllReduces, in XLA's program and in shardc's plan, at the lines that made them
    assert [(c.kind, c.axes) for c in e.xla] == [("AllReduce", "model")] * 2
    assert [c.line for c in e.xla] == [_line_of(attention_layer, "the attention's AllReduce"),
                                       _line_of(attention_layer, "the MLP's AllReduce")]
    assert [(c.kind, c.axes) for c in e.plan] == [("AllReduce_{model}", "model")] * 2
    assert not e.not_needed and not e.differently


def embedding_model() -> tuple[Any, tuple[Any, ...]]:
    """Token ids looked up in a vocabulary-parallel table (rows over `model`), then a projection."""
    import jax
    import jax.numpy as jnp

    mesh = _mesh((4, 2))

    def model(ids: Any, table: Any, w1: Any, w2: Any, head: Any) -> Any:
        x = jnp.take(table, ids, axis=0)  # the lookup
        y = x + jax.nn.relu(x @ w1) @ w2
        return jnp.einsum("bsd,vd->bsv", y, head)

    weights = [_arg(mesh, (64, 16), "model", None), _arg(mesh, (16, 32)), _arg(mesh, (32, 16)),
               _arg(mesh, (64, 16), "model", None)]
    return jax.jit(model), (_arg(mesh, (4, 8), "data").update(dtype=jnp.int32),
                            *[w.update(dtype=jnp.bfloat16) for w in weights])


def test_an_embedding_lookup_is_the_languages_embed() -> None:
    fn, args = embedding_model()
    e = explain(fn, *args)
    made = _statements(e)
    assert made["E1"] == "E1[B_{data}, S, D] = embed(ids[B_{data}, S], table[V_{model}, D])", e.spec
    assert "dtype bf16" in e.spec.splitlines()  # the table's dtype, not the ids' (the first argument)
    # the vocabulary-parallel lookup is a partial sum over `model`: XLA and shardc reduce it
    assert ("AllReduce_{model}", "E1") in [(c.kind, c.tensor) for c in e.plan]
    assert any("E1" in c.tensor.split("|") and c.line == _line_of(embedding_model, "the lookup") for c in e.xla)
    assert shardc.cost(shardc.plan(shardc.parse(e.spec))).step.step_s > 0


def test_a_reshape_the_language_cannot_write_names_its_equation_and_line(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    program = tmp_path / "regroup.py"
    program.write_text(
        "import jax\nimport jax.numpy as jnp\nfrom jax.sharding import AxisType, NamedSharding, PartitionSpec as P\n\n"
        "def program():\n"
        "    mesh = jax.make_mesh((4, 2), ('data', 'model'), axis_types=(AxisType.Auto,) * 2)\n"
        "    arg = jax.ShapeDtypeStruct((16, 6), jnp.float32, sharding=NamedSharding(mesh, P('data')))\n"
        "    def f(x):\n"
        "        return jnp.tanh(x).reshape(8, 12)\n"
        "    return jax.jit(f), (arg,)\n", encoding="utf-8")
    fails_clearly(capsys, "explain", f"{program}:program",
                  says=f"`reshape` ([8, 12] = reshape [16, 6]) at {program}:9: [16, 6] to [8, 12] regroups its "
                  "dims [0, 1] as [0, 1]: neither a split of one dim nor a merge of several")


def test_a_split_whose_sharding_is_not_blocks_of_its_parts_is_a_clear_error() -> None:
    import jax
    import jax.numpy as jnp

    mesh = _mesh((4, 2))

    def f(x: Any, w: Any) -> Any:
        return jnp.tanh((x @ w).reshape(16, 2, 8))  # F over 4 devices is 4 rows of each of 2 heads

    line = _line_of(test_a_split_whose_sharding_is_not_blocks_of_its_parts_is_a_clear_error, "reshape(16")
    with pytest.raises(shardc.ShardcError, match=r"a dim sharded over data is reshaped to 2x8: a device's block of "
                       r"it is not a block of each of those dims \(`reshape` \[16, 16\] to \[16, 2, 8\] at "
                       + line):
        explain(jax.jit(f), _arg(mesh, (16, 8)), _arg(mesh, (8, 16), None, "data"))


def mlp_train_step() -> tuple[Any, tuple[Any, ...]]:
    """A training step as jax users write it: the loss's value and gradients, then SGD on the params
    (a pytree); the batch over `data`, the hidden dim over `model` (Megatron's MLP under data parallel)."""
    import jax
    import jax.numpy as jnp

    mesh = _mesh((4, 2))

    def loss(params: Any, x: Any, y: Any) -> Any:
        h = jax.nn.gelu(x @ params["w1"])  # the first matmul
        return jnp.mean((h @ params["w2"] - y) ** 2)  # the forward's AllReduce

    def step(params: Any, x: Any, y: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), value

    params = {"w1": _arg(mesh, (8, 32), None, "model"), "w2": _arg(mesh, (32, 8), "model", None)}
    return jax.jit(step), (params, _arg(mesh, (16, 8), "data"), _arg(mesh, (16, 8), "data"))


def test_a_training_step_is_read_as_its_forward_and_both_phases_compared() -> None:
    fn, args = mlp_train_step()
    e = explain(fn, *args)
    lines = e.spec.splitlines()
    assert "param params_w1, params_w2" in lines and "const x, y" in lines, e.spec
    spec = shardc.parse(e.spec)
    # the forward alone: two contractions, gelu, the loss's difference, square and mean (two sums)
    assert sum(" · " in str(s.expr) for s in spec.statements) == 2, e.spec
    assert not any(s.result.name.startswith("d") for s in spec.statements)
    phases = {c.phase for c in e.xla}
    assert phases == {"forward", "backward"}, render_explanation(e)
    # the gradients' data-parallel AllReduces: XLA's (named by shardc's gradient names) and the plan's
    xla_grads = sorted((c.tensor.split("|")[0], c.axes, c.bytes) for c in e.xla if c.phase == "backward")
    plan_grads = sorted((c.tensor, c.axes, c.bytes) for c in e.plan if c.phase == "backward")
    assert xla_grads == plan_grads == [("dparams_w1", "data", 8 * 16 * 4), ("dparams_w2", "data", 16 * 8 * 4)]
    # jax gives a transposed op the source line of the forward op it transposes (XLA's combined
    # AllReduce of both gradients has its first part's)
    loss_lines = {_line_of(mlp_train_step, "the first matmul"), _line_of(mlp_train_step, "the forward's AllReduce")}
    assert {c.line for c in e.xla if c.phase == "backward"} <= loss_lines
    forward = [c for c in e.xla if c.phase == "forward" and c.axes == "model"]
    assert [c.line for c in forward] == [_line_of(mlp_train_step, "the forward's AllReduce")]
    text = render_explanation(e)
    assert e.training and e.plan_comm_s > 0 and "shardc's plan of the forward and backward" in text
    assert "the program's forward as a spec (a training step: shardc derives its backward):" in text


def involuntary_remat() -> tuple[Any, tuple[Any, ...]]:
    """A sum constrained from (B over `model`, T over `data`) to S over both (xla #15207): XLA's SPMD
    partitioner logs "Involuntary full rematerialization" and gathers the whole sum onto every device,
    then slices it; the layouts differ by two AllToAlls."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh((4, 2))

    def f(a: Any, b: Any, c: Any) -> Any:
        d = jax.lax.with_sharding_constraint(a + b, NamedSharding(mesh, P(None, ("data", "model"))))  # the reshard
        return c + d

    shape = (32, 128, 128)
    return jax.jit(f), (_arg(mesh, shape, "model", None, "data"), _arg(mesh, shape, "model", None, "data"),
                        _arg(mesh, shape, None, ("data", "model")))


def test_an_involuntary_full_rematerialization_is_listed_beside_the_cheaper_plan() -> None:
    fn, args = involuntary_remat()
    e = explain(fn, *args)
    assert "R1[B, S_{data,model}, T] = a[B_{model}, S, T_{data}] + b[B_{model}, S, T_{data}]" in e.spec
    line = _line_of(involuntary_remat, "the reshard")
    whole = [c for c in e.xla if c.whole]
    assert [(c.kind, c.bytes, c.line) for c in whole] == [("AllGather", 32 * 128 * 128 * 4, line)]
    assert "R1" in whole[0].tensor.split("|") and whole[0] in e.not_needed
    assert "(whole)" in render_explanation(e)
    # shardc moves the axes with AllToAlls, never holding the whole sum: cheaper on the chip
    assert e.differently and {c.kind.split("_")[0] for c in e.differently} == {"AllToAll"}
    assert all(c.tensor == "R1" and c.line == line and c.bytes <= whole[0].bytes for c in e.differently)
    assert e.plan_comm_s < e.xla_comm_s / 2


def flax_block() -> tuple[Any, tuple[Any, ...]]:
    """A flax.linen pre-norm transformer block (flax's RMSNorm, MultiHeadDotProductAttention, a Dense
    gelu MLP), its parameters sharded Megatron's way by their names: the module's ``apply``, jitted."""
    flax = pytest.importorskip("flax")
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    nn = flax.linen
    mesh = _mesh((4, 2))

    class Block(nn.Module):  # type: ignore[misc]
        @nn.compact
        def __call__(self, x: Any) -> Any:
            x = x + nn.MultiHeadDotProductAttention(num_heads=4, deterministic=True)(nn.RMSNorm()(x))  # attention
            up, down = nn.Dense(32, name="up"), nn.Dense(16, name="down")
            return x + down(nn.gelu(up(nn.RMSNorm()(x))))  # the MLP

    def sharding(path: Any, leaf: Any) -> Any:
        name = jax.tree_util.keystr(path)
        column = any(k in name for k in ("query", "key", "value", "up"))
        row = any(k in name for k in ("out", "down")) and "kernel" in name
        spec = P(None, "model") if column and "kernel" in name else P("model") if column or row else P()
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

    x = _arg(mesh, (4, 8, 16), "data")
    params = jax.tree_util.tree_map_with_path(sharding, jax.eval_shape(Block().init, jax.random.key(0), x))
    assert jnp is not None
    return jax.jit(Block().apply), (params, x)


def test_a_flax_transformer_block_is_explained() -> None:
    """flax's attention scales the queries by 1/sqrt(head dim) (4 here): the language's scale(X, 0.5), the spec's
    values the block's (nothing approximate)."""
    fn, args = flax_block()
    e = explain(fn, *args)
    assert "# approximate" not in e.spec, e.spec
    spec = shardc.parse(e.spec)
    texts = [str(s.expr) for s in spec.statements]
    assert sum(t.startswith("softmax(") for t in texts) == 1 and any(t.startswith("gelu(") for t in texts)
    assert [t for t in texts if t.startswith("scale(")] == ["scale(R1[B_{data}, S, D_{model}, F], 0.5)"], e.spec
    # flax's RMSNorm, x * (rsqrt(mean(x**2) + eps) * scale), is the norm times its scale
    norms = [t for t in texts if t.startswith("rmsnorm(")]
    assert len(norms) == 2 and sum(t.endswith("_scale[T]") and " * " in t for t in texts) == 2, e.spec
    query = next(r for s in spec.statements for r in leaves(s.expr) if r.name.endswith("query_kernel"))
    assert [d.axes for d in query.dims] == [(), ("model",), ()], e.spec  # DenseGeneral's [D, heads, head dim]
    # every line is the user's (the block's), not flax's; Megatron's two AllReduces, as the plan's
    assert all(c.line.startswith(f"{__file__}:") for c in e.xla) and len(e.xla) == 2
    assert [c.line for c in e.xla] == [_line_of(flax_block, "# attention"), _line_of(flax_block, "# the MLP")]
    assert [(c.kind, c.axes) for c in e.plan] == [("AllReduce_{model}", "model")] * 2
    assert not e.not_needed and not e.differently


def transformer_train_step() -> tuple[Any, tuple[Any, ...]]:
    """A one-layer language model's training step: a vocabulary-parallel embedding, the attention
    layer with reshaped heads, a head over the vocabulary, the mean negative log likelihood of the
    labels (jax.nn.log_softmax, jnp.take_along_axis), SGD."""
    import jax
    import jax.numpy as jnp

    mesh = _mesh((4, 2))
    layer, layer_args = attention_layer()

    def loss(params: Any, ids: Any, labels: Any) -> Any:
        x = params["embedding"][ids]
        y = layer.__wrapped__(x, *[params[w] for w in ("wq", "wk", "wv", "wo", "w1", "w2")])
        logp = jax.nn.log_softmax(jnp.einsum("bsd,vd->bsv", y, params["head"]))
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))  # the loss

    def step(params: Any, ids: Any, labels: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(params, ids, labels)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), value

    params = dict(zip(("wq", "wk", "wv", "wo", "w1", "w2"), layer_args[1:], strict=True))
    params |= {"embedding": _arg(mesh, (64, 16), "model"), "head": _arg(mesh, (64, 16), "model")}
    ids = _arg(mesh, (4, 8), "data").update(dtype=jnp.int32)
    return jax.jit(step), (params, ids, ids)


def test_a_transformer_training_step_is_read_end_to_end() -> None:
    """The softmax's and rmsnorm's linearization (a max's `eq` mask, ...) feeds the backward alone:
    only what the loss needs is read, so the forward is the spec's functions."""
    fn, args = transformer_train_step()
    e = explain(fn, *args)
    spec = shardc.parse(e.spec)
    texts = [str(s.expr) for s in spec.statements]
    assert sum(t.startswith("softmax(") for t in texts) == 1 and sum(t.startswith("rmsnorm(") for t in texts) == 2
    assert any(t.startswith("embed(ids[B_{data}, S], params_embedding[V_{model}") for t in texts), e.spec
    loss = spec.statements[-1]
    # the logits' vocabulary over `model`: shardc's vocabulary-parallel loss, never gathering them
    assert str(loss.result) == "L1[]" and re.fullmatch(r"cross_entropy\(Y\d+\[B_\{data\}, S, \w+_\{model\}\], "
                                                       r"labels\[B_\{data\}, S\]\)", str(loss.expr)), e.spec
    assert _line_of(transformer_train_step, "# the loss") in e.spec
    assert set(spec.params or ()) == {f"params_{w}" for w in ("wq", "wk", "wv", "wo", "w1", "w2", "embedding",
                                                               "head")}
    # each weight's gradient AllReduced over `data`, in XLA's program and in shardc's plan, all paired
    grads = [c for c in e.xla if c.phase == "backward" and c.axes == "data"]
    assert len(grads) == 8 == len([c for c in e.plan if c.phase == "backward" and c.axes == "data"])
    assert not [c for c in e.differently if c.phase == "backward" and c.axes == "data"]


def test_an_optax_step_reads_the_parameters_not_the_optimizer_state() -> None:
    """jax.grad (the loss returned by nobody) and optax's AdamW: the moments the update reads are no
    parameters of the spec, and XLA's combined AllReduce of both gradients is read part by part."""
    optax = pytest.importorskip("optax")
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh((4, 2))
    opt = optax.adamw(1e-3)

    def loss(params: Any, x: Any, y: Any) -> Any:
        return jnp.mean((jax.nn.relu(x @ params["w1"]) @ params["w2"] - y) ** 2)

    def step(params: Any, state: Any, x: Any, y: Any) -> Any:
        updates, state = opt.update(jax.grad(loss)(params, x, y), state, params)
        return optax.apply_updates(params, updates), state

    params = {"w1": _arg(mesh, (8, 32), None, "model"), "w2": _arg(mesh, (32, 8), "model", None)}
    specs = {(8, 32): P(None, "model"), (32, 8): P("model", None)}
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
        mesh, specs.get(a.shape, P()))), jax.eval_shape(opt.init, params))
    e = explain(jax.jit(step), params, state, _arg(mesh, (16, 8), "data"), _arg(mesh, (16, 8), "data"))
    assert "param params_w1, params_w2" in e.spec.splitlines() and "const x, y" in e.spec.splitlines(), e.spec
    grads = sorted((c.tensor.split("|")[0], c.axes) for c in e.xla if c.phase == "backward")
    assert grads == [("dparams_w1", "data"), ("dparams_w2", "data")]
    assert not [c for c in e.differently if c.phase == "backward"]


def test_a_step_returning_only_the_parameters_is_read_through_its_loss() -> None:
    """No output of the jitted step is of the forward: the loss jax.grad computes and drops is its end."""
    import jax
    import jax.numpy as jnp

    mesh = _mesh((4, 2))

    def loss(params: Any, x: Any) -> Any:
        return jnp.mean(jnp.tanh(x @ params["w"]) ** 2)

    def step(params: Any, x: Any) -> Any:
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params, x))

    e = explain(jax.jit(step), {"w": _arg(mesh, (8, 32), None, "model")}, _arg(mesh, (16, 8), "data"))
    forward = [str(s.expr).split("(")[0] for s in shardc.parse(e.spec).statements]
    # not gelu; jnp.mean's division, which nothing reads (jax seeds the backward with 1/n instead), still a mean:
    # read as sums, the spec's gradients would be n = 512 times the program's
    assert forward == ["x[B_{data}, S] · params_w[S, T_{model}]", "tanh", "square", "mean", "mean"], e.spec
    assert [(c.phase, c.tensor.split("|")[0], c.axes) for c in e.xla if c.phase == "backward"] == \
        [("backward", "dparams_w", "data")]


def test_a_layernorm_written_out_is_the_languages_layernorm() -> None:
    import jax
    import jax.numpy as jnp

    mesh = _mesh((4, 2))

    def f(x: Any, w: Any) -> Any:
        y = jnp.einsum("bd,df->bf", x, w)
        centered = y - jnp.mean(y, axis=-1, keepdims=True)
        return centered * jax.lax.rsqrt(jnp.mean(centered**2, axis=-1, keepdims=True) + 1e-5)

    e = explain(jax.jit(f), _arg(mesh, (8, 16), "data"), _arg(mesh, (16, 8), None, "model"))
    texts = [str(s.expr) for s in shardc.parse(e.spec).statements]
    assert texts[1:] == ["layernorm(Y1[B_{data}, F_{model}] over F)"], e.spec
    # F over `model`: XLA AllReduces the mean, then the mean squared deviation; shardc costs that
    # against gathering the rows (at these sizes, one AllGather's latency is less than two AllReduces')
    assert [(c.kind, c.bytes) for c in e.xla] == [("AllReduce", 2 * 4)] * 2  # 2 rows a device, 1 value each
    assert [(c.kind, c.tensor) for c in e.plan] == [("AllGather_{model}", "Y1")]


def test_flax_layernorm_with_its_fast_variance_is_the_languages_layernorm() -> None:
    """flax's LayerNorm computes the variance as mean(x**2) - mean(x)**2 (``use_fast_variance``); its epsilon
    the language's layernorm's (flax's default, 1e-6, is refused: tests/test_explain_scales.py)."""
    flax = pytest.importorskip("flax")
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh((4, 2))

    class Block(flax.linen.Module):  # type: ignore[misc]
        @flax.linen.compact
        def __call__(self, x: Any) -> Any:
            return flax.linen.LayerNorm(epsilon=1e-5)(flax.linen.Dense(8, use_bias=False)(x))  # the language's

    def sharding(path: Any, leaf: Any) -> Any:
        spec = P(None, "model") if "kernel" in jax.tree_util.keystr(path) else P()
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

    x = _arg(mesh, (8, 16), "data")
    params = jax.tree_util.tree_map_with_path(sharding, jax.eval_shape(Block().init, jax.random.key(0), x))
    e = explain(jax.jit(Block().apply), params, x)
    texts = [str(s.expr) for s in shardc.parse(e.spec).statements]
    assert texts[1].startswith("layernorm(") and texts[1].endswith(" over T)"), e.spec
    assert texts[2].endswith("_LayerNorm_0_scale[T]") and texts[3].endswith("_LayerNorm_0_bias[T]"), e.spec
    assert len(texts) == 4, e.spec


def scanned_layers(train: bool) -> tuple[Any, tuple[Any, ...]]:
    """Four residual softmax-MLP layers as `jax.lax.scan` over stacked weights (the layers dim first,
    whole on each device), the hidden dim over `model`; as a forward, or as a training step."""
    import jax
    import jax.numpy as jnp

    mesh = _mesh((4, 2))

    def forward(params: Any, x: Any) -> Any:
        def layer(h: Any, w: Any) -> Any:
            return h + jax.nn.softmax(h @ w[0], axis=-1) @ w[1], None  # the layer

        return jax.lax.scan(layer, x, (params["w1"], params["w2"]))[0]

    def step(params: Any, x: Any) -> Any:
        value, grads = jax.value_and_grad(lambda p, x: jnp.mean(forward(p, x) ** 2))(params, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    params = {"w1": _arg(mesh, (4, 8, 32), None, None, "model"), "w2": _arg(mesh, (4, 32, 8), None, "model")}
    return jax.jit(step if train else forward), (params, _arg(mesh, (16, 8), "data"))


def test_a_scan_over_layers_is_a_layers_block() -> None:
    fn, args = scanned_layers(train=False)
    e = explain(fn, *args)
    spec = shardc.parse(e.spec)
    assert spec.layers == 4 and "layers 4 {" in e.spec.splitlines() and spec.params == ("params_w1", "params_w2")
    # each layer's weights without the layers dim; the block reads x and hands on its sum
    assert "params_w1[S, T_{model}]" in e.spec and "params_w2[T_{model}, S]" in e.spec, e.spec
    # XLA's collectives of the loop body run once a layer: 4 times, as the plan's steps of the block
    assert e.xla and all(c.runs == 4 for c in e.xla) and all(c.runs == 4 for c in e.plan)
    assert all(c.line == _line_of(scanned_layers, "# the layer") for c in e.xla)
    assert "x4" in render_explanation(e)


def test_two_scans_are_two_layers_blocks_each_with_its_count() -> None:
    """Four layers of one width, then two of another: each scan its own block, and the plan's steps of
    each run as often as its block's layers."""
    import jax

    mesh = _mesh((4, 2))

    def forward(params: Any, x: Any) -> Any:
        def layer(h: Any, w: Any) -> Any:
            return h + jax.nn.softmax(h @ w[0], axis=-1) @ w[1], None

        h = jax.lax.scan(layer, x, (params["w1"], params["w2"]))[0]
        return jax.lax.scan(layer, h, (params["v1"], params["v2"]))[0]

    params = {"w1": _arg(mesh, (4, 8, 32), None, None, "model"), "w2": _arg(mesh, (4, 32, 8), None, "model"),
              "v1": _arg(mesh, (2, 8, 16), None, None, "model"), "v2": _arg(mesh, (2, 16, 8), None, "model")}
    e = explain(jax.jit(forward), params, _arg(mesh, (16, 8), "data"))
    spec = shardc.parse(e.spec)
    assert [layers for _, _, layers in spec.blocks()] == [4, 2], e.spec
    assert sorted(c.runs for c in e.plan) == [2, 2, 4, 4], e.spec


def test_a_scanned_training_step_reads_the_loop_once_and_its_loss_after() -> None:
    fn, args = scanned_layers(train=True)
    e = explain(fn, *args)
    spec = shardc.parse(e.spec)
    texts = [str(s.expr) for s in spec.statements]
    assert spec.layers == 4 and sum(t.startswith("softmax(") for t in texts) == 1, e.spec
    assert texts[-1].startswith("mean(") and "const x" in e.spec.splitlines()  # the loss (jnp.mean), after the block
    assert {c.phase for c in e.xla} == {"forward", "backward"}
    grads = sorted(c.tensor.split("|")[0] for c in e.xla if c.phase == "backward" and c.axes == "data")
    assert grads == ["dparams_w1", "dparams_w2"]


def test_a_scan_over_layers_sharded_along_the_layers_is_fsdp_over_those_axes() -> None:
    """W[L_data, D, F]: each device holds L/4 whole layers; the spec, whose weights are each layer's, shards
    each layer's weights over `data` instead (the same bytes a device), and says so."""
    import jax

    mesh = _mesh((4, 2))
    fn, (params, x) = scanned_layers(train=False)
    params = {"w1": _arg(mesh, (4, 8, 32), "data", None, "model"), "w2": _arg(mesh, (4, 32, 8), "data", "model")}
    e = explain(fn, params, jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding))
    assert "params_w1[S_{data}, T_{model}]" in e.spec and "params_w2[T_{model}, S_{data}]" in e.spec, e.spec
    assert "# params_w1: its 4 layers sharded over data in the program" in e.spec
    gathers = sorted((c.tensor, c.bytes, c.runs) for c in e.plan if c.axes == "data")
    assert gathers == [("params_w1", 8 * 32 * 4 // 2, 4), ("params_w2", 32 * 8 * 4 // 2, 4)], e.plan
    # XLA gathers the stacked weights over data too: as many bytes in all as the plan's gathers
    xla = sum(c.bytes * c.runs for c in e.xla if c.axes == "data" and c.kind == "AllGather")
    assert xla == sum(b * runs for _, b, runs in gathers), e.xla
