"""Training steps in the styles users write them (``jax.grad``, ``value_and_grad``, ``has_aux``, a jitted loss,
``jax.checkpoint``, optax's losses and optimizers, flax), read by explain off their jaxprs: each spec's loss
(by shardc's float64 reference) is the program's and so are the gradients the spec's backward derives of it,
or explain refuses, saying what it cannot write.

jax's own values are the step's jaxpr evaluated in numpy (float64, no XLA compile): the loss it returns, and
its gradient ``(w - w') / lr`` of an SGD update.  A jaxpr after dead-code elimination (``dce``: what jax's
lowering runs) drops what nothing reads, the forward's unread division of ``has_aux`` returning the sum too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import shardc
from shardc.errors import ShardcError
from shardc.explanation.jaxpr_spec import read_program
from shardc.explanation.numpy_prims import evaluate
from shardc.explanation.run_values import bound
from shardc.lowering.reference import backward, forward

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy

_LR = 0.5  # each step's SGD rate: jax's gradient is (w - w') / _LR
_REDUCE = {"reduce_sum": np.sum, "reduce_max": np.max}


def _mse(p: Any, y: Any) -> Any:
    return jnp.mean((p - y) ** 2)


LOSSES: dict[str, Callable[[Any, Any], Any]] = {
    "mse": _mse, "sum": lambda p, y: jnp.sum((p - y) ** 2), "rows": lambda p, y: jnp.mean(jnp.sum((p - y) ** 2, -1)),
    "l2": lambda p, y: optax.l2_loss(p, y).mean(), "l2_sum": lambda p, y: optax.l2_loss(p, y).sum(),
    "by_shape": lambda p, y: jnp.sum((p - y) ** 2) / (p.shape[0] * 2.0),
    "sce": lambda p, y: optax.softmax_cross_entropy(p, y).mean(),
    "sigmoid_bce": lambda p, y: optax.sigmoid_binary_cross_entropy(p, y).mean(),
    "huber": lambda p, y: optax.huber_loss(p, y).mean(),
    "regularized": lambda p, y: _mse(p, y) + 1e-3 * jnp.sum(p**2)}


def _model(w1: Any, w2: Any, x: Any) -> Any:
    return jnp.tanh(x @ w1) @ w2


def _step(loss_name: str, style: str) -> Callable[..., Any]:
    """``(w1, w2, x, y) -> (w1', w2', the loss or what has_aux returns)`` in ``style``."""
    reduce = LOSSES[loss_name]

    def loss(w1: Any, w2: Any, x: Any, y: Any) -> Any:
        return reduce(_model(w1, w2, x), y)

    def with_sum(w1: Any, w2: Any, x: Any, y: Any) -> Any:  # the loss's sum returned too: has_aux
        total = jnp.sum((_model(w1, w2, x) - y) ** 2)
        return total / 64.0, total

    def with_metric(w1: Any, w2: Any, x: Any, y: Any) -> Any:  # a mean absolute error beside the loss: has_aux
        return loss(w1, w2, x, y), jnp.mean(jnp.abs(_model(w1, w2, x) - y))

    fn = {"jit": jax.jit(loss), "checkpoint": jax.checkpoint(loss), "aux": lambda *a: (loss(*a), _model(*a[:3])),
          "sum_aux": with_sum, "jit_sum_aux": jax.jit(with_sum), "metric": with_metric}.get(style, loss)

    def step(w1: Any, w2: Any, x: Any, y: Any) -> Any:
        if style in ("sgd", "adam"):
            opt = optax.sgd(_LR) if style == "sgd" else optax.adam(1e-3)
            value, grads = jax.value_and_grad(lambda p: loss(*p, x, y))((w1, w2))
            updates, _ = opt.update(grads, opt.init((w1, w2)), (w1, w2))
            return (*optax.apply_updates((w1, w2), updates), value)
        aux = style in ("aux", "sum_aux", "jit_sum_aux", "metric")
        if style == "grad":
            value, grads = 0.0, jax.grad(fn, (0, 1))(w1, w2, x, y)
        elif style.endswith("sum_aux"):
            grads, value = jax.grad(fn, (0, 1), has_aux=True)(w1, w2, x, y)
        else:
            value, grads = jax.value_and_grad(fn, (0, 1), has_aux=aux)(w1, w2, x, y)
            value = value if style == "metric" else value[0] if aux else value  # the loss (and the metric)
        return w1 - _LR * grads[0], w2 - _LR * grads[1], value

    return step


# (loss, style, dce) the spec reads faithfully
EXPLAINED = [("mse", "grad", False), ("mse", "value_and_grad", True), ("mse", "jit", True), ("mse", "aux", True),
             ("mse", "checkpoint", True), ("mse", "sgd", True), ("mse", "adam", True), ("sum", "jit", True),
             ("rows", "value_and_grad", True), ("l2", "sgd", True), ("l2_sum", "jit", True),
             ("by_shape", "aux", False), ("by_shape", "checkpoint", True), ("mse", "sum_aux", True),
             ("mse", "jit_sum_aux", True), ("mse", "jit_sum_aux", False), ("sce", "value_and_grad", True),
             ("sce", "jit", True), ("sce", "checkpoint", False)]
# (loss, style, dce) explain refuses, and what its message says
REFUSED = {("sigmoid_bce", "jit", True): "is not the language's `exp`",  # softplus, logaddexp(x, 0)
           ("huber", "value_and_grad", True): "a scale by 0.5",  # inside where's branch
           ("regularized", "value_and_grad", True): "an addition of a scalar",  # two losses added
           ("mse", "grad", True): "holds no loss it is of",  # jax.grad's unread loss dropped whole
           ("mse", "metric", False): "scalars of more than one sum",  # has_aux's metric: which is the loss?
           ("mse", "metric", True): "scalars of more than one sum"}


def _numpy(eqn: Any, xs: list[Any]) -> Any:
    """One primitive of a training step in numpy (float64): a map's (explain's own), or a sum or maximum over axes,
    or jax's sum of cotangents."""
    name = eqn.primitive.name
    if name in _REDUCE:
        return _REDUCE[name](xs[0], axis=tuple(eqn.params["axes"]))
    return np.add(*xs) if name == "add_any" else xs[0] if name in ("copy", "stop_gradient") else evaluate(eqn, xs)


def _read(loss_name: str, style: str, dce: bool) -> tuple[Any, Any, dict[str, np.ndarray]]:
    """(the step's closed jaxpr, its spec, the inputs)."""
    from jax._src.interpreters import partial_eval as pe  # the one dead-code elimination jax has

    rng = np.random.default_rng(0)
    inputs = {"w1": rng.standard_normal((8, 32)) * 0.3, "w2": rng.standard_normal((32, 4)) * 0.3,
              "x": rng.standard_normal((16, 8)), "y": rng.standard_normal((16, 4))}
    if loss_name == "sce":
        inputs["y"] = np.eye(4)[rng.integers(0, 4, 16)]
    closed = jax.make_jaxpr(_step(loss_name, style))(*(v.astype(np.float32) for v in inputs.values()))
    if dce:
        closed = closed.replace(jaxpr=pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars),
                                                   instantiate=True)[0])
    results = [()] * len(closed.jaxpr.outvars)
    text = read_program(closed, [()] * 4, results, list(inputs), {"data": 2}, f"{loss_name}_{style}").text
    return closed, shardc.parse(text), inputs


@pytest.mark.parametrize(("loss_name", "style", "dce"), EXPLAINED, ids=lambda v: str(v))
def test_a_training_steps_spec_has_its_loss_and_gradients(loss_name: str, style: str, dce: bool) -> None:
    closed, spec, inputs = _read(loss_name, style, dce)
    new_w1, new_w2, value = bound(closed, list(inputs.values()), _numpy)
    values = forward(spec, inputs)
    # the spec's loss: the scalar the step's returned loss is (a sum has_aux returns is the loss's numerator)
    loss = float(value) / (64.0 if "sum_aux" in style else 1.0)
    if style == "grad":  # jax.grad returns no loss: the program's, by its function
        loss = float(bound(jax.make_jaxpr(lambda *a: LOSSES[loss_name](_model(*a[:3]), a[3]))(
            *inputs.values()), list(inputs.values()), _numpy)[0])
    found = [s.result.name for s in spec.statements if not s.result.dims and np.isclose(values[s.result.name], loss)]
    assert found and found[-1] == spec.statements[-1].result.name, (loss, spec)
    grads = backward(spec, inputs, {found[-1]: np.ones(())})
    assert set(spec.params) == {"w1", "w2"}, spec
    if style != "adam":  # an SGD step: jax's gradients are (w - w') / lr
        assert np.allclose(grads["w1"], (inputs["w1"] - new_w1) / _LR, rtol=1e-4, atol=1e-6), spec
        assert np.allclose(grads["w2"], (inputs["w2"] - new_w2) / _LR, rtol=1e-4, atol=1e-6), spec


@pytest.mark.parametrize(("loss_name", "style", "dce"), list(REFUSED), ids=lambda v: str(v))
def test_a_training_step_explain_cannot_write_is_refused(loss_name: str, style: str, dce: bool) -> None:
    with pytest.raises(ShardcError) as err:
        _read(loss_name, style, dce)
    assert REFUSED[(loss_name, style, dce)] in err.value.message and err.value.fix, err.value
