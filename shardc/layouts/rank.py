"""Plan and cost each candidate layout, and rank them.

Each candidate is the spec with its mesh axes set (:func:`shardc.spec.overrides.apply_overrides`,
which validates it again), planned for the chip (``shardc plan``: the planner minimises
the step time ``shardc cost`` reports) and costed (``shardc cost``); every figure of a
row is the cost report's.  A candidate the spec refuses (a dim smaller than its devices,
more stages than layers) is skipped with the reason.  Candidates whose spec, once its
size-1 axes are stripped, is one already planned (the same spec under ``--with``, or two
specs equal but for an axis switched off) reuse that plan's figures.  A candidate is planned as
``shardc cost`` plans it: the fastest plan that fits the chip's HBM (the planner's memory-fitting
search, :func:`shardc.costmodel.fitting.fitting_plan`), asked for only where the fastest holds more.

The ranking: layouts that fit the chip's HBM first; then by step time, compared to
:data:`DIGITS` significant digits (compute-bound layouts all take the compute time, up to
rounding); then layouts whose mesh axes all lie on whole physical axes of the topology before
those that split one (``mesh_utils.create_device_mesh`` splits a physical axis only when asked,
``allow_split_physical_axes``, since it "would reduce total usable bandwidth": the layout JAX
builds by default, and the one with room to spare); then by communication time on the critical
path (what is left exposed when only ahead-of-time collectives overlap); then by memory per
device; then in enumeration order.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from shardc.costmodel.cost_report import CostReport
from shardc.costmodel.fitting import fitting_report
from shardc.errors import ShardcError
from shardc.hardware import Hardware
from shardc.ir.spec import Mesh, Network, Spec
from shardc.layouts.microbatches import held_of
from shardc.planner.planner import shared_search
from shardc.sharding.unit import strip_unit_axes
from shardc.spec.overrides import apply_overrides
from shardc.timing import plan_links

__all__ = ["DIGITS", "RULE", "Layout", "Skipped", "Options", "on_cluster", "prepare", "prepare_noted", "evaluate",
           "fitted_report", "layout_of", "rank_key", "rank", "ranked", "processes", "mapped", "pairs"]

T = TypeVar("T")
DIGITS = 9
RULE = ("layouts that fit HBM first, then least step time (equal to 9 significant digits: compute-bound "
        "layouts all take the compute time), then mesh axes on whole physical axes before split ones, then "
        "least communication on the critical path, then least "
        "memory per device")


@dataclass(frozen=True)
class Options:
    """What every candidate is planned and costed with (the flags of ``shardc layouts``)."""

    hardware: Hardware
    save: str = "default"
    recompute: str = "none"
    optimizer: str | None = None  # the accounting (--optimizer); None: the first spec's `optimizer` line, or adam10
    mfu: float | None = None
    topology: str | tuple[int, ...] | None = None  # the slice or cluster (--topology); None: the spec's or usual
    knobs: tuple[str, ...] = ()  # the step's settings searched too (shardc.layouts.knobs.KNOBS)
    exact: bool = False  # plan every candidate at its own sizes, however many (shardc.layouts.templates)
    collective_matmul: bool = True  # plan with collective matmuls where faster (--no-collective-matmul: none)


def on_cluster(spec: Spec, options: Options) -> bool:
    """Whether ``spec`` is searched on a GPU cluster given as NODESxGPUS (``--topology`` or its ``topology``
    line): then its DCN axes are searched too (:func:`shardc.layouts.factor.searched_axes`)."""
    hw = options.hardware
    return hw.ici_domain is not None and not hw.book and (options.topology or spec.topology) is not None


@dataclass(frozen=True)
class Layout:
    """One candidate's figures, all from its cost report (whole step, all layers, one device)."""

    spec: str
    sizes: tuple[tuple[str, int], ...]  # every mesh axis, in mesh order
    step_s: float
    compute_s: float
    comm_s: float
    critical_s: float
    bound: str  # the cost's verdict on the step (PhaseCost.bound: "host" under --offload where the host
    # link or the host's update outlasts what hides it, Offload.host_bound), never a rule of its own
    mfu: float  # model FLOPs / (chips * C * step_s)
    at_mfu_s: float | None  # the step at --mfu: cost's compute at that MFU, or step_s when longer
    memory: tuple[tuple[str, float], ...]  # (part, bytes) per device
    memory_bytes: float
    hbm_bytes: float
    notes: tuple[str, ...] = ()  # padding of uneven dims, the pipeline's schedule
    split: bool = False  # a mesh axis lies on part of a physical axis another mesh axis shares
    knobs: tuple[tuple[str, str], ...] = ()  # the step's settings searched (microbatches, schedule, ...)
    planned: bool = True  # planned at these sizes; False: another candidate's plan re-costed at them
    # compute alone, which no order of the mesh axes changes for this plan: its compute, or a pipeline's
    # microbatches times a device's compute a microbatch (averaged over the devices), under its step
    floor_s: float = 0.0
    placement: tuple[str, ...] = ()  # where each mesh axis lies on the topology (cost's notes)

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.hbm_bytes

    @property
    def state_bytes(self) -> float:
        """The training state a device holds (a pipeline's fullest stage's): params, gradients, optimizer."""
        return sum(b for part, b in self.memory if part in ("params", "grads", "optimizer", "state"))

    @property
    def axes_text(self) -> str:
        return " ".join([f"{name}={size}" for name, size in self.sizes] + [f"{k}={v}" for k, v in self.knobs])

    def to_json(self) -> dict[str, object]:
        return {"spec": self.spec, "axes": dict(self.sizes), "step_s": self.step_s, "compute_s": self.compute_s,
                "comm_s": self.comm_s, "critical_s": self.critical_s, "bound": self.bound, "mfu": self.mfu,
                "step_at_mfu_s": self.at_mfu_s, "memory": dict(self.memory), "memory_bytes": self.memory_bytes,
                "hbm_bytes": self.hbm_bytes, "fits": self.fits, "split": self.split, "notes": list(self.notes),
                "knobs": dict(self.knobs), "planned": self.planned, "order": [name for name, _ in self.sizes],
                "placement": list(self.placement)}


@dataclass(frozen=True)
class Skipped:
    """A candidate the spec refuses at those sizes, and why (the first line of the error)."""

    spec: str
    sizes: tuple[tuple[str, int], ...]
    reason: str

    def to_json(self) -> dict[str, object]:
        return {"spec": self.spec, "axes": dict(self.sizes), "reason": self.reason}


def prepare(spec: Spec, sizes: dict[str, int], cluster: bool = False) -> Spec | Skipped:
    """``spec`` with its mesh axes at ``sizes``, validated again; or why the spec refuses them.

    A pipelined candidate runs the spec's microbatch size, not its count (:mod:`shardc.layouts.microbatches`).
    On a GPU ``cluster`` its axes lose their ``over dcn`` marks: the devices are numbered node by
    node and the mesh laid on them in mesh order, so an axis crosses nodes where its size and
    place make it (a DCN axis of whole nodes is costed the same either way).
    """
    made = prepare_noted(spec, sizes, cluster)
    return made if isinstance(made, Skipped) else made[0]


def prepare_noted(spec: Spec, sizes: dict[str, int], cluster: bool = False) -> tuple[Spec, str | None] | Skipped:
    """:func:`prepare`, and the note saying which microbatch count the candidate runs (None: not pipelined)."""
    try:
        candidate = apply_overrides(_own_split(spec, sizes), sizes)
    except ShardcError as err:
        return Skipped(spec.filename or "<spec>", _pairs(spec, sizes), err.message.splitlines()[0])
    held = held_of(spec)
    candidate, note = held.apply(candidate) if held is not None else (candidate, None)
    if not cluster:
        return candidate, note
    return replace(candidate, mesh=Mesh(tuple(replace(a, network=Network.ICI) for a in candidate.mesh.axes))), note


def _own_split(spec: Spec, sizes: dict[str, int]) -> Spec:
    """``spec`` without its ``stage_layers`` where a candidate has another number of stages: the split was
    written for the spec's own stages (BLOOM's 5, 6 x 10, 5 on 12), so another count splits the layers evenly,
    as a spec without the line does, rather than refusing every other pipeline depth."""
    pipe = next((a for a in spec.mesh.axes if a.pipeline), None)
    if spec.stage_layers is None or pipe is None or sizes.get(pipe.name, pipe.size) == len(spec.stage_layers):
        return spec
    return replace(spec, stage_layers=None)


def _pairs(spec: Spec, sizes: dict[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple((name, sizes[name]) for name in spec.mesh.names)


def pairs(spec: Spec) -> tuple[tuple[str, int], ...]:
    """A candidate's row axes: its mesh axes and sizes, in its mesh order."""
    return tuple((a.name, a.size) for a in spec.mesh.axes)


def evaluate(candidate: Spec, options: Options, recompute: str | None = None, offload: str = "none") -> Layout | str:
    """Plan ``candidate`` for the chip and cost it: its row, or the planner's refusal (one line).
    ``recompute``: the policy, over ``options.recompute``; ``offload``: what the host holds (``shardc cost
    --offload``).  The plan is ``shardc cost``'s: the fastest that fits the chip's memory."""
    try:
        report = fitted_report(candidate, options, recompute or options.recompute, offload)
    except ShardcError as err:
        return err.message.splitlines()[0]
    sizes = {a.name: a.size for a in candidate.mesh.axes}
    return layout_of(report, candidate.filename or "<spec>", _pairs(candidate, sizes))


def fitted_report(candidate: Spec, options: Options, recompute: str, offload: str) -> CostReport:
    """``shardc cost`` of ``candidate``: its fastest plan's report where that fits the chip's memory, else the
    report of the planner's fastest plan that fits (:func:`shardc.costmodel.fitting.fitting_report`: the fastest
    planned and costed once, the others planned only where it does not fit)."""
    how: dict[str, Any] = {"save": options.save, "hardware": options.hardware, "recompute": recompute,
                           "topology": options.topology, "collective_matmul": options.collective_matmul}
    return fitting_report(candidate, options.optimizer, offload, options.mfu, **how)


def layout_of(report: CostReport, label: str, sizes: tuple[tuple[str, int], ...]) -> Layout:
    """A row from a cost report: the step's times, and memory (a pipeline's: its fullest stage's).

    A pipelined row's every figure is the simulated schedule's (``shardc cost``'s pipeline section): its step,
    MFU and step at ``--mfu``, and the busiest device's compute, communication, exposed communication and
    verdict a step (the tables are the slowest stage over the whole batch, no bubble nor sends)."""
    step, mem = report.step, report.memory
    mfu, at_mfu = step.mfu, report.step_at_mfu_s
    compute, comm, critical, bound = step.compute_s, step.comm_s, step.critical_s, step.bound
    notes = tuple(n for n in report.plan.notes if "padded" in n) + tuple(
        n for n in report.notes if "a node has" in n or "split with" in n or "usual" in n)
    memory: tuple[tuple[str, float], ...] = (
        ("params", mem.param_bytes), ("grads", mem.grad_bytes), ("optimizer", mem.optimizer_bytes),
        ("activations", mem.residual_bytes), ("gathered", mem.gathered_bytes + mem.ring_bytes))  # and ring buffers
    total, step_s, floor = mem.total_bytes, step.step_s, step.compute_s
    host = mem.host_bytes  # --offload: what the host's memory holds instead
    if report.pipeline is not None:  # the schedule's step, and the stage holding the most
        pipe = report.pipeline
        fullest = pipe.fullest
        memory = (("state", fullest.state_bytes), ("activations", fullest.activation_bytes),
                  ("gathered", fullest.gathered_bytes))
        host = fullest.host_bytes
        total, step_s, mfu = fullest.memory_bytes, pipe.step_s, pipe.mfu
        compute, comm, critical, bound = pipe.compute_s, pipe.comm_s, pipe.exposed_comm_s, pipe.bound
        floor = pipe.pipeline.microbatches * math.fsum(s.compute_s for s in pipe.stages) / len(pipe.stages)
        if pipe.pipeline.stages > 1:
            notes += (f"pipeline: {pipe.pipeline.stages} stages, {pipe.pipeline.microbatches} microbatches, "
                      f"{pipe.pipeline.schedule}; step = the simulated schedule",)
    memory += (("host", host),) if host else ()
    links, _ = plan_links(report.plan, report.hardware, report.sizes)
    return Layout(label, sizes, step_s, compute, comm, critical, bound, mfu,
                  None if at_mfu is None else max(at_mfu, step_s), memory, total, mem.hbm_bytes, notes,
                  any(k.split for k in links.values()), floor_s=floor,
                  placement=tuple(n for n in report.notes if n.startswith("mesh axis ")))


def rank_key(row: Layout) -> tuple[bool, float, bool, float, float]:
    """Fits first, then step time (to :data:`DIGITS` digits), whole physical axes, critical-path
    communication, memory."""
    return (not row.fits, float(f"{row.step_s:.{DIGITS - 1}e}"), row.split, row.critical_s, row.memory_bytes)


def ranked(found: Sequence[tuple[Spec, tuple[tuple[str, int], ...]]], skipped: Sequence[Skipped], options: Options,
           jobs: int = 1, progress: Callable[[int, int], None] | None = None
           ) -> tuple[list[Layout], list[Skipped], dict[str, float]]:
    """Every candidate (a spec at its sizes, and the sizes of its row) evaluated (over ``jobs`` processes), the
    layouts ranked; those the spec refused (``skipped``) and the planner refuses; counts, seconds.

    A candidate whose spec, stripped of its size-1 axes, is one already met is not planned again.
    ``progress(done, total)`` is called after each plan.
    """
    start = time.perf_counter()
    unique: dict[str, Spec] = {}
    keys = []
    for candidate, _ in found:
        keys.append(key := str(strip_unit_axes(candidate)))
        unique.setdefault(key, candidate)
    done = dict(zip(unique, _run(list(unique.values()), options, jobs, progress), strict=True))
    rows: list[Layout] = []
    refused = list(skipped)
    for (candidate, pairs), key in zip(found, keys, strict=True):
        row = done[key]
        if isinstance(row, str):
            refused.append(Skipped(candidate.filename or "<spec>", pairs, row))
        else:
            rows.append(replace(row, spec=candidate.filename or "<spec>", sizes=pairs))
    stats = {"candidates": len(found) + len(skipped), "planned": len(unique), "reused": len(found) - len(unique),
             "jobs": _jobs(jobs, len(unique)), "seconds": time.perf_counter() - start}
    return rank(rows), refused, stats


def rank(rows: Sequence[Layout]) -> list[Layout]:
    """``rows`` by :func:`rank_key`, equal keys in the order given (enumeration order)."""
    return sorted(rows, key=rank_key)  # sorted is stable


def _jobs(jobs: int, plans: int) -> int:
    """``jobs`` processes (0: one a core, up to 8, and none when fewer than 8 plans would not repay starting them)."""
    if jobs == 0:
        jobs = 1 if plans < 8 else min(os.cpu_count() or 1, 8)
    return max(1, min(jobs, plans))


def processes(jobs: int, tasks: int, worth: int = 8) -> int:
    """The processes ``jobs`` asks for ``tasks`` (0: one a core, up to 8, when there are ``worth`` tasks or more)."""
    if jobs == 0 and tasks < worth:
        return 1
    return _jobs(jobs, tasks) if jobs else max(1, min(os.cpu_count() or 1, 8, tasks))


def mapped(fn: Callable[..., T], items: Sequence[tuple[object, ...]], n: int,
           progress: Callable[[int, int], None] | None = None) -> list[T]:
    """``fn(*item)`` for each item, in order, over ``n`` processes (this one when ``n`` is 1);
    ``progress(done, total)`` after each."""
    out: list[T] = []
    if n == 1:
        for item in items:
            out.append(fn(*item))
            if progress is not None:
                progress(len(out), len(items))
        return out

    # spawn, not fork: a fresh interpreter per worker, whatever threads the caller runs; workers leave
    # Ctrl-C to this process, which cancels what is left rather than waiting for it
    pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"), initializer=_ignore_interrupt)
    try:
        for row in pool.map(fn, *zip(*items, strict=True), chunksize=1):
            out.append(row)
            if progress is not None:
                progress(len(out), len(items))
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return out


def _run(candidates: list[Spec], options: Options, jobs: int,
         progress: Callable[[int, int], None] | None) -> list[Layout | str]:
    return mapped(_evaluated, [(c, options) for c in candidates], _jobs(jobs, len(candidates)), progress)


def _evaluated(candidate: Spec, options: Options) -> Layout | str:
    """:func:`evaluate`, its plans sharing one search: planned again to fit, the fastest reuses its einsums."""
    with shared_search():
        return evaluate(candidate, options)


def _ignore_interrupt() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
