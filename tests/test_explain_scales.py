"""The guard that `shardc explain` never changes a program's meaning silently: for small plain-jax programs,
the spec explain writes, evaluated by shardc's own float64 reference (the one `shardc verify` checks the lowered
program against, :func:`shardc.lowering.reference.forward`), gives the program's values on the same inputs;
a constant scale or shift first or last in a run of maps is the language's ``scale(X, a)`` / ``shift(X, b)``;
where the spec language cannot say a construct (a constant inside a run of maps, a norm's other epsilon), explain
refuses, naming it and its source line (:mod:`shardc.explanation.constants`).

The programs are read by :func:`~shardc.explanation.jaxpr_spec.read_program` off their jaxprs (traced, never
compiled: what the spec says is the reader's alone), on unsharded arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardc
from shardc.errors import ShardcError
from shardc.explanation.jaxpr_spec import read_program
from shardc.lowering.reference import backward, forward
from tests.test_cli import fails_clearly, run_main

jax = pytest.importorskip("jax")
jnp = jax.numpy


def _mlp_gelu(x: Any, w1: Any, w2: Any) -> Any:
    return jax.nn.gelu(x @ w1) @ w2  # the tanh GELU's constants are the language's gelu's


def _mlp_gelu_halved(x: Any, w1: Any, w2: Any) -> Any:
    return (jax.nn.gelu(x @ w1) * 0.5) @ w2  # the scale: gelu's own 0.5 is gelu's, this one is not


def _mlp_bias_relu(x: Any, w1: Any, b1: Any, w2: Any) -> Any:
    return jax.nn.relu(x @ w1 + b1) @ w2


def _mlp_scaled(x: Any, w1: Any, w2: Any) -> Any:
    return jnp.tanh((x @ w1) * 0.5) @ w2  # the scale


def _mlp_scaled_after(x: Any, w1: Any, w2: Any) -> Any:
    return (jax.nn.relu(x @ w1) * 3.0) @ w2  # the scale


def _mlp_shifted(x: Any, w1: Any, w2: Any) -> Any:
    return jax.nn.relu(x @ w1 + 1.0) @ w2  # the shift


def _attention(x: Any, wq: Any, wk: Any) -> Any:
    p = jax.nn.softmax(jnp.einsum("bd,td->bt", x @ wq, x @ wk), axis=-1)
    return p @ x


def _attention_scaled(x: Any, wq: Any, wk: Any) -> Any:
    scores = jnp.einsum("bd,td->bt", x @ wq, x @ wk) / jnp.sqrt(8.0)  # the scale
    return jax.nn.softmax(scores, axis=-1) @ x


def _rmsnorm(x: Any, w1: Any, w2: Any) -> Any:
    y = x @ w1
    return (y * jax.lax.rsqrt(jnp.mean(y**2, axis=-1, keepdims=True) + 1e-6)) @ w2


def _rmsnorm_other_eps(x: Any, w1: Any, w2: Any) -> Any:
    y = x @ w1
    return (y * jax.lax.rsqrt(jnp.mean(y**2, axis=-1, keepdims=True) + 1e-5)) @ w2  # the epsilon


def _layernorm(x: Any, w1: Any, w2: Any) -> Any:
    y = x @ w1
    centered = y - jnp.mean(y, axis=-1, keepdims=True)
    return (centered * jax.lax.rsqrt(jnp.mean(centered**2, axis=-1, keepdims=True) + 1e-5)) @ w2


def _loss_mean(x: Any, w: Any, y: Any) -> Any:
    return jnp.mean((x @ w - y) ** 2)


def _sum_halved(x: Any, w: Any, y: Any) -> Any:
    return jnp.tanh((x @ w - y).sum(0) * 0.5)  # the scale


def _total_halved(x: Any, w: Any, y: Any) -> Any:
    return jnp.sum(jnp.tanh(x @ w - y)) * 0.5  # the scale, of a scalar result (the spec's last statement)


def _from_two(x: Any, w: Any, y: Any) -> Any:
    return jnp.exp(2.0 - x @ w) + y  # the shift


def _scaled_inside(x: Any, w: Any, y: Any) -> Any:
    h = x @ w
    return h * jnp.tanh(h * 0.5) + y  # the scale, inside the run of maps (h read again after it)


def _tanh_then_exp(x: Any, w: Any, y: Any) -> Any:
    return jnp.exp(jnp.tanh(x @ w) * 0.5) + y  # maps of the language, one after another: exp(scale(tanh))


def _computed_divisor(x: Any, w: Any, y: Any) -> Any:
    return jnp.tanh(x @ w) / jnp.sqrt(y.shape[0] * 1.0) + y  # a scalar made of literals: a scale by its inverse


def _tanh_squared(x: Any, w: Any, y: Any) -> Any:
    return jnp.tanh(x @ w) ** 2 + y  # the square after the tanh: square(tanh)


def _flipped(x: Any, w: Any, y: Any) -> Any:
    return jnp.flip(x @ w, axis=1) + y  # the flip, along a dim whole on each device: no map


def _log(x: Any, w: Any, y: Any) -> Any:
    return jnp.log(jnp.square(x @ w)) + y  # the log of the square: log(square)


def _sin(x: Any, w: Any, y: Any) -> Any:
    return jnp.sin(x @ w) + y


def _sqrt(x: Any, w: Any, y: Any) -> Any:
    return jnp.sqrt(jnp.abs(x @ w)) + y  # the square root of the absolute value: sqrt(abs)


def _abs(x: Any, w: Any, y: Any) -> Any:
    return jnp.abs(x @ w) + y


def _softplus(x: Any, w: Any, y: Any) -> Any:
    return jnp.log(1.0 + jnp.exp(x @ w)) - y  # log(shift(exp)): the shift last in the run exp, 1 +


def _reciprocal(x: Any, w: Any, y: Any) -> Any:
    return jnp.cos(1.0 / (jnp.abs(x @ w) + 0.5)) * -(x @ w) + y  # 1 / x a reciprocal, -x a negative


def _divided(x: Any, w: Any, y: Any) -> Any:
    return jnp.cos(-2.0 / (jnp.abs(x @ w) + 0.5)) + 3.0 / (jnp.square(x @ w) + 1.0) + y  # c / x: scale(reciprocal)


def _softplus_call(x: Any, w: Any, y: Any) -> Any:
    return jax.nn.softplus(x @ w) + y  # the custom function logaddexp(x, 0): exp's primitives, not exp


def _log_times_tanh(x: Any, w: Any, y: Any) -> Any:
    h = x @ w
    return jnp.log(jnp.abs(h)) * jnp.tanh(h) + y  # the product of two maps of h: no map of the language


def _rotary(x: Any, w: Any, y: Any) -> Any:
    h = x @ w
    angles = jnp.arange(4.0)[:, None] * jnp.arange(8.0)[None, :] / 8.0
    rotated = jnp.concatenate([-h[:, 4:], h[:, :4]], axis=1)
    return h * jnp.cos(angles) + rotated * jnp.sin(angles) + y  # the rotation: no map of the language


def _padding_mask(x: Any, w: Any, y: Any) -> Any:
    keep = jnp.arange(8)[None, :] < 6
    return jax.nn.softmax(jnp.where(keep, x @ w, -jnp.inf), axis=-1) + y  # the mask: not causal


def _strictly_causal(x: Any, w: Any, y: Any) -> Any:
    keep = jnp.arange(4)[:, None] > jnp.arange(8)[None, :]
    return jnp.where(keep, x @ w, 0.0) + y  # the mask: not causal (the diagonal masked too)


_SHAPES = {"x": (4, 8), "w1": (8, 16), "b1": (16,), "w2": (16, 8), "wq": (8, 8), "wk": (8, 8), "w": (8, 8),
           "y": (4, 8)}
# a norm's inputs small (its mean of squares near 1e-6), so that another epsilon changes its values
_SCALE = {_rmsnorm: 3e-3, _layernorm: 3e-3, _rmsnorm_other_eps: 3e-3}
# a scale or shift first or last in a run of maps is the language's scale(X, a) or shift(X, b)
SCALED = {_mlp_scaled: "H1[B, T] = scale(Y1[B, T], 0.5)", _mlp_gelu_halved: "H2[B, T] = scale(H1[B, T], 0.5)",
          _mlp_scaled_after: "H2[B, T] = scale(H1[B, T], 3.0)", _mlp_shifted: "H1[B, T] = shift(Y1[B, T], 1.0)",
          _attention_scaled: "H1[B, T] = scale(Y3[B, T], 0.35355339", _sum_halved: "H1[T] = scale(M1[T], 0.5)",
          _from_two: "H1[B, T] = scale(Y1[B, T], -1.0)",
          _total_halved: "H2[] = scale(M2[], 0.5)", _computed_divisor: "H2[B, T] = scale(H1[B, T], 0.5)"}
# one primitive's map is the language's own (log, sqrt, abs, sin, cos, negative, reciprocal), last in a run apart
NAMED = {_log: ("H1[B, T] = square(Y1[B, T])", "H2[B, T] = log(H1[B, T])"), _sin: ("H1[B, T] = sin(Y1[B, T])",),
         _sqrt: ("H1[B, T] = abs(Y1[B, T])", "H2[B, T] = sqrt(H1[B, T])"), _abs: ("H1[B, T] = abs(Y1[B, T])",),
         _softplus: ("H1[B, T] = exp(Y1[B, T])", "H2[B, T] = shift(H1[B, T], 1.0)", "H3[B, T] = log(H2[B, T])"),
         _reciprocal: ("H3[B, T] = reciprocal(H2[B, T])", "H4[B, T] = cos(H3[B, T])", "H5[B, T] = negative(Y2[B, T])"),
         _divided: ("H3[B, T] = reciprocal(H2[B, T])", "H4[B, T] = scale(H3[B, T], -2.0)", "H5[B, T] = cos(H4[B, T])",
                    "H8[B, T] = reciprocal(H7[B, T])", "H9[B, T] = scale(H8[B, T], 3.0)")}
FAITHFUL = [_mlp_gelu, _mlp_bias_relu, _attention, _rmsnorm, _layernorm, _loss_mean, _tanh_squared, _tanh_then_exp,
            *SCALED, *NAMED]
REFUSED = {_scaled_inside: "a scale by 0.5", _rmsnorm_other_eps: "the epsilon 1e-05 of a rmsnorm",
           _flipped: "a flip", _log_times_tanh: "the run of maps", _softplus_call: "the run of maps",
           _rotary: "parts of a dim put back together",
           _padding_mask: "a run of maps reading a constant array",
           _strictly_causal: "a run of maps reading a constant array"}


def _inputs(fn: Callable[..., Any]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    names = list(inspect.signature(fn).parameters)
    scale = _SCALE.get(fn, 1.0)
    return {n: (rng.standard_normal(_SHAPES[n]) * (scale if n == "x" else 1.0)).astype(np.float32) for n in names}


def _spec(fn: Callable[..., Any], inputs: dict[str, np.ndarray], approximate: bool = False) -> Any:
    closed = jax.make_jaxpr(fn)(*inputs.values())
    program = read_program(closed, [()] * len(inputs), [()] * len(closed.jaxpr.outvars), list(inputs),
                           {"data": 2}, fn.__name__, approximate)
    return program


def _line(fn: Callable[..., Any]) -> str:
    """The line of the program's constant (marked `# the scale`, ...): the one explain names."""
    lines, start = inspect.getsourcelines(fn)
    return f"{__file__}:{start + next(i for i, line in enumerate(lines) if '  # the ' in line)}"


@pytest.mark.slow  # the program run once, jitted (an XLA compile), for the values the spec must have
@pytest.mark.parametrize("fn", FAITHFUL + list(REFUSED), ids=lambda f: f.__name__)
def test_the_spec_explain_writes_computes_the_programs_values_or_it_refuses(fn: Callable[..., Any]) -> None:
    """The property: a program explain reads, its spec computes; one it cannot, it refuses at its line."""
    inputs = _inputs(fn)
    try:
        spec = shardc.parse(_spec(fn, inputs).text)
    except ShardcError as err:
        assert fn in REFUSED and f" at {_line(fn)} " in err.message, err
        return
    values = forward(spec, {k: v.astype(np.float64) for k, v in inputs.items()})
    assert np.allclose(values[spec.statements[-1].result.name], jax.jit(fn)(**inputs), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("fn", list(REFUSED), ids=lambda f: f.__name__)
def test_a_constant_the_language_cannot_say_is_refused_with_its_line(fn: Callable[..., Any]) -> None:
    with pytest.raises(ShardcError, match=f"^{_line(fn)}:[0-9]+: error: {REFUSED[fn]} .* at {_line(fn)} ") as err:
        _spec(fn, _inputs(fn))
    assert "--approximate" in str(err.value.fix)


@pytest.mark.parametrize("fn", list(SCALED), ids=lambda f: f.__name__)
def test_a_scale_or_shift_first_or_last_in_a_run_is_written_with_its_number(fn: Callable[..., Any]) -> None:
    text = _spec(fn, _inputs(fn)).text
    assert SCALED[fn] in text and "# approximate" not in text, text


@pytest.mark.parametrize("fn", list(NAMED), ids=lambda f: f.__name__)
def test_a_primitives_own_map_is_written_as_the_languages(fn: Callable[..., Any]) -> None:
    text = _spec(fn, _inputs(fn)).text
    assert all(line in text for line in NAMED[fn]) and "# approximate" not in text, text


def test_a_log_is_checked_where_it_is_defined() -> None:
    """``jnp.log(x @ w)`` is the language's log: its run and the map agree at the sample points where log is
    defined (x > 0); at the others both are NaN, which equals nothing, and would refuse it."""
    text = _spec(lambda x, w, y: jnp.log(x @ w) + y, _inputs(_log)).text
    assert "H1[B, T] = log(Y1[B, T])" in text and "# approximate" not in text, text


@pytest.mark.parametrize("fn", list(REFUSED), ids=lambda f: f.__name__)
def test_approximately_a_dropped_constant_is_a_note_of_the_spec(fn: Callable[..., Any]) -> None:
    """Under ``approximate`` the spec is read for its shardings (the constant left out), and says so."""
    text = _spec(fn, _inputs(fn), approximate=True).text
    assert [line for line in text.splitlines() if line.startswith("# approximate: ")][0].startswith(
        f"# approximate: {REFUSED[fn]}"), text
    shardc.parse(text)


_PROGRAM = '''
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


def program():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    x = jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    return jax.jit(lambda x: x * jnp.tanh(x * 0.5)), (x,)
'''


@pytest.mark.slow  # two XLA compiles of the program
def test_the_command_refuses_a_scale_inside_a_run_and_approximately_notes_it(capsys: pytest.CaptureFixture[str],
                                                                  tmp_path: Path) -> None:
    program = tmp_path / "scaled.py"
    program.write_text(_PROGRAM, encoding="utf-8")
    fails_clearly(capsys, "explain", f"{program}:program", says=f"a scale by 0.5 (`[16, 4] = mul [16, 4], []`) at "
                                                                 f"{program}:10")
    status, out, err = run_main(capsys, "explain", f"{program}:program", "--approximate")
    assert status == 0 and "# approximate: a scale by 0.5" in out and "= tanh(x[" in out, err



# training steps: jax.grad's forward ends in the loss nothing reads (its gradient seeded with the loss's own
# scale, 1/n of a mean), so the loss's last division or scale is the spec's too, else the spec's gradients differ.
# Each loss reduces h = tanh(x @ w)**2 (xp: numpy, for the program's values with no XLA compile, or jax.numpy)
TRAINING: dict[str, Callable[[Any, Any], Any]] = {
    "mean": lambda xp, h: xp.mean(h), "sum_halved": lambda xp, h: xp.sum(h) * 0.5,
    "mean_doubled": lambda xp, h: 2.0 * xp.mean(h), "sum_over_ten": lambda xp, h: xp.sum(h) / 10.0,
    "mean_of_rows_summed": lambda xp, h: xp.sum(xp.mean(h, axis=0)), "sum": lambda xp, h: xp.sum(h)}


@pytest.mark.parametrize("jitted", [False, True], ids=["loss", "jitted_loss"])
@pytest.mark.parametrize("name", list(TRAINING))
def test_a_training_steps_loss_and_gradients_are_the_specs(name: str, jitted: bool) -> None:
    """The step returns only ``w - 0.1 * grad``: the spec's loss (its last statement, by shardc's float64
    reference) is the program's, and so is the gradient the spec's backward derives of it; a jitted loss's
    result is dropped by its caller (jax's ``_``), its scale read inside it."""
    reduce = TRAINING[name]
    rng = np.random.default_rng(0)
    w, x = rng.standard_normal((8, 32)), rng.standard_normal((16, 8))

    def loss(w: Any, x: Any) -> Any:
        return reduce(jnp, jnp.tanh(x @ w) ** 2)

    grad = jax.grad(jax.jit(loss) if jitted else loss)
    closed = jax.make_jaxpr(lambda w, x: w - 0.1 * grad(w, x))(w.astype(np.float32), x.astype(np.float32))
    spec = shardc.parse(read_program(closed, [(), ()], [()], ["w", "x"], {"data": 2}, name).text)
    last = spec.statements[-1].result.name
    t = np.tanh(x @ w)
    assert np.isclose(forward(spec, {"w": w, "x": x})[last], reduce(np, t**2)), spec
    weight = reduce(np, np.ones_like(t)) / t.size  # each loss is a constant times every element of h, summed
    want = x.T @ (weight * 2 * t * (1 - t**2))
    assert np.allclose(backward(spec, {"w": w, "x": x}, {last: np.ones(())})["w"], want), spec


@pytest.mark.parametrize("jitted", [False, True], ids=["loss", "jitted_loss"])
def test_a_training_step_whose_unread_loss_jax_dropped_is_refused(jitted: bool) -> None:
    """Dead-code elimination (jax's ``dce_jaxpr``, as its lowering runs it) drops the forward's unread loss with
    its whole chain (the mean's division, its sum, the square): the backward's seed is left, what it is the
    gradient of is not, and the spec would have no loss; explain says so, rather than write a forward whose
    derived backward is of something else."""
    from jax._src.interpreters import partial_eval as pe  # the one dead-code elimination jax has

    def loss(w: Any, x: Any) -> Any:
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    grad = jax.grad(jax.jit(loss) if jitted else loss)
    w, x = np.ones((8, 32), np.float32), np.ones((16, 8), np.float32)
    closed = jax.make_jaxpr(lambda w, x: w - 0.1 * grad(w, x))(w, x)
    assert any(e.primitive.name == "reduce_sum" for e in _all_eqns(closed.jaxpr))  # the loss, kept by tracing
    dropped = closed.replace(jaxpr=pe.dce_jaxpr(closed.jaxpr, [True])[0])
    assert not any(e.primitive.name == "reduce_sum" for e in _all_eqns(dropped.jaxpr))
    with pytest.raises(ShardcError, match="holds no loss it is of") as err:
        read_program(dropped, [(), ()], [()], ["w", "x"], {"data": 2}, "dropped")
    assert "value_and_grad" in str(err.value.fix)
    read_program(closed, [(), ()], [()], ["w", "x"], {"data": 2}, "kept")  # with its loss: read


def _all_eqns(jaxpr: Any) -> list[Any]:
    """The equations of ``jaxpr`` and of the jaxprs its calls run."""
    found = []
    for eqn in jaxpr.eqns:
        found.append(eqn)
        inner = eqn.params.get("jaxpr")
        if inner is not None:
            found += _all_eqns(getattr(inner, "jaxpr", inner))
    return found


@pytest.mark.parametrize("jitted", [False, True], ids=["loss", "jitted_loss"])
@pytest.mark.parametrize("dropped", [False, True], ids=["traced", "scale_dropped"])
def test_a_losss_scale_is_read_from_its_gradients_seed_where_jax_dropped_it(dropped: bool, jitted: bool) -> None:
    """``jax.grad(has_aux=True)`` of ``(sum / 512, sum)``: dead-code elimination drops the unread division alone
    (the sum is returned), so the forward holds no scale; the backward's seed, ``1.0 / 512`` broadcast over the
    summed array, is that scale, and the spec's loss and gradients are the program's either way.  A jitted loss
    (flax's and optax's are pjit calls) holds its sum in the forward's call and its seed in the backward's, the
    ``1.0`` passed in and divided there: read through the calls (before, its spec's gradients were 512 times)."""
    from jax._src.interpreters import partial_eval as pe

    def loss(w: Any, x: Any) -> Any:
        total = jnp.sum(jnp.tanh(x @ w) ** 2)
        return total / 512.0, total

    def step(w: Any, x: Any) -> Any:
        grad, total = jax.grad(jax.jit(loss) if jitted else loss, has_aux=True)(w, x)
        return w - 0.1 * grad, total

    rng = np.random.default_rng(0)
    w, x = rng.standard_normal((8, 32)), rng.standard_normal((16, 8))
    closed = jax.make_jaxpr(step)(w.astype(np.float32), x.astype(np.float32))
    if dropped:
        closed = closed.replace(jaxpr=pe.dce_jaxpr(closed.jaxpr, [True, True])[0])
        sums = {e.outvars[0] for e in _all_eqns(closed.jaxpr) if e.primitive.name == "reduce_sum"}
        assert not [e for e in _all_eqns(closed.jaxpr) if e.primitive.name == "div"
                    and not isinstance(e.invars[0], jax.extend.core.Literal) and e.invars[0] in sums]
    spec = shardc.parse(read_program(closed, [(), ()], [(), ()], ["w", "x"], {"data": 2}, "aux").text)
    last = spec.statements[-1].result.name
    t = np.tanh(x @ w)
    assert np.isclose(forward(spec, {"w": w, "x": x})[last], np.sum(t**2) / 512), spec
    want = x.T @ (2 * t * (1 - t**2) / 512)
    assert np.allclose(backward(spec, {"w": w, "x": x}, {last: np.ones(())})["w"], want), spec


@pytest.mark.parametrize("remat", [False, True], ids=["loss", "checkpointed_loss"])
def test_a_cross_entropys_loss_and_gradients_are_the_specs_under_jax_checkpoint(remat: bool) -> None:
    """``jax.checkpoint``'s backward makes the forward again, take_along_axis's zeros (a where's other branch)
    broadcast over the per-example losses' shape among it: zeros seed no gradient, and the loss is the
    cross entropy (before, the spec's loss was scaled by 0, read as its seed)."""

    def loss(w: Any, x: Any, labels: Any) -> Any:
        logits = jnp.tanh(x @ w)
        picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)

    rng = np.random.default_rng(0)
    w, x, labels = rng.standard_normal((8, 4)), rng.standard_normal((16, 8)), rng.integers(0, 4, 16)
    grad = jax.grad(jax.checkpoint(loss) if remat else loss)
    closed = jax.make_jaxpr(lambda w, x, ids: w - 0.1 * grad(w, x, ids))(w.astype(np.float32),
                                                                           x.astype(np.float32), labels)
    spec = shardc.parse(read_program(closed, [()] * 3, [()], ["w", "x", "labels"], {"data": 2}, "ce").text)
    last, inputs = spec.statements[-1].result.name, {"w": w, "x": x, "labels": labels}
    t = np.tanh(x @ w)
    softmax, picked = np.exp(t) / np.exp(t).sum(-1, keepdims=True), np.eye(4)[labels]
    assert np.isclose(forward(spec, inputs)[last], np.mean(np.log(np.exp(t).sum(-1)) - t[np.arange(16), labels]))
    want = x.T @ ((softmax - picked) / 16 * (1 - t**2))
    assert np.allclose(backward(spec, inputs, {last: np.ones(())})["w"], want), spec
