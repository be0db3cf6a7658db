"""The time of a plan on a chip: the one objective the planner minimises and ``shardc cost`` reports.

Each step is a row (:func:`shardc.step_cost.cost_step`: a collective's time from the table of
collectives, an einsum's FLOPs at the rate the chip reaches or its bytes where they take longer, a
memory-bound step's HBM bytes after fusion); this module sums a phase's rows into its time.

The optimizer's update reads the param, its gradient and the optimizer state and
writes the param and the state (:func:`update_seconds`), once a step, after the
backward.  Uneven dims use the padded per-device size (``ceil(D / devices)``), as
XLA pads them.

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
The backward needs the forward's results, so the training step takes ``forward +
backward``, plus the optimizer phase of ZeRO-1/2 (``Plan.optimizer``: its
all-gathers, after the backward; ZeRO-1's gradient reduce-scatters, which the plan lists there, run in the
backward as ZeRO-2's do, :func:`zero_reductions`), plus the update.  A pipeline's stage runs its
forward and backward once a microbatch (:func:`microbatched`) and its gradient reductions once a step
on the microbatches' sums (:func:`stage_phases`), issued under the last microbatch's backward, which hides
them as the pipeline's cost hides them (:func:`shardc.overlap.reduced_after`), then the optimizer phase.  The
forward steps a ``--recompute`` mode runs again (``Plan.recomputed``) are part of
the backward phase.  All are multiplied by the layer count.

The book's model (``Hardware.book``, ``--model book``): every matmul at peak,
memory-bound steps and the update free, every collective overlapping its phase's
compute (``max(compute, comm)`` a phase) with no buckets.

:func:`plan_time` is that step time; ``shardc cost`` reports it as ``step_s`` and
the planner returns, of the plans it builds, the one it makes least.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from shardc.accountings import ACCOUNTINGS, chosen, update_bytes
from shardc.chip_choice import chip_for
from shardc.collectives import Layout, Op
from shardc.device_pieces import local_elements
from shardc.fusion import kept_values, memory_traffic, named_values
from shardc.hardware import Hardware
from shardc.ir.localops import Update
from shardc.ir.plan import Plan, Step, TensorInfo
from shardc.ir.precision import Precision
from shardc.ir.spec import Spec, TensorRef
from shardc.layer_counts import block_counts, runs, step_count
from shardc.overlap import beside_seconds, gathered_before, reduced_after
from shardc.phase_ends import exposed_ends
from shardc.pipeline.boundary import batch_dim, gradient_reductions
from shardc.quantize import quantize_traffic, weight_quantize_bytes
from shardc.ring_sends import shared_rings
from shardc.spec.stages import pipeline_of
from shardc.spec.walk import block_reads
from shardc.step_cost import StepCost, cost_step, step_dtype
from shardc.topology import AxisLinks, resolve_links

__all__ = ["bound_of", "phase_seconds", "step_seconds", "PhaseTime", "PlanTime", "plan_time", "plan_chip",
           "plan_sizes", "plan_links", "update_seconds", "comm_split", "plan_dtype", "phase_rows",
           "local_bytes_of", "phase_time", "phase_ends", "microbatched", "stage_run", "stage_phases",
           "reductions_exposed", "zero_reductions", "deferred_dcn"]


def plan_dtype(plan: Plan) -> Precision:
    """Every tensor's element type (:attr:`shardc.ir.plan.Plan.precision`): an einsum runs in its operands'
    (:func:`shardc.step_cost.step_dtype`)."""
    return plan.precision


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


@dataclass(frozen=True)
class PlanTime:
    """A plan's times on a chip, all layers: per phase compute and communication, the update, the step."""

    forward: PhaseTime
    backward: PhaseTime  # with the recomputed forward steps
    optimizer: PhaseTime = PhaseTime()
    update_s: float = 0.0  # the optimizer's update of the params (memory-bound), once a step
    # a pipeline's stage: its gradient reductions, once a step on the microbatches' sums, and what of them
    # the last microbatch's backward does not hide (shardc.overlap.reduced_after, as the pipeline's cost)
    reduce: PhaseTime = PhaseTime()
    reduce_exposed_s: float = 0.0
    # what of the optimizer phase the step counts: under `param_gather overlapped` what its all-gathers add beside
    # the next step's first forward (shardc.overlap.gathered_before); None: all of it
    optimizer_exposed_s: float | None = None

    @property
    def forward_compute_s(self) -> float:
        return self.forward.compute_s

    @property
    def forward_comm_s(self) -> float:
        return self.forward.comm_s

    @property
    def backward_compute_s(self) -> float:
        return self.backward.compute_s

    @property
    def backward_comm_s(self) -> float:
        return self.backward.comm_s

    @property
    def forward_s(self) -> float:
        return self.forward.seconds

    @property
    def backward_s(self) -> float:
        return self.backward.seconds

    @property
    def optimizer_s(self) -> float:
        return self.optimizer.seconds

    @property
    def step_s(self) -> float:
        opt = self.optimizer_s if self.optimizer_exposed_s is None else self.optimizer_exposed_s
        return step_seconds(self.forward_s, self.backward_s, self.reduce_exposed_s, opt, self.update_s)

    @property
    def comm_s(self) -> float:
        return self.forward.comm_s + self.backward.comm_s + self.reduce.comm_s + self.optimizer.comm_s

    def key(self) -> tuple[float, float]:
        """What the planner compares: the step time, then less communication."""
        return (self.step_s, self.comm_s)


def plan_sizes(plan: Plan) -> dict[str, int]:
    values = {a.name: a.size for a in plan.spec.mesh.axes}
    values.update(plan.spec.sizes)
    values.update(plan.size_map or {})
    return values


def plan_chip(plan: Plan, hardware: str | Hardware | None = None, hardware_file: str | None = None) -> Hardware:
    """The chip to cost ``plan`` on: a file or chip given here (run as the spec's ``fusion`` and
    ``grad_reduce`` lines say, where it sets neither), else the one it was planned for (``Plan.chip``)."""
    if hardware is None and hardware_file is None:
        return plan.chip
    return chip_for(plan.spec, hardware, hardware_file)


def plan_links(plan: Plan, hw: Hardware, sizes: Mapping[str, int],
               spans: Mapping[str, int] | None = None) -> tuple[dict[str, AxisLinks], tuple[str, ...]]:
    """Each mesh axis's links at these sizes on the plan's topology (:func:`shardc.topology.resolve_links`),
    the spans the plan was made with on this chip and ``spans`` over them; and the notes that say so."""
    given = dict(plan.spans) if plan.hardware == hw.name else {}
    given.update(spans or {})
    return resolve_links(plan.spec.mesh, sizes, hw, plan.topology, given)


def plan_time(plan: Plan, hardware: str | Hardware | None = None, sizes: Mapping[str, int] | None = None,
              spans: Mapping[str, int] | None = None, memo: dict[tuple[object, ...], StepCost] | None = None,
              optimizer: str | None = None) -> PlanTime:
    """The step time of ``plan`` on a chip (by default the one it was planned for), all layers.

    ``memo`` keeps each step's cost across calls: pass one dict only to calls on
    plans of the same spec, chip, sizes and spans (the planner's candidates).  ``optimizer``: the accounting
    the update is costed under (None: the spec's ``optimizer`` line's, else adam10).
    """
    hw = plan_chip(plan, hardware)
    values = dict(sizes) if sizes is not None else plan_sizes(plan)
    counts = block_counts(plan, values)
    links = plan_links(plan, hw, values, spans)[0]
    mesh, dtype = plan.spec.mesh, plan_dtype(plan)
    seen = {} if memo is None else memo  # layers repeat the same steps
    update = update_seconds(plan, values, hw, counts, chosen(plan.spec.optimizer, optimizer))
    values, repeats = microbatched(plan, values, hw.book)
    traffic = phase_traffic(plan, values, hw)

    def row(step: Step, moved: float, shared: bool, quantized: float) -> StepCost:
        key = (step.op, step.fn, step.axes, step.volume, tuple(r.dims for r in (step.dst, *step.operands)),
               step.src.dims if step.src is not None else None, moved, step.ahead, step.collective, shared,
               step_dtype(step, dtype), quantized)
        hit = seen.get(key)
        if hit is None:
            hit = seen[key] = cost_step(0, step, mesh, values, hw, links, dtype, moved, text="", shared=shared,
                                        quantize_bytes=quantized)
        return hit

    def rows_of(steps: tuple[Step, ...]) -> list[StepCost]:
        moved = traffic(steps)
        quantized = quantize_traffic(plan, steps, values, hw.fuses) if not hw.book else [0.0] * len(steps)
        return [row(s, b, shared, q) for s, b, shared, q in zip(steps, moved, shared_rings(steps), quantized,
                                                                strict=True)]

    def phase(steps: tuple[Step, ...], times: int, rows: list[StepCost] | None = None) -> PhaseTime:
        rows = rows_of(steps) if rows is None else rows
        return phase_time(((r, step_count(s, counts) * times) for s, r in zip(steps, rows, strict=True)), hw,
                          phase_ends(plan, hw, steps, rows))

    forward, backward, after = stage_phases(plan, repeats)
    rest = len(plan.optimizer) - len(zero_reductions(plan))  # the optimizer's steps left in its phase
    once, opt = after[:len(after) - rest], after[len(after) - rest:]
    back_rows = rows_of(backward)
    reduce = phase(once, 1)
    exposed = reductions_exposed(reduce, phase(backward, 1, back_rows).seconds, hw)
    fwd, gathers = phase(forward, repeats), phase(opt, 1)
    shown = gathered_before(fwd.busy_s / repeats, gathers.seconds, hw.overlap_share, hw.gathers_under_forward)
    return PlanTime(fwd, phase(backward, repeats, back_rows), gathers, update, reduce, exposed, shown)


def reductions_exposed(reduce: PhaseTime, backward_s: float, hw: Hardware) -> float:
    """What a pipelined stage's gradient reductions, once a step (``reduce``), add to its step: issued under
    the last microbatch's backward (``backward_s``, one microbatch's), on the cores they leave it, or after it
    where the framework reduces then (:func:`shardc.overlap.reduced_after`, as the pipeline's cost adds them);
    under ``grad_reduce after-backward over dcn`` their DCN phase after it, the rest beside it."""
    if not reduce.comm_s:
        return 0.0
    return reduce.deferred_s + reduced_after(backward_s, reduce.seconds - reduce.deferred_s, hw.overlap_share,
                                             hw.reduces_after_backward)


def microbatched(plan: Plan, sizes: Mapping[str, int], book: bool = False) -> tuple[dict[str, int], int]:
    """The sizes a pipelined plan's stage runs at, one microbatch's (the batch dim cut M ways, where M
    divides it), and M, how many times it runs them; a plan without a pipeline: the sizes, once.

    A stage runs its layers on one microbatch at a time (:mod:`shardc.costmodel.pipeline_cost`), so its
    einsums' efficiency, its memory-bound steps and a dim's padding are a microbatch's.  The book's model
    costs the whole batch at once.
    """
    return stage_run(plan.spec, plan.tensors, sizes, book)


def stage_run(spec: Spec, tensors: tuple[TensorInfo, ...], sizes: Mapping[str, int],
              book: bool = False) -> tuple[dict[str, int], int]:
    """:func:`microbatched` of a pipelined ``spec`` whose tensors are ``tensors``, before it is planned: the
    sizes and the count its stage's plan is searched at (:func:`shardc.planner.planner.plan`)."""
    pipe = pipeline_of(spec)
    values = dict(sizes)
    if pipe is None or book:
        return values, 1
    dim = batch_dim(spec, tensors)
    m = pipe.microbatches
    if dim not in values or values[dim] % m or m == 1:
        return values, 1
    values[dim] = values[dim] // m
    return values, m


def stage_phases(plan: Plan, repeats: int) -> tuple[tuple[Step, ...], tuple[Step, ...], tuple[Step, ...]]:
    """A training step's steps in the phases it runs them: the forward and the backward (the forward steps
    it recomputes first), each ``repeats`` times, once a microbatch under a pipeline; then once a step the
    gradient reductions, which a pipeline runs on the microbatches' sums after its backward
    (:func:`shardc.pipeline.boundary.gradient_reductions`), and the optimizer phase (ZeRO-1/2)."""
    once = gradient_reductions(plan) if repeats > 1 else frozenset()
    backward = plan.recomputed + tuple(s for k, s in enumerate(plan.backward) if k not in once)
    moves = zero_reductions(plan)
    reduced = tuple(replace(plan.optimizer[k], ahead=True) for k in sorted(moves))  # issued ahead, bucketed
    rest = tuple(s for k, s in enumerate(plan.optimizer) if k not in moves)
    if repeats > 1:  # with the pipeline's once-a-step reductions, under the last microbatch's backward
        return plan.forward, backward, tuple(plan.backward[k] for k in sorted(once)) + reduced + rest
    return plan.forward, _issued_in(backward, reduced), rest


def zero_reductions(plan: Plan) -> frozenset[int]:
    """The optimizer phase's steps (ZeRO-1's) that move a gradient onto its optimizer-state shard, which the
    step runs in the backward, each issued, in buckets, as the gradient it reduces is made, as ZeRO-2's are:
    DeepSpeed's stages 1 and 2 share one bucketed reduction path, its backward hooks
    (``runtime/zero/stage_1_and_2.py``, ``create_gradient_handling_hooks`` under ``overlap_comm``; stage 1
    differs only in keeping the whole gradient), and Megatron-LM's distributed optimizer, ZeRO-1 in memory
    (its grad buffer holds every gradient), reduce-scatters its grad buffer's buckets by the same DDP path
    as an all-reduce (``overlap_grad_reduce``); under a pipeline, with its other gradient reductions, under
    the last microbatch's backward (:mod:`shardc.costmodel.stage_optimizer`)."""
    grads = {plan.grad_name(i.name) for i in plan.tensors if i.role == "param"}
    return frozenset(k for k, s in enumerate(plan.optimizer) if s.tensor in grads and not isinstance(s.fn, Update))


def _issued_in(backward: tuple[Step, ...], moves: tuple[Step, ...]) -> tuple[Step, ...]:
    """``backward`` with each of ``moves`` (in order, each reading what the backward or an earlier move
    makes) right after the step that makes what it reads, as the backward's own gradient reductions are;
    under ``grad_reduce after-backward`` the buckets of ahead reductions are exposed (:func:`comm_split`)."""
    out = list(backward)
    for step in moves:
        at = max((k for k, s in enumerate(out) if s.dst in step.reads), default=len(out) - 1)
        out.insert(at + 1, step)
    return tuple(out)


def phase_rows(plan: Plan, steps: tuple[Step, ...], values: dict[str, int], hw: Hardware,
               spans: Layout, again: frozenset[int] = frozenset()) -> tuple[StepCost, ...]:
    """The rows of a phase; the steps numbered in ``again`` are recomputed forward steps, and say so."""
    moved = phase_traffic(plan, values, hw)(steps)
    dtype = plan_dtype(plan)
    quantized = quantize_traffic(plan, steps, values, hw.fuses) if not hw.book else [0.0] * len(steps)
    rows = (cost_step(i, s, plan.spec.mesh, values, hw, spans, dtype, b, shared=shared, quantize_bytes=q)
            for i, (s, b, shared, q) in enumerate(zip(steps, moved, shared_rings(steps), quantized, strict=True), 1))
    return tuple(replace(r, text=f"(recomputed) {r.text}", recomputed=True) if r.index in again else r for r in rows)


def phase_traffic(plan: Plan, sizes: Mapping[str, int], hw: Hardware) -> Callable[[tuple[Step, ...]], list[float]]:
    """The HBM bytes of each step of a phase of ``plan`` at ``sizes`` as ``hw``'s framework runs them
    (:func:`shardc.fusion.memory_traffic`); none under the book's model."""
    nbytes, kept = local_bytes_of(plan, sizes), kept_values(plan)
    named = named_values(plan) if hw.fuses_statements else None

    def traffic(steps: tuple[Step, ...]) -> list[float]:
        if hw.book:
            return [0.0] * len(steps)
        return memory_traffic(steps, nbytes, kept, hw.fuses, named, lambda ref: float(local_elements(ref, sizes)))

    return traffic


def local_bytes_of(plan: Plan, sizes: Mapping[str, int]) -> Callable[[TensorRef], float]:
    """Bytes of one device's piece of a value of ``plan`` (padded elements times its element bytes)."""
    cache: dict[TensorRef, float] = {}

    def size(ref: TensorRef) -> float:
        hit = cache.get(ref)
        if hit is None:
            hit = cache[ref] = float(local_elements(ref, sizes)) * plan.nbytes(ref.name)
        return hit

    return size


def update_seconds(plan: Plan, sizes: Mapping[str, int], hw: Hardware, counts: Sequence[int],
                   optimizer: str = "adam10") -> float:
    """The optimizer's update, memory-bound: per element of the state a device updates, it reads the
    param, the gradient (in the param's dtype where the accounting keeps none) and the optimizer state,
    and writes the param and the state (``optimizer`` names the accounting, :mod:`shardc.accountings`), in
    one kernel; under ``fusion none`` in PyTorch AdamW's kernels, one a pass
    (:func:`shardc.accountings.update_bytes`).
    The elements are the ZeRO shard's where the plan updates a shard (its ``update`` steps), else the
    param's piece; a block's params count once a layer.  Then the weights ``gemm f8`` GEMMs read as held
    are quantized, once a step (:func:`shardc.quantize.weight_quantize_bytes`).  0 under the book's model."""
    if hw.book or optimizer not in ACCOUNTINGS:
        return 0.0
    per_param = ACCOUNTINGS[optimizer][0]
    per_element = update_bytes(optimizer, hw.fuses)
    shards = {s.operands[0].name: s.dst for s in plan.optimizer if isinstance(s.fn, Update) and s.operands}
    repeated = block_reads(plan.spec)
    elements = math.fsum(float(local_elements(shards.get(info.name, info.ref), sizes))
                         * runs(info.name not in repeated, repeated.get(info.name, 0), counts)
                         for info in plan.tensors if info.role == "param")
    quantized = weight_quantize_bytes(plan, sizes, counts, per_param)
    return hw.memory_seconds(elements * per_element + quantized)
