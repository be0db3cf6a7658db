"""The lowered schedule's buffers hold the microbatches in flight, not one slot a microbatch."""

from __future__ import annotations

import pytest

from shardc.lowering.pipeline_lowering import SPLIT_SCHEDULES, schedule_tables
from shardc.lowering.pipeline_routes import Placement
from shardc.lowering.pipeline_slots import Rings, rings
from shardc.pipeline.schedules import chunks_of

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2))


def _rings(schedule: str, stages: int, microbatches: int, virtual: int) -> tuple[Rings, dict[str, list[list[int]]]]:
    tables = schedule_tables(schedule, stages, microbatches, virtual)
    place = Placement(stages, chunks_of(schedule, virtual), schedule in ("zbv", "dualpipev"))
    weight = tables["W"] if schedule in SPLIT_SCHEDULES else None
    return rings(place, microbatches, tables["F"], tables["B"], weight), tables


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (4, 8), (4, 3)])
def test_1f1b_keeps_the_microbatches_in_flight_in_a_ring(stages: int, microbatches: int) -> None:
    ring, _ = _rings("1f1b", stages, microbatches, 1)
    held = min(stages, microbatches)  # the first stage's in flight (Narayanan et al. 2021, 2.2.1)
    assert ring.kept.count == held
    assert ring.kept.table[0] == tuple(j % held for j in range(microbatches))
    for s in range(stages):  # stage s holds min(stages - s, microbatches): its slots are j mod that
        assert len(set(ring.kept.table[s])) == min(stages - s, microbatches)


def test_gpipe_keeps_every_microbatch() -> None:
    ring, _ = _rings("gpipe", 4, 8, 1)
    assert ring.kept.count == 8
    assert ring.kept.table[0] == tuple(range(8))


@pytest.mark.parametrize(("schedule", "virtual"), SCHEDULES)
def test_no_two_residuals_alive_at_once_share_a_slot(schedule: str, virtual: int) -> None:
    ring, tables = _rings(schedule, 4, 8, virtual)
    free = "W" if schedule in SPLIT_SCHEDULES else "B"
    for s in range(4):
        start = {row[s]: t for t, row in enumerate(tables["F"]) if row[s] >= 0}
        end = {row[s]: t for t, row in enumerate(tables[free]) if row[s] >= 0}
        for a in start:
            for b in start:
                overlap = a != b and start[a] <= end[b] and start[b] <= end[a]
                assert not (overlap and ring.kept.table[s][a] == ring.kept.table[s][b]), (s, a, b)
        alive = max(sum(start[e] <= t <= end[e] for e in start) for t in range(len(tables["F"])))
        assert max(ring.kept.table[s]) < ring.kept.count and alive <= ring.kept.count



def test_the_ends_w_values_take_the_microbatches_between_their_b_and_w() -> None:
    """Under ZB-H1 over 4 stages the last stage runs F0 B0 F1 B1 F2 B2 F3 B3 W0: what the loss's W reads
    (made at its B, in the last stage's F tick) is held for 4 microbatches there; stage 0 runs each W right
    after its B, so the block input's gradient takes 1 slot; only the ends' devices hold them."""
    ring, _ = _rings("zb-h1", 4, 8, 1)
    assert (ring.post.count, ring.pre.count) == (4, 1)
    assert [bool(h) for h in ring.post.held] == [False, False, False, True]
    assert [bool(h) for h in ring.pre.held] == [True, False, False, False]
    one, _ = _rings("1f1b", 4, 8, 1)  # each backward whole: the ends keep nothing for a W
    assert (one.post.count, one.pre.count) == (1, 1) and not any(one.post.held + one.pre.held)
