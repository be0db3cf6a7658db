"""What a pipeline simulation is made of and gives: a chunk's times, the ops run, the whole run.

:class:`Timing` is a microbatch's seconds through one stage or chunk, :class:`Op` one op run,
:class:`Simulation` a whole run and what is read off it (the step, the bubble, the activations held);
and where each model chunk runs (:func:`device_of`), how many a device holds (:func:`chunks_of`).
The simulator that makes them is :mod:`shardc.pipeline.schedules`.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np

from shardc.pipeline.dualpipe import TWO_WAY, Group
from shardc.pipeline.pairing import Phases, pair_seconds

__all__ = ["Timing", "Phases", "paired_seconds", "PAIRED", "TWO_WAY", "ZERO_BUBBLE", "stage_share",
           "Op", "Runs", "Simulation", "device_of", "chunks_of", "operations"]

ZERO_BUBBLE = frozenset({"zb-h1", "zbv", "dualpipe", "dualpipev"})
PAIRED = frozenset({"dualpipe", "dualpipev"})  # the schedules that overlap an F with a B as one unit


@dataclass(frozen=True)
class Timing:
    """Seconds of one microbatch through one stage (all its layers) or one chunk: forward, input grad, weight grad."""

    forward: float
    backward: float  # the input-gradient part of the backward (the whole backward when weight is 0)
    weight: float = 0.0
    comm: float = 0.0  # one point-to-point send between devices: a forward's activation
    phases: Phases | None = None  # where known: what an F&B pair can overlap
    # the backward's send of the activation's gradient, where its bytes differ from the activation's (an FP8
    # activation's gradient is in the storage type: shardc.ir.precision.gradient_dtype); None: ``comm``
    comm_back: float | None = None

    @property
    def send_back(self) -> float:
        """One point-to-point send of a backward's gradient between devices."""
        return self.comm if self.comm_back is None else self.comm_back

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.weight


def paired_seconds(forward: Timing, backward: Timing) -> float:
    """One chunk's forward overlapped with another chunk's whole backward (DualPipe's F&B).

    DeepSeek-V3 (section 3.2.1, Figure 4) interleaves the two chunks' attention, dispatch, MLP and
    combine so that each one's AllToAll runs under the other's computation, the computations one after
    the other on the cores the collectives leave (:func:`shardc.pipeline.pairing.pair_seconds`), never
    more than the two run one after the other.  Without their chains of computation and collectives
    (``phases``) nothing is known to hide and the pair takes F + B + W.
    """
    apart = forward.forward + backward.backward + backward.weight
    f, b = forward.phases, backward.phases
    if f is None or b is None:
        return apart
    return min(apart, pair_seconds(f, b))


class Op(NamedTuple):
    """One op run: ops sort by start, then end, device, ... (a named tuple: a simulation makes one an op, and
    a tuple is made and compared several times faster than a frozen dataclass)."""

    start: float
    end: float
    device: int
    kind: str  # "F", "B" or "W"
    microbatch: int
    chunk: int
    paired: bool = False  # run overlapped with another op as one F&B unit (drawn as its share of the pair)


@dataclass(frozen=True)
class Runs:
    """The ops of a run, a column each, in the order the simulation ran them (not sorted): a run of 1536
    microbatches over 96 stages is hundreds of thousands of ops, which as :class:`Op` tuples take hundreds of MB
    and a second to make and sort; the columns take 8 bytes an op for the times (the rest is shared by every
    timing of one walk), and the sorted ops are made where they are read (:attr:`Simulation.ops`)."""

    device: Sequence[int]
    kind: str  # one letter an op: "F", "B" or "W"
    microbatch: Sequence[int]
    chunk: Sequence[int]
    start: Sequence[float]
    end: Sequence[float]
    paired: Sequence[bool] = ()  # empty: none paired

    @classmethod
    def of(cls, ops: Sequence[Op]) -> Runs:
        return cls(array("i", [op.device for op in ops]), "".join(op.kind for op in ops),
                   array("i", [op.microbatch for op in ops]), array("i", [op.chunk for op in ops]),
                   array("d", [op.start for op in ops]), array("d", [op.end for op in ops]),
                   [op.paired for op in ops] if any(op.paired for op in ops) else ())

    def ops(self) -> list[Op]:
        paired = self.paired or [False] * len(self.kind)
        return list(map(Op, self.start, self.end, self.device, self.kind, self.microbatch, self.chunk, paired))


@dataclass(frozen=True)
class Simulation:
    schedule: str
    stages: int
    microbatches: int
    chunks: int  # chunks a device holds
    timing: Timing
    runs: Runs = field(repr=False, compare=False)
    chunk_times: tuple[Timing, ...] = ()  # a microbatch's times through each model chunk, in chunk order
    # each device's groups in the order it ran them, where they are not each one op run (else read off the runs)
    groups: tuple[tuple[Group, ...], ...] = field(default=(), repr=False, compare=False)
    # whether a chunk's ops take other times than its chunk_times (``sends paired``: the warm-up's and cool-down's
    # hold their transfers alone, chunk_times the steady state's), so a device's work sums its ops
    summed: bool = False

    @cached_property
    def ops(self) -> tuple[Op, ...]:
        """Every op run, by start (then end, device, ...)."""
        return tuple(sorted(self.runs.ops()))

    @cached_property
    def orders(self) -> tuple[tuple[Group, ...], ...]:
        """Each device's groups in the order it ran them: what the lowered program's tick table places
        (shardc.pipeline.ticks), so the cost and the program run one order.  A walk runs each device's order
        in turn, so where every group is one op, a device's ops in the runs' order are its order."""
        if self.groups:
            return self.groups
        r = self.runs
        mine: list[list[Group]] = [[] for _ in range(self.stages)]
        for d, kind, j, c in zip(r.device, r.kind, r.microbatch, r.chunk, strict=True):
            mine[d].append(((kind, j, c),))
        return tuple(map(tuple, mine))

    def work(self, device: int) -> float:
        """Seconds of ops ``device`` runs: every microbatch through each chunk it holds (DualPipe's
        overlapped pairs at the pair's time: each chunk sees half the microbatches)."""
        if self.schedule in PAIRED or self.summed:
            works = self._summed_work
            return works[device] if 0 <= device < len(works) else 0.0
        return self.microbatches * math.fsum(t.total for c, t in enumerate(self.chunk_times)
                                             if device_of(self.schedule, c, self.stages) == device)

    @cached_property
    def _summed_work(self) -> list[float]:
        """Each device's ops' seconds (end less start) summed, every op read once: a pass over every op for each
        device (the busiest device's search asks each) took two fifths of a GPT-3 layouts search on 384 GPUs.
        ``math.fsum`` rounds the exact sum once, so the ops grouped by device, in any order, give each device
        the float a pass over its own ops gave."""
        r = self.runs
        device = np.asarray(r.device, np.int64)
        order = np.argsort(device, kind="stable")
        took = (np.asarray(r.end, np.float64) - np.asarray(r.start, np.float64))[order].tolist()
        bounds = np.searchsorted(device[order], np.arange(self.stages + 1)).tolist()
        return [math.fsum(took[bounds[d]:bounds[d + 1]]) for d in range(self.stages)]

    @cached_property
    def makespan(self) -> float:  # kept: a re-cost reads it a few times, each a pass over every op
        return max(self.runs.end)

    @property
    def ideal(self) -> float:
        """The busiest device's work: every microbatch through its chunks, no idling."""
        return max(self.work(d) for d in range(self.stages))

    @property
    def bubble(self) -> float:
        """Idle time of the busiest device: the step minus its work (every device's, when chunks are alike)."""
        return self.makespan - self.ideal

    @property
    def bubble_of_ideal(self) -> float:
        return self.bubble / self.ideal

    @property
    def bubble_of_total(self) -> float:
        return self.bubble / self.makespan

    def peak_inflight(self, device: int = 0) -> float:
        """Most microbatches' activations held at once, in microbatches of a whole stage.

        Held from the forward's start to the end of the last op that reads them: the
        backward, or for the zero-bubble schedules the weight gradient (it reads the
        layer inputs too; the paper counts that memory until W).
        """
        return self._peaks[device] * stage_share(self.schedule, self.chunks)

    def peak_chunks(self, device: int, weights: dict[int, float]) -> dict[int, int]:
        """The microbatches of each chunk ``device`` holds when what it holds peaks, a microbatch of chunk
        c weighing ``weights[c]`` (its bytes): under DualPipe the device's own direction's stage holds most
        of them (device 0: 16 of its first stage, 1 of its last), not half each."""
        r = self.runs
        free = "W" if "W" in r.kind else "B"
        events = sorted((s, 1, c) if k == "F" else (e, -1, c)
                        for s, e, d, k, c in zip(r.start, r.end, r.device, r.kind, r.chunk, strict=True)
                        if d == device and k in ("F", free))
        held: dict[int, int] = {}
        best: dict[int, int] = {}
        total, peak = 0.0, -1.0
        for _, step, chunk in events:
            held[chunk] = held.get(chunk, 0) + step
            total += step * weights.get(chunk, 0.0)
            if total > peak:
                peak, best = total, dict(held)
        return best

    @cached_property
    def _peaks(self) -> list[int]:
        """Each device's most activations held at once (in chunks), counted off the runs' columns whole (a run
        of 1F1B over 48 stages and 1536 microbatches is 147,456 ops, where a loop over them took most of a
        re-cost's time)."""
        r = self.runs
        kind, device = np.frombuffer(r.kind.encode(), np.uint8), np.asarray(r.device)
        forward, free = kind == ord("F"), kind == ord("W" if "W" in r.kind else "B")
        return _most_held(self.stages, (device[forward], np.asarray(r.start)[forward]),
                          (device[free], np.asarray(r.end)[free]))


def _most_held(stages: int, starts: tuple[np.ndarray, np.ndarray], ends: tuple[np.ndarray, np.ndarray]) -> list[int]:
    """Each device's most held at once, one more at each of its ``starts`` and one fewer at each of its ``ends``
    (each a column of devices and one of times; an end before a start at the same time): the peak of the running
    count over the device's events sorted, 0 at least."""
    device = np.concatenate([ends[0], starts[0]])
    step = np.concatenate([np.full(len(ends[0]), -1), np.ones(len(starts[0]), np.int64)])
    order = np.lexsort((step, np.concatenate([ends[1], starts[1]]), device))
    device, running = device[order], np.cumsum(step[order])
    first = np.searchsorted(device, np.arange(stages + 1))  # each device's first event (and the end)
    held = running - np.concatenate([[0], running])[first[:-1]][device]  # the count since the device's first
    some = first[:-1] < first[1:]
    peaks = np.zeros(stages, np.int64)
    peaks[some] = np.maximum.reduceat(held, first[:-1][some]) if len(held) else 0
    return np.maximum(peaks, 0).tolist()


def chunks_of(schedule: str, virtual: int = 1) -> int:
    return {"interleaved": virtual, "zbv": 2, "dualpipe": 2, "dualpipev": 2}.get(schedule, 1)


def stage_share(schedule: str, chunks: int) -> float:
    """A chunk's share of a stage's layers: 1/chunks, except DualPipe's, each a whole stage."""
    return 1.0 if schedule in TWO_WAY else 1 / chunks


def device_of(schedule: str, chunk: int, stages: int) -> int:
    """The device that holds model chunk ``chunk`` (DualPipe's direction-1 chunks run back like zbv's V)."""
    if schedule in ("zbv", "dualpipe", "dualpipev") and chunk >= stages:
        return 2 * stages - 1 - chunk
    return chunk % stages


def operations(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> int:
    """Ops the simulation of ``schedule`` runs: F and B (and W) for each microbatch and model chunk."""
    kinds = 3 if schedule in ZERO_BUBBLE else 2
    passes = 1 if schedule in TWO_WAY else chunks_of(schedule, virtual)  # DualPipe's microbatches: one way
    return kinds * microbatches * passes * stages
