"""Mixture of experts: ``route`` (top-k routing with capacity) and expert parallelism's AllToAlls.

``examples/moe_layer.shard`` itself is verified (values and HLO) by tests/test_lower.py, with every example."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import shardc
from shardc.errors import ShardcError
from shardc.ir.localops import Route
from shardc.ir.plan import Op, Plan
from shardc.lowering.reference import backward as ref_backward
from shardc.lowering.reference import forward as ref_forward
from shardc.lowering.sizes import small_sizes
from shardc.ops.route_code import route_forward
from shardc.planner.check import check_plan
from shardc.verification.verify import render_report, verify

MOE = Path(__file__).parent.parent / "examples" / "moe_layer.shard"


def _plan(text: str) -> Plan:
    p = shardc.plan(shardc.parse(text))
    assert check_plan(p) == []
    return p


def _collectives(plan: Plan, phase: str) -> list[tuple[Op, tuple[str, ...], str, int]]:
    sizes = plan.spec.sizes or {}
    return [(s.op, s.axes, s.tensor, int(s.weighted_volume().evaluate(sizes)))  # type: ignore[union-attr]
            for s in getattr(plan, phase) if s.is_collective]


def test_moe_layer_plans_dispatch_and_combine_alltoalls_and_all_reduces_only_the_router() -> None:
    p = shardc.plan(shardc.parse(MOE.read_text(), filename=str(MOE)))
    assert check_plan(p) == []
    tokens = 4 * 64 * 320 * 4096 * 8 // 4  # f32 G*E*C*D; an AllToAll weighs a quarter of its bytes
    assert _collectives(p, "forward") == [(Op.ALL_TO_ALL, ("X",), "In", tokens),
                                          (Op.ALL_TO_ALL, ("X",), "Ex", tokens)]
    # the transposed AllToAlls, and the router's data-parallel gradient: 2 * 4 bytes * D * E
    assert _collectives(p, "backward") == [(Op.ALL_TO_ALL, ("X",), "dEx", tokens),
                                           (Op.ALL_TO_ALL, ("X",), "dIn", tokens),
                                           (Op.ALL_REDUCE, ("X",), "dW_r", 2 * 4 * 4096 * 8)]
    (route,) = [s for s in p.forward if isinstance(s.fn, Route)]
    assert str(route.operands[0]) == "Gate[G_X, S, E]" and str(route.dst) == "Disp[G_X, S, E, C]"
    assert "dDisp" not in {g.name for g in p.grads} and [g.name for g in p.grads] == ["dX", "dW_r", "dW_1", "dW_2"]
    assert all(s.dst.name != "dDisp" for s in p.backward)  # the mask's gradient is never made


SMALL = """mesh X=2
dims G=4, S=8, E=4, C=3, D=6, F=5
dtype f32
Gate[G_X, S, E] = softmax(X[G_X, S, D] · W_r[D, E] over E)
Disp[G_X, S, E, C] = route(Gate[G_X, S, E], S, C, 2 over E)
Comb[G_X, S, E, C] = Gate[G_X, S, E] * Disp[G_X, S, E, C]
In[G, E_X, C, D] = Disp[G_X, S, E, C] · X[G_X, S, D]
Ex[G, E_X, C, D] = gelu(In[G, E_X, C, D] · W_1[E_X, D, F]) · W_2[E_X, F, D]
Out[G_X, S, D] = Comb[G_X, S, E, C] · Ex[G, E_X, C, D]
"""


@pytest.mark.slow
def test_a_routed_layer_that_drops_tokens_verifies_with_its_own_sizes() -> None:
    # 8 tokens x 2 choices over 4 experts of 3 slots: some tokens are dropped at every expert they chose
    spec = shardc.parse(SMALL)
    rng = np.random.default_rng(0)
    mask = ref_forward(spec, {"X": rng.normal(size=(4, 8, 6)), "W_r": rng.normal(size=(6, 4)),
                              "W_1": rng.normal(size=(4, 6, 5)), "W_2": rng.normal(size=(4, 5, 6))},
                       sizes={"C": 3})["Disp"]
    assert mask.sum() < 4 * 8 * 2 and mask.sum(axis=1).max() == 1  # dropped ones; a slot holds one token
    report = verify(spec)
    assert report.ok, render_report(report)


def test_gathered_route_when_its_tokens_are_sharded() -> None:
    p = _plan(SMALL.replace("mesh X=2", "mesh X=2, Y=2").replace("Gate[G_X, S, E]", "Gate[G_X, S_Y, E]")
              .replace("X[G_X, S, D]", "X[G_X, S_Y, D]"))
    (route,) = [s for s in p.forward if isinstance(s.fn, Route)]
    assert str(route.operands[0]) == "Gate[G_X, S, E]"  # the count along S needs it whole
    assert any(s.op is Op.ALL_GATHER and s.tensor == "Gate" and s.axes == ("Y",) for s in p.forward)


def test_route_semantics_by_hand() -> None:
    gates = np.array([[0.5, 0.5, 0.0], [0.1, 0.2, 0.7], [0.3, 0.3, 0.4]])  # [S, E]; ties to the lower expert
    mask = route_forward(gates, 0, 1, 2, 1, np)  # k=1, capacity 2
    chosen = [tuple(map(int, np.argwhere(mask[s]).ravel())) for s in range(3)]
    assert chosen == [(0, 0), (2, 0), (2, 1)]  # token 2 takes expert 2's second slot
    top2 = route_forward(gates, 0, 1, 1, 2, np)  # k=2, capacity 1: token 2 is dropped at both its experts
    assert top2[2].sum() == 0 and top2[0, 0, 0] == top2[0, 1, 0] == top2[1, 2, 0] == 1


@pytest.mark.slow
@given(st.integers(1, 3), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_route_topk_helper_matches_the_reference(k: int, capacity: int, seed: int) -> None:
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from shardc.lowering.runtime import route_topk

    gates = np.round(np.random.default_rng(seed).normal(size=(2, 5, 3)), 1)  # rounded: ties happen
    got = np.asarray(route_topk(jnp.asarray(gates, jnp.float32), k, capacity, 1, 2))
    np.testing.assert_array_equal(got, route_forward(gates.astype(np.float32), 1, 2, capacity, k, np))


def test_route_has_no_gradient_and_its_gates_get_one_through_the_combine() -> None:
    spec = shardc.parse(SMALL)
    rng = np.random.default_rng(1)
    inputs = {"X": rng.normal(size=(4, 8, 6)), "W_r": rng.normal(size=(6, 4)),
              "W_1": rng.normal(size=(4, 6, 5)), "W_2": rng.normal(size=(4, 5, 6))}
    grads = ref_backward(spec, inputs, {"Out": rng.normal(size=(4, 8, 6))}, sizes={"C": 3})
    assert set(grads) == {"X", "W_r", "W_1", "W_2"} and np.abs(grads["W_r"]).max() > 0


@pytest.mark.parametrize(("call", "message"), [
    ("route(Gate[G, S, E], S, E, 2 over E)", "capacity index E is an index of its argument"),
    ("route(Gate[G, S, E], E, C, 2 over E)", "ordered along E, which is the expert index"),
    ("route(Gate[G, S, E], S, C, 5 over E)", "k=5 is not a whole number of experts from 1 to 4"),
    ("route(Gate[G, S, E], T, C, 2 over E)", "T is not an index of its argument"),
    ("route(Gate[G, S, E], S, C over E)", "`route` takes 1 tensor, 2 index names, a number and `over`"),
])
def test_route_errors(call: str, message: str) -> None:
    text = f"mesh X=2\ndims G=4, S=8, E=4, C=3\nD[G, S, E, C] = {call}\n"
    with pytest.raises(ShardcError) as err:
        shardc.plan(shardc.parse(text))
    assert message in err.value.message


NESTED = """mesh X=2, Y=2
dims G=4, S=8, E=4, C=3, D=6
dtype f32
Disp[G_X, S, E_Y, C] = route(softmax(X[G_X, S_Y, D] · W_r[D, E] over E), S, C, 2 over E)
In[G, E_X, C, D] = Disp[G_X, S, E_Y, C] · X[G_X, S_Y, D]
"""


@pytest.mark.slow
def test_route_of_sequence_sharded_gates_gathers_them_and_verifies() -> None:
    spec = shardc.parse(NESTED)
    assert shardc.parse(str(spec)) == spec  # route prints back as written
    p = _plan(NESTED)
    assert [(s.op, s.axes) for s in p.forward if s.is_collective][0] == (Op.ALL_GATHER, ("Y",))
    assert [g.name for g in p.grads] == ["dX"]  # W_r reaches the output only through the mask: no gradient
    report = verify(spec)
    assert report.ok, render_report(report)


@pytest.mark.slow
def test_the_float32_recheck_of_a_routed_spec_gives_the_unsharded_program_the_capacity() -> None:
    """Weak rows are checked again against the unsharded program (verify's ``differential_rows``):
    that program must get the capacity C too, as no input has it (it raised "C has no size")."""
    pytest.importorskip("jax")
    from shardc.lowering.api import lower
    from shardc.lowering.sizes import small_sizes
    from shardc.verification.verify import differential_rows

    p = _plan(SMALL)
    lowered = lower(p, sizes=small_sizes(p, 2))
    rows = differential_rows(lowered, seed=0)
    assert {r.tensor for r in rows} >= {"Disp", "Out", "dW_r"} and all(r.ok for r in rows)


@pytest.mark.slow
def test_verify_runs_a_route_of_more_experts_than_its_small_sizes_would_give() -> None:
    # S=128 is too large to run, so verify picks small sizes: E must stay >= k=8 for top_k (found by
    # shardc.testing's route draws: small_sizes gave E=4 and top_k failed)
    spec = shardc.parse(NESTED.replace("mesh X=2, Y=2", "mesh X=2").replace("S=8, E=4", "S=128, E=128")
                        .replace("S_Y", "S").replace("E_Y", "E").replace("2 over E", "8 over E"))
    assert small_sizes(shardc.plan(spec))["E"] >= 8
    report = verify(spec)
    assert report.ok, render_report(report)


def test_the_lowered_capacity_is_read_from_the_token_count_not_written_as_a_constant() -> None:
    """examples/moe_transformer.shard: C=1280 of S=4096 tokens; the module keeps that share at any S."""
    import re

    from shardc.lowering.api import module_source

    path = MOE.parent / "moe_transformer.shard"
    source, _ = module_source(shardc.plan(shardc.parse(path.read_text(), filename=str(path))))
    (line,) = [t for t in source.splitlines() if "route_topk(" in t and "=" in t.split("route_topk(")[0]]
    code = line.split("capacity=")[1].split(", order=")[0]
    assert "1280" not in code and re.fullmatch(r"-\(-Gate\.shape\[1\] \* 5 // 16\)", code)

    class Gates:
        def __init__(self, tokens: int) -> None:
            self.shape = (1, tokens, 8)

    assert [eval(code, {"Gate": Gates(s)}) for s in (4096, 64, 100)] == [1280, 20, 32]


@pytest.mark.slow
def test_a_module_lowered_at_the_spec_sizes_verifies_at_small_ones(tmp_path: Path) -> None:
    """The module `shardc lower` writes for examples/moe_layer.shard (C=320 of S=1024) runs at verify's
    small sizes, its capacity the same share of the tokens."""
    from shardc.lowering.api import module_source

    p = shardc.plan(shardc.parse(MOE.read_text(), filename=str(MOE)))
    source, _ = module_source(p)
    report = verify(p, module=source)
    assert report.ok, render_report(report)
    assert report.sizes["C"] * 1024 == report.sizes["S"] * 320
