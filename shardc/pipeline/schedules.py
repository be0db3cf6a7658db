"""A discrete-event simulation of every pipeline schedule: when each stage runs which op.

Each device (a stage, or for ``interleaved``/``zbv`` a device holding several
chunks of layers) runs, per microbatch and chunk, a forward ``F``, a backward
``B`` and, for the zero-bubble schedules, a separate weight-gradient op ``W``
(Qi et al. 2023, "Zero Bubble Pipeline Parallelism": B computes the input's
gradient, which the previous stage waits for; W the weights', which nobody
waits for, so it can fill the bubbles).  Elsewhere W is part of B.

Dependencies: F(j, c) needs F(j, c-1); B(j, c) needs F(j, c) and B(j, c+1); W(j, c)
needs B(j, c); a dependency across devices also waits for the point-to-point send
(``comm`` seconds for a forward's activation, ``send_back`` for a backward's gradient,
whose type may be wider).  A device runs one op at a time:

* ``gpipe`` (Huang et al. 2019): every forward, then every backward.
* ``1f1b`` (PipeDream-flush, Narayanan et al. 2021): stage s runs p-1-s forwards,
  then alternates one forward and one backward, then drains the backwards.
* ``interleaved V`` (Megatron-LM, Narayanan et al. 2021): device s holds chunks
  s, s+p, ...; the same warm-up/steady/drain order over virtual microbatches,
  with a warm-up of 2(p-1-s) + (V-1)p.
* ``zb-h1`` (Qi et al. 2023): 1F1B's order with W split off, stage s's W lagging s
  microbatches behind its B; every stage holds p microbatches, 1F1B's peak.
* ``zbv`` (Qi et al. 2024): two chunks a device in a V (chunk c on device c, then
  chunk 2p-1-c), so the last chunk and the loss are on device 0.  Its order is found
  greedily with free sends: a device runs a ready B first, else an F while it holds
  fewer than p stage-microbatches of activations (1F1B's peak; held until W, which
  reads them), else a W; that order is then kept, as a fixed order, when the sends
  take time (so they delay ops but cannot reorder them into more memory).  With
  T_F = T_B = T_W and free sends its bubble is the unavoidable fill, (p-1) T_F / 2.
* ``dualpipe`` (DeepSeek-AI 2024, DeepSeek-V3's schedule): microbatches enter from both
  ends, half of them each way, so device d holds model stage d and stage p-1-d (two whole
  stages, twice the parameters); its fixed order is the public repository's
  (:mod:`shardc.pipeline.dualpipe`), whose steady state runs a forward of one microbatch
  overlapped with the backward of another as one unit (an F&B pair): the pair takes
  :func:`paired_seconds`, the two chunks' computations one after the other, interleaved so that
  each one's collectives run under the other's computation (:mod:`shardc.pipeline.pairing`).
* ``dualpipev`` (the same repository's DualPipeV, "cut in half"): zbv's V of 2p half-stage
  chunks on p devices, every microbatch down the V and back, each device running the order a
  device of the first half of DualPipe over 2p devices runs with 2m microbatches (its two
  directions the two legs of the V); one copy of the parameters.

The simulation commits, among all devices, the op that can start first, so it
never runs an op before its inputs exist.

Chunks need not do the same work: :func:`simulate` takes one :class:`Timing` a
model chunk (``chunk_times``; by default the stage's times shared equally by its
chunks), as when the first chunk also runs an embedding and the last a loss
(Megatron-LM's placement).  The ideal time is then the busiest device's work (m
microbatches through its chunks, no idling) and the bubble the step minus it: the
idle time of that device, which with equal chunks is every device's.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import NamedTuple

from shardc.errors import ShardcError
from shardc.pipeline.blocking_sends import Held, blocking_delays, transfers
from shardc.pipeline.dualpipe import TWO_WAY, Group, dualpipe_orders
from shardc.pipeline.fixed_orders import fixed_order
from shardc.pipeline.greedy import greedy_order, op_inputs
from shardc.pipeline.pairing import Phases, pair_seconds
from shardc.spec.stages import check_dualpipe

__all__ = ["Timing", "Phases", "paired_seconds", "PAIRED", "TWO_WAY", "stage_share",
           "Op", "Simulation", "simulate", "device_of", "chunks_of", "ZERO_BUBBLE", "operations",
           "check_budget", "MAX_OPS", "MAX_GREEDY", "run_orders"]

ZERO_BUBBLE = frozenset({"zb-h1", "zbv", "dualpipe", "dualpipev"})
PAIRED = frozenset({"dualpipe", "dualpipev"})  # the schedules that overlap an F with a B as one unit
# Budgets, in work counts: half a million ops is a few hundred MB of ops and seconds of simulation
# (4096 microbatches over 64 stages of 1F1B); zbv's greedy search weighs each op by the devices.
MAX_OPS = 500_000
MAX_GREEDY = 1_000_000


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
class Simulation:
    schedule: str
    stages: int
    microbatches: int
    chunks: int  # chunks a device holds
    timing: Timing
    ops: tuple[Op, ...] = field(repr=False)
    chunk_times: tuple[Timing, ...] = ()  # a microbatch's times through each model chunk, in chunk order
    # each device's groups in the order it ran them: what the lowered program's tick table places
    # (shardc.pipeline.ticks), so the cost and the program run one order
    orders: tuple[tuple[Group, ...], ...] = field(default=(), repr=False, compare=False)

    def work(self, device: int) -> float:
        """Seconds of ops ``device`` runs: every microbatch through each chunk it holds (DualPipe's
        overlapped pairs at the pair's time: each chunk sees half the microbatches)."""
        if self.schedule in PAIRED:
            return math.fsum(op.end - op.start for op in self.ops if op.device == device)
        return self.microbatches * math.fsum(t.total for c, t in enumerate(self.chunk_times)
                                             if device_of(self.schedule, c, self.stages) == device)

    @property
    def makespan(self) -> float:
        return max(op.end for op in self.ops)

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
        free = "W" if any(op.kind == "W" for op in self.ops) else "B"
        events = sorted((op.start, 1, op.chunk) if op.kind == "F" else (op.end, -1, op.chunk)
                        for op in self.ops if op.device == device and op.kind in ("F", free))
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
        """Each device's most activations held at once (in chunks), from one pass over the ops."""
        free = "W" if any(op.kind == "W" for op in self.ops) else "B"
        starts: list[list[float]] = [[] for _ in range(self.stages)]
        ends: list[list[float]] = [[] for _ in range(self.stages)]
        for start, end, device, kind, *_ in self.ops:
            if kind == "F":
                starts[device].append(start)
            elif kind == free:
                ends[device].append(end)
        return [_most_held(s, e) for s, e in zip(starts, ends, strict=True)]


def _most_held(starts: list[float], ends: list[float]) -> int:
    """The most held at once, one more at each of ``starts`` and one fewer at each of ``ends`` (an end before
    a start at the same time; both sorted in place): the most is right after a start, the k-th, when k less the
    ends up to it are held."""
    starts.sort()
    ends.sort()
    return max(0, max((k - bisect_right(ends, t) for k, t in enumerate(starts, 1)), default=0))


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


@lru_cache(maxsize=64)  # a pure function of frozen values: a layouts search asks for the same run again
def simulate(schedule: str, stages: int, microbatches: int, timing: Timing, virtual: int = 1,
             chunk_times: tuple[Timing, ...] | None = None,
             blocking: Held | None = None) -> Simulation:
    """Run ``schedule`` on ``stages`` devices for ``microbatches`` microbatches (see the module docstring).

    ``chunk_times`` gives each model chunk's own times (``stages`` x chunks a device of them);
    by default each chunk is an equal share of ``timing``, a whole stage's.  ``timing.comm``
    and ``timing.send_back`` are the sends in both cases; ``blocking`` (``sends blocking`` or ``paired``): each
    holds both its devices (:mod:`shardc.pipeline.blocking_sends`), the chunks' ops then taking their transfers.
    """
    p, m = stages, microbatches
    if p < 1 or m < 1:
        raise ShardcError(f"a pipeline needs stages and microbatches >= 1, not {p} and {m}")
    if schedule == "interleaved" and m % p:
        raise ShardcError(f"interleaved needs microbatches a multiple of the stages ({m} over {p})",
                          fix=f"use microbatches {max(p, m - m % p)} (Megatron-LM's interleaved order)")
    chunks = chunks_of(schedule, virtual)
    zb = schedule in ZERO_BUBBLE
    if schedule in PAIRED:
        check_dualpipe(schedule, p, m)
    if chunk_times is None:  # a device's chunks share the stage's layers equally (DualPipe's: each a stage)
        k = stage_share(schedule, chunks)
        share = Timing(timing.forward * k, timing.backward * k, timing.weight * k,
                       phases=None if timing.phases is None else timing.phases.scaled(k))
        chunk_times = (share,) * (chunks * p)
    if len(chunk_times) != chunks * p:
        raise ShardcError(f"schedule {schedule} on {p} stages has {chunks * p} chunks, "
                          f"not the {len(chunk_times)} timed")
    check_budget(schedule, p, m, virtual)
    sends = timing.comm, timing.send_back
    if blocking is not None:
        adds = [transfers(c, len(chunk_times), sends, blocking) for c in range(len(chunk_times))]
        chunk_times = tuple(replace(t, forward=t.forward + f, backward=t.backward + b)
                            for t, (f, b) in zip(chunk_times, adds, strict=True))
        sends = blocking_delays(sends, blocking)
    durations = [_durations(t, zb) for t in chunk_times]
    orders: tuple[tuple[Group, ...], ...]
    if schedule == "zbv":  # the greedy order found with free sends, then kept as each device's order
        found = greedy_order(schedule, p, m, durations, [device_of(schedule, c, p) for c in range(len(durations))])
        # each device's ops as the greedy committed them, which is by start time and, among ops of 0 s that
        # start together, puts an op after those it reads (sorting by start, device and chunk would not)
        orders = tuple(tuple(((kind, j, c),) for *_, e, kind, j, c in found if e == d) for d in range(p))
        steps = _walk(schedule, p, m, len(durations), orders)
        ones = _ones(steps)
    else:  # a fixed order: its walk depends on the schedule's shape alone, so a re-cost reuses it
        orders, steps, ones = _fixed_walk(schedule, p, m, virtual)
    ops = (_timeline(p, steps, durations, sends[0], chunk_times, back=sends[1]) if ones is None
           else _one_timeline(p, ones, durations, _sends(*sends)))
    return Simulation(schedule, p, m, chunks, timing, tuple(sorted(ops)), tuple(chunk_times), orders)


def operations(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> int:
    """Ops the simulation of ``schedule`` runs: F and B (and W) for each microbatch and model chunk."""
    kinds = 3 if schedule in ZERO_BUBBLE else 2
    passes = 1 if schedule in TWO_WAY else chunks_of(schedule, virtual)  # DualPipe's microbatches: one way
    return kinds * microbatches * passes * stages


def check_budget(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> None:
    """Refuse a simulation past :data:`MAX_OPS` ops (zbv's greedy search: :data:`MAX_GREEDY` op-devices).

    Work counts rather than seconds, so the answer is the same on every machine: the
    fixed orders cost a few microseconds an op, zbv's search an op per device per op.
    """
    ops = operations(schedule, stages, microbatches, virtual)
    greedy = ops * stages if schedule == "zbv" else 0
    if ops > MAX_OPS or greedy > MAX_GREEDY:
        what = (f"{ops:,} ops" if ops > MAX_OPS else f"{ops:,} ops searched over {stages} devices")
        cap = f"{MAX_OPS:,} ops" if ops > MAX_OPS else f"{MAX_GREEDY:,} op-devices"
        raise ShardcError(f"simulating {schedule} over {stages} stages and {microbatches} microbatches is {what}, "
                          f"past the budget of {cap}",
                          fix="use fewer microbatches or fewer stages (the bubble depends on their ratio, "
                              "(p-1)/m for 1F1B)" + (", or another schedule than zbv" if greedy else ""))


def run_orders(schedule: str, p: int, m: int, durations: list[dict[str, float]], comm: float,
               orders: list[list[Group]] | tuple[tuple[Group, ...], ...], chunk_times: tuple[Timing, ...] = (),
               tick: bool = False, back: float | None = None) -> list[Op]:
    """Each device runs its ``orders`` in turn, each group as soon as its inputs and the device are free.

    A group is one op, or ops run as one unit (DualPipe's whole backward, B then its W; its
    overlapped F&B pair): the unit starts when every input of its ops is there, its outputs are
    all sent at its end, and a pair takes :func:`paired_seconds`.  Start times follow from the
    orders alone (a device's previous group, the ops it reads), so one pass that advances each
    device until it waits on another's op gives them, in time linear in the ops (:func:`_walk`); a
    device that waits is resumed when that op is done.  With ``tick`` every group takes one unit, all its ops
    spanning it (a lowered program's tick: :mod:`shardc.pipeline.ticks`), and no op of a group may read
    its forward (the program's body runs a tick's backward on what the tick found, not on its forward).
    An input from another device arrives ``comm`` after its op ends, a backward's gradient ``back`` (or ``comm``).
    """
    steps = _walk(schedule, p, m, len(durations), orders, tick)
    return _timeline(p, steps, durations, comm, chunk_times, tick, back)


# A step of a walk: the device, the group it runs, and what the group reads: (the step that made the
# input, how it comes: 0 on the device, 1 a forward's send, 2 a backward's gradient's)
Step = tuple[int, Group, tuple[tuple[int, int], ...]]


@lru_cache(maxsize=64)  # a layouts search re-costs many layouts of one schedule, stages and microbatches (its
# layouts of each data-parallel size at their own counts, shardc.layouts.microbatches: many pairs of p and m)
def _fixed_walk(schedule: str, p: int, m: int, virtual: int) -> tuple[tuple[tuple[Group, ...], ...],
                                                                      tuple[Step, ...], tuple[One, ...] | None]:
    """The fixed orders of ``schedule`` (all but zbv's), their walk, and it as :func:`_ones` gives it."""
    if schedule in PAIRED:
        orders = tuple(map(tuple, dualpipe_orders(p, m, v=schedule == "dualpipev")))
    else:
        orders = tuple(tuple((key,) for key in fixed_order(schedule, s, p, m, virtual)) for s in range(p))
    steps = _walk(schedule, p, m, chunks_of(schedule, virtual) * p, orders)
    return orders, steps, _ones(steps)


# A step whose group is one op, flat: device, kind, microbatch, chunk, reads (the most common walk's)
One = tuple[int, str, int, int, tuple[tuple[int, int], ...]]


def _ones(steps: tuple[Step, ...]) -> tuple[One, ...] | None:
    """``steps`` flat, where every group is one op (None where not)."""
    if any(len(group) != 1 for _, group, _ in steps):
        return None
    return tuple((d, *group[0], reads) for d, group, reads in steps)


def _sends(comm: float, back: float | None) -> tuple[float, float, float]:
    """The time an input takes to come, by how it comes (a :data:`Step`'s reads)."""
    return 0.0, comm, comm if back is None else back


def _walk(schedule: str, p: int, m: int, n: int, orders: list[list[Group]] | tuple[tuple[Group, ...], ...],
          tick: bool = False) -> tuple[Step, ...]:
    """The groups of ``orders`` in the order :func:`run_orders` runs them, ``n`` model chunks: which group
    runs next and what it waits on depend on the orders alone, never on the times."""
    made: dict[tuple[str, int, int], int] = {}  # an op run -> its step
    position = [0] * p
    blocked: dict[tuple[str, int, int], list[int]] = {}  # an op not yet run -> the devices waiting on it
    runnable = list(range(p - 1, -1, -1))
    steps: list[Step] = []
    home = [device_of(schedule, c, p) for c in range(n)]
    spans = [_span(schedule, p, m, j, n) for j in range(m)]
    while runnable:
        d = runnable.pop()
        order, i = orders[d], position[d]
        while i < len(order):
            group = order[i]
            reads: list[tuple[int, int]] = []
            missing = None
            for kind, j, c in group:
                for dep in op_inputs(kind, j, c, *spans[j]):
                    if (at := made.get(dep)) is not None:
                        reads.append((at, 0 if home[dep[2]] == d else 2 if dep[0] == "B" else 1))
                    elif dep not in group:
                        missing = dep
                        break
                    elif tick and dep[0] == "F":
                        raise ShardcError(f"{schedule}'s group {group} reads its own forward (a bug in its order)")
                if missing is not None:
                    break
            if missing is not None:
                blocked.setdefault(missing, []).append(d)
                break
            for key in group:
                made[key] = len(steps)
                if key in blocked:
                    runnable += blocked.pop(key)
            steps.append((d, group, tuple(reads)))
            i += 1
        position[d] = i
    if sum(len(group) for _, group, _ in steps) < operations(schedule, p, m, n // p) or blocked:
        raise ShardcError(f"schedule {schedule} deadlocked (a bug in its order)")
    return tuple(steps)


def _timeline(p: int, steps: tuple[Step, ...], durations: list[dict[str, float]], comm: float,
              chunk_times: tuple[Timing, ...] = (), tick: bool = False, back: float | None = None) -> list[Op]:
    """The ops of a walk's ``steps``, in its order: each group starts when its device is free and its
    inputs are there (a send's time after the op that made them, where it ran on another device)."""
    sends = _sends(comm, back)
    ends: list[float] = []  # each step's end
    free = [0.0] * p
    result: list[Op] = []
    for d, group, reads in steps:
        start = free[d]
        for at, how in reads:
            end = ends[at] + sends[how] if how else ends[at]
            if end > start:  # max(start, end), the same float
                start = end
        if tick:
            t = start + 1
            result += [Op(start, t, d, *key) for key in group]
        elif len(group) == 1:  # one op: it runs its own time (what _placed gives it, without the scaling)
            kind, j, c = group[0]
            t = start + durations[c][kind]
            result.append(Op(start, t, d, kind, j, c))
        else:
            result += _placed(group, start, d, durations, chunk_times)
            t = result[-1].end
        ends.append(t)
        free[d] = t
    return result


def _one_timeline(p: int, steps: tuple[One, ...], durations: list[dict[str, float]],
                  sends: tuple[float, float, float]) -> list[Op]:
    """:func:`_timeline` of a walk whose groups are each one op, without its cases: a re-cost's hot loop."""
    ends: list[float] = []
    free = [0.0] * p
    result: list[Op] = []
    new = tuple.__new__  # Op's own __new__ without its call: a third of this loop's time
    for d, kind, j, c, reads in steps:
        start = free[d]
        for at, how in reads:
            end = ends[at] + sends[how] if how else ends[at]
            if end > start:  # max(start, end), the same float
                start = end
        t = start + durations[c][kind]
        result.append(new(Op, (start, t, d, kind, j, c, False)))
        ends.append(t)
        free[d] = t
    return result


def _placed(group: tuple[tuple[str, int, int], ...], start: float, d: int, durations: list[dict[str, float]],
            chunk_times: tuple[Timing, ...]) -> list[Op]:
    """A group's ops from ``start``: one after another, an F&B pair's each drawn as its share of the pair."""
    own = [durations[c][kind] for kind, _, c in group]
    kinds = [key[0] for key in group]
    span = sum(own)
    paired = "F" in kinds and "B" in kinds
    if paired:
        span = paired_seconds(chunk_times[group[0][2]], chunk_times[group[kinds.index("B")][2]])
    scale = span / sum(own) if sum(own) else 0.0
    out, t = [], start
    for key, seconds in zip(group, own, strict=True):
        end = start + span if key is group[-1] else t + seconds * scale
        out.append(Op(t, end, d, *key, paired))
        t = end
    return out


def _span(schedule: str, p: int, m: int, j: int, n: int) -> tuple[int, int]:
    """The first and the last chunk microbatch ``j`` runs through (DualPipe's second half: the way back)."""
    if schedule in TWO_WAY:
        return (p, n - 1) if j >= m // 2 else (0, p - 1)
    return 0, n - 1


def _durations(timing: Timing, zb: bool) -> dict[str, float]:
    """A chunk's op times: W is part of B unless the schedule splits it off."""
    if zb:
        return {"F": timing.forward, "B": timing.backward, "W": timing.weight}
    return {"F": timing.forward, "B": timing.backward + timing.weight, "W": 0.0}
