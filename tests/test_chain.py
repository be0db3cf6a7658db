"""The chain DP's factored step costs equal one exact einsum search per (state, target)."""

from __future__ import annotations

import math

import pytest

import shardc
from shardc.planner.chain import layouts, step_costs
from shardc.planner.graph import build_graph
from shardc.sharding.einsum import EinsumProblem, Operand, solve
from shardc.sharding.layout import CostContext, Value

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
        assert _close(table[(None, target)], exact.cost), target
    final = Value.of(graph.declared[last.result])
    starts = middles[::5]
    head = Operand(last.operands[0], first.indices, (starts[0],))
    rest = tuple(Operand(n, graph.indices[n], held[n]) for n in last.operands[1:])
    table = step_costs(ctx, EinsumProblem((head, *rest), last.result, last.indices, None), starts, [final])
    for state in starts:
        problem = EinsumProblem((Operand(head.name, head.indices, (state,)), *rest), last.result,
                                last.indices, final)
        exact, _ = solve(ctx, problem)
        assert _close(table[(state, final)], exact.cost), state
