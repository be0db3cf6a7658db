"""``scale(X, a)`` and ``shift(X, b)``: a program's constant scales and shifts as maps of the language
(:mod:`shardc.ops.affine`): parsed with their number (a sign too), refused with a span where the number is
missing or misplaced, planned and fused as any map, and lowered to the reference's values."""

from __future__ import annotations

import numpy as np
import pytest

import shardc
from shardc.errors import ShardcError
from shardc.ir.localops import Affine, AffineVjp
from shardc.lowering.reference import backward as ref_backward
from shardc.lowering.reference import forward as ref_forward
from shardc.ops.elementwise import function

SPEC = """mesh X=2, Y=2
dims B=8, D=16, F=32
param W1, W2

H[B_X, F_Y] = In[B_X, D] · W1[D, F_Y]
G[B_X, F_Y] = scale(gelu(H[B_X, F_Y]), 0.125)
Z[B_X, F_Y] = shift(G[B_X, F_Y], -1.5)
Y[B_X, D] = Z[B_X, F_Y] · W2[F_Y, D]
"""


@pytest.fixture(scope="module")
def plan() -> shardc.Plan:
    return shardc.plan(shardc.parse(SPEC))


def test_scale_and_shift_are_maps_that_keep_the_sharding(plan: shardc.Plan) -> None:
    maps = [(s.fn, str(s.dst)) for s in plan.forward if isinstance(s.fn, Affine)]
    assert maps == [(Affine(scale=0.125), "G[B_X, F_Y]"), (Affine(shift=-1.5), "Z[B_X, F_Y]")]
    assert not any(s.is_collective for s in plan.forward if s.tensor in ("G", "Z"))
    # the gradient is the cotangent times the scale: no argument read, none kept for it
    assert [s.fn for s in plan.backward if isinstance(s.fn, AffineVjp)] == [AffineVjp(1.0), AffineVjp(0.125)]
    assert all(len(s.operands) == 1 for s in plan.backward if isinstance(s.fn, AffineVjp))


def test_the_reference_scales_and_shifts() -> None:
    spec = shardc.parse(SPEC)
    rng = np.random.default_rng(0)
    inputs = {"In": rng.normal(size=(8, 16)), "W1": rng.normal(size=(16, 32)), "W2": rng.normal(size=(32, 8))}
    values = ref_forward(spec, inputs)
    h = inputs["In"] @ inputs["W1"]
    gelu = 0.5 * h * (1 + np.tanh(0.7978845608028654 * (h + 0.044715 * h**3)))
    assert np.allclose(values["Z"], gelu * 0.125 - 1.5)
    dy = rng.normal(size=(8, 8))
    grads = ref_backward(spec, inputs, {"Y": dy})
    assert np.allclose(grads["W2"], values["Z"].T @ dy)  # the shift's gradient is the cotangent
    dh = function("gelu").derivative(h, np) * 0.125 * (dy @ inputs["W2"].T)  # the scale's, times 0.125
    assert np.allclose(grads["W1"], inputs["In"].T @ dh)


def memory_rows(text: str) -> list[float]:
    """The HBM bytes of each step of the spec ``text``'s plan, forward then backward, as the cost model counts them."""
    cost = shardc.cost(shardc.plan(shardc.parse(text)))
    return [r.memory_bytes for phase in (cost.forward, cost.backward) for r in phase.rows]


def test_a_scale_fuses_as_any_other_map_in_the_cost_model() -> None:
    """The run gelu, scale, shift costs what gelu, identity, identity cost (maps whose gradients read no argument
    either): each map's bytes by the same fusion."""
    rows = memory_rows
    other = SPEC.replace("scale(gelu(H[B_X, F_Y]), 0.125)", "identity(gelu(H[B_X, F_Y]))").replace(
        "shift(G[B_X, F_Y], -1.5)", "identity(G[B_X, F_Y])")
    assert rows(SPEC) == rows(other)
    assert rows(SPEC)[1:3] == [0.0, 0.0]  # gelu and the scale fused into the shift's kernel: nothing written


@pytest.mark.slow  # the lowered program compiled and run by XLA
def test_a_spec_with_a_scale_and_a_shift_verifies() -> None:
    from shardc.verification.verify import render_report, verify
    report = verify(shardc.parse(SPEC))
    assert report.ok, render_report(report)


@pytest.mark.parametrize(("call", "says", "column"), [
    ("scale(H[B_X, F_Y])", "`scale` takes 1 tensor and a number", 15),
    ("shift(H[B_X, F_Y], F)", "`shift` takes 1 tensor and a number", 15),
    ("scale(H[B_X, F_Y], 0.5, 2)", "`scale` takes 1 tensor and a number", 15),
    ("scale(0.5, H[B_X, F_Y])", "arguments go tensors first", 21),
    ("shift(H[B_X, F_Y], -x)", "expected a number", 35),
])
def test_a_bad_argument_is_an_error_at_its_place(call: str, says: str, column: int) -> None:
    text = SPEC.replace("scale(gelu(H[B_X, F_Y]), 0.125)", call)
    with pytest.raises(ShardcError, match=says) as err:
        shardc.parse(text)
    assert err.value.span is not None and (err.value.span.line, err.value.span.column) == (6, column), err.value


def test_a_negative_number_parses_with_its_sign() -> None:
    spec = shardc.parse(SPEC.replace("0.125", "-2"))
    call = spec.statements[1].expr
    assert isinstance(call, shardc.ir.spec.Call) and call.numbers == (-2.0,)
