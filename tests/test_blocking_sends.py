"""``schedule 1f1b sends blocking``: DeepSpeed's pipeline engine's blocking point-to-point transfers, each holding
its sender and its receiver (shardc.pipeline.blocking_sends)."""

from __future__ import annotations

import math

import pytest

import shardc
from shardc.errors import ShardcError
from shardc.hardware import get_hardware
from shardc.ir.spec import Schedule
from shardc.layouts import Options, Skipped
from shardc.layouts.knobs import _apply, combinations
from shardc.layouts.rank import pairs, prepare
from shardc.layouts.templates import Candidate
from shardc.pipeline.blocking_sends import Held
from shardc.pipeline.schedules import Timing, simulate

HEAD = "mesh P=2 pipeline, X=2\nmicrobatches 4\nhardware h100\n"
BLOCK = """\
dims B=64, S=2048, D=4096, F=16384
param W_in, W_out
layers 4 {
  H[B_X, S, F] = gelu(X0[B_X, S, D] · W_in[D, F])
  X1[B_X, S, D] = X0[B_X, S, D] + H[B_X, S, F] · W_out[F, D]
}
"""


def test_the_line_parses_prints_back_and_only_under_1f1b() -> None:
    s = shardc.parse("mesh P=2 pipeline, X=2\nschedule 1f1b sends blocking\n" + BLOCK)
    assert s.schedule == Schedule("1f1b", sends="blocking") and "schedule 1f1b sends blocking" in str(s)
    assert shardc.parse(str(s)) == s
    assert shardc.parse("mesh P=2 pipeline, X=2\nschedule 1f1b sends async\n" + BLOCK).schedule == Schedule("1f1b")
    with pytest.raises(ShardcError, match="only under 1f1b"):
        shardc.parse("mesh P=2 pipeline, X=2\nschedule gpipe sends blocking\n" + BLOCK)


def test_two_stages_by_hand() -> None:
    # F = 1, B = 2, a transfer 0.5 s, 2 stages, 2 microbatches.  Blocking, each op holds its transfers: stage 0's F
    # 1.5 (its send), B 2.5 (its receive); stage 1's F 1.5 (its receive), B 2.5 (its send); a receive starts with
    # the send. Stage 0: F0 0-1.5, F1 1.5-3; stage 1: F0 1-2.5, B0 2.5-5, F1 5-6.5 (F1 came at 2.5), B1 6.5-9;
    # stage 0: B0 4.5-7 (B0's send began at 4.5), B1 8.5-11.  Async (the sends only delay their readers): 10.
    t = Timing(1.0, 2.0, comm=0.5)
    blocking, free = simulate("1f1b", 2, 2, t, blocking=Held()), simulate("1f1b", 2, 2, t)
    assert math.isclose(blocking.makespan, 11.0) and math.isclose(free.makespan, 10.0)
    ends = {(o.device, o.kind, o.microbatch): (o.start, o.end) for o in blocking.ops}
    assert ends[(1, "F", 0)] == (1.0, 2.5) and ends[(0, "B", 0)] == (4.5, 7.0) and ends[(0, "B", 1)] == (8.5, 11.0)


def test_the_receiver_alone_holds_its_gather() -> None:
    # The transfer 0.3 s and the receiving side's AllGather 0.2 (a split send): stage 0's F 1 + 0.3 (its send), B
    # 2 + 0.5 (its receive, gathered); stage 1's F 0.5 + 1, B 2 + 0.3; a receive starts 0.3 before its sender's op
    # ends. Stage 0: F0 0-1.3, F1 1.3-2.6; stage 1: F0 1-2.5, B0 2.5-4.8, F1 4.8-6.3, B1 6.3-8.6; stage 0: B0
    # 4.5-7, B1 8.3-10.8.
    sim = simulate("1f1b", 2, 2, Timing(1.0, 2.0, comm=0.5), blocking=Held(0.2, 0.2))
    ends = {(o.device, o.kind, o.microbatch): (o.start, o.end) for o in sim.ops}
    assert ends[(1, "F", 0)] == pytest.approx((1.0, 2.5)) and ends[(0, "B", 0)] == pytest.approx((4.5, 7.0))
    assert sim.makespan == pytest.approx(10.8)


def test_a_middle_stage_holds_four_transfers_a_microbatch() -> None:
    t = Timing(1.0, 2.0, comm=0.25)
    sim = simulate("1f1b", 3, 6, t, blocking=Held())
    assert math.isclose(sim.work(1), 6 * (1.0 + 2.0 + 4 * 0.25))  # activation in and out, gradient in and out
    assert math.isclose(sim.work(0), 6 * (1.0 + 2.0 + 2 * 0.25))  # an end stage: one neighbour


def test_the_cost_holds_each_stages_sends() -> None:
    async_, blocking = (shardc.cost(shardc.plan(shardc.parse(HEAD + line + BLOCK))).pipeline
                        for line in ("schedule 1f1b\n", "schedule 1f1b sends blocking\n"))
    assert async_ is not None and blocking is not None
    c, back = blocking.timing.comm, blocking.timing.send_back
    assert c > 0 and async_.timing == blocking.timing
    # each of the 2 stages' 4 microbatches: one activation (in or out) and one gradient (out or in) more work
    assert math.isclose(blocking.simulation.ideal - async_.simulation.ideal, 4 * (c + back), rel_tol=1e-9)
    assert blocking.step_s > async_.step_s
    assert math.isclose(blocking.free_sends_step_s, async_.free_sends_step_s, rel_tol=1e-9)
    assert blocking.to_json()["schedule"] == "1f1b" and (blocking.to_json()["sends"], async_.to_json()["sends"]) == (
        "blocking", "async")


def test_the_layouts_schedule_knob_reads_the_blocking_schedule() -> None:
    """The knob's settings are the schedules' texts: the spec's own, `1f1b sends blocking`, is one of them (it
    was split at its first space, `sends blocking` read as interleaved's V) and the others drop the sends."""
    spec = shardc.parse(HEAD + "schedule 1f1b sends blocking\n" + BLOCK)
    prepared = prepare(spec, {a.name: a.size for a in spec.mesh.axes})
    assert not isinstance(prepared, Skipped)
    candidate = Candidate(prepared, pairs(prepared))
    options = Options(get_hardware("h100"), knobs=("schedule",))
    schedules = {c.spec.schedule for c in combinations(candidate, ("schedule",), options)}
    assert Schedule("gpipe") in schedules and Schedule("1f1b") in schedules
    kept = _apply(candidate, {"schedule": "1f1b sends blocking"}, options)
    assert kept.spec.schedule == Schedule("1f1b", sends="blocking")
