"""The figures of one step of a plan on a chip: a row of ``shardc cost``'s tables, and what the planner sums.

A collective takes its time from the table of collectives
(:func:`shardc.collectives.collective_time`: bandwidth over the links of its axes, torus spans,
DCN hierarchy, latency bound); an einsum costs ``2 * prod(local index sizes)`` FLOPs per device
over the chip's peak for the spec's dtype times the fraction of peak a matmul of that size reaches
(:meth:`shardc.hardware.Hardware.matmul_seconds`; its model FLOPs, for MFU, are
``2 * prod(global index sizes)``), or its operands' and result's bytes over HBM where they take
longer (the roofline, :func:`shardc.steptime.einsum_time`, which the planner's search prices with
too).  Every other local step is memory-bound: its HBM bytes (the op family's
:attr:`shardc.ops.registry.Family.traffic`) over the chip's HBM bandwidth, less what fusion saves
(:func:`shardc.fusion.memory_traffic`, the rule as XLA fuses).  A kernel that sends blocks around
a ring while it computes (ring attention, a collective matmul) keeps the part of its transfers its
compute does not hide (:func:`shardc.steptime.ring_time`).

:mod:`shardc.timing` sums these rows into a phase's and a plan's time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from shardc.collectives import FACTOR, Layout, Op, collective_time
from shardc.device_pieces import einsum_flops, size_of, step_volume
from shardc.fusion import is_product
from shardc.hardware import Hardware
from shardc.ir.plan import Step, unfused
from shardc.ir.precision import Precision
from shardc.ir.spec import DType, Mesh
from shardc.ops.registry import of_op
from shardc.quantize import step_gemm
from shardc.ring_sends import ring_of
from shardc.steptime import einsum_time, ring_time

__all__ = ["StepCost", "cost_step", "describe", "step_dtype"]


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
    dtype: str = ""  # the type its matmuls run in, where not the spec's (a `dtype T` line: step_dtype)
    # a GEMM's quantize passes (shardc.quantize.quantize_traffic): HBM bytes, in memory_bytes and memory_s too
    quantize_bytes: float = 0.0
    dcn_s: float = 0.0  # of bandwidth_s, its DCN phase's (CollectiveTime.dcn_s)

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
            row.update({"quantize_bytes": self.quantize_bytes, "memory_bytes": self.memory_bytes,
                        "memory_s": self.memory_s} if self.quantize_bytes else {})
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
              text: str | None = None, shared: bool = False, quantize_bytes: float = 0.0) -> StepCost:
    """The :class:`StepCost` of one step of a plan; ``memory_bytes`` its HBM traffic if memory-bound
    (:func:`shardc.fusion.memory_traffic`), ``dtype`` the tensors' types (:func:`step_dtype`: an einsum of
    two f8 operands, or a GEMM a ``gemm f8`` line names, runs at the chip's fp8 rate); ``quantize_bytes``
    its quantize passes' (:func:`shardc.quantize.quantize_traffic`), memory-bound beside its matmul;
    ``shared``: a collective matmul whose blocks an earlier step of its phase sends
    (:func:`shardc.ring_sends.shared_rings`)."""
    kind = step_dtype(step, dtype)
    row = _step_cost(index, step, mesh, sizes, hw, spans, kind, memory_bytes, text, shared)
    if quantize_bytes:  # its own kernels before the matmul: their time adds to the matmul's
        row = replace(row, quantize_bytes=quantize_bytes, memory_bytes=row.memory_bytes + quantize_bytes,
                      memory_s=row.memory_s + hw.memory_seconds(quantize_bytes))
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
                        once=step.once, block=step.block, serial=t.serial, dcn_s=t.dcn_s)
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
        # its rate is measured on whole calls, its own reads and writes inside them: its bytes count only
        # where they outlast its FLOPs' time (its roofline, as a matmul's)
        row = StepCost(index, step.op, step.tensor, text, axes=step.axes, flops=float(flops),
                       model_flops=float(model), hardware_flops=float(executed), compute_s=seconds,
                       once=step.once, block=step.block, memory_bytes=memory_bytes,
                       memory_s=max(0.0, hw.memory_seconds(memory_bytes) - seconds))
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


def step_dtype(step: Step, dtype: Precision | str) -> str:
    """The element type by name (``"bf16"``, ``"f8"``) a step's matmuls run in: a GEMM's ``gemm`` type
    (:meth:`shardc.ir.precision.Precision.gemm`: forward, Dgrad and Wgrad alike), else its operands'
    (:func:`shardc.ir.precision.matmul_dtype`), or ``dtype`` where one type is given for all."""
    if isinstance(dtype, str):
        return dtype
    gemm = step_gemm(step, dtype)
    return gemm.value if gemm is not None else dtype.matmul(r.name for r in step.operands)


def describe(step: Step) -> str:
    """A step in spec notation: ``W_in[D_X, F] -> W_in[D, F]`` or ``A[..] · B[..] -> C[..]``."""
    if step.op in (Op.EINSUM, Op.COPY):
        return " · ".join(str(o) for o in step.operands) + f" -> {step.dst}"
    if step.op is Op.ELEMENTWISE:
        args = ", ".join(str(o) for o in step.operands)
        return f"{step.fn}({args}) -> {step.dst}"
    return f"{step.src} -> {step.dst}"
