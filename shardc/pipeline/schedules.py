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

from dataclasses import replace
from functools import lru_cache

from shardc.errors import ShardcError
from shardc.pipeline.blocking_sends import Held, blocking_delays, transfers
from shardc.pipeline.dualpipe import TWO_WAY, Group, dualpipe_orders
from shardc.pipeline.fixed_orders import fixed_order
from shardc.pipeline.greedy import greedy_order
from shardc.pipeline.keyed_walk import keyed_walk
from shardc.pipeline.order_walk import Ones, Step, one_timeline, ones, run_orders, sends_of, timeline, walk
from shardc.pipeline.paired_sends import megatron_steps
from shardc.pipeline.simulation import (
    PAIRED,
    ZERO_BUBBLE,
    Op,
    Phases,
    Runs,
    Simulation,
    Timing,
    chunks_of,
    device_of,
    operations,
    paired_seconds,
    stage_share,
)
from shardc.spec.stages import check_dualpipe

__all__ = ["Timing", "Phases", "paired_seconds", "PAIRED", "TWO_WAY", "stage_share",
           "Op", "Simulation", "simulate", "device_of", "chunks_of", "ZERO_BUBBLE", "operations",
           "check_budget", "MAX_OPS", "MAX_GREEDY", "run_orders"]

# Budgets, in work counts: half a million ops is a few hundred MB of ops and seconds of simulation
# (4096 microbatches over 64 stages of 1F1B); zbv's greedy search weighs each op by the devices.
MAX_OPS = 500_000
MAX_GREEDY = 1_000_000


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
    if blocking is not None and blocking.paired and schedule != "1f1b":
        raise ShardcError(f"sends paired: only under 1f1b (Megatron-LM's), not {schedule}",
                          fix="simulate schedule 1f1b, or hold the sends one at a time (sends blocking)")
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
    bare = chunk_times  # the ops' own times, before the transfers they hold
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
        found_steps = walk(schedule, p, m, len(durations), orders)
        steps: tuple[Step, ...] | None = found_steps
        flat = ones(found_steps)
    else:  # a fixed order: its walk depends on the schedule's shape alone, so a re-cost reuses it
        orders, steps, flat = _fixed_walk(schedule, p, m, virtual)
    if blocking is not None and blocking.paired:  # the warm-up's and cool-down's ops hold their transfers alone
        assert flat is not None  # 1f1b's fixed order, one op a group
        marked, seconds, delays = megatron_steps(flat, p, m, [_durations(t, zb) for t in bare], (timing.comm,
                                                 timing.send_back), (blocking.gather, blocking.gather_back))
        runs, orders = one_timeline(p, marked, durations, delays, seconds), ()
    elif flat is not None:  # each device's order is read off the runs (Simulation.orders)
        runs, orders = one_timeline(p, flat, durations, sends_of(*sends)), ()
    else:
        assert steps is not None
        runs = Runs.of(timeline(p, steps, durations, sends[0], chunk_times, back=sends[1]))
    return Simulation(schedule, p, m, chunks, timing, runs, tuple(chunk_times), orders,
                      summed=blocking is not None and blocking.paired)


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


Walk = tuple[tuple[tuple[Group, ...], ...], tuple[Step, ...] | None, Ones | None]
# The walks kept, by (schedule, p, m, virtual), least recently used first: a layouts search re-costs many layouts
# of one schedule, stages and microbatches (its layouts of each data-parallel size at their own counts,
# shardc.layouts.microbatches: many pairs of p and m).  Bounded by the ops they hold, not by their number: a
# walk of one-op groups is about 20 bytes an op (Ones), so MAX_KEPT is some 100 MB; the others' steps, a few
# hundred bytes an op, count ten times.
_KEPT: dict[tuple[str, int, int, int], tuple[int, Walk]] = {}
MAX_KEPT = 10 * MAX_OPS


def _fixed_walk(schedule: str, p: int, m: int, virtual: int) -> Walk:
    """The fixed orders of ``schedule`` (all but zbv's), their walk, and it as :func:`ones` gives it (where it
    does, neither the orders nor the steps: the runs give them); kept while they fit :data:`MAX_KEPT`.  The
    one-op orders are walked in closed form (:func:`~shardc.pipeline.keyed_walk.keyed_walk`)."""
    key = (schedule, p, m, virtual)
    if (kept := _KEPT.pop(key, None)) is not None:
        _KEPT[key] = kept  # now the most recently used
        return kept[1]
    keyed = None if schedule in PAIRED else keyed_walk(schedule, p, m, virtual)  # 1F1B's family: no walk
    found = ((), None, keyed) if keyed is not None else _full_walk(schedule, p, m, virtual)
    weight = len(found[2]) if found[2] is not None else 10 * len(found[1] or ())
    while _KEPT and sum(w for w, _ in _KEPT.values()) + weight > MAX_KEPT:
        del _KEPT[next(iter(_KEPT))]
    _KEPT[key] = weight, found
    return found


def _full_walk(schedule: str, p: int, m: int, virtual: int) -> Walk:
    """The fixed orders of ``schedule`` walked op by op (:func:`walk`): DualPipe's, and any order whose keys
    :func:`~shardc.pipeline.keyed_walk.keyed_walk` cannot settle."""
    if schedule in PAIRED:
        orders = tuple(map(tuple, dualpipe_orders(p, m, v=schedule == "dualpipev")))
    else:
        orders = tuple(tuple((key,) for key in fixed_order(schedule, s, p, m, virtual)) for s in range(p))
    steps = walk(schedule, p, m, chunks_of(schedule, virtual) * p, orders)
    flat = ones(steps)
    return ((), None, flat) if flat is not None else (orders, steps, None)


def _durations(timing: Timing, zb: bool) -> dict[str, float]:
    """A chunk's op times: W is part of B unless the schedule splits it off."""
    if zb:
        return {"F": timing.forward, "B": timing.backward, "W": timing.weight}
    return {"F": timing.forward, "B": timing.backward + timing.weight, "W": 0.0}
