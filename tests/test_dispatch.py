"""Index-based expert routing: ``dispatch`` and ``combine`` (shardc/ops/dispatch.py), planned, costed,
lowered and verified; the same values as ``route``'s one-hot mask and its einsums."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardc
from shardc.errors import ShardcError
from shardc.ir.localops import Dispatch
from shardc.ir.plan import Op, Plan
from shardc.lowering.api import module_source
from shardc.lowering.reference import backward as ref_backward
from shardc.lowering.reference import forward as ref_forward
from shardc.ops.dispatch_code import whole_forward, whole_vjp
from shardc.planner.check import check_plan
from shardc.verification.verify import render_report, verify
from tests.example_reports import example_report

EXAMPLE = Path(__file__).parent.parent / "examples" / "moe_dispatch.shard"

HEAD = "mesh X=2\ndims G=4, S=8, E=4, C=3, D=6, F=5\ndtype f32\nparam W_r, W_1, W_2\n"
ROUTER = "Gate[G_X, S, E] = softmax(X[G_X, S, D] · W_r[D, E] over E)\n"
EXPERTS = ("H[G, E_X, C, F] = relu(In[G, E_X, C, D] · W_1[E_X, D, F])\n"
           "Ex[G, E_X, C, D] = H[G, E_X, C, F] · W_2[E_X, F, D]\n")
INDEXED = (HEAD + ROUTER + "In[G, E_X, C, D] = dispatch(Gate[G_X, S, E], X[G_X, S, D], S, C, 2 over E)\n" + EXPERTS
           + "Out[G_X, S, D] = combine(Gate[G_X, S, E], Ex[G, E_X, C, D], S, C, 2 over E)\n")
DENSE = (HEAD + ROUTER + "Disp[G_X, S, E, C] = route(Gate[G_X, S, E], S, C, 2 over E)\n"
         "Comb[G_X, S, E, C] = Gate[G_X, S, E] * Disp[G_X, S, E, C]\n"
         "In[G, E_X, C, D] = Disp[G_X, S, E, C] · X[G_X, S, D]\n" + EXPERTS
         + "Out[G_X, S, D] = Comb[G_X, S, E, C] · Ex[G, E_X, C, D]\n")


def _plan(text: str) -> Plan:
    p = shardc.plan(shardc.parse(text))
    assert check_plan(p) == []
    return p


def _inputs(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"X": rng.normal(size=(4, 8, 6)), "W_r": rng.normal(size=(6, 4)), "W_1": rng.normal(size=(4, 6, 5)),
            "W_2": rng.normal(size=(4, 5, 6))}


def test_the_plan_moves_tokens_by_alltoall_and_holds_no_mask() -> None:
    p = _plan(INDEXED)
    sizes = p.spec.sizes or {}
    tokens = 4 * 4 * 3 * 6 * 4 // 4  # f32 G*E*C*D; an AllToAll weighs a quarter of its bytes
    moved = [(s.op, s.tensor, int(s.weighted_volume().evaluate(sizes)))  # type: ignore[union-attr]
             for s in p.forward if s.is_collective]
    assert moved == [(Op.ALL_TO_ALL, "In", tokens), (Op.ALL_TO_ALL, "Ex", tokens)]
    parts = [s.fn.part for s in p.forward + p.backward if isinstance(s.fn, Dispatch)]
    assert parts == ["dispatch", "combine", "combine_vjp", "combine_gate_vjp", "dispatch_vjp"]
    assert all(len(r.indices) < 4 or "S" not in r.indices for r in p.residuals)  # no [G, S, E, C] kept
    assert {g.name for g in p.grads} == {"dX", "dW_r", "dW_1", "dW_2"}


def test_dispatch_and_combine_cost_no_flops_and_the_dense_mask_does() -> None:
    big = {"G": 64, "S": 4096, "E": 256, "C": 160, "D": 1024, "F": 512}
    text = {k: t.replace("dims G=4, S=8, E=4, C=3, D=6, F=5",
                         "dims " + ", ".join(f"{n}={v}" for n, v in big.items())) for k, t in
            (("indexed", INDEXED), ("dense", DENSE))}
    flops = {k: shardc.cost(shardc.plan(shardc.parse(t))).step.compute_flops for k, t in text.items()}
    g, s, e, c, d, f = big.values()
    experts = 3 * 2 * 2 * g * e * c * d * f / 2  # two matmuls, forward and two backward, over X=2
    router = 3 * 2 * g * s * d * e / 2
    assert flops["indexed"] == pytest.approx(experts + router, rel=1e-9)
    assert flops["dense"] > 2 * flops["indexed"]  # the one-hot einsums: G*S*E*C*D each, more than the experts

# the gates applied at the experts (DeepEP's way): each slot's gate dispatched with the tokens, the SwiGLU-like
# output weighed by it, the rows summed back unweighted; the same function as INDEXED
AT_EXPERTS = (HEAD + ROUTER + "In[G, E_X, C, D] = dispatch(Gate[G_X, S, E], X[G_X, S, D], S, C, 2 over E)\n"
              "Gw[G, E_X, C] = dispatch(Gate[G_X, S, E], Gate[G_X, S, E], S, C, 2 over E)\n"
              "H[G, E_X, C, F] = relu(In[G, E_X, C, D] · W_1[E_X, D, F]) * Gw[G, E_X, C]\n"
              "Ex[G, E_X, C, D] = H[G, E_X, C, F] · W_2[E_X, F, D]\n"
              "Out[G_X, S, D] = collect(Gate[G_X, S, E], Ex[G, E_X, C, D], S, C, 2 over E)\n")

def test_the_values_are_route_s_dense_ones() -> None:
    """The reference of dispatch/combine (the mask form, written again) against route's spec, forward and
    backward, at sizes that drop tokens."""
    inputs = _inputs(0)
    got = ref_forward(shardc.parse(INDEXED), inputs, sizes={"C": 3})
    want = ref_forward(shardc.parse(DENSE), inputs, sizes={"C": 3})
    np.testing.assert_allclose(got["Out"], want["Out"], rtol=1e-12)
    np.testing.assert_allclose(got["In"], want["In"], rtol=1e-12)
    assert np.count_nonzero(np.abs(got["In"]).sum(axis=-1)) < 4 * 8 * 2  # some tokens were dropped
    d_out = {"Out": np.random.default_rng(1).normal(size=(4, 8, 6))}
    g_got = ref_backward(shardc.parse(INDEXED), inputs, d_out, sizes={"C": 3})
    g_want = ref_backward(shardc.parse(DENSE), inputs, d_out, sizes={"C": 3})
    for name in ("X", "W_r", "W_1", "W_2"):
        np.testing.assert_allclose(g_got[name], g_want[name], rtol=1e-9, atol=1e-12)



def test_gates_weighed_at_the_experts_are_the_combine_s_values_and_keep_no_expert_output() -> None:
    """dispatch of the gates (a value per token and expert) and collect (combine unweighted): the same
    output and gradients as combine's, and the backward keeps no expert output Ex for the gates' gradient
    (it is the weighed rows' gradient dotted with the unweighed rows, on the experts' side)."""
    inputs, d_out = _inputs(0), {"Out": np.random.default_rng(1).normal(size=(4, 8, 6))}
    got = ref_forward(shardc.parse(AT_EXPERTS), inputs, sizes={"C": 3})
    np.testing.assert_allclose(got["Out"], ref_forward(shardc.parse(INDEXED), inputs, sizes={"C": 3})["Out"],
                               rtol=1e-12)
    g_got = ref_backward(shardc.parse(AT_EXPERTS), inputs, d_out, sizes={"C": 3})
    g_want = ref_backward(shardc.parse(INDEXED), inputs, d_out, sizes={"C": 3})
    for name in ("X", "W_r", "W_1", "W_2"):
        np.testing.assert_allclose(g_got[name], g_want[name], rtol=1e-9, atol=1e-12)
    p = _plan(AT_EXPERTS)
    assert "Ex" in {r.name for r in _plan(INDEXED).residuals} and "Ex" not in {r.name for r in p.residuals}
    parts = [str(s.fn) for s in p.forward + p.backward if isinstance(s.fn, Dispatch)]
    assert parts == ["dispatch(S,E,C,2)", "dispatch(S,E,C,2,each)", "collect(S,E,C,2)", "collect_vjp(S,E,C,2)",
                     "dispatch_vjp(S,E,C,2,each)", "dispatch_vjp(S,E,C,2)"]


@pytest.mark.slow
def test_gates_weighed_at_the_experts_verify() -> None:
    report = verify(_plan(AT_EXPERTS))
    assert report.ok, render_report(report)


def test_collect_round_trips_and_takes_combine_s_arguments() -> None:
    line = "Out[G_X, S, D] = collect(Gate[G_X, S, E], Ex[G, E_X, C, D], S, C, 2 over E, 1, 2)"
    spec = shardc.parse(AT_EXPERTS.replace(AT_EXPERTS.splitlines()[-1], line))
    assert str(spec.statements[-1]).startswith("Out[G_X, S, D] = collect(") and shardc.parse(str(spec)) == spec
    with pytest.raises(ShardcError, match="the expert outputs Ex carry every index") as err:
        shardc.plan(shardc.parse(AT_EXPERTS.replace("Ex[G, E_X, C, D], S, C", "Ex[G, E_X, D], S, C")))
    assert err.value.span is not None and "collect" in err.value.span.source_line

@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_the_runtime_helpers_match_the_dense_meaning(k: int, capacity: int, seed: int) -> None:
    import jax.numpy as jnp

    from shardc.lowering import runtime

    rng = np.random.default_rng(seed)
    gates = np.round(rng.normal(size=(2, 5, 3)), 1).astype(np.float32)  # rounded: ties happen
    x, d = rng.normal(size=(2, 5, 4)).astype(np.float32), rng.normal(size=(2, 5, 4)).astype(np.float32)
    rows = rng.normal(size=(2, 3, capacity, 4)).astype(np.float32)
    j = {n: jnp.asarray(v) for n, v in (("g", gates), ("x", x), ("d", d), ("rows", rows))}

    def close(a: object, b: np.ndarray) -> None:
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5)

    close(runtime.expert_dispatch(j["g"], j["x"], k, capacity), whole_forward("dispatch", gates, x, k, capacity, np))
    close(runtime.expert_combine(j["g"], j["rows"], k, capacity),
          whole_forward("combine", gates, rows, k, capacity, np))
    close(runtime.expert_dispatch_vjp(j["g"], j["rows"], k, capacity),
          whole_vjp("dispatch", gates, x, rows, k, capacity, np)[1])
    d_gates, d_rows = whole_vjp("combine", gates, rows, d, k, capacity, np)
    close(runtime.expert_combine_vjp(j["g"], j["d"], k, capacity), d_rows)
    assert d_gates is not None
    close(runtime.expert_gate_vjp(j["g"], j["d"], j["rows"], k, capacity), d_gates)
    each = rng.normal(size=(2, 5, 3, 4)).astype(np.float32)  # a row per token and expert
    close(runtime.expert_dispatch(j["g"], jnp.asarray(each), k, capacity, each=True),
          whole_forward("dispatch", gates, each, k, capacity, np, each=True))
    close(runtime.expert_dispatch_vjp(j["g"], j["rows"], k, capacity, each=True),
          whole_vjp("dispatch", gates, each, rows, k, capacity, np, each=True)[1])
    close(runtime.expert_dispatch_vjp(j["g"], j["rows"], k, capacity), whole_forward("collect", gates, rows, k,
                                                                                      capacity, np))
    close(runtime.expert_dispatch(j["g"], j["d"], k, capacity), whole_vjp("collect", gates, rows, d, k, capacity,
                                                                         np)[1])


def test_the_lowered_capacity_is_the_share_of_the_tokens() -> None:
    source, _ = module_source(_plan(INDEXED))
    lines = [t for t in source.splitlines() if "expert_" in t and " = expert_" in t]
    assert len(lines) == 5 and all("capacity=-(-Gate.shape[1] * 3 // 8)" in t for t in lines)


@pytest.mark.slow
def test_the_small_spec_verifies_values_and_hlo_with_features_sharded() -> None:
    """D sharded over Y: the gates' gradient is a partial sum over Y, reduced by the plan."""
    text = (INDEXED.replace("mesh X=2", "mesh X=2, Y=2").replace("X[G_X, S, D]", "X[G_X, S, D_Y]")
            .replace("Out[G_X, S, D]", "Out[G_X, S, D_Y]"))
    p = _plan(text)
    (gate_vjp,) = [s for s in p.backward if isinstance(s.fn, Dispatch) and s.fn.part == "combine_gate_vjp"]
    assert gate_vjp.dst.unreduced == ("Y",)
    report = verify(p)
    assert report.ok, render_report(report)


@pytest.mark.slow
def test_the_example_verifies() -> None:
    report = example_report(EXAMPLE.stem)  # shared with test_lower's verification of every example
    assert report.ok, render_report(report)


@pytest.mark.parametrize(("call", "message"), [
    ("dispatch(Gate[G, S, E], X[G, D], S, C, 2 over E)", "the tokens X carry every index of the gates but E"),
    ("dispatch(Gate[G, S, E], X[G, S, D], S, E, 2 over E)", "capacity index E is an index of its argument"),
    ("dispatch(Gate[G, S, E], X[G, S, D], S, C, 5 over E)", "k=5 is not a whole number of experts"),
    ("dispatch(Gate[G, S, E], S, C, 2 over E)", "`dispatch` takes 2 tensors, 2 index names, a number and `over`"),
])
def test_dispatch_errors(call: str, message: str) -> None:
    text = f"mesh X=2\ndims G=4, S=8, E=4, C=3, D=6\nIn[G, E, C, D] = {call}\n"
    with pytest.raises(ShardcError) as err:
        shardc.plan(shardc.parse(text))
    assert message in err.value.message


def test_combine_needs_the_expert_rows_indexed_by_slot() -> None:
    text = ("mesh X=2\ndims G=4, S=8, E=4, C=3, D=6\n"
            "Y[G, S, D] = combine(Gate[G, S, E], Ex[G, E, D], S, C, 2 over E)\n")
    with pytest.raises(ShardcError, match="the expert outputs Ex carry every index"):
        shardc.plan(shardc.parse(text))


def test_gates_read_by_dispatch_alone_get_no_gradient() -> None:
    """dispatch's gradient reaches the tokens only (a routing is 0/1): a router read by nothing else is
    not trained, and no step waits for its gradient."""
    p = _plan(HEAD.replace(", W_2", "") + ROUTER
              + "In[G, E_X, C, D] = dispatch(Gate[G_X, S, E], X[G_X, S, D], S, C, 2 over E)\n"
              "Out[G, E_X, C, F] = In[G, E_X, C, D] · W_1[E_X, D, F]\n")
    assert {g.name for g in p.grads} == {"dX", "dW_1"}
    assert not any(s.dst.name.startswith("dGate") for s in p.backward)
    made = {s.dst.name for s in p.backward}
    assert not any(s.op is Op.ELEMENTWISE and len(s.operands) == 1 and s.operands[0].name in made
                   and str(s.fn).startswith("add") for s in _plan(INDEXED).backward)  # no sum of one part


PIPELINED = """mesh P=2 pipeline, X=2
dims B=8, S=8, E=4, C=4, D=6, F=5, V=11
microbatches 2
dtype f32
const Tok, Next
param W_emb, W_r, W_1, W_2, W_out
X0[B_X, S, D] = embed(Tok[B_X, S], W_emb[V, D])
layers 2 {
  Gate[B_X, S, E] = softmax(X0[B_X, S, D] · W_r[D, E] over E)
  In[B, E_X, C, D] = dispatch(Gate[B_X, S, E], X0[B_X, S, D], S, C, 2 over E)
  H[B, E_X, C, F] = relu(In[B, E_X, C, D] · W_1[E_X, D, F])
  Ex[B, E_X, C, D] = H[B, E_X, C, F] · W_2[E_X, F, D]
  Y[B_X, S, D] = combine(Gate[B_X, S, E], Ex[B, E_X, C, D], S, C, 2 over E)
  X1[B_X, S, D] = X0[B_X, S, D] + Y[B_X, S, D]
}
Lg[B_X, S, V] = X1[B_X, S, D] · W_out[D, V]
Loss[] = cross_entropy(Lg[B_X, S, V], Next[B_X, S])
"""


@pytest.mark.slow
def test_a_pipelined_stack_of_routed_layers_verifies() -> None:
    report = verify(_plan(PIPELINED))
    assert report.ok, render_report(report)
