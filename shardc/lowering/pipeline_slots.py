"""Which buffer slot each microbatch's saved values take in a pipelined program: as many slots as
the schedule keeps in flight, not one a microbatch.

A stage keeps a microbatch's residuals from its forward to its backward (to its weight gradient W
under the zero-bubble schedules), the activation it receives from its arrival to the forward that
reads it, and the cotangent from its arrival to the backward.  Under 1F1B the first stage holds
min(stages, microbatches) of them at once (Narayanan et al. 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters", section 2.2.1), so a program keeping a slot for every microbatch
holds more than the schedule promises.  Megatron-LM and torchtitan keep a queue of the microbatches
in flight; here each (stage, microbatch) gets a slot of a ring of the in-flight count, assigned
from the tick tables: each value lives over an interval of the ticks, and the intervals of one stage
take the lowest slot free at their start (interval-graph colouring, whose greedy order by start uses
exactly the most intervals alive at once).  Under 1F1B that is the microbatch modulo the in-flight
count; under GPipe every microbatch; under the interleaved and V schedules what the table keeps.

Within a tick the body runs in this order (:meth:`shardc.lowering.pipeline_runtime.Pipeline._local`),
so that a slot read and written in the same tick is reused only where the read comes first: a slot F
writes at a tick is never one B or W read there.  Where a tick pairs an F and a B (DualPipe, DualPipeV:
:func:`paired`) they read the residuals and cotangents the tick began with, F's writes landing at the next
tick's start; the slots are the same (freeing a slot a tick's B reads for its F's write at the next tick
saved no slot under DualPipe or DualPipeV over 4 stages and 8 microbatches).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from shardc.lowering.pipeline_routes import Placement

__all__ = ["Ring", "Rings", "rings"]

# The order of a tick's reads and writes in the program's body.
READ_ACT, WRITE_KEPT, WRITE_END_COT, SEND_ACT, READ_B, WRITE_HANDED, READ_W, SEND_COT = range(8)

Table = Sequence[Sequence[int]]
Moment = tuple[int, int]  # (tick, its moment in the body)


@dataclass(frozen=True)
class Ring:
    """One buffer's slots: ``count`` of them, ``table[stage][entry]`` the slot of a chunk x M + microbatch
    entry on that stage (0 where the stage never holds it)."""

    count: int
    table: tuple[tuple[int, ...], ...]
    held: tuple[tuple[int, ...], ...] = ()  # the entries each stage holds at some tick (its table's others: 0)


@dataclass(frozen=True)
class Rings:
    """The rings of a pipelined program's buffers: the residuals (``kept``), what B hands W
    (``handed``), the activations received (``acts``) and the cotangents (``cots``); under the zero-bubble
    schedules what the ends' W reads, on the devices that run them: the statements after the block's, from
    the last virtual stage's F (where their B runs) to its W (``post``), the block input's gradient, from
    the first virtual stage's B to its W (``pre``)."""

    kept: Ring
    handed: Ring
    acts: Ring
    cots: Ring
    post: Ring
    pre: Ring


def paired(forward: Table, backward: Table) -> bool:
    """Whether a tick of the tables runs an F and a B on one device (DualPipe's F&B pairs): its B and W
    then read the buffers as the tick found them, and its F's writes wait for the next tick."""
    return any(f >= 0 and b >= 0 for fs, bs in zip(forward, backward, strict=True) for f, b in zip(fs, bs, strict=True))


def rings(placement: Placement, microbatches: int, forward: Table, backward: Table,
          weight: Table | None) -> Rings:
    """Each buffer's ring under the tick tables ``forward``, ``backward`` and ``weight`` (None: each
    backward whole at its B tick), the chunks placed as ``placement`` places them."""
    stages, entries = placement.stages, placement.chunks * microbatches
    names = ("kept", "handed", "acts", "cots", "post", "pre")
    live: dict[str, list[dict[int, list[Moment]]]] = {k: [{} for _ in range(stages)] for k in names}

    def mark(buf: str, stage: int, entry: int, at: Moment) -> None:
        live[buf][stage].setdefault(entry, []).append(at)

    def entry_of(virtual: int, e: int) -> tuple[int, int]:  # the device holding ``virtual`` and e's entry there
        to, chunk = placement.place(virtual)
        return to, chunk * microbatches + e % microbatches

    for t, s, e, u in _ops(forward, placement, microbatches):
        mark("kept", s, e, (t, WRITE_KEPT))
        if not placement.starts(u):  # (the first virtual stage, or either of DualPipe's, reads the ends')
            mark("acts", s, e, (t, READ_ACT))
        if not placement.ends(u):
            mark("acts", *entry_of(u + 1, e), (t, SEND_ACT))
        else:
            mark("cots", s, e, (t, WRITE_END_COT))
            if weight is not None:
                mark("post", s, e, (t, WRITE_KEPT))
    for t, s, e, u in _ops(backward, placement, microbatches):
        mark("cots", s, e, (t, READ_B))
        mark("kept", s, e, (t, READ_B))
        if weight is not None:
            mark("handed", s, e, (t, WRITE_HANDED))
            if placement.starts(u):
                mark("pre", s, e, (t, WRITE_HANDED))
        if not placement.starts(u):
            mark("cots", *entry_of(u - 1, e), (t, SEND_COT))
    for t, s, e, u in _ops(weight or (), placement, microbatches):
        mark("kept", s, e, (t, READ_W))
        mark("handed", s, e, (t, READ_W))
        for name, here in (("post", placement.ends(u)), ("pre", placement.starts(u))):
            if here:
                mark(name, s, e, (t, READ_W))
    return Rings(*(_ring(live[k], entries) for k in names))


def _ops(table: Table, placement: Placement, microbatches: int) -> Iterator[tuple[int, int, int, int]]:
    """(tick, stage, chunk x M + microbatch entry, its virtual stage) of each op of a tick table."""
    for t, row in enumerate(table):
        for s, e in enumerate(row):
            if e >= 0:
                yield t, s, e, placement.virtual(e // microbatches, s)


def _ring(stages: list[dict[int, list[Moment]]], entries: int) -> Ring:
    """The fewest slots holding every stage's intervals (each entry's first to last moment), and each
    entry's slot: the lowest one whose last interval ended before it starts."""
    table, count = [], 0
    for held in stages:  # each stage's entries, each a list of the moments it is read or written
        ends: list[Moment] = []  # each slot's last moment so far
        mine = [0] * entries
        for entry, (start, end) in sorted(((e, (min(m), max(m))) for e, m in held.items()), key=lambda x: x[1]):
            free = [k for k, last in enumerate(ends) if last < start]
            if free:
                ends[free[0]] = end
            else:
                ends.append(end)
            mine[entry] = free[0] if free else len(ends) - 1
        table.append(tuple(mine))
        count = max(count, len(ends))
    return Ring(max(count, 1), tuple(table), tuple(tuple(sorted(held)) for held in stages))
