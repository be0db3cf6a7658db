"""Two levels of the data-centre network (pods of slices, or two rails) written as two DCN axes.

``mesh W=2 over dcn, Z=2 over dcn, X=4, Y=2`` with the batch over ``B_WZX`` is the merged mesh
``D=4 over dcn`` written in two axes: its four axes run the exact search ~9 times as long as three
(the 4-axis PaLM 540B spec so written gave up at the budget); past the budget, the planner searches
again with W and Z moved as one, and says so.
"""

from __future__ import annotations

import pytest

import shardc
from shardc.ir.plan import Plan
from shardc.planner import candidates, planner
from shardc.planner.check import check_plan
from shardc.sharding.unit import bonded_axes
from shardc.timing import plan_time

BLOCK = """dims B=256, S=512, D=1024, F=4096
param W_in, W_out
H[B_{b}, S, F_Y] = In[B_{b}, S, D] · W_in[D_X, F_Y]
Out[B_{b}, S, D] = H[B_{b}, S, F_Y] · W_out[F_Y, D_X]
"""
SPLIT = "mesh W=2 over dcn, Z=2 over dcn, X=4, Y=2\n" + BLOCK.replace("{b}", "WZX")
MERGED = "mesh P=4 over dcn, X=4, Y=2\n" + BLOCK.replace("{b}", "PX")
# what the search with W and Z moved as one needs (about 9,000 steps); the exact one needs ~78,000
BUDGET = 20_000


def _collectives(p: Plan) -> list[tuple[str, str, tuple[str, ...]]]:
    """Each step's kind, tensor and axes, W and Z read as the merged axis P."""
    def merged(axes: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(dict.fromkeys("P" if a in "WZ" else a for a in axes))
    return [(s.op.value, s.tensor, merged(s.axes)) for s in p.forward + p.backward + p.optimizer]


@pytest.fixture(scope="module")
def split() -> Plan:
    return shardc.plan(shardc.parse(SPLIT), budget=BUDGET)


def test_two_dcn_axes_written_together_move_as_one_in_the_second_search() -> None:
    assert bonded_axes(shardc.parse(SPLIT)) is None  # the first search: every axis alone, exact
    assert bonded_axes(shardc.parse(SPLIT), dcn=True) == (("W", "Z"), ("X",), ("Y",))
    three = SPLIT.replace(", Y=2", "").replace("F_Y", "F")
    assert bonded_axes(shardc.parse(three), dcn=True) is None  # three axes: exact
    ici = SPLIT.replace(" over dcn", "")
    assert bonded_axes(shardc.parse(ici), dcn=True) is None  # four ICI axes: exact
    apart = SPLIT.replace("Out[B_WZX", "Out[B_ZWX")
    assert bonded_axes(shardc.parse(apart), dcn=True) is None  # written in two orders: not one unit


def test_the_split_mesh_plans_as_the_merged_one(split: Plan) -> None:
    """The regression: within a budget the exact search of four axes overruns, the plan has the merged
    mesh's collectives (over W and Z where it has P) at the same cost, and says why."""
    assert check_plan(split) == []
    merged = shardc.plan(shardc.parse(MERGED))
    assert _collectives(split) == _collectives(merged)
    assert any(s.axes[:2] == ("W", "Z") for s in split.backward if s.is_collective)
    assert candidates.objective(plan_time(split)) == candidates.objective(plan_time(merged))
    assert any("searched as one (WZ)" in n for n in split.notes)


def test_the_exact_search_of_the_four_axes_overruns_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the second search saves: without it, the same spec is past the same budget."""
    monkeypatch.setattr(planner, "_dcn_bondable", lambda spec: False)
    with pytest.raises(shardc.ShardcError, match="gave up"):
        shardc.plan(shardc.parse(SPLIT), budget=BUDGET)


def test_within_the_budget_the_search_stays_exact_and_says_nothing() -> None:
    """The bonded search is only a fallback: a 4-axis spec the exact search finishes keeps its exact plan."""
    one = SPLIT.split("Out[")[0].replace("W_in, W_out", "W_in")  # the first einsum alone
    planned = shardc.plan(shardc.parse(one), budget=5 * BUDGET)  # it needs 50,000-100,000 steps
    assert not any("searched as one" in n for n in planned.notes)
