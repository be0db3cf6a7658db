"""``schedule 1f1b sends paired``: Megatron-LM's 1F1B exchanges, a step's send and receive with one neighbour
posted together and waited on by both stages (shardc.pipeline.paired_sends)."""

from __future__ import annotations

import math

import pytest

import shardc
from shardc.costmodel.cost_report import CostReport
from shardc.errors import ShardcError
from shardc.hardware import get_hardware
from shardc.ir.spec import Schedule
from shardc.layouts import Options, Skipped
from shardc.layouts.knobs import _apply
from shardc.layouts.rank import pairs, prepare
from shardc.layouts.templates import Candidate
from shardc.pipeline.blocking_sends import Held
from shardc.pipeline.schedules import Timing, simulate
from tests.test_blocking_sends import BLOCK, HEAD

PAIRED = Held(paired=True)


def test_the_line_parses_prints_back_and_only_under_1f1b() -> None:
    s = shardc.parse("mesh P=2 pipeline, X=2\nschedule 1f1b sends paired\n" + BLOCK)
    assert s.schedule == Schedule("1f1b", sends="paired") and "schedule 1f1b sends paired" in str(s)
    assert shardc.parse(str(s)) == s
    with pytest.raises(ShardcError, match="only under 1f1b") as wrong:
        shardc.parse("mesh P=2 pipeline, X=2\nschedule interleaved 2 sends paired\n" + BLOCK)
    span = wrong.value.span
    assert span is not None and (span.line, span.column, span.length) == (2, 24, 12)  # `sends paired`
    with pytest.raises(ShardcError, match="unknown schedule ... sends `eager`") as unknown:
        shardc.parse("mesh P=2 pipeline, X=2\nschedule 1f1b sends eager\n" + BLOCK)
    assert unknown.value.span is not None and (unknown.value.span.column, unknown.value.span.length) == (21, 5)


def test_two_stages_by_hand() -> None:
    # F = 1, B = 2, a send 0.5 s each way, 2 stages, 2 microbatches.  Stage 0's forward ends with its exchange
    # (activation out, gradient in), stage 1's backward with its own (gradient out, activation in); the reader
    # starts when both ops ended.  Stage 0: F0 0-1.5, F1 1.5-3; stage 1: F0 1.5-2.5, B0 2.5-5, F1 5-6, B1 6-8.5;
    # stage 0: B0 5-7, B1 8.5-10.5.  Between async's 10 and blocking's 11 (tests/test_blocking_sends.py).
    sim = simulate("1f1b", 2, 2, Timing(1.0, 2.0, comm=0.5), blocking=PAIRED)
    ends = {(o.device, o.kind, o.microbatch): (o.start, o.end) for o in sim.ops}
    assert ends[(1, "F", 0)] == (1.5, 2.5) and ends[(1, "B", 0)] == (2.5, 5.0) and ends[(0, "B", 0)] == (5.0, 7.0)
    assert ends[(1, "F", 1)] == (5.0, 6.0) and ends[(0, "B", 1)] == (8.5, 10.5)
    assert math.isclose(sim.makespan, 10.5)


def test_each_side_gathers_what_it_received() -> None:
    # The sends 0.5 s, of them the receiving side's AllGather 0.2 for an activation, 0.1 for a gradient: the
    # exchange max(0.3, 0.4) = 0.4, then stage 0 gathers the gradient (0.1), stage 1 the activation (0.2).  Stage 1:
    # F0 1.6 (0.4 + 0.2 after stage 0's F0) - 2.6, B0 2.6-5.2 (2 + 0.4 + 0.2); stage 0: B0 5.1-7.1 (the exchange
    # ended 5.0), B1 8.7-10.7 (stage 1's B1 ended 8.2 + 0.4 + 0.1).
    sim = simulate("1f1b", 2, 2, Timing(1.0, 2.0, comm=0.5), blocking=Held(0.2, 0.1, paired=True))
    ends = {(o.device, o.kind, o.microbatch): (o.start, o.end) for o in sim.ops}
    assert ends[(1, "F", 0)] == pytest.approx((1.6, 2.6)) and ends[(1, "B", 0)] == pytest.approx((2.6, 5.2))
    assert ends[(0, "B", 0)] == pytest.approx((5.1, 7.1)) and ends[(0, "B", 1)] == pytest.approx((8.7, 10.7))


def test_three_stages_by_hand() -> None:
    # F = 1, B = 2, a send 0.5 s; stage 0's forward 1.5, stage 1's forward 1.5 and backward 2.5, stage 2's
    # backward 2.5.  Stage 0: F0 0-1.5, F1 -3, F2 -4.5; stage 1: F0 1.5-3, F1 3-4.5; stage 2: F0 3-4, B0 -6.5;
    # stage 1: B0 6.5-9; stage 2: F1 6.5-7.5, B1 -10; stage 1: F2 9-10.5, B1 10.5-13; stage 0: B0 9-11, B1 13-15;
    # stage 2: F2 10.5-11.5, B2 -14; stage 1: B2 14-16.5; stage 0: B2 16.5-18.5.
    sim = simulate("1f1b", 3, 3, Timing(1.0, 2.0, comm=0.5), blocking=PAIRED)
    ends = {(o.device, o.kind, o.microbatch): (o.start, o.end) for o in sim.ops}
    assert ends[(1, "B", 0)] == (6.5, 9.0) and ends[(0, "B", 1)] == (13.0, 15.0) and ends[(1, "B", 2)] == (14.0, 16.5)
    assert math.isclose(sim.makespan, 18.5)


def test_a_middle_stage_holds_two_exchanges_a_microbatch() -> None:
    # a gradient's send (0.5) longer than an activation's (0.25): each exchange lasts the longer, both at once
    t = Timing(1.0, 2.0, comm=0.25, comm_back=0.5)
    paired, blocking = simulate("1f1b", 3, 6, t, blocking=PAIRED), simulate("1f1b", 3, 6, t, blocking=Held())
    assert math.isclose(paired.work(1), 6 * (1.0 + 2.0 + 2 * 0.5))
    assert math.isclose(paired.work(0), 6 * (1.0 + 2.0 + 0.5))  # an end stage: one neighbour
    assert math.isclose(blocking.work(1), 6 * (1.0 + 2.0 + 2 * 0.25 + 2 * 0.5))


@pytest.fixture(scope="module")
def costs() -> dict[str, CostReport]:
    return {how: shardc.cost(shardc.plan(shardc.parse(HEAD + f"schedule 1f1b sends {how}\n" + BLOCK)))
            for how in ("async", "paired")}


def test_the_cost_holds_each_stages_exchanges(costs: dict[str, CostReport]) -> None:
    async_, paired = costs["async"].pipeline, costs["paired"].pipeline
    assert async_ is not None and paired is not None and paired.timing == async_.timing
    c, back = paired.timing.comm, paired.timing.send_back
    assert c > 0 and not paired.p2p_split  # one node: no gathers
    # each of the 2 stages' 4 microbatches: one exchange more work
    assert math.isclose(paired.simulation.ideal - async_.simulation.ideal, 4 * max(c, back), rel_tol=1e-9)
    assert paired.step_s > async_.step_s
    assert paired.to_json()["schedule"] == "1f1b" and paired.to_json()["sends"] == "paired"
    assert any(n.startswith("sends paired:") for n in costs["paired"].notes)
    assert not any(n.startswith("sends") for n in costs["async"].notes)


def test_the_layouts_schedule_knob_keeps_the_paired_schedule() -> None:
    spec = shardc.parse(HEAD + "schedule 1f1b sends paired\n" + BLOCK)
    prepared = prepare(spec, {a.name: a.size for a in spec.mesh.axes})
    assert not isinstance(prepared, Skipped)
    options = Options(get_hardware("h100"), knobs=("schedule",))
    kept = _apply(Candidate(prepared, pairs(prepared)), {"schedule": "1f1b sends paired"}, options)
    assert kept.spec.schedule == Schedule("1f1b", sends="paired")
