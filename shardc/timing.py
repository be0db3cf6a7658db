"""The time of a plan on a chip: the one objective the planner minimises and ``shardc cost`` reports.

Per step (:func:`cost_step`): a collective takes its time from the table of
collectives (:func:`shardc.collectives.collective_time`: bandwidth over the links of
its axes, torus spans, DCN hierarchy, latency bound); an einsum costs
``2 * prod(local index sizes)`` FLOPs per device over the chip's C (its model
FLOPs, for MFU, are ``2 * prod(global index sizes)``); copies, slices and
elementwise steps are free.  Uneven dims use the padded per-device size
(``ceil(D / devices)``), as XLA pads them.

The overlap rule (:func:`phase_seconds`, :func:`step_seconds`), as the book draws
it: within a phase every collective overlaps the phase's compute, so a phase
takes ``max(compute_s, comm_s)``; the backward needs the forward's results, so the
training step takes ``forward + backward``, plus the optimizer phase of ZeRO-1/2
(``Plan.optimizer``: its reduce-scatters and all-gathers, after the backward, with
no compute to overlap).  The forward steps a ``--recompute`` mode runs again
(``Plan.recomputed``) are part of the backward phase, FLOPs and collectives.  All
are multiplied by the layer count.  :func:`plan_time` is that step time; ``shardc cost`` reports it as
``step_s`` and the planner returns, of the plans it builds, the one it makes least.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from shardc.collectives import FACTOR, Layout, Op, collective_time, piece, share, volume_elements
from shardc.collectives import einsum_flops as flops_of  # this module's einsum_flops takes a Step
from shardc.errors import ShardcError
from shardc.hardware import Hardware, resolve_hardware
from shardc.ir.plan import Plan, Step
from shardc.ir.spec import Mesh, TensorRef
from shardc.topology import AxisLinks, resolve_links

__all__ = ["step_count", "bound_of",
           "StepCost", "cost_step", "einsum_flops", "local_elements", "step_volume", "describe",
           "phase_seconds", "step_seconds", "PlanTime", "plan_time", "plan_chip", "plan_sizes", "plan_links",
           "resolve_layers"]


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
    compute_s: float = 0.0
    ahead: bool = False
    once: bool = False  # outside a `layers` block: counted once, not once a layer
    serial: bool = False  # the latency adds to the transfer (NCCL's model, a send) instead of bounding it

    @property
    def comm_s(self) -> float:
        return self.bandwidth_s + self.latency_s if self.serial else max(self.bandwidth_s, self.latency_s)

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
        return row


def _pieces(ref: TensorRef, sizes: Mapping[str, int]) -> list[tuple[int, int]]:
    return [(_size(sizes, d.name), math.prod(_size(sizes, a) for a in d.axes)) for d in ref.dims]


def local_elements(ref: TensorRef, sizes: Mapping[str, int]) -> Fraction:
    """Elements of one device's piece of ``ref``: per dim ``ceil(size / devices)`` (XLA's padding)."""
    return Fraction(piece(_pieces(ref, sizes)))


def step_volume(step: Step, sizes: Mapping[str, int]) -> float:
    """V of a collective in bytes: its volume formula, padded where a dim does not divide its devices."""
    if step.volume is None or step.src is None:
        raise ShardcError(f"collective step on {step.tensor} has no volume",
                          fix="this is a planner bug: report it with the spec")
    exact = float(step.volume.evaluate(dict(sizes)))
    src, dst = _pieces(step.src, sizes), _pieces(step.dst, sizes)
    if all(n % k == 0 or not isinstance(n, int) for n, k in src + dst):
        return exact  # even (or a fractional sweep point): the formula is the volume
    group = math.prod(_size(sizes, a) for a in step.axes)
    unpadded = volume_elements(step.op, _exact(src), _exact(dst), Fraction(group))
    padded = volume_elements(step.op, Fraction(piece(src)), Fraction(piece(dst)), Fraction(group))
    return exact * float(padded / unpadded)


def _exact(pieces: list[tuple[int, int]]) -> Fraction:
    return math.prod((Fraction(n, k) for n, k in pieces), start=Fraction(1))


def einsum_flops(step: Step, sizes: Mapping[str, int]) -> tuple[int, int]:
    """(per-device FLOPs, model FLOPs) of an einsum step (:func:`shardc.collectives.einsum_flops`)."""
    occurrences = ((d.name, d.axes) for ref in (*step.operands, step.dst) for d in ref.dims)
    return flops_of(occurrences, lambda name: _size(sizes, name))


def step_seconds_of(step: Step, mesh: Mesh, sizes: Mapping[str, int], hw: Hardware,
                    spans: Layout | None = None) -> tuple[float, float]:
    """(compute seconds, communication seconds) of one step: what :func:`cost_step` reports, without text."""
    if step.is_collective:
        return 0.0, collective_time(step.op, step_volume(step, sizes), step.axes, mesh, sizes, hw, spans).seconds
    if step.op is Op.EINSUM:
        return einsum_flops(step, sizes)[0] / hw.flops, 0.0
    return 0.0, 0.0


def cost_step(index: int, step: Step, mesh: Mesh, sizes: Mapping[str, int], hw: Hardware,
              spans: Layout | None = None) -> StepCost:
    """The :class:`StepCost` of one step of a plan."""
    text = describe(step)
    if step.is_collective:
        volume = step_volume(step, sizes)
        t = collective_time(step.op, volume, step.axes, mesh, sizes, hw, spans)
        return StepCost(index, step.op, step.tensor, text, step.axes, t.network, volume,
                        volume * float(FACTOR[step.op]), t.bandwidth_s, t.latency_s, ahead=step.ahead,
                        once=step.once, serial=t.serial)
    if step.op is Op.EINSUM:
        flops, model = einsum_flops(step, sizes)
        return StepCost(index, step.op, step.tensor, text, flops=float(flops),
                        model_flops=float(model), compute_s=flops / hw.flops, once=step.once)
    return StepCost(index, step.op, step.tensor, text, axes=step.axes, once=step.once)


def describe(step: Step) -> str:
    """A step in spec notation: ``W_in[D_X, F] -> W_in[D, F]`` or ``A[..] · B[..] -> C[..]``."""
    if step.op in (Op.EINSUM, Op.COPY):
        return " · ".join(str(o) for o in step.operands) + f" -> {step.dst}"
    if step.op is Op.ELEMENTWISE:
        args = ", ".join(str(o) for o in step.operands)
        return f"{step.fn}({args}) -> {step.dst}"
    return f"{step.src} -> {step.dst}"


def step_count(step: Step, layers: int) -> int:
    """How often a step runs in a training step: once a layer, or once (outside a ``layers`` block)."""
    return 1 if step.once else layers


def phase_seconds(compute_s: float, comm_s: float) -> float:
    """A phase's time: its collectives overlap its compute (the book's max)."""
    return max(compute_s, comm_s)


def bound_of(compute_s: float, comm_s: float) -> str:
    """The verdict beside :func:`phase_seconds`: which of the two sets the time."""
    return "communication" if comm_s > compute_s else "compute"


def step_seconds(*phases_s: float) -> float:
    """A training step's time: its phases run one after the other (forward, backward, optimizer)."""
    return math.fsum(phases_s)


@dataclass(frozen=True)
class PlanTime:
    """A plan's times on a chip, all layers: per phase compute and communication, and the step."""

    forward_compute_s: float
    forward_comm_s: float
    backward_compute_s: float  # with the recomputed forward steps
    backward_comm_s: float
    optimizer_compute_s: float = 0.0
    optimizer_comm_s: float = 0.0

    @property
    def forward_s(self) -> float:
        return phase_seconds(self.forward_compute_s, self.forward_comm_s)

    @property
    def backward_s(self) -> float:
        return phase_seconds(self.backward_compute_s, self.backward_comm_s)

    @property
    def optimizer_s(self) -> float:
        return phase_seconds(self.optimizer_compute_s, self.optimizer_comm_s)

    @property
    def step_s(self) -> float:
        return step_seconds(self.forward_s, self.backward_s, self.optimizer_s)

    @property
    def comm_s(self) -> float:
        return self.forward_comm_s + self.backward_comm_s + self.optimizer_comm_s

    def key(self) -> tuple[float, float]:
        """What the planner compares: the step time, then less communication."""
        return (self.step_s, self.comm_s)


def plan_sizes(plan: Plan) -> dict[str, int]:
    values = {a.name: a.size for a in plan.spec.mesh.axes}
    values.update(plan.spec.sizes)
    values.update(plan.size_map or {})
    return values


def plan_chip(plan: Plan, hardware: str | Hardware | None = None, hardware_file: str | None = None) -> Hardware:
    """The chip to cost ``plan`` on: a file or chip given here, else the one it was planned for (``Plan.chip``)."""
    if hardware is None and hardware_file is None:
        return plan.chip
    return resolve_hardware(hardware, hardware_file)


def plan_links(plan: Plan, hw: Hardware, sizes: Mapping[str, int],
               spans: Mapping[str, int] | None = None) -> tuple[dict[str, AxisLinks], tuple[str, ...]]:
    """Each mesh axis's links at these sizes on the plan's topology (:func:`shardc.topology.resolve_links`),
    the spans the plan was made with on this chip and ``spans`` over them; and the notes that say so."""
    given = dict(plan.spans) if plan.hardware == hw.name else {}
    given.update(spans or {})
    return resolve_links(plan.spec.mesh, sizes, hw, plan.topology, given)


def plan_time(plan: Plan, hardware: str | Hardware | None = None, sizes: Mapping[str, int] | None = None,
              spans: Mapping[str, int] | None = None,
              memo: dict[tuple[object, ...], tuple[float, float]] | None = None) -> PlanTime:
    """The step time of ``plan`` on a chip (by default the one it was planned for), all layers.

    ``memo`` keeps each step's seconds across calls: pass one dict only to calls on
    plans of the same spec, chip, sizes and spans (the planner's candidates).
    """
    hw = plan_chip(plan, hardware)
    values = dict(sizes) if sizes is not None else plan_sizes(plan)
    layers, _ = resolve_layers(plan, values)
    links = plan_links(plan, hw, values, spans)[0]
    mesh = plan.spec.mesh

    seen = {} if memo is None else memo  # layers repeat the same steps

    def seconds(step: Step) -> tuple[float, float]:
        key = (step.op, step.axes, step.volume, tuple(r.dims for r in (step.dst, *step.operands)),
               step.src.dims if step.src is not None else None)
        hit = seen.get(key)
        if hit is None:
            hit = seen[key] = step_seconds_of(step, mesh, values, hw, links)
        return hit

    def totals(steps: Iterable[Step]) -> tuple[float, float]:
        pairs = [(seconds(s), step_count(s, layers)) for s in steps]
        return math.fsum(c * n for (c, _), n in pairs), math.fsum(m * n for (_, m), n in pairs)

    return PlanTime(*totals(plan.forward), *totals(plan.recomputed + plan.backward), *totals(plan.optimizer))


def resolve_layers(plan: Plan, sizes: Mapping[str, int]) -> tuple[int, str | None]:
    """The layer count, and its symbol when the spec names a dim (``layers L``).

    A pipelined plan is one stage's (:mod:`shardc.spec.stages`): its count is the
    slowest stage's, ceil(L / P), with no symbol.
    """
    layers, symbol = _all_layers(plan, sizes)
    axis = plan.spec.mesh.pipeline_axis
    if axis is not None:
        return share(layers, sizes.get(axis.name, axis.size)), None
    return layers, symbol


def _all_layers(plan: Plan, sizes: Mapping[str, int]) -> tuple[int, str | None]:
    layers = plan.spec.layers
    if layers is None:
        indices = {d.name for info in plan.tensors for d in info.ref.dims}
        if "L" in sizes and "L" not in indices:  # --set L=40 without a `layers` line
            return sizes["L"], "L"
        return 1, None
    if isinstance(layers, int):
        return layers, None
    if layers not in sizes:
        raise ShardcError(f"`layers {layers}` names no known size",
                          fix=f"add {layers}=... to the `dims` line, or pass --set {layers}=...")
    return sizes[layers], layers


def _size(sizes: Mapping[str, int], name: str) -> int:
    try:
        return sizes[name]
    except KeyError:
        raise ShardcError(f"no size for {name!r}: costs need every dim and mesh axis size",
                          fix=f"add {name}=... to the `dims` line, or pass --set {name}=...") from None
