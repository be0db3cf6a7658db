"""The schedule simulator with per-chunk times: chunks that do more work than others (an embedding on
the first, a loss on the last, as Megatron-LM places them), the busiest device's ideal time, the bubble."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardc.errors import ShardcError
from shardc.ir.spec import SCHEDULES
from shardc.pipeline.bubbles import EXACT
from shardc.pipeline.schedules import Timing, chunks_of, device_of, simulate, stage_share


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_equal_chunk_times_are_the_default(schedule: str) -> None:
    timing = Timing(1.0, 1.5, 0.5, comm=0.25)
    chunks = chunks_of(schedule, 2)
    k = stage_share(schedule, chunks)  # DualPipe's chunks are whole stages
    share = Timing(1.0 * k, 1.5 * k, 0.5 * k)
    default = simulate(schedule, 4, 8, timing, virtual=2)
    given_ = simulate(schedule, 4, 8, timing, virtual=2, chunk_times=(share,) * (4 * chunks))
    assert default.ops == given_.ops
    assert default.ideal == pytest.approx(8 * timing.total)  # every device's work, alike


@pytest.mark.parametrize(("p", "m", "e"), [(4, 8, 0.5), (2, 3, 2.0), (4, 1, 1.0), (3, 6, 0.0)])
def test_gpipe_with_a_slower_first_chunk_golden(p: int, m: int, e: float) -> None:
    """GPipe, chunk 0's forward e longer (an embedding), sends free: stage 0 paces the forwards, so the
    last forward ends at m (f + e) + (p-1) f and the backwards then take (m + p - 1) b.  The bubble,
    step minus the busiest (first) device's work m (f + e + b), stays (p-1)(f + b)."""
    f, b = 1.0, 2.0
    times = (Timing(f + e, b),) + (Timing(f, b),) * (p - 1)
    sim = simulate("gpipe", p, m, Timing(f, b), chunk_times=times)
    assert sim.makespan == pytest.approx(m * (f + e) + (p - 1) * f + (m + p - 1) * b)
    assert sim.work(0) == pytest.approx(m * (f + e + b)) and sim.ideal == sim.work(0)
    assert sim.bubble == pytest.approx((p - 1) * (f + b))


def test_first_and_last_chunk_extra_work_lengthens_the_one_f_one_b_step() -> None:
    """1F1B, an embedding's forward and backward on the first chunk and a loss's on the last: the step
    grows by at least the extra work of the busier of the two ends, m microbatches of it."""
    p, m = 4, 8
    even = simulate("1f1b", p, m, Timing(1.0, 2.0))
    times = (Timing(1.3, 2.2),) + (Timing(1.0, 2.0),) * (p - 2) + (Timing(1.6, 2.8),)
    uneven = simulate("1f1b", p, m, Timing(1.0, 2.0), chunk_times=times)
    assert uneven.ideal == pytest.approx(m * 4.4) == uneven.work(p - 1)  # the last device is the busiest
    assert uneven.makespan >= even.makespan + m * 1.4 - 1e-9
    assert uneven.work(1) == pytest.approx(even.work(1))


def test_chunk_times_must_cover_every_chunk() -> None:
    with pytest.raises(ShardcError, match="has 8 chunks, not the 4 timed"):
        simulate("interleaved", 4, 8, Timing(1.0, 1.0), virtual=2, chunk_times=(Timing(1.0, 1.0),) * 4)


@settings(max_examples=40, deadline=None)
@given(schedule=st.sampled_from(SCHEDULES), p=st.integers(1, 5), m=st.integers(1, 10),
       times=st.lists(st.tuples(*[st.floats(0.01, 4.0)] * 3), min_size=10, max_size=10),
       comm=st.floats(0.0, 0.5), slower=st.integers(0, 9), by=st.floats(0.0, 3.0))
def test_the_bubble_is_the_busiest_devices_idle_time(schedule: str, p: int, m: int,
                                                      times: list[tuple[float, float, float]], comm: float,
                                                      slower: int, by: float) -> None:
    if schedule == "interleaved":
        m = p * max(1, m // p)
    if schedule == "dualpipe":  # an even number of devices, an even number of microbatches, at least 2p
        p = 2 * max(1, p // 2)
        m = max(2 * p, m + m % 2)
    if schedule == "dualpipev":
        m = max(2 * p, m)
    n = chunks_of(schedule, 2) * p
    chunk_times = tuple(Timing(*t) for t in times[:n])
    sim = simulate(schedule, p, m, Timing(1.0, 1.0, comm=comm), virtual=2, chunk_times=chunk_times)
    for d in range(p):  # each device's ops add up to its work, which the step covers
        ran = sum(op.end - op.start for op in sim.ops if op.device == d)
        assert ran == pytest.approx(sim.work(d))
        assert sim.makespan >= sim.work(d) - 1e-9
        assert all(device_of(schedule, op.chunk, p) == d for op in sim.ops if op.device == d)
    assert sim.bubble >= -1e-9 and sim.ideal == max(sim.work(d) for d in range(p))
    if schedule in EXACT:  # a fixed order: a slower chunk never shortens the step
        k = slower % n
        t = chunk_times[k]
        longer = chunk_times[:k] + (Timing(t.forward + by, t.backward, t.weight),) + chunk_times[k + 1:]
        again = simulate(schedule, p, m, Timing(1.0, 1.0, comm=comm), virtual=2, chunk_times=longer)
        assert again.makespan >= sim.makespan - 1e-9
