"""One cost model: every pass after planning costs on the plan's chip, with one span rule."""

from __future__ import annotations

import pytest

import shardc
from shardc.costmodel.symbolic import cost_formulas
from shardc.errors import ShardcError
from shardc.hardware import get_hardware

MLP = """
mesh X=16, Y=4
Tmp[B_X, F_Y] = In[B_X, D_Y] · W_in[D_X, F_Y]
Out[B_X, D_Y] = Tmp[B_X, F_Y] · W_out[F_Y, D_X]
"""


def test_formulas_cost_on_the_chip_the_plan_was_made_for() -> None:
    plan = shardc.plan(shardc.parse(MLP, "<test>"), hardware="h100")
    report = cost_formulas(plan)
    assert report.hardware.name == "h100"
    # the thresholds compare with the H100's C / W_ici (1099), not tpu-v5p's 2550
    h100 = get_hardware("h100").intensity_ici
    assert round(h100) == 1099
    assert report.thresholds and all("(h100)" in t.sentence and "tpu-v5p" not in t.sentence
                                     for t in report.thresholds)
    assert "i.e. B/X > 1099*F/(F - 1099*Y)" in report.thresholds[0].sentence


def test_formulas_and_cost_take_a_chip_given_over_the_plans() -> None:
    plan = shardc.plan(shardc.parse(MLP + "dims B=4096, D=1024, F=4096\n", "<test>"), hardware="h100")
    assert shardc.cost(plan).hardware.name == "h100"
    assert shardc.cost(plan, hardware="tpu-v4p").hardware.name == "tpu-v4p"
    assert cost_formulas(plan, hardware="tpu-v4p").hardware.name == "tpu-v4p"


@pytest.mark.parametrize("spans", [{"X": True}, {"X": 0}, {"Q": 2}])
def test_cost_refuses_the_spans_the_planner_refuses(spans: dict[str, int]) -> None:
    spec = shardc.parse(MLP + "dims B=4096, D=1024, F=4096\n", "<test>")
    with pytest.raises(ShardcError, match="--spans"):
        shardc.plan(spec, spans=spans)
    plan = shardc.plan(spec)
    with pytest.raises(ShardcError, match="--spans"):
        shardc.cost(plan, spans=spans)
    with pytest.raises(ShardcError, match="--spans"):
        cost_formulas(plan, spans=spans)
