"""A re-cost's fast simulation is the general one: the walk kept across timings, the one-op loop, the peak count.

``simulate`` reuses a fixed order's walk (which group runs next and what it reads, never the times) for
every timing, and times a walk of one-op groups with a loop of its own; both must give the very floats the
general walk gives with its own orders (:func:`run_orders`), ties and sends of either kind included.
"""

from __future__ import annotations

import math
import random
from array import array
from itertools import accumulate

import numpy as np
import pytest

from shardc.pipeline import schedules
from shardc.pipeline.blocking_sends import Held, blocking_delays
from shardc.pipeline.fixed_orders import fixed_order
from shardc.pipeline.schedules import (
    ZERO_BUBBLE,
    Timing,
    _durations,
    chunks_of,
    run_orders,
    simulate,
)
from shardc.pipeline.simulation import Runs, Simulation, _most_held

# small times that tie often (quarters add exactly) and sends that make the devices wait
TIMES = (0.0, 0.25, 0.5, 1.0, 1.75)


def _case(rng: random.Random, schedule: str) -> tuple[int, int, int, Timing, tuple[Timing, ...] | None]:
    times = TIMES
    p = rng.choice((1, 2, 3, 4, 6))
    virtual = rng.choice((2, 3)) if schedule == "interleaved" else 1
    m = p * rng.randint(1, 4) if schedule == "interleaved" else rng.randint(1, 13)
    timing = Timing(*(rng.choice(times) for _ in range(3)), comm=rng.choice((0.0, 0.25, 0.3)),
                    comm_back=rng.choice((None, 0.5, 0.1)))
    uneven = tuple(Timing(*(rng.choice(times) for _ in range(3))) for _ in range(p * chunks_of(schedule, virtual)))
    return p, m, virtual, timing, uneven if rng.random() < 0.5 else None


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"])
def test_the_kept_walk_and_its_one_op_loop_give_the_general_walks_floats(schedule: str) -> None:
    rng = random.Random(schedule)
    for _ in range(25):
        p, m, virtual, timing, uneven = _case(rng, schedule)
        sim = simulate(schedule, p, m, timing, virtual, uneven)  # a walk of this shape already kept, or kept now
        durations = [_durations(t, schedule in ZERO_BUBBLE) for t in sim.chunk_times]
        general = run_orders(schedule, p, m, durations, timing.comm, sim.orders, sim.chunk_times,
                             back=timing.send_back)
        assert [tuple(op) for op in sim.ops] == sorted(tuple(op) for op in general), (p, m, virtual, timing)


def test_zbv_orders_ops_of_no_time_after_what_they_read() -> None:
    """A stage whose backward takes 0 s (no gradient to propagate): zbv's greedy order ran B of two chunks on
    one device at one moment, and sorting them by chunk put the one reading the other first: a deadlock."""
    sim = simulate("zbv", 3, 3, Timing(1.0, 0.0, 0.25, comm_back=0.5))
    assert sim.makespan >= 3 * 2 * 1.0  # each device runs its two chunks' forwards of 3 microbatches
    assert len(sim.ops) == 3 * 3 * 2 * 3  # F, B and W of 3 microbatches through 6 chunks


def test_a_kept_walk_gives_each_timing_its_own_ops() -> None:
    """The walk kept from one timing's simulation gives another timing what a fresh walk gives it."""
    a, b = Timing(1.0, 2.0, comm=0.5), Timing(0.25, 1.75, comm=0.0)
    simulate.cache_clear()
    kept = simulate("1f1b", 4, 9, a).ops, simulate("1f1b", 4, 9, b).ops
    simulate.cache_clear()
    _ = simulate("1f1b", 4, 9, a)  # the walk kept from a's run (or from the tests before: never b's ops)
    assert simulate("1f1b", 4, 9, b).ops == kept[1] != kept[0]


def test_the_most_held_is_the_running_count_of_the_sorted_events() -> None:
    """The counting of :func:`_most_held` is each device's running count's peak over (time, +1 or -1) sorted, an
    end before a start at one time (the count it replaced), ties and devices without events included."""
    rng = random.Random(5)
    for _ in range(300):
        starts = [(rng.randint(0, 2), float(rng.randint(0, 8))) for _ in range(rng.randint(0, 9))]
        ends = [(rng.randint(0, 2), float(rng.randint(0, 8))) for _ in range(rng.randint(0, 9))]
        columns = [(np.array([d for d, _ in e], np.int64), np.array([t for _, t in e])) for e in (starts, ends)]
        expected = [max(accumulate((step for _, step in sorted([(t, 1) for e, t in starts if e == d]
                                                                + [(t, -1) for e, t in ends if e == d])), initial=0))
                    for d in range(3)]
        assert _most_held(3, columns[0], columns[1]) == expected


def test_the_kept_walks_stay_within_their_ops_budget_and_give_what_a_fresh_walk_gives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The walks kept are bounded by the ops they hold (MAX_KEPT), the least recently used dropped first; a walk
    dropped and walked again gives the same run, and each device's order read off the runs is the walk's."""
    monkeypatch.setattr(schedules, "MAX_KEPT", 200)
    monkeypatch.setattr(schedules, "_KEPT", {})
    timing = Timing(1.0, 2.0, comm=0.25)
    first = simulate.__wrapped__("1f1b", 4, 9, timing)  # 72 ops, kept
    for m in (10, 11, 12):  # 80, 88 and 96 ops: each pushes out the oldest
        simulate.__wrapped__("1f1b", 4, m, timing)
        assert sum(w for w, _ in schedules._KEPT.values()) <= 200
    assert ("1f1b", 4, 9, 1) not in schedules._KEPT
    again = simulate.__wrapped__("1f1b", 4, 9, timing)
    assert again.ops == first.ops and again.orders == first.orders
    assert first.orders == tuple(tuple((key,) for key in fixed_order("1f1b", s, 4, 9, 1)) for s in range(4))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"])
def test_blocking_sends_through_the_kept_walk_give_the_general_walks_floats(schedule: str) -> None:
    """``sends blocking`` puts each chunk's transfers into its ops and lets a reader start one transfer early
    (a negative delay): the kept walk's one-op loop still gives the general walk's floats, uneven chunks too."""
    rng = random.Random("blocking " + schedule)
    for _ in range(8):
        p, m, virtual, timing, uneven = _case(rng, schedule)
        gathers = Held(timing.comm * rng.choice((0.0, 0.5)), timing.send_back * rng.choice((0.0, 0.25)))
        sim = simulate(schedule, p, m, timing, virtual, uneven, blocking=gathers)
        comm, back = blocking_delays((timing.comm, timing.send_back), gathers)
        durations = [_durations(t, schedule in ZERO_BUBBLE) for t in sim.chunk_times]
        general = run_orders(schedule, p, m, durations, comm, sim.orders, sim.chunk_times, back=back)
        assert [tuple(op) for op in sim.ops] == sorted(tuple(op) for op in general), (p, m, virtual, timing)


def test_a_devices_summed_work_is_the_fsum_of_its_ops_in_the_runs_order() -> None:
    """Where ops take other times than their chunk's (``sends paired``, DualPipe), a device's work is the exactly
    rounded sum of its ops' end less start: grouped a device at a time, the very float of a pass over its ops."""
    rng = random.Random(8)
    for _ in range(40):
        p, n = rng.randint(1, 5), rng.randint(0, 60)
        device = [rng.randrange(p) for _ in range(n)]
        start = [rng.uniform(0, 1e3) for _ in range(n)]
        end = [s + rng.choice((0.0, rng.uniform(0, 10), rng.uniform(0, 1e-9))) for s in start]
        runs = Runs(array("i", device), "F" * n, array("i", [0] * n), array("i", device), array("d", start),
                    array("d", end))
        sim = Simulation("1f1b", p, 1, 1, Timing(1.0, 1.0), runs, summed=True)
        assert [sim.work(d) for d in range(p)] == [
            math.fsum(e - s for s, e, d in zip(start, end, device, strict=True) if d == dev) for dev in range(p)]
