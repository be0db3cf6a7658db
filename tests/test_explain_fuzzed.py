"""``shardc explain`` on small programs a user writes that it misread once (found by fuzzing it):
each is read as a spec `shardc plan` accepts, or refused with a clear error.

Each program builds its mesh over the 8 emulated CPU devices (conftest) and is compiled, not run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import shardc
from shardc.explanation.explain_report import explain
from tests.test_cli import fails_clearly
from tests.test_explain import _arg, _mesh, megatron_mlp

pytestmark = pytest.mark.slow


def test_a_scan_of_a_square_layer_ending_in_a_map_hands_on_its_carry() -> None:
    """``tanh(h @ w)`` over square stacked weights, returned sharded otherwise: the map is written
    inside the block and its result copied into the carry's dims and layout (the spec `shardc plan`
    reads), the return's sharding a copy after the block; the plan's AllGather a layer is XLA's."""
    import jax
    import jax.numpy as jnp

    mesh = _mesh((2, 4))

    def forward(x: Any, ws: Any) -> Any:
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    out = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model"))
    e = explain(jax.jit(forward, out_shardings=out), _arg(mesh, (16, 32), "data", None),
                _arg(mesh, (4, 32, 32), None, None, "model"))
    block = e.spec[e.spec.index("layers 4 {"):e.spec.index("\n}")]
    assert "tanh(" in block and "C1[B_{data}, S] = H1[B_{data}, T_{model}]" in block, e.spec
    assert "C2[B_{data}, S_{model}] = C1[B_{data}, S]" in e.spec
    assert [(c.kind, c.runs) for c in e.xla] == [("AllGather", 4)] and not e.not_needed and not e.differently


def test_a_checkpointed_function_is_read_as_its_body() -> None:
    """``jax.checkpoint`` (the ``remat2`` call) changes what the backward keeps, not the forward."""
    import jax

    fn, args = megatron_mlp()
    body = explain(fn, *args, origin="mlp").spec
    assert explain(jax.jit(jax.checkpoint(fn)), *args, origin="mlp").spec == body


def test_a_layernorm_dividing_by_the_root_of_its_variance_is_the_languages_layernorm() -> None:
    """``(x - mu) / sqrt(mean((x - mu)**2) + eps)``: jax traces ``x - mu`` twice, one the square's and
    one the division's; the two are one value, so the whole is ``layernorm`` (it was refused as a
    division of two arrays)."""
    import jax
    import jax.numpy as jnp

    mesh = _mesh((2, 4))

    def norm(x: Any, g: Any) -> Any:
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * g

    e = explain(jax.jit(norm), _arg(mesh, (16, 32), "data", None), _arg(mesh, (32,)))
    assert "layernorm(x[B_{data}, S] over S)" in e.spec and e.spec.count(" = ") == 2, e.spec


def test_a_result_of_literals_alone_is_left_out_of_the_spec() -> None:
    """``jnp.zeros`` returned beside a product: jax puts it on one device (no NamedSharding) and no
    input reaches it, so the spec has the product alone (it was an AttributeError, then a statement
    reading itself); returned alone, the program computes nothing the language writes: a clear error."""
    import jax
    import jax.numpy as jnp

    mesh = _mesh((2, 4))
    x, w = _arg(mesh, (16, 8), "data", None), _arg(mesh, (8, 32), None, "model")
    e = explain(jax.jit(lambda x, w: (x @ w, jnp.zeros((4, 4)))), x, w)
    assert e.spec.count(" = ") == 1 and "x[B_{data}, S] · w[S, T_{model}]" in e.spec, e.spec
    with pytest.raises(shardc.ShardcError, match="computes nothing"):
        explain(jax.jit(lambda x: jnp.zeros((4, 4))), x)


def test_a_one_hot_other_than_a_lookup_or_a_loss_is_refused_naming_what_is_read() -> None:
    """A one-hot times an array elementwise (not a table's rows, not the cross entropy): the comparison with
    positions names its equation and the two places a one-hot is read (it said "`eq` of 1 different
    arrays"; ``one_hot(ids, V) @ table`` is now embed, tests/test_explain_idioms.py)."""
    import jax

    mesh = _mesh((2, 4))
    ids = jax.ShapeDtypeStruct((16,), "int32", sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    with pytest.raises(shardc.ShardcError, match=r"(?s)`eq` \(\[16, 32\] = eq .*times a 2-d table \(embed\)"):
        explain(jax.jit(lambda ids, x: jax.nn.one_hot(ids, 32) * x), ids, _arg(mesh, (16, 32), "data"))


_PROGRAMS = """
import jax


def raises():
    raise RuntimeError("boom")


def too_big_a_mesh():
    return jax.make_mesh((4, 4), ("data", "model"))


def one_argument():
    return jax.jit(abs), jax.ShapeDtypeStruct((8,), "float32")


def no_function():
    return 5, ()
"""


def test_explain_says_what_the_users_function_did_wrong(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """FUNC raising, a mesh of more devices than emulated, the arguments not a tuple, no function: each
    a clear error naming the function (they were internal errors, or "must return (jitted_fn, args)")."""
    path = tmp_path / "programs.py"
    path.write_text(_PROGRAMS, encoding="utf-8")
    fails_clearly(capsys, "explain", f"{path}:raises", says="raises() raised RuntimeError: boom")
    err = fails_clearly(capsys, "explain", f"{path}:too_big_a_mesh", says="product of mesh_shape (4, 4)")
    assert "--devices" in err
    fails_clearly(capsys, "explain", f"{path}:one_argument", says="returned ShapeDtypeStruct where the tuple")
    fails_clearly(capsys, "explain", f"{path}:no_function", says="returned 5 where the jitted function goes")


def test_static_arguments_and_empty_arrays_are_clear_errors() -> None:
    """A static argument (jit's static_argnums) cannot be traced as an array for the jaxpr, and an array
    of no elements gives a dim of 0, which no spec has: both said as such (a ValueError traceback, and
    the spec's own "size must be positive" at a .shard line the user never saw)."""
    import jax

    mesh = _mesh((2, 4))
    with pytest.raises(shardc.ShardcError, match="(?s)static arguments before jit"):
        explain(jax.jit(lambda x, n: x * n, static_argnums=1), _arg(mesh, (16, 8), "data", None), 3)
    with pytest.raises(shardc.ShardcError, match=r"shape \(0, 8\) holds no elements"):
        explain(jax.jit(lambda x: x * 2), _arg(mesh, (0, 8), "data", None))


def test_a_jitted_layer_called_twice_is_read_as_two_calls() -> None:
    """jax reuses one jaxpr for both calls of ``layer``: the second is read with variables of its own
    (it read the first call's dims as the second weight's: "w2 reads one dim twice")."""
    import jax

    mesh = _mesh((2, 4))
    layer = jax.jit(lambda x, w: jax.nn.relu(x @ w))
    e = explain(jax.jit(lambda x, w1, w2: layer(layer(x, w1), w2)), _arg(mesh, (16, 8), "data", None),
                _arg(mesh, (8, 8), None, "model"), _arg(mesh, (8, 8), "model", None))
    assert "w1[S, T_{model}]" in e.spec and "w2[T_{model}, D]" in e.spec and e.spec.count("relu(") == 2, e.spec
    assert [(c.kind, c.axes) for c in e.xla] == [("AllReduce", "model")] and not e.not_needed and not e.differently


def test_two_scans_of_one_layer_function_are_two_blocks() -> None:
    """Two scans of one ``layer`` at one width share its traced body: the second block is read with
    variables of its own (the spec defined Y2 twice, which parse refused)."""
    import jax
    import jax.numpy as jnp

    mesh = _mesh((2, 4))

    def layer(h: Any, w: Any) -> Any:
        return h + jnp.tanh(h @ w), None

    def forward(x: Any, ws: Any, vs: Any) -> Any:
        return jax.lax.scan(layer, jax.lax.scan(layer, x, ws)[0], vs)[0]

    stack = _arg(mesh, (3, 32, 32), None, None, "model")
    e = explain(jax.jit(forward), _arg(mesh, (16, 32), "data", None), stack, stack)
    spec = shardc.parse(e.spec)
    assert [layers for _, _, layers in spec.blocks()] == [3, 3] and e.spec.count("tanh(") == 2, e.spec


def test_a_scans_per_layer_outputs_returned_are_named_as_left_out() -> None:
    """A scan returning a value a layer (``h.sum()``) beside its carry: the spec has the carry, and a note
    says the per-layer result is left out (it was left out without a word)."""
    import jax
    import jax.numpy as jnp

    mesh = _mesh((2, 4))

    def forward(x: Any, ws: Any) -> Any:
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w),) * 2, x, ws)

    e = explain(jax.jit(forward), _arg(mesh, (16, 32), "data", None), _arg(mesh, (4, 32, 32), None, None, "model"))
    assert "# a result of [4, 16, 32], a scan's per-layer outputs, is left out" in e.spec, e.spec
