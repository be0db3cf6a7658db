"""The maps a user's program writes beside the activations: ``log``, ``sqrt``, ``rsqrt``, ``reciprocal``, ``abs``,
``sin``, ``cos``, ``negative`` (:mod:`shardc.ops.elementwise`): each derivative is its forward's, XLA's fusion
counts the right ones expensive, each is planned as a map (``negative``'s gradient reads no argument), and verify
draws the inputs a map defined on part of the reals reads in its domain, saying where a computed argument leaves
it (:mod:`shardc.verification.domains`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import shardc
from shardc.ir.localops import Map, MapVjp
from shardc.ir.spec import Mesh, MeshAxis, Schedule
from shardc.lowering.api import drawn_in, lower
from shardc.ops.elementwise import FUNCTIONS, TRANSCENDENTAL, function
from shardc.spec.functions import DOMAINS, ELEMENTWISE, signature
from shardc.spec.walk import domain_reads
from shardc.verification.domains import outside_notes

NEW = ("log", "sqrt", "rsqrt", "reciprocal", "abs", "sin", "cos", "negative")

SPEC = """mesh X=2, Y=2
dims B=8, D=16, F=32
param W1, W2

H[B_X, F_Y] = In[B_X, D] · W1[D, F_Y]
P2[B_X, F_Y] = P[B_X, F_Y]
S[B_X, F_Y] = sin(H[B_X, F_Y]) + cos(H[B_X, F_Y]) + abs(H[B_X, F_Y]) + negative(H[B_X, F_Y])
G[B_X, F_Y] = S[B_X, F_Y] + log(P2[B_X, F_Y]) + sqrt(P[B_X, F_Y]) + rsqrt(P[B_X, F_Y]) + reciprocal(Q[B_X, F_Y])
Y[B_X, D] = G[B_X, F_Y] · W2[F_Y, D]
"""
# log of a product of normal inputs: no draw keeps its argument positive
OUTSIDE = SPEC.replace("log(P2[B_X, F_Y])", "log(H[B_X, F_Y])")


@pytest.fixture(scope="module")
def plan() -> shardc.Plan:
    return shardc.plan(shardc.parse(SPEC))


@pytest.mark.parametrize("name", NEW)
def test_each_derivative_is_its_forwards_slope_in_its_domain(name: str) -> None:
    f = function(name)
    x = drawn_in(signature(name).domain, np.linspace(-3.0, 3.0, 61) + 0.01)  # off 0, where abs has no slope
    h = 1e-6
    slope = (f.forward(x + h, np) - f.forward(x - h, np)) / (2 * h)
    assert np.allclose(f.derivative(x, np), slope, rtol=1e-6, atol=1e-6)
    assert np.all(f.slope_terms(x) >= np.abs(f.derivative(x, np)) * (1 - 1e-12))  # the terms bound the slope


def test_xla_counts_a_divide_log_sqrt_rsqrt_expensive_and_abs_sin_cos_negate_cheap() -> None:
    """jax's derivatives of log, sqrt, rsqrt and reciprocal divide (expensive for floats in ``IsExpensive``);
    abs's is a select, sin's a cos, cos's a sin, negative's a negate: cheap for real numbers."""
    assert {"log", "sqrt", "rsqrt", "reciprocal"} <= TRANSCENDENTAL
    assert not {"abs", "sin", "cos", "negative"} & TRANSCENDENTAL
    assert TRANSCENDENTAL <= set(FUNCTIONS) and set(ELEMENTWISE) <= set(FUNCTIONS)


def test_the_maps_keep_the_sharding_and_negatives_gradient_reads_no_argument(plan: shardc.Plan) -> None:
    maps = {s.fn.name for s in plan.forward if isinstance(s.fn, Map)}
    assert set(NEW) <= maps
    assert not any(s.is_collective for s in plan.forward if s.tensor in ("G", "P2"))
    negated = [s for s in plan.backward if isinstance(s.fn, Map) and s.fn.name == "negative"]
    assert len(negated) == 1 and len(negated[0].operands) == 1  # -dG, the cotangent alone
    reads = {s.fn.name: len(s.operands) for s in plan.backward if isinstance(s.fn, MapVjp)}
    assert {reads[n] for n in NEW if n != "negative"} == {2}  # f'(x) dG: the argument and the cotangent


def test_an_input_a_map_reads_is_drawn_in_its_domain_through_a_copy(plan: shardc.Plan) -> None:
    spec = plan.spec
    assert domain_reads(spec) == {"P2": "positive", "P": "positive", "Q": "nonzero"}
    drawn = lower(plan, sizes={"B": 8, "D": 16, "F": 32}).random_inputs(0, np.float64)
    assert drawn["P"].min() >= 0.5 and np.abs(drawn["Q"]).min() >= 0.5 and (drawn["Q"] < 0).any()
    assert (drawn["In"] < 0).any()  # every real: standard normal
    assert outside_notes(spec, drawn) == []
    normal = {k: np.random.default_rng(0).standard_normal(v.shape) for k, v in drawn.items()}
    notes = outside_notes(spec, normal)  # a normal draw leaves each map's domain somewhere
    assert [n.split(" is outside")[0] for n in notes] == ["the argument of log in G", "the argument of sqrt in G",
                                                          "the argument of rsqrt in G"], notes


def test_a_computed_argument_outside_the_domain_is_named() -> None:
    spec = shardc.parse(OUTSIDE)
    rng = np.random.default_rng(0)
    inputs = {n: drawn_in(domain_reads(spec).get(n, ""), rng.standard_normal(s)) for n, s in
              {"In": (8, 16), "W1": (16, 32), "W2": (32, 16), "P": (8, 32), "Q": (8, 32)}.items()}
    (note,) = outside_notes(spec, inputs)
    assert note.startswith("the argument of log in G is outside its domain (x > 0) at ") and " of 256 " in note


def test_a_domain_holds_no_nan() -> None:
    for _, inside in DOMAINS.values():
        assert not inside(np.array([np.nan])).any()


@pytest.mark.slow  # the lowered program compiled and run by XLA
def test_a_spec_of_every_new_map_verifies(plan: shardc.Plan) -> None:
    from shardc.verification.verify import render_report, verify
    report = verify(plan)
    assert report.ok, render_report(report)
    assert {r.tensor for r in report.values} >= {"G", "dP", "dQ", "dIn"}


PIPELINED = """\
mesh X=4, Y=2
dims B=64, S=16, D=32, F=64, V=128
const Tok, Next
param W_emb, W1, W2, W_out
X0[B_X, S, D] = embed(Tok[B_X, S], W_emb[V_Y, D_X])
layers 4 {
  H[B_X, S, F_Y] = gelu(X0[B_X, S, D] · W1[D_X, F_Y])
  R[F_Y, D_X] = sqrt(W2[F_Y, D_X])
  X1[B_X, S, D] = X0[B_X, S, D] + H[B_X, S, F_Y] · R[F_Y, D_X]
}
Fn[B_X, S, D] = rmsnorm(X1[B_X, S, D] over D)
Lg[B_X, S, V_Y] = Fn[B_X, S, D] · W_out[D_X, V_Y]
Loss[] = cross_entropy(Lg[B_X, S, V_Y], Next[B_X, S])
"""


def test_a_pipelined_verify_draws_a_stacked_param_a_map_reads_in_its_domain() -> None:
    """Each layer's W2, read by sqrt, is drawn positive (then scaled, as every stacked param is); W1 is not."""
    from shardc.lowering.pipeline_lowering import lower_pipeline
    from shardc.verification.pipeline_verify import draw_inputs, run_sizes

    spec = shardc.parse(PIPELINED)
    plan = shardc.plan(dataclasses.replace(spec, mesh=Mesh((MeshAxis("P", 2, pipeline=True), *spec.mesh.axes)),
                                           microbatches=4, schedule=Schedule("1f1b", 1)))
    drawn = draw_inputs(lower_pipeline(plan, *run_sizes(plan, 8)), 0, 0)
    assert drawn["W2"].min() > 0 and drawn["W1"].min() < 0
