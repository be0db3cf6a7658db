"""The closed-form walk of 1F1B's family (:mod:`shardc.pipeline.keyed_walk`) gives what the full walk gives.

The keyed walk lists the ops in another order than :func:`~shardc.pipeline.order_walk.walk`, so equality is
asked of what a simulation returns, exactly (the same floats, not to a rounding): every op's start and end,
each device's order, the step, the ideal and the bubble, each device's work and activations held, under
every send mode (async, blocking, paired, with their gathers), uneven chunks (the first and last stage's
extra work) and sends that differ each way.
"""

from __future__ import annotations

from itertools import accumulate

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardc.pipeline import keyed_walk as keyed_walk_module
from shardc.pipeline import schedules
from shardc.pipeline.blocking_sends import Held
from shardc.pipeline.keyed_walk import _settle, keyed_walk
from shardc.pipeline.schedules import Simulation, Timing, chunks_of, simulate

# quarters tie often (they add exactly), the others round; 0 s ops and sends included
SECONDS = st.one_of(st.sampled_from((0.0, 0.25, 0.5, 1.0, 1.75)), st.floats(0.01, 3.0))


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, int, int, int, Timing, tuple[Timing, ...] | None, Held | None]:
    schedule = draw(st.sampled_from(("gpipe", "1f1b", "interleaved", "zb-h1")))
    p = draw(st.integers(1, 6))
    virtual = draw(st.integers(2, 3)) if schedule == "interleaved" else 1
    m = p * draw(st.integers(1, 3)) if schedule == "interleaved" else draw(st.integers(1, 14))
    timing = Timing(draw(SECONDS), draw(SECONDS), draw(SECONDS), comm=draw(SECONDS),
                    comm_back=draw(st.one_of(st.none(), SECONDS)))
    uneven = draw(st.one_of(st.none(), st.tuples(*[st.builds(Timing, SECONDS, SECONDS, SECONDS)
                                                   for _ in range(p * chunks_of(schedule, virtual))])))
    # sends paired: Megatron-LM's 1F1B's alone
    held = draw(st.one_of(st.none(), st.builds(Held, st.sampled_from((0.0, 0.1)), st.sampled_from((0.0, 0.05)),
                                               st.just(schedule == "1f1b") | st.just(False))))
    return schedule, p, m, virtual, timing, uneven, held


def _figures(sim: Simulation) -> tuple[object, ...]:
    devices = range(sim.stages)
    return (sim.ops, sim.orders, sim.makespan, sim.ideal, sim.bubble, [sim.work(d) for d in devices],
            [sim.peak_inflight(d) for d in devices], [sim.peak_chunks(d, {0: 1.0, 1: 0.5}) for d in devices])


def _most_held(sim: Simulation, device: int) -> int:
    """The running count's peak over the device's events sorted by time, an end before a start at one time
    (what Simulation._peaks counts off the runs' columns)."""
    free = "W" if any(op.kind == "W" for op in sim.ops) else "B"
    events = sorted([(op.start, 1) for op in sim.ops if op.device == device and op.kind == "F"]
                    + [(op.end, -1) for op in sim.ops if op.device == device and op.kind == free])
    return max(accumulate((step for _, step in events), initial=0))


@settings(max_examples=25, deadline=None)
@given(cases())
def test_the_keyed_walk_simulates_what_the_full_walk_simulates(
        case: tuple[str, int, int, int, Timing, tuple[Timing, ...] | None, Held | None]) -> None:
    schedule, p, m, virtual, timing, uneven, held = case
    assert keyed_walk(schedule, p, m, virtual) is not None  # the shortcut itself is what is compared
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(schedules, "_KEPT", {})
        keyed = simulate.__wrapped__(schedule, p, m, timing, virtual, uneven, held)
        patch.setattr(schedules, "_KEPT", {})
        patch.setattr(schedules, "keyed_walk", lambda *_: None)
        full = simulate.__wrapped__(schedule, p, m, timing, virtual, uneven, held)
    assert _figures(keyed) == _figures(full)
    assert keyed._peaks == [_most_held(keyed, d) for d in range(p)]


def test_keys_are_raised_to_what_they_follow_and_a_cycle_never_settles() -> None:
    """Two ops on one device: a key below the device's previous op's is raised; where the first reads the second,
    no key rises along the order and above what each op reads, so the passes run out (the full walk then
    reports the deadlock)."""
    none = np.array([[-1, -1]])
    settled = _settle(np.array([[0, 0]]), [np.array([[-1, 0]]), none], 50)
    assert settled is not None and settled.tolist() == [[0, 1]]
    assert _settle(np.array([[0, 1]]), [np.array([[1, -1]]), none], 50) is None


def test_the_periods_closed_forms_hold_without_raising(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPipe's, 1F1B's, ZB-H1's and the interleaved order's keys from their period are already above every op
    they must follow: one pass checks them, none raises them."""
    monkeypatch.setattr(keyed_walk_module, "settle_passes", lambda p: 1)
    for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3)):
        for p in range(1, 9):
            counts = (1, 2, 3, 5, 8, 13, 20) if virtual == 1 else (p, 2 * p, 3 * p)
            assert all(keyed_walk(schedule, p, m, virtual) is not None for m in counts), (schedule, p)
