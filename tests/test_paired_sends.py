"""``schedule 1f1b sends paired``: Megatron-LM's 1F1B exchanges, a step's send and receive with one neighbour
posted together and waited on by both stages (shardc.pipeline.paired_sends)."""

from __future__ import annotations

import math
import random

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
from shardc.pipeline.keyed_walk import keyed_walk
from shardc.pipeline.order_walk import Ones
from shardc.pipeline.paired_sends import megatron_steps
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
    # F = 1, B = 2, a send 0.5 s each way, 2 stages, 2 microbatches.  Stage 0 runs F0 (warm-up: send_forward
    # alone), F1 then its exchange (activation out, gradient in), B0, then B1 after recv_backward alone; stage 1
    # F0 after recv_forward alone, B0 then its exchange (gradient out, activation in), F1, B1 then send_backward
    # alone.  An exchange's reader starts when both ops ended; a lone receive runs beside its send, so its op
    # starts one transfer before the sender's ends.  Stage 0: F0 0-1.5, F1 1.5-3; stage 1: F0 1-2.5 (its receive
    # 1-1.5), B0 2.5-5, F1 5-6, B1 6-8.5; stage 0: B0 5-7, B1 8-10.5 (its receive 8-8.5).
    sim = simulate("1f1b", 2, 2, Timing(1.0, 2.0, comm=0.5), blocking=PAIRED)
    ends = {(o.device, o.kind, o.microbatch): (o.start, o.end) for o in sim.ops}
    assert ends[(1, "F", 0)] == (1.0, 2.5) and ends[(1, "B", 0)] == (2.5, 5.0) and ends[(0, "B", 0)] == (5.0, 7.0)
    assert ends[(1, "F", 1)] == (5.0, 6.0) and ends[(0, "B", 1)] == (8.0, 10.5)
    assert math.isclose(sim.makespan, 10.5)


def test_each_side_gathers_what_it_received() -> None:
    # The sends 0.5 s, of them the receiving side's AllGather 0.2 for an activation, 0.1 for a gradient: an
    # exchange max(0.3, 0.4) = 0.4, then each side gathers what it got; a lone send 0.3 or 0.4, the sender
    # gathering nothing.  Stage 0: F0 0-1.3 (1 + its send alone 0.3), F1 1.3-2.8 (exchange 0.4, the gradient's
    # gather 0.1); stage 1: F0 1-2.5 (its receive 0.3 and gather 0.2 first), B0 2.5-5.1 (2 + 0.4 + 0.2); stage 0:
    # B0 5-7 (the exchange ended 5); stage 1: F1 5.1-6.1, B1 6.1-8.5 (its send alone 0.4); stage 0: B1 8.1-10.6.
    sim = simulate("1f1b", 2, 2, Timing(1.0, 2.0, comm=0.5), blocking=Held(0.2, 0.1, paired=True))
    ends = {(o.device, o.kind, o.microbatch): (o.start, o.end) for o in sim.ops}
    assert ends[(0, "F", 0)] == pytest.approx((0.0, 1.3)) and ends[(0, "F", 1)] == pytest.approx((1.3, 2.8))
    assert ends[(1, "F", 0)] == pytest.approx((1.0, 2.5)) and ends[(1, "B", 0)] == pytest.approx((2.5, 5.1))
    assert ends[(0, "B", 0)] == pytest.approx((5.0, 7.0)) and ends[(1, "B", 1)] == pytest.approx((6.1, 8.5))
    assert ends[(0, "B", 1)] == pytest.approx((8.1, 10.6)) and math.isclose(sim.makespan, 10.6)


def test_three_stages_by_hand() -> None:
    # F = 1, B = 2, a send 0.5 s.  Stage 0: F0 0-1.5, F1 -3 (warm-up: each sent alone), F2 3-4.5 (exchange);
    # stage 1: F0 1-3 (received and sent alone), F1 3-5 (received alone, exchange); stage 2: F0 2.5-4 (received
    # alone), B0 -6.5, F1 -7.5, B1 -10 (exchanges); stage 1: B0 6.5-9 (exchange), F2 9-10.5, B1 10.5-13 (the last
    # steady backward: sent alone); stage 0: B0 9-11, B1 12.5-15 (received alone); stage 2: F2 10.5-11.5,
    # B2 -14 (sent alone); stage 1: B2 13.5-16.5 (cool-down: received and sent alone); stage 0: B2 16-18.5.
    sim = simulate("1f1b", 3, 3, Timing(1.0, 2.0, comm=0.5), blocking=PAIRED)
    ends = {(o.device, o.kind, o.microbatch): (o.start, o.end) for o in sim.ops}
    assert ends[(1, "F", 0)] == (1.0, 3.0) and ends[(2, "F", 0)] == (2.5, 4.0) and ends[(1, "B", 0)] == (6.5, 9.0)
    assert ends[(0, "B", 1)] == (12.5, 15.0) and ends[(1, "B", 2)] == (13.5, 16.5)
    assert math.isclose(sim.makespan, 18.5)


def test_the_warm_up_and_cool_down_transfers_hold_alone() -> None:
    # Megatron-LM's warm-up (recv_forward, forward, send_forward) and cool-down (recv_backward, backward,
    # send_backward) each send or receive one tensor alone, at its own time: with an activation's send 0.25 s
    # and a gradient's 0.5, a warm-up forward holds 0.25 where an exchange holds the longer, 0.5.  3 stages, 6
    # microbatches, F = 1, B = 2.  Stage 1 (1 warm-up forward): F0 receives and sends alone (0.5), F1 receives
    # alone and exchanges (0.75), F2-F5 exchange (4 x 0.5), B0-B3 exchange (4 x 0.5), B4 sends alone (0.5), B5
    # receives and sends alone (1): 6.75 s of transfers where every op exchanging would be 6 x 2 x 0.5 = 6.
    # Stage 0 (2 warm-up forwards): 2 x 0.25 + 4 x 0.5 + 2 x 0.5 (its two cool-down receives) = 3.5;
    # stage 2: F0's receive 0.25, B0-B4's exchanges 2.5, B5's send 0.5 = 3.25.
    t = Timing(1.0, 2.0, comm=0.25, comm_back=0.5)
    paired, blocking = simulate("1f1b", 3, 6, t, blocking=PAIRED), simulate("1f1b", 3, 6, t, blocking=Held())
    assert [paired.work(d) - 6 * 3.0 for d in range(3)] == pytest.approx([3.5, 6.75, 3.25])
    ends = {(o.device, o.kind, o.microbatch): (o.start, o.end) for o in paired.ops}
    assert ends[(0, "F", 0)] == (0.0, 1.25) and ends[(0, "F", 2)] == (2.5, 4.0)  # alone, then exchanged
    assert math.isclose(paired.ideal, 6 * 3.0 + 6.75)
    assert math.isclose(blocking.work(1), 6 * (1.0 + 2.0 + 2 * 0.25 + 2 * 0.5))  # DeepSpeed's: one at a time


def test_sends_paired_is_1f1b_only() -> None:
    with pytest.raises(ShardcError, match="only under 1f1b"):
        simulate("gpipe", 2, 2, Timing(1.0, 2.0, comm=0.5), blocking=PAIRED)


@pytest.fixture(scope="module")
def costs() -> dict[str, CostReport]:
    return {how: shardc.cost(shardc.plan(shardc.parse(HEAD + f"schedule 1f1b sends {how}\n" + BLOCK)))
            for how in ("async", "paired")}


def test_the_cost_holds_each_stages_exchanges(costs: dict[str, CostReport]) -> None:
    async_, paired = costs["async"].pipeline, costs["paired"].pipeline
    assert async_ is not None and paired is not None and paired.timing == async_.timing
    c, back = paired.timing.comm, paired.timing.send_back
    assert c > 0 and not paired.p2p_split  # one node: no gathers
    # each of the 2 stages' 4 microbatches: 3 exchanges (the steady state's) and 2 transfers alone (stage 0's
    # warm-up send and cool-down receive, stage 1's first receive and last send) more work
    assert math.isclose(paired.simulation.ideal - async_.simulation.ideal, 3 * max(c, back) + c + back,
                        rel_tol=1e-9)
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


def _steps_one_at_a_time(steps: Ones, stages: int, microbatches: int, compute: list[dict[str, float]],
                         sends: tuple[float, float], gathers: tuple[float, float]) -> tuple[list[float], list[int],
                                                                                             list[int]]:
    """megatron_steps as a loop an op (what the columns replaced): the seconds and the two marked read columns."""
    (comm, back), (on, off) = sends, gathers
    exchange = max(comm - on, back - off)
    after = {"F": (comm - on, exchange + off), "B": (back - off, exchange + on)}
    last = {"F": stages - 1, "B": 0}
    seconds, first_how, second_how = [], list(steps.first_how), list(steps.second_how)
    for i, (kind, j, s) in enumerate(zip(steps.kind, steps.microbatch, steps.chunk, strict=True)):
        warm = min(stages - 1 - s, microbatches)
        steady = microbatches - warm
        lone_in, lone_out = ((s > 0 and j <= warm, j < warm) if kind == "F"
                             else (j >= steady, s > 0 and j >= steady - 1))
        held = 0.0 if s == last[kind] else after[kind][0 if lone_out else 1]
        if lone_in:
            held += comm if kind == "F" else back
            first_how[i] += 2 * (first_how[i] > 0)
            second_how[i] += 2 * (second_how[i] > 0)
        seconds.append(compute[s][kind] + held)
    return seconds, first_how, second_how


def test_the_columns_give_the_loop_an_ops_floats() -> None:
    rng = random.Random(21)
    for _ in range(12):
        p, m = rng.randint(1, 7), rng.randint(1, 9)
        steps = keyed_walk("1f1b", p, m, 1)
        assert steps is not None
        compute = [{"F": rng.choice((0.0, 0.1, 0.3, 1.7)), "B": rng.choice((0.0, 0.2, 0.7, 3.1))} for _ in range(p)]
        sends = (rng.choice((0.0, 0.13, 0.4)), rng.choice((0.0, 0.11, 0.5)))
        gathers = (rng.choice((0.0, 0.03, sends[0])), rng.choice((0.0, 0.07, sends[1])))
        marked, seconds, _ = megatron_steps(steps, p, m, compute, sends, gathers)
        assert (seconds, list(marked.first_how), list(marked.second_how)) == _steps_one_at_a_time(
            steps, p, m, compute, sends, gathers)
