"""The chain DP's factored step costs equal one exact einsum search per (state, target)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardc
from shardc.errors import InternalError
from shardc.hardware import PRESETS
from shardc.planner.chain import layouts, step_costs
from shardc.planner.contexts import search_context
from shardc.planner.graph import build_graph
from shardc.sharding.einsum import EinsumProblem, Operand, solve
from shardc.sharding.layout import CostContext, Value
from shardc.verification.verify import render_report, verify
from tests.test_gemm_types import MLP

CHAINS = {
    "fsdp_tp": """
mesh X=4, Y=2
dims B=64, D=16, F=32
Out[B_X, D_Y] = In[B_X, D_Y] · W_in[D_X, F_Y] · W_out[F_Y, D_X]
""",
    "three_axes": """
mesh Z=2 over dcn, E=2, D=2
dims H=8, J=4, N=4, B=8
Out[H, J_E, N, B_D] = W_in[B_ZE] × W3[H_E, J, N_Z] × emb[B_ZE, N_D, H]
""",
}


def _close(a: tuple[float, int, int], b: tuple[float, int, int]) -> bool:
    """Equal seconds; the collective counts that break ties may differ, since summing the
    same seconds in another order can differ in the last bit and decide the tie."""
    return math.isclose(a[0], b[0], rel_tol=1e-9, abs_tol=1e-18)


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_step_costs_equal_the_search_per_pair(name: str) -> None:
    spec = shardc.parse(CHAINS[name])
    graph = build_graph(spec)
    ctx = CostContext(spec.mesh, spec.dtype, spec.sizes, graph.params)
    first, last = graph.nodes[0], graph.nodes[1]
    held = {n: (Value.of(graph.declared[n]),) for n in graph.inputs}
    ops = tuple(Operand(n, graph.indices[n], held[n]) for n in first.operands)
    middles = list(layouts(ctx, first.indices))
    table = step_costs(ctx, EinsumProblem(ops, first.result, first.indices, None), [None], middles)
    for target in middles[::7]:  # every pair is slow to search one by one: a spread of them
        exact, _ = solve(ctx, EinsumProblem(ops, first.result, first.indices, target))
        assert _close(table.costs[(None, target)][0], exact.cost), target
    final = Value.of(graph.declared[last.result])
    starts = middles[::5]
    head = Operand(last.operands[0], first.indices, (starts[0],))
    rest = tuple(Operand(n, graph.indices[n], held[n]) for n in last.operands[1:])
    table = step_costs(ctx, EinsumProblem((head, *rest), last.result, last.indices, None), starts, [final])
    for state in starts:
        problem = EinsumProblem((Operand(head.name, head.indices, (state,)), *rest), last.result,
                                last.indices, final)
        exact, _ = solve(ctx, problem)
        assert _close(table.costs[(state, final)][0], exact.cost), state


# test_gemm_types' MLP as one chain: O = I · W1 · W2 (the intermediate Tmp, no relu)
FP8_CHAIN = MLP.split("H[", 1)[0] + "O[B_X, D] = I[B_X, D] · W1[D, F] · W2[F, D]\n"


def test_the_chains_search_prices_its_quantize_passes_as_cost_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain's steps see what a two-operand einsum sees: its second GEMM quantizes Tmp, which the first made
    where it stands, in that GEMM's epilogue (Tmp not read back, 134 MB at these sizes), so the search's
    estimate of the chain is the time cost reports for its steps (it was 1.089 ms against 1.037)."""
    import shardc.planner.planner as planner

    estimates: list[float] = []
    choose = planner.choose_chain
    monkeypatch.setattr(planner, "choose_chain", lambda *args: estimates.append(choose(*args)) or estimates[-1])
    plan = shardc.plan(shardc.parse(FP8_CHAIN))
    rows = shardc.cost(plan).forward.rows
    assert [r.quantize_bytes for r in rows] == [4096 * 4096 * (2 + 1.03125), 4096 * 16384 * 1.03125]
    assert estimates[0] == pytest.approx(sum(r.compute_s + r.memory_s + r.comm_s for r in rows), rel=1e-12)


def test_a_fused_step_cost_is_the_search_with_its_head_made_in_place() -> None:
    """With the intermediate made where it stands, each state's entry (the lesser of the head moved or read
    there, its quantize pass fused) equals one exact search whose head the step before made there."""
    spec = shardc.parse(FP8_CHAIN)
    graph = build_graph(spec)
    ctx = search_context(spec, graph, PRESETS["h100"], None)
    first, last = graph.nodes[0], graph.nodes[1]
    starts = list(layouts(ctx, first.indices))
    rest = tuple(Operand(n, graph.indices[n], (Value.of(graph.declared[n]),)) for n in last.operands[1:])
    head = Operand(last.operands[0], first.indices, (starts[0],))
    final = Value.of(graph.declared[last.result])
    table = step_costs(ctx, EinsumProblem((head, *rest), last.result, last.indices, None), starts, [final], fuse=True)
    assert any(fused is not None for _, fused in table.costs.values())
    for (state, _), (cost, fused) in table.costs.items():
        made = Operand(head.name, head.indices, (state,), fresh=state)
        exact, _ = solve(ctx, EinsumProblem((made, *rest), last.result, last.indices, final))
        assert _close(min(cost, fused or cost), exact.cost), state


# A chain inside an expression ends in the expression's own intermediate, which no statement declares
# (issue 20's point 3: `KeyError: 'O_t2'` from the chain planner; O_t1 is silu's result here, O_t2 the
# product's, `Tmp` the chain's intermediate).
NESTED = """mesh X=2
dims B=16, D=8, F=8
param W1
layers 2 {
  G[B_X, F] = X0[B_X, D] · W1[D, F]
  O[B_X, D] = silu(X0[B_X, D]) + G[B_X, F] · G[B_X, F] · X0[B_X, D]
  X1[B_X, D] = X0[B_X, D] + O[B_X, D]
}
"""


PIPELINED = NESTED.replace("mesh X=2\ndims B=16, D=8, F=8\nparam W1\n", """mesh P=2 pipeline, X=2
dims B=16, D=8, F=8, V=16
microbatches 2
const Tok, Next
param W1, W_emb, W_out
X0[B_X, D] = embed(Tok[B_X], W_emb[V, D])
""") + "Lg[B_X, V] = X1[B_X, D] · W_out[D, V]\nLoss[] = cross_entropy(Lg[B_X, V], Next[B_X])\n"


@pytest.mark.parametrize("text", [NESTED, PIPELINED,
                                  "mesh X=2\ndims B=16, D=8, E=8\nY[B_X, D] = silu(X[B_X, D] · W1[D, E] · W2[E, D])\n"],
                         ids=["sum", "pipelined", "call"])
def test_a_chain_inside_an_expression_is_planned(text: str) -> None:
    plan = shardc.plan(shardc.parse(text))
    made = {s.tensor for s in plan.forward}
    assert "Tmp" in made and ("O_t2" in made or "Y_t1" in made)  # its intermediate and its end, planned
    assert shardc.cost(plan).step.step_s > 0


@pytest.mark.slow
def test_a_chain_inside_an_expression_verifies() -> None:
    report = verify(shardc.parse(NESTED))
    assert report.ok, render_report(report)


# Chains of three to five operands in `layers` blocks, with operands repeated, nested in sums and calls, over
# a pipeline or not: the search that found the bugs above (issue 20, point 3), kept small.
CHAIN_BODIES = ["{G} · {G} · {X0}", "silu({X0}) + {G} · {G} · {X0}", "silu({G} · {G} · {X0})",
                "{W2} · {W2} · {X0}", "{G} · {W3} · {W4} · {G2} · {W5}", "{X0} + {X0} · {W2} · {W4} · {W2} · {W4}",
                "{X0} * ({G} · {G} · {X0})"]


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(body=st.sampled_from(CHAIN_BODIES), pipe=st.booleans(), b=st.sampled_from(["B_X", "B_Y", "B"]),
       d=st.sampled_from(["D", "D_X", "D_Y"]), recompute=st.sampled_from(["none", "selective", "full"]),
       dead=st.booleans())
def test_chains_in_a_block_plan_and_cut(body: str, pipe: bool, b: str, d: str, recompute: str, dead: bool) -> None:
    if b[1:] == d[1:] != "":
        d = "D"
    refs = {"X0": f"X0[{b}, {d}]", "G": f"G[{b}, F]", "G2": f"G2[{b}, F]", "W2": f"W2[{d}, E]",
            "W3": "W3[F, E]", "W4": f"W4[E, {d}]", "W5": f"W5[F, {d}]"}
    expr = body.format(**refs)
    block = [f"G[{b}, F] = silu(X0[{b}, {d}] · W1[{d}, F])", f"G2[{b}, F] = G[{b}, F]",
             f"O[{b}, {d}] = {expr}"] + [f"Z[{b}, {d}] = silu(X0[{b}, {d}])"] * dead + \
        [f"X1[{b}, {d}] = X0[{b}, {d}] + O[{b}, {d}]"]
    text = (f"mesh {'P=2 pipeline, ' if pipe else ''}X=2, Y=2\ndims B=16, D=8, E=8, F=8, V=16\n"
            + "microbatches 2\n" * pipe + "const Tok, Next\nparam W1, W_emb, W_out"
            + "".join(f", {w}" for w in ("W2", "W3", "W4", "W5") if "{" + w + "}" in body) + "\n"
            f"X0[{b}, {d}] = embed(Tok[{b}], W_emb[V, {d}])\nlayers 2 {{\n  " + "\n  ".join(block) + "\n}\n"
            f"Lg[{b}, V] = X1[{b}, {d}] · W_out[{d}, V]\nLoss[] = cross_entropy(Lg[{b}, V], Next[{b}])\n")
    try:
        plan = shardc.plan(shardc.parse(text), recompute=recompute)
    except shardc.ShardcError as err:  # a layout the spec or the pipeline refuses, said plainly
        assert not isinstance(err, InternalError), text
        return
    assert plan.sections is not None, text
    assert shardc.cost(plan).step.step_s > 0


# A parenthesised group keeps the indices the rest of its chain reads: OLMo's or LLaMA's MLP written in one line,
# `(Gt * U) · W_down`, was refused ("index F is summed over inside one operand of this chain"), the group
# computed towards the result's indices alone and so summing F before W_down could contract it.
GROUPED = """mesh X=2, Y=2
dims B=8, D=8, F=16
X1[B_X, D] = R1[B_X, D] + (Gt[B_X, F_Y] * U[B_X, F_Y]) · W_down[F_Y, D]
"""


def test_a_group_keeps_the_indices_its_siblings_read() -> None:
    plan = shardc.plan(shardc.parse(GROUPED))
    product = next(s for s in plan.forward if [o.name for o in s.operands] == ["Gt", "U"])
    assert "F" in product.dst.indices  # Gt * U keeps F: elementwise, as an einsum would


@pytest.mark.slow
def test_a_group_verifies_against_the_reference() -> None:
    report = verify(shardc.parse(GROUPED))  # the reference folds the group as the planner does
    assert report.ok, render_report(report)
