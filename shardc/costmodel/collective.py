"""The time of one plan step on one chip: a collective's bandwidth and latency terms, an einsum's FLOPs.

The model, with the choices the book leaves open:

* V is the step's ``volume`` (bytes a device would hold unsharded over the
  collective's axes).  With W the bidirectional bandwidth of one mesh axis
  (:attr:`Hardware.w_ici`, twice the one-way link figure, as the book uses it),
  AllGather and ReduceScatter take ``V / (W * n_axes)``, AllReduce
  ``2V / (W * n_axes)``, AllToAll ``V / (4 * W * n_axes)``.
* A collective whose axes all cross DCN uses ``W_dcn`` (a chip's DCN figure is
  one number, so DCN axes do not multiply it).  One that mixes ICI axes I and DCN
  axes is costed hierarchically, as such collectives are run: the ICI part moves V
  over I (``factor * V / (W_ici * n_I)``), the DCN part moves the ``V / |I|`` each
  chip is left with (``factor * V / (|I| * W_dcn)``).  That is what makes data
  parallelism across pods compute-bound iff tokens per pod > C / W_dcn, the
  the book's 73,440 on v5p.
* A mesh axis may be laid over several physical ICI axes of the torus (the
  the book's M_X: X = 1024 chips of a 16x16x16 pod spans about 3).  ``spans`` gives
  that count per mesh axis (default 1); an ICI collective's ``n_axes`` is the sum
  of its axes' spans, since each physical axis brings its own links.
* Latency: about ``hop_latency`` (1 us) a hop, ``ceil(n/2)`` hops around a ring of
  n chips, summed over the collective's axes (the axes' rings run one after the
  other when latency-bound); an axis spanning k physical axes is k rings of n**(1/k).
  A collective takes ``max(bandwidth term, latency)``:
  latency only bounds small arrays.  Formulas carry the bandwidth terms only.
* An einsum costs ``2 * prod(local index sizes)`` FLOPs per device (global
  product / devices sharing the work); its model FLOPs, for MFU, are
  ``2 * prod(global index sizes)``.  Elementwise steps and slices are free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

from shardc.costmodel.hardware import Hardware
from shardc.errors import ShardcError
from shardc.planner.ir import Op, Step
from shardc.spec.ir import Mesh, Network, TensorRef

__all__ = ["FACTOR", "links", "hops", "StepCost", "cost_step", "einsum_flops", "split_axes", "local_elements"]

# How many times V crosses a link, relative to an AllGather (the book's weighting).
FACTOR: dict[Op, Fraction] = {
    Op.ALL_GATHER: Fraction(1),
    Op.REDUCE_SCATTER: Fraction(1),
    Op.ALL_REDUCE: Fraction(2),
    Op.ALL_TO_ALL: Fraction(1, 4),
}


@dataclass(frozen=True)
class StepCost:
    """The figures of one step; collectives have bytes, einsums FLOPs, both have seconds."""

    index: int
    op: Op
    tensor: str
    text: str  # what the step does, in spec notation
    axes: tuple[str, ...] = ()
    network: str = ""  # "ici", "dcn" or "ici+dcn" for collectives
    volume: float = 0.0  # V, bytes
    weighted: float = 0.0  # V with AllReduce x2 and AllToAll x1/4
    bandwidth_s: float = 0.0
    latency_s: float = 0.0
    flops: float = 0.0  # per device
    model_flops: float = 0.0  # the whole einsum, all devices
    compute_s: float = 0.0
    ahead: bool = False

    @property
    def comm_s(self) -> float:
        return max(self.bandwidth_s, self.latency_s)

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


def split_axes(mesh: Mesh, axes: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The collective's axes over ICI and over DCN, in their given order."""
    ici = tuple(a for a in axes if mesh.axis(a).network is not Network.DCN)
    dcn = tuple(a for a in axes if mesh.axis(a).network is Network.DCN)
    return ici, dcn


def local_elements(ref: TensorRef, sizes: dict[str, int]) -> Fraction:
    """Elements of one device's piece of ``ref``: each dim's size over its axes' sizes."""
    count = Fraction(1)
    for dim in ref.dims:
        count *= _size(sizes, dim.name)
        for axis in dim.axes:
            count /= _size(sizes, axis)
    return count


def einsum_flops(step: Step, sizes: dict[str, int]) -> tuple[Fraction, Fraction]:
    """(per-device FLOPs, model FLOPs) of an einsum step: 2 * product of its index sizes."""
    local: dict[str, Fraction] = {}
    for ref in (*step.operands, step.dst):
        for dim in ref.dims:
            piece = Fraction(_size(sizes, dim.name))
            for axis in dim.axes:
                piece /= _size(sizes, axis)
            # an index is sharded alike in every operand of a local einsum; keep the smallest
            # piece in case the result is sliced further than the operands
            local[dim.name] = min(local.get(dim.name, piece), piece)
    flops, model = Fraction(2), Fraction(2)
    for name, piece in local.items():
        flops *= piece
        model *= _size(sizes, name)
    return flops, model


def links(axes: tuple[str, ...], spans: Mapping[str, int] | None) -> int:
    """The physical ICI axes (each with its links) that a collective over ``axes`` runs on."""
    return sum((spans or {}).get(a, 1) for a in axes)


def hops(axes: tuple[str, ...], sizes: dict[str, int], spans: Mapping[str, int] | None) -> int:
    """Ring hops of a latency-bound collective: ceil(n/2) a ring, an axis of k spans k rings."""
    total = 0
    for axis in axes:
        k = (spans or {}).get(axis, 1)
        side = _size(sizes, axis) ** (1.0 / k)
        total += k * math.ceil(round(side, 9) / 2)
    return total


def collective_seconds(step: Step, mesh: Mesh, sizes: dict[str, int], hw: Hardware,
                       spans: Mapping[str, int] | None = None) -> tuple[float, float, str]:
    """(bandwidth term, latency bound, network) of one collective step."""
    if step.volume is None:
        raise ShardcError(f"collective step on {step.tensor} has no volume",
                          fix="this is a planner bug: report it with the spec")
    volume = float(step.volume.evaluate(sizes))
    factor = float(FACTOR[step.op])
    ici, dcn = split_axes(mesh, step.axes)
    seconds = 0.0
    group_ici = math.prod(_size(sizes, a) for a in ici)
    if ici:
        seconds += factor * volume / (hw.w_ici * links(ici, spans))
    if dcn:
        seconds += factor * volume / (group_ici * hw.w_dcn)
    network = "+".join(n for n, part in (("ici", ici), ("dcn", dcn)) if part)
    return seconds, hops(step.axes, sizes, spans) * hw.hop_latency, network


def cost_step(index: int, step: Step, mesh: Mesh, sizes: dict[str, int], hw: Hardware,
              spans: Mapping[str, int] | None = None) -> StepCost:
    """The :class:`StepCost` of one step of a plan."""
    text = describe(step)
    if step.is_collective:
        bandwidth, latency, network = collective_seconds(step, mesh, sizes, hw, spans)
        volume = float(step.volume.evaluate(sizes)) if step.volume is not None else 0.0
        return StepCost(index, step.op, step.tensor, text, step.axes, network, volume,
                        volume * float(FACTOR[step.op]), bandwidth, latency, ahead=step.ahead)
    if step.op is Op.EINSUM:
        flops, model = einsum_flops(step, sizes)
        return StepCost(index, step.op, step.tensor, text, flops=float(flops),
                        model_flops=float(model), compute_s=float(flops) / hw.flops)
    return StepCost(index, step.op, step.tensor, text, axes=step.axes)


def describe(step: Step) -> str:
    """A step in spec notation: ``W_in[D_X, F] -> W_in[D, F]`` or ``A[..] · B[..] -> C[..]``."""
    if step.op is Op.EINSUM:
        return " · ".join(str(o) for o in step.operands) + f" -> {step.dst}"
    if step.op is Op.ELEMENTWISE:
        args = ", ".join(str(o) for o in step.operands)
        return f"{step.fn}({args}) -> {step.dst}"
    return f"{step.src} -> {step.dst}"


def _size(sizes: dict[str, int], name: str) -> int:
    try:
        return sizes[name]
    except KeyError:
        raise ShardcError(f"no size for {name!r}: costs need every dim and mesh axis size",
                          fix=f"add {name}=... to the `dims` line, or pass --set {name}=...") from None
