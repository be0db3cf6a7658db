"""The tick table: what each device runs at each step of a lowered pipeline's loop, placed from the
device orders the cost's simulation ran (:attr:`~shardc.pipeline.schedules.Simulation.orders`).

A tick is one iteration of the lowered program's loop, in which every device runs at most one forward
(F), one backward (B: under the zero-bubble schedules the input's gradient only) and one weight
gradient (W), then sends what they made.  Each group of a device's order takes one tick: one op;
DualPipe's whole backward (its B, then the W that reads what B made); DualPipe's overlapped F&B pair,
a forward of one microbatch with the whole backward of another.  A group is placed as soon as the
device has run its previous group and every op it reads ran at an earlier tick: the simulation's own
walk of the orders (:func:`~shardc.pipeline.schedules.run_orders`) with each group one unit of time
and free sends, so the cost and the program run one order and the tick table's length is that walk's
makespan.  A pair's forward and backward thus sit in one row: the program issues both in the same
loop iteration, neither reading what the other makes (its body runs a tick's backward on the values
the tick found), so XLA may run one's collectives under the other's computation as the cost times
the pair (:func:`~shardc.pipeline.schedules.paired_seconds`); on one CPU device it runs them in turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.errors import InternalError
from shardc.pipeline.dualpipe import Group
from shardc.pipeline.schedules import (
    ZERO_BUBBLE,
    Simulation,
    Timing,
    chunks_of,
    run_orders,
    simulate,
    stage_share,
)

__all__ = ["TickTable", "tick_table", "ticks_of", "unit_ticks"]


@dataclass(frozen=True)
class TickTable:
    """``rows[t][d]``: the group device d runs at tick t (``()``: none), its ops (kind, microbatch, chunk)."""

    schedule: str
    stages: int
    microbatches: int
    rows: tuple[tuple[Group, ...], ...]

    def table(self, kind: str) -> list[list[int]]:
        """What each device runs of ``kind`` ("F", "B" or "W") at each tick: the microbatch j of model
        chunk c as c // stages x microbatches + j (the device's chunk's entry), -1 for none."""
        p, m = self.stages, self.microbatches
        out = [[-1] * p for _ in self.rows]
        for t, row in enumerate(self.rows):
            for d, group in enumerate(row):
                for k, j, c in group:
                    if k == kind:
                        out[t][d] = c // p * m + j
        return out

    @property
    def orders(self) -> tuple[tuple[Group, ...], ...]:
        """Each device's groups in tick order: the simulation's orders, read back."""
        return tuple(tuple(row[d] for row in self.rows if row[d]) for d in range(self.stages))


def tick_table(sim: Simulation) -> TickTable:
    """The tick table of ``sim``'s orders: each group one tick, as early as its device and inputs allow."""
    return ticks_of(sim.schedule, sim.stages, sim.microbatches, sim.chunks, sim.orders)


def ticks_of(schedule: str, stages: int, microbatches: int, chunks: int,
             orders: tuple[tuple[Group, ...], ...] | list[list[Group]]) -> TickTable:
    """The tick table of the devices' ``orders``: each group one tick, as early as its device and inputs allow
    (a :class:`~shardc.errors.ShardcError` where the orders deadlock or leave an op out)."""
    ops = run_orders(schedule, stages, microbatches, [{"F": 1.0, "B": 1.0, "W": 1.0}] * (chunks * stages), 0.0,
                     orders, tick=True)
    rows: list[list[list[tuple[str, int, int]]]] = [[[] for _ in range(stages)]
                                                    for _ in range(int(max(op.end for op in ops)))]
    for op in ops:
        cell = rows[int(op.start)][op.device]
        if any(key[0] == op.kind for key in cell):
            raise InternalError(f"{schedule}'s tick {int(op.start)} runs two {op.kind} ops on device "
                                f"{op.device}", fix="this is a shardc bug: report the schedule")
        cell.append((op.kind, op.microbatch, op.chunk))
    return TickTable(schedule, stages, microbatches, tuple(tuple(tuple(cell) for cell in row) for row in rows))


def unit_ticks(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> TickTable:
    """The tick table of ``schedule``'s orders as the simulation finds them with a chunk's F, B (and W) one
    unit each (only zbv's greedy order depends on the times)."""
    chunks = chunks_of(schedule, virtual)
    unit = float(stage_share(schedule, chunks) ** -1)  # a chunk's op, one unit
    timing = Timing(unit, unit, unit) if schedule in ZERO_BUBBLE else Timing(unit, unit)
    return tick_table(simulate(schedule, stages, microbatches, timing, virtual=chunks))
