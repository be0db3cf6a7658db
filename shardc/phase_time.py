"""A phase's time from its rows (:func:`shardc.step_cost.cost_step`'s, each with how often it runs): the one
rule the planner's objective (:func:`shardc.timing.plan_time`) and ``shardc cost`` both time a phase by.

The overlap rule (:func:`phase_seconds`), as the lowered program runs: a
collective the next op waits for (``Step.ahead`` false: a Megatron AllReduce, a
sequence-parallel gather) is exposed; those that can be issued ahead (weight
gathers, gradient reductions) overlap the phase's compute, but for those at its ends, which nothing
runs beside (the gathers its first step waits on, the reductions after its last: ``ends``, once a phase,
:mod:`shardc.phase_ends`), so a phase takes
``max(compute + memory, ahead - ends) + ends + critical`` (on a GPU ``compute + memory`` grows by the share of its
SMs that NCCL holds while the ahead collectives run, :attr:`Hardware.overlap_share`); a kernel that
sends blocks around a ring while it
computes (ring attention) adds the part of its transfers its compute does not hide to the critical
time (:func:`shardc.steptime.ring_time`).  Gradient reductions are bucketed as
PyTorch DDP and FSDP bucket them (:attr:`Hardware.bucket_bytes`, 25 MiB): a
reduction's latency is paid once a bucket, not once a tensor (:func:`comm_split`);
under ``grad_reduce after-backward`` they run after the backward's compute, exposed.

The book's model (``Hardware.book``, ``--model book``): every collective overlapping its phase's
compute (``max(compute, comm)`` a phase) with no buckets.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shardc.collectives import Op
from shardc.hardware import Hardware
from shardc.ir.plan import Plan, Step
from shardc.overlap import beside_seconds
from shardc.phase_ends import exposed_ends
from shardc.step_cost import StepCost

__all__ = ["bound_of", "phase_seconds", "seconds_at_mfu", "step_seconds", "comm_split", "deferred_dcn",
           "deferred_rows", "PhaseTime", "phase_time", "phase_ends"]


def phase_seconds(busy_s: float, ahead_s: float, critical_s: float = 0.0, book: bool = True,
                  share: float = 0.0, ends_s: float = 0.0) -> float:
    """A phase's time: its compute and memory-bound time ``busy_s``; the collectives issued ahead overlap
    it and those the next op waits for add to it.  The book's model overlaps every collective (its max).

    While an overlapped collective runs it holds ``share`` of the chip's cores (NCCL's channels,
    :attr:`Hardware.overlap_share`), so the compute under it runs at ``1 - share`` of its rate: the phase
    takes ``busy + share * ahead`` where the compute outlasts the collectives, else ``ahead``
    (:func:`shardc.overlap.beside_seconds`, the rule DualPipe's F&B pairs run by too).
    ``ends_s`` of the ahead ones have no compute beside them (the gathers the phase's first step waits on,
    the reductions after its last: :func:`shardc.phase_ends.exposed_ends`): they add to it too."""
    if book:
        return max(busy_s, ahead_s + critical_s)
    ends_s = min(ends_s, ahead_s)
    hidden = ahead_s - ends_s
    return beside_seconds(busy_s, hidden, share) + ends_s + critical_s


def bound_of(compute_s: float, comm_s: float, host: bool = False) -> str:
    """The verdict beside :func:`phase_seconds`: which of the two sets the time; ``"host"`` over both where the
    host link or the host's update outlasts what runs beside it (``--offload``:
    :attr:`shardc.costmodel.offload.Offload.host_bound`, a phase's or a stage's own copies)."""
    if host:
        return "host"
    return "communication" if comm_s > compute_s else "compute"


def seconds_at_mfu(model_flops: float, devices: int, peak: float, mfu: float) -> float:
    """A step's time at model FLOPs utilisation ``mfu``: its model FLOPs over every chip at that share of the
    peak (``--mfu``; a phase's and a pipelined step's alike)."""
    return model_flops / (devices * peak * mfu) if devices * peak else 0.0


def step_seconds(*phases_s: float) -> float:
    """A training step's time: its phases run one after the other (forward, backward, optimizer)."""
    return math.fsum(phases_s)


_BUCKETED = (Op.REDUCE_SCATTER, Op.ALL_REDUCE)


def comm_split(rows: Iterable[tuple[StepCost, int]], hw: Hardware) -> tuple[float, float]:
    """(ahead, critical) seconds of the collectives among ``rows`` (each with how often it runs).

    Gradient reductions issued ahead (a ReduceScatter or AllReduce off the critical path) are bucketed
    as PyTorch DDP and FSDP bucket them: alike ones (op and axes) share buckets of ``hw.bucket_bytes``,
    each paying the collective's latency once, so a group takes max(its bandwidth terms, buckets x
    latency), or their sum where the latency adds to the transfer (NCCL's model on GPUs,
    :attr:`StepCost.serial`).  Every other collective takes its own time each time.  The book's model
    has no buckets.  Where the framework reduces gradients once the backward is done
    (:attr:`Hardware.reduces_after_backward`: Megatron-LM's own DDP of 2021), the buckets are critical:
    nothing runs under them.
    """
    ahead: list[float] = []
    critical: list[float] = []
    groups: dict[tuple[Op, tuple[str, ...]], list[tuple[StepCost, int]]] = {}
    pairs = list(rows)
    for row, n in pairs:
        if row.exposed_comm_s:  # a ring's transfers its compute does not hide: the next step waits for them
            critical.append(row.exposed_comm_s * n)
        if not row.is_collective:
            continue
        if row.ahead and row.op in _BUCKETED and not hw.book:
            groups.setdefault((row.op, row.axes), []).append((row, n))
        else:
            (ahead if row.ahead else critical).append(row.comm_s * n)
    for members in groups.values():
        volume = math.fsum(r.volume * n for r, n in members)
        buckets = max(1, math.ceil(volume / hw.bucket_bytes - 1e-9))
        latency = max(r.latency_s for r, _ in members)
        bandwidth = math.fsum(r.bandwidth_s * n for r, n in members)
        serial = any(r.serial for r, _ in members)
        seconds = bandwidth + buckets * latency if serial else max(bandwidth, buckets * latency)
        (critical if hw.reduces_after_backward else ahead).append(seconds)
    deferred = deferred_dcn(pairs, hw)  # of the ahead ones, what waits for the backward's end
    return math.fsum(ahead) - deferred, math.fsum(critical) + deferred


def deferred_dcn(rows: Sequence[tuple[StepCost, int]], hw: Hardware) -> float:
    """Under ``grad_reduce after-backward over dcn`` (:attr:`Hardware.reduces_dcn_after_backward`), the seconds
    among ``rows`` (each with how often it runs) that wait for the end of the backward: the DCN phase of each
    gradient reduction issued ahead (its own step over the pods, after its ICI phase:
    :attr:`shardc.collectives.CollectiveTime.dcn_s`) and of the collectives on the same gradient (a gather over
    the pods of a reduce-scattered one), which cannot start before it.  0 under any other line."""
    late = deferred_rows([r for r, _ in rows], hw)
    return math.fsum(d * n for d, (_, n) in zip(late, rows, strict=True))


def deferred_rows(rows: Sequence[StepCost], hw: Hardware) -> list[float]:
    """Each row's seconds that wait for the end of the backward (:func:`deferred_dcn`), 0 for the others."""
    if not hw.reduces_dcn_after_backward:
        return [0.0] * len(rows)
    grads = {r.tensor for r in rows if r.ahead and r.op in _BUCKETED and r.is_collective}
    return [r.dcn_s if r.ahead and r.is_collective and r.tensor in grads else 0.0 for r in rows]


@dataclass(frozen=True)
class PhaseTime:
    """One phase's times, all layers: einsums, memory-bound steps, and its collectives split by overlap."""

    compute_s: float = 0.0
    memory_s: float = 0.0
    ahead_s: float = 0.0
    critical_s: float = 0.0
    book: bool = True
    share: float = 0.0  # the chip's cores an overlapped collective holds (Hardware.overlap_share)
    ends_s: float = 0.0  # of ahead_s, what no compute hides (shardc.phase_ends.exposed_ends), once a phase
    deferred_s: float = 0.0  # of critical_s, the gradient reductions' DCN phase after the backward (deferred_dcn)

    @property
    def busy_s(self) -> float:
        return self.compute_s + self.memory_s

    @property
    def comm_s(self) -> float:
        return self.ahead_s + self.critical_s

    @property
    def seconds(self) -> float:
        return phase_seconds(self.busy_s, self.ahead_s, self.critical_s, self.book, self.share, self.ends_s)


def phase_time(rows: Iterable[tuple[StepCost, int]], hw: Hardware, ends_s: float = 0.0) -> PhaseTime:
    """The :class:`PhaseTime` of a phase's rows, each with how often it runs (layers, or once); ``ends_s``
    the ahead collectives' seconds at its ends (:func:`phase_ends`)."""
    pairs = list(rows)
    ahead, critical = comm_split(pairs, hw)
    return PhaseTime(math.fsum(r.compute_s * n for r, n in pairs), math.fsum(r.memory_s * n for r, n in pairs),
                     ahead, critical, hw.book, hw.overlap_share, ends_s, deferred_dcn(pairs, hw))


def phase_ends(plan: Plan, hw: Hardware, steps: Sequence[Step], rows: Sequence[StepCost]) -> float:
    """The seconds of the collectives issued ahead at the ends of a phase of ``plan`` (its ``steps``, costed
    as ``rows`` on ``hw``) that no compute hides (:func:`shardc.phase_ends.exposed_ends`); 0 under the book's
    model (every collective overlapped) and for a pipeline's stage, whose microbatches' phases run beside
    each other (:mod:`shardc.costmodel.pipeline_cost`)."""
    if hw.book or plan.spec.mesh.pipeline_axis is not None:
        return 0.0
    late = deferred_rows(rows, hw)  # what runs after the backward is critical, no end of it
    return exposed_ends(steps, [r.busy_s for r in rows],
                        [r.comm_s - d if r.is_collective else 0.0 for r, d in zip(rows, late, strict=True)])
