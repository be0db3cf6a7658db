"""The time of a plan on a chip: the one objective the planner minimises and ``shardc cost`` reports.

Per step (:func:`cost_step`): a collective takes its time from the table of
collectives (:func:`shardc.collectives.collective_time`: bandwidth over the links of
its axes, torus spans, DCN hierarchy, latency bound); an einsum costs
``2 * prod(local index sizes)`` FLOPs per device over the chip's peak for the
spec's dtype times the fraction of peak a matmul of that size reaches
(:meth:`shardc.hardware.Hardware.matmul_seconds`; its model FLOPs, for MFU, are
``2 * prod(global index sizes)``), or its operands' and result's bytes over HBM where
they take longer (the roofline, :func:`shardc.steptime.einsum_time`, which the
planner's search prices with too).  Every other local step is memory-bound: its HBM
bytes (the op family's :attr:`shardc.ops.registry.Family.traffic`) over the chip's
HBM bandwidth, less what fusion saves (:func:`shardc.fusion.memory_traffic`, the rule
as XLA fuses).

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
reduce-scatters and all-gathers, after the backward), plus the update.  The
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

from shardc.accountings import ACCOUNTINGS
from shardc.chip_choice import chip_for
from shardc.collectives import FACTOR, Layout, Op, collective_time
from shardc.device_pieces import einsum_flops, local_elements, size_of, step_volume
from shardc.fusion import is_product, kept_values, memory_traffic, named_values
from shardc.hardware import Hardware
from shardc.ir.localops import Update
from shardc.ir.plan import Plan, Step, unfused
from shardc.ir.precision import Precision
from shardc.ir.spec import DType, Mesh, TensorRef
from shardc.layer_counts import block_counts, runs, step_count
from shardc.ops.registry import of_op
from shardc.phase_ends import exposed_ends
from shardc.pipeline.boundary import microbatch_dim
from shardc.ring_sends import ring_of, shared_rings
from shardc.spec.stages import pipeline_of
from shardc.spec.walk import block_reads
from shardc.steptime import einsum_time, ring_time
from shardc.topology import AxisLinks, resolve_links

__all__ = ["bound_of",
           "StepCost", "cost_step", "describe",
           "phase_seconds", "step_seconds", "PhaseTime", "PlanTime", "plan_time", "plan_chip", "plan_sizes",
           "plan_links", "update_seconds", "comm_split",
           "plan_dtype", "step_dtype", "phase_rows", "local_bytes_of", "phase_time", "phase_ends", "microbatched"]


@dataclass(frozen=True)
class StepCost:
    """The figures of one step; collectives have bytes, einsums FLOPs, both have seconds."""

    index: int
    op: Op
    tensor: str
    text: str  # what the step does, in spec notation
    axes: tuple[str, ...] = ()
    network: str = ""  # "ici", "dcn" or "ici+dcn" for collectives
    volume: float = 0.0  # V, bytes (padded where a dim is uneven)
    weighted: float = 0.0  # V with AllReduce x2 and AllToAll x1/4
    bandwidth_s: float = 0.0
    latency_s: float = 0.0
    flops: float = 0.0  # per device
    model_flops: float = 0.0  # the whole einsum, all devices
    hardware_flops: float = 0.0  # what all devices run of it (a causal kernel's unmasked half; HFU's)
    compute_s: float = 0.0
    ahead: bool = False
    once: bool = False  # outside a `layers` block: counted once, not once a layer
    block: int = 0  # not once: the `layers` block it repeats in (Step.block), counted that block's layers
    serial: bool = False  # the latency adds to the transfer (NCCL's model, a send) instead of bounding it
    memory_bytes: float = 0.0  # HBM bytes of a memory-bound step (after fusion)
    memory_s: float = 0.0
    recomputed: bool = False  # a forward step the backward runs again: hardware FLOPs, not model FLOPs
    # a kernel that sends blocks around a ring while it computes (ring attention, steptime.ring_time): its
    # ring's axes and steps, each step's transfer, what of the transfers stays exposed (critical), and the
    # block length (tokens a device) from which each step's compute hides its transfer
    ring_axes: tuple[str, ...] = ()
    ring_steps: int = 0
    transfer_s: float = 0.0
    exposed_comm_s: float = 0.0
    hidden_from: float = 0.0
    ring_shared: bool = False  # a collective matmul whose blocks an earlier step sends (ring_sends.shared_rings)
    # an attention kernel of the all-gather or Ulysses form ("all-gather", "Ulysses"): the time of the moves
    # of the sequence before and after it; hidden_from is then where its compute outlasts them
    # (shardc.costmodel.context_parallel)
    context_parallel: str = ""
    cp_comm_s: float = 0.0
    dtype: str = ""  # the type its matmuls run in, where not the spec's (a `dtype T` line: timing.step_dtype)

    @property
    def comm_s(self) -> float:
        return self.bandwidth_s + self.latency_s if self.serial else max(self.bandwidth_s, self.latency_s)

    @property
    def busy_s(self) -> float:
        """The time the chip's cores spend on it: matmul time or memory-bound time."""
        return self.compute_s + self.memory_s

    @property
    def is_collective(self) -> bool:
        return self.op in FACTOR

    def to_json(self) -> dict[str, object]:
        row: dict[str, object] = {"index": self.index, "op": self.op.value, "tensor": self.tensor,
                                  "text": self.text}
        if self.is_collective:
            row.update(axes=list(self.axes), network=self.network, volume_bytes=self.volume,
                       weighted_bytes=self.weighted, bandwidth_s=self.bandwidth_s,
                       latency_s=self.latency_s, comm_s=self.comm_s,
                       path="ahead" if self.ahead else "critical")
        elif self.op is Op.EINSUM:
            row.update(flops=self.flops, model_flops=self.model_flops, compute_s=self.compute_s)
            row.update({"dtype": self.dtype} if self.dtype else {})
            if self.ring_steps:  # a collective matmul: its ring's transfers, and what of them stays exposed
                row.update(axes=list(self.axes), volume_bytes=self.volume, ring_axes=list(self.ring_axes),
                           ring_steps=self.ring_steps, transfer_s=self.transfer_s, exposed_comm_s=self.exposed_comm_s,
                           sent_bytes=self.weighted, ring_shared=self.ring_shared)
        elif self.flops:  # a kernel with matmuls (attention): its FLOPs and its HBM traffic
            row.update(flops=self.flops, model_flops=self.model_flops, compute_s=self.compute_s,
                       memory_bytes=self.memory_bytes, memory_s=self.memory_s)
            row.update({"dtype": self.dtype} if self.dtype else {})
            if self.ring_steps:
                row.update(ring_axes=list(self.ring_axes), ring_steps=self.ring_steps, transfer_s=self.transfer_s,
                           exposed_comm_s=self.exposed_comm_s, sent_bytes=self.weighted,
                           hidden_from_tokens=self.hidden_from if math.isfinite(self.hidden_from) else None)
            if self.context_parallel:
                row.update(context_parallel=self.context_parallel, context_comm_s=self.cp_comm_s,
                           hidden_from_tokens=self.hidden_from if math.isfinite(self.hidden_from) else None)
        elif self.memory_bytes:
            row.update(memory_bytes=self.memory_bytes, memory_s=self.memory_s)
        return row


def cost_step(index: int, step: Step, mesh: Mesh, sizes: Mapping[str, int], hw: Hardware,
              spans: Layout | None = None, dtype: Precision | str = "bf16", memory_bytes: float = 0.0,
              text: str | None = None, shared: bool = False) -> StepCost:
    """The :class:`StepCost` of one step of a plan; ``memory_bytes`` its HBM traffic if memory-bound
    (:func:`shardc.fusion.memory_traffic`), ``dtype`` the tensors' types (:func:`step_dtype`: an einsum of
    two f8 operands runs at the chip's fp8 rate);
    ``shared``: a collective matmul whose blocks an earlier step of its phase sends
    (:func:`shardc.ring_sends.shared_rings`)."""
    kind = step_dtype(step, dtype)
    row = _step_cost(index, step, mesh, sizes, hw, spans, kind, memory_bytes, text, shared)
    if isinstance(dtype, str) or kind == dtype.default.value or not row.flops:
        return row
    return replace(row, dtype=kind)  # a matmul in another type than the spec's: the report says which


def _step_cost(index: int, step: Step, mesh: Mesh, sizes: Mapping[str, int], hw: Hardware, spans: Layout | None,
               dtype: str, memory_bytes: float, text: str | None, shared: bool) -> StepCost:
    text = describe(step) if text is None else text
    if step.is_collective:
        volume = step_volume(step, sizes)
        t = collective_time(step.op, volume, step.axes, mesh, sizes, hw, spans, step.routed)
        return StepCost(index, step.op, step.tensor, text, step.axes, t.network, volume,
                        volume * float(FACTOR[step.op]), t.bandwidth_s, t.latency_s, ahead=step.ahead,
                        once=step.once, block=step.block, serial=t.serial)
    if step.op is Op.EINSUM and step.collective is not None:
        return _collective_matmul(index, step, mesh, sizes, hw, spans, dtype, memory_bytes, text, shared)
    if step.op is Op.EINSUM:
        flops, model = einsum_flops(step, sizes)
        product = is_product(step)
        timed = einsum_time(flops, memory_bytes, product, hw, dtype)
        # a matmul's bytes count where they outlast its FLOPs (its roofline), a product's always
        memory_bytes = memory_bytes if product or timed.memory_s > 0 else 0.0
        return StepCost(index, step.op, step.tensor, text, flops=float(flops), model_flops=float(model),
                        hardware_flops=float(model), compute_s=timed.compute_s, once=step.once, block=step.block,
                        memory_bytes=memory_bytes, memory_s=timed.memory_s)
    family = of_op(step.fn) if step.op is Op.ELEMENTWISE else None
    if family is not None and family.flops is not None:  # a kernel with matmuls (attention)
        size = lambda name: size_of(sizes, name)  # noqa: E731
        flops, model, executed = family.flops(step, size)
        seconds = family.seconds(step, size, hw, dtype) if family.seconds else hw.matmul_seconds(flops, dtype)
        row = StepCost(index, step.op, step.tensor, text, axes=step.axes, flops=float(flops),
                       model_flops=float(model), hardware_flops=float(executed), compute_s=seconds,
                       once=step.once, block=step.block, memory_bytes=memory_bytes,
                       memory_s=hw.memory_seconds(memory_bytes))
        ring = ring_of(step, sizes, DType(dtype).nbytes)
        if ring is None:
            return row
        times = ring_time(ring, row.compute_s, mesh, sizes, hw, spans)
        return replace(row, ring_axes=ring.axes, ring_steps=ring.steps, transfer_s=times.transfer_s,
                       exposed_comm_s=times.exposed_s, hidden_from=times.hidden_from, weighted=times.sent_bytes,
                       bandwidth_s=times.bandwidth_s)
    return StepCost(index, step.op, step.tensor, text, axes=step.axes, once=step.once, block=step.block,
                    memory_bytes=memory_bytes,
                    memory_s=hw.memory_seconds(memory_bytes))


def _collective_matmul(index: int, step: Step, mesh: Mesh, sizes: Mapping[str, int], hw: Hardware,
                       spans: Layout | None, dtype: str, memory_bytes: float, text: str, shared: bool) -> StepCost:
    """A collective matmul (:mod:`shardc.planner.collective_matmul`): its einsum in n block matmuls, one
    block of the collective's n sent on to the next device along the axis while each of the first n - 1
    runs (:func:`shardc.steptime.ring_time`: the part of the n - 1 transfers no matmul hides is exposed).
    ``shared``: an earlier step of the phase sends the same blocks (einsums reading one gathered operand:
    the lowered program's chains of permutes are one, which XLA keeps once), so this one sends nothing."""
    c = step.collective
    assert c is not None
    einsum = next(s for s in unfused(step) if s.op is Op.EINSUM)
    plain = cost_step(index, einsum, mesh, sizes, hw, spans, dtype, memory_bytes, text)
    n = math.prod(size_of(sizes, a) for a in c.axes)
    block = einsum_time(plain.flops / n, memory_bytes / n, False, hw, dtype)  # one of the n block matmuls
    compute, memory_s = n * block.compute_s, n * block.memory_s
    row = replace(plain, axes=c.axes, compute_s=compute, memory_s=memory_s,
                  memory_bytes=memory_bytes if memory_s > 0 else 0.0, ring_axes=c.axes, ring_steps=n,
                  ring_shared=shared)
    if shared:
        return row
    ring = ring_of(step, sizes, DType(dtype).nbytes)
    assert ring is not None
    times = ring_time(ring, compute, mesh, sizes, hw, spans)
    return replace(row, volume=step_volume(c, sizes), transfer_s=times.transfer_s, exposed_comm_s=times.exposed_s,
                   weighted=times.sent_bytes, bandwidth_s=times.bandwidth_s)


def plan_dtype(plan: Plan) -> Precision:
    """Every tensor's element type (:attr:`shardc.ir.plan.Plan.precision`): an einsum runs in its operands'
    (:func:`step_dtype`)."""
    return plan.precision


def step_dtype(step: Step, dtype: Precision | str) -> str:
    """The element type by name (``"bf16"``, ``"f8"``) a step's matmuls run in: its operands'
    (:func:`shardc.ir.precision.matmul_dtype`), or ``dtype`` where one type is given for all."""
    return dtype if isinstance(dtype, str) else dtype.matmul(r.name for r in step.operands)


def describe(step: Step) -> str:
    """A step in spec notation: ``W_in[D_X, F] -> W_in[D, F]`` or ``A[..] · B[..] -> C[..]``."""
    if step.op in (Op.EINSUM, Op.COPY):
        return " · ".join(str(o) for o in step.operands) + f" -> {step.dst}"
    if step.op is Op.ELEMENTWISE:
        args = ", ".join(str(o) for o in step.operands)
        return f"{step.fn}({args}) -> {step.dst}"
    return f"{step.src} -> {step.dst}"


def phase_seconds(busy_s: float, ahead_s: float, critical_s: float = 0.0, book: bool = True,
                  share: float = 0.0, ends_s: float = 0.0) -> float:
    """A phase's time: its compute and memory-bound time ``busy_s``; the collectives issued ahead overlap
    it and those the next op waits for add to it.  The book's model overlaps every collective (its max).

    While an overlapped collective runs it holds ``share`` of the chip's cores (NCCL's channels,
    :attr:`Hardware.overlap_share`), so the compute under it runs at ``1 - share`` of its rate: the phase
    takes ``busy + share * ahead`` where the compute outlasts the collectives, else ``ahead``.
    ``ends_s`` of the ahead ones have no compute beside them (the gathers the phase's first step waits on,
    the reductions after its last: :func:`shardc.phase_ends.exposed_ends`): they add to it too."""
    if book:
        return max(busy_s, ahead_s + critical_s)
    ends_s = min(ends_s, ahead_s)
    hidden = ahead_s - ends_s
    return max(busy_s + share * hidden, hidden) + ends_s + critical_s


def bound_of(compute_s: float, comm_s: float) -> str:
    """The verdict beside :func:`phase_seconds`: which of the two sets the time."""
    return "communication" if comm_s > compute_s else "compute"


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
    for row, n in rows:
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
    return math.fsum(ahead), math.fsum(critical)


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
                     ahead, critical, hw.book, hw.overlap_share, ends_s)


def phase_ends(plan: Plan, hw: Hardware, steps: Sequence[Step], rows: Sequence[StepCost]) -> float:
    """The seconds of the collectives issued ahead at the ends of a phase of ``plan`` (its ``steps``, costed
    as ``rows`` on ``hw``) that no compute hides (:func:`shardc.phase_ends.exposed_ends`); 0 under the book's
    model (every collective overlapped) and for a pipeline's stage, whose microbatches' phases run beside
    each other (:mod:`shardc.costmodel.pipeline_cost`)."""
    if hw.book or plan.spec.mesh.pipeline_axis is not None:
        return 0.0
    return exposed_ends(steps, [r.busy_s for r in rows], [r.comm_s if r.is_collective else 0.0 for r in rows])


@dataclass(frozen=True)
class PlanTime:
    """A plan's times on a chip, all layers: per phase compute and communication, the update, the step."""

    forward: PhaseTime
    backward: PhaseTime  # with the recomputed forward steps
    optimizer: PhaseTime = PhaseTime()
    update_s: float = 0.0  # the optimizer's update of the params (memory-bound), once a step

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
        return step_seconds(self.forward_s, self.backward_s, self.optimizer_s, self.update_s)

    @property
    def comm_s(self) -> float:
        return self.forward.comm_s + self.backward.comm_s + self.optimizer.comm_s

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
              optimizer: str = "adam10") -> PlanTime:
    """The step time of ``plan`` on a chip (by default the one it was planned for), all layers.

    ``memo`` keeps each step's cost across calls: pass one dict only to calls on
    plans of the same spec, chip, sizes and spans (the planner's candidates).
    """
    hw = plan_chip(plan, hardware)
    values = dict(sizes) if sizes is not None else plan_sizes(plan)
    counts = block_counts(plan, values)
    links = plan_links(plan, hw, values, spans)[0]
    mesh, dtype = plan.spec.mesh, plan_dtype(plan)
    seen = {} if memo is None else memo  # layers repeat the same steps
    update = update_seconds(plan, values, hw, counts, optimizer)
    values, repeats = microbatched(plan, values, hw.book)
    nbytes = local_bytes_of(plan, values)
    kept = kept_values(plan)
    named = named_values(plan) if hw.fuses_statements else None

    def row(step: Step, moved: float, shared: bool) -> StepCost:
        key = (step.op, step.fn, step.axes, step.volume, tuple(r.dims for r in (step.dst, *step.operands)),
               step.src.dims if step.src is not None else None, moved, step.ahead, step.collective, shared,
               step_dtype(step, dtype))
        hit = seen.get(key)
        if hit is None:
            hit = seen[key] = cost_step(0, step, mesh, values, hw, links, dtype, moved, text="", shared=shared)
        return hit

    def phase(steps: tuple[Step, ...], times: int) -> PhaseTime:
        moved = memory_traffic(steps, nbytes, kept, hw.fuses, named) if not hw.book else [0.0] * len(steps)
        rows = [row(s, b, shared) for s, b, shared in zip(steps, moved, shared_rings(steps), strict=True)]
        return phase_time(((r, step_count(s, counts) * times) for s, r in zip(steps, rows, strict=True)), hw,
                          phase_ends(plan, hw, steps, rows))

    return PlanTime(phase(plan.forward, repeats), phase(plan.recomputed + plan.backward, repeats),
                    phase(plan.optimizer, 1), update)


def microbatched(plan: Plan, sizes: Mapping[str, int], book: bool = False) -> tuple[dict[str, int], int]:
    """The sizes a pipelined plan's stage runs at, one microbatch's (the batch dim cut M ways, where M
    divides it), and M, how many times it runs them; a plan without a pipeline: the sizes, once.

    A stage runs its layers on one microbatch at a time (:mod:`shardc.costmodel.pipeline_cost`), so its
    einsums' efficiency, its memory-bound steps and a dim's padding are a microbatch's.  The book's model
    costs the whole batch at once.
    """
    pipe = pipeline_of(plan.spec)
    values = dict(sizes)
    if pipe is None or book:
        return values, 1
    dim = microbatch_dim(plan)
    m = pipe.microbatches
    if dim not in values or values[dim] % m or m == 1:
        return values, 1
    values[dim] = values[dim] // m
    return values, m


def phase_rows(plan: Plan, steps: tuple[Step, ...], values: dict[str, int], hw: Hardware,
               spans: Layout, again: frozenset[int] = frozenset()) -> tuple[StepCost, ...]:
    """The rows of a phase; the steps numbered in ``again`` are recomputed forward steps, and say so."""
    named = named_values(plan) if hw.fuses_statements else None
    moved = memory_traffic(steps, local_bytes_of(plan, values), kept_values(plan), hw.fuses, named) \
        if not hw.book else [0.0] * len(steps)
    dtype = plan_dtype(plan)
    rows = (cost_step(i, s, plan.spec.mesh, values, hw, spans, dtype, b, shared=shared)
            for i, (s, b, shared) in enumerate(zip(steps, moved, shared_rings(steps), strict=True), 1))
    return tuple(replace(r, text=f"(recomputed) {r.text}", recomputed=True) if r.index in again else r for r in rows)


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
    and writes the param and the state (``optimizer`` names the accounting, :mod:`shardc.accountings`).
    The elements are the ZeRO shard's where the plan updates a shard (its ``update`` steps), else the
    param's piece; a block's params count once a layer.  0 under the book's model."""
    if hw.book or optimizer not in ACCOUNTINGS:
        return 0.0
    per_param, per_grad, per_state, _ = ACCOUNTINGS[optimizer]
    per_element = 2 * per_param + max(per_grad, per_param) + 2 * per_state
    shards = {s.operands[0].name: s.dst for s in plan.optimizer if isinstance(s.fn, Update) and s.operands}
    repeated = block_reads(plan.spec)
    elements = math.fsum(float(local_elements(shards.get(info.name, info.ref), sizes))
                         * runs(info.name not in repeated, repeated.get(info.name, 0), counts)
                         for info in plan.tensors if info.role == "param")
    return hw.memory_seconds(elements * per_element)
