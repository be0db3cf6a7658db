"""An einsum solve asks each operand's reshard once per local value (shardc.sharding.einsum._operand): the
same cheapest solution, the same ``--explain`` alternatives and the same search work as asking the search
for every configuration anew."""

from __future__ import annotations

import pytest

from shardc.ir.spec import DType, Mesh, MeshAxis
from shardc.sharding import einsum
from shardc.sharding.einsum import EinsumProblem, Operand, Solution, configurations, partial_axes, solve
from shardc.sharding.layout import Cost, CostContext, Value

MESH = Mesh((MeshAxis("X", 4), MeshAxis("Y", 2), MeshAxis("Z", 2)))
SIZES = {"B": 256, "D": 512, "F": 1024}
# a matmul whose operands the phase holds sharded, one of them partial sums: configurations pass, reduce,
# gather and reshard each operand, and read the same local values again and again
PROBLEM = EinsumProblem(
    (Operand("In", ("B", "D"), (Value((("X",), ("Y",)), ("Z",)), Value((("X", "Z"), ()), ("Y",)))),
     Operand("W", ("D", "F"), (Value((("Z",), ("X", "Y"))),))),
    "Out", ("B", "F"), Value((("X",), ("Y", "Z"))))


def context(explain: bool) -> CostContext:
    return CostContext(MESH, DType.BF16, dict(SIZES), weights=frozenset({"W"}), explain=explain)


def unmemoized(ctx: CostContext) -> tuple[Solution, list[Solution]]:
    """:func:`solve` with every configuration asking the searches itself (no ``reached``)."""
    best: Solution | None = None
    seen: list[Solution] = []
    bound: Cost | None = None
    partial = partial_axes(ctx, PROBLEM)
    for config in configurations(ctx, PROBLEM):
        ctx.tick()
        sol = einsum._evaluate(ctx, PROBLEM, config, bound, partial)
        if sol is None:
            continue
        seen.append(sol)
        if best is None or sol.cost < best.cost:
            best = sol
        if len(seen) >= (einsum.KEEP if ctx.explain else 1):
            seen = sorted(seen, key=lambda s: s.cost)[:einsum.KEEP if ctx.explain else 1]
            bound = seen[-1].cost
    assert best is not None
    return best, seen


@pytest.mark.parametrize("explain", [False, True])
def test_a_solve_memoized_per_local_value_is_the_search_asked_anew(explain: bool) -> None:
    memo, plain = context(explain), context(explain)
    found, expected = solve(memo, PROBLEM), unmemoized(plain)
    assert found == expected
    assert len(found[1]) == (einsum.KEEP if explain else 1)  # more configurations than kept: some pruned
    assert memo.explored == plain.explored  # the searches stepped as far: the same work for the budget
