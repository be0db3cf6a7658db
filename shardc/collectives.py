"""The one table of plan operations: per collective its title, volume, bandwidth factor, JAX call and HLO op,
and its time on a chip.

Every pass reads this table: the planner costs its moves with :func:`collective_time`,
``shardc cost`` and its formulas use the same factors, links and DCN split, the plan
checker and ``shardc plan`` use the titles, codegen the JAX calls, and the HLO reader
and ``shardc compare`` the HLO op names.  It imports neither jax nor sympy.

The time model, with the choices the book leaves open:

* V is a collective's volume: the bytes a device would hold unsharded over the
  collective's axes.  :attr:`OpInfo.volume_side` says which side's per-device piece
  it is made from (AllGather: its source piece times the group; ReduceScatter: its
  result piece times the group; AllReduce: its source; AllToAll: its source piece
  times the group).  Uneven dims are padded as XLA pads them: each device's piece of
  a dim of size D over n devices is ``ceil(D / n)`` (:func:`piece`).
* With W the bidirectional bandwidth of one mesh axis (:attr:`Hardware.w_ici`,
  twice the one-way link figure, as the book uses it), AllGather and ReduceScatter
  take ``V / (W * links)``, AllReduce ``2V / (W * links)``, AllToAll
  ``V / (4 * W * links)`` (:attr:`OpInfo.factor`: the book's weighting).
* ``links`` is the number of physical ICI axes the collective runs on: a mesh axis
  may be laid over several axes of the torus (the book's M_X: X = 1024 chips of a
  16x16x16 pod spans 3); ``spans`` gives that count per mesh axis (default 1).
* A collective whose axes all cross DCN uses ``W_dcn`` (a chip's DCN figure is one
  number, so DCN axes do not multiply it).  One that mixes ICI axes I and DCN axes
  is costed hierarchically, as such collectives are run: the ICI part moves V over I,
  the DCN part moves the ``V / |I|`` each chip is left with.  That is what makes
  data parallelism across pods compute-bound iff tokens per pod > C / W_dcn, the
  book's 73,440 on v5p.
* Latency: about ``hop_latency`` (1 us) a hop, ``ceil(n/2)`` hops around a ring of
  n chips, summed over the collective's axes; an axis spanning k physical axes is
  k rings of n**(1/k).  A collective takes ``max(bandwidth term, latency)``:
  latency only bounds small arrays.  Formulas carry the bandwidth terms only.
* CollectivePermute (a pipeline's send of a stage's output to the next stage,
  :attr:`OpInfo.neighbour`) moves its V one way over one link: half the axis's
  bidirectional W_ici (W_dcn is a per-chip figure already), one hop, and its
  latency adds to the transfer (one message, nothing to hide it behind).

The figures are written once, generic over numbers and formulas: per-device
pieces (:func:`share`, :func:`piece`), volumes (:func:`volume_elements`), the
bandwidth terms of a collective (:func:`bandwidth_terms`) and the FLOPs of a local
einsum (:func:`einsum_flops`) take ints, floats, fractions or symengine
expressions alike, so the planner, ``shardc cost``, its formulas and memory agree.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Protocol, TypeVar

from shardc.hardware import Hardware
from shardc.ir.spec import Mesh, Network

__all__ = ["Op", "OpInfo", "TABLE", "COLLECTIVES", "FACTOR", "BY_HLO_OP", "CollectiveTime", "collective_time",
           "links", "hops", "split_axes", "share", "piece", "volume_elements", "bandwidth_terms", "einsum_flops"]


class Op(enum.Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"
    SLICE = "slice"
    EINSUM = "einsum"
    COPY = "copy"  # a one-operand statement with the same indices: a reshard or transpose, no FLOPs
    ELEMENTWISE = "elementwise"
    COLLECTIVE_PERMUTE = "collective_permute"  # a pipeline's send between stages, never a plan step

    @property
    def title(self) -> str:
        """The book's name of the operation (``AllGather``)."""
        return TABLE[self].title

    @property
    def info(self) -> OpInfo:
        return TABLE[self]

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class OpInfo:
    """One row of the table.  ``factor`` is None for local steps (they move nothing)."""

    op: Op
    title: str
    factor: Fraction | None = None  # how many times V crosses a link, relative to an AllGather
    volume_side: str = ""  # "src" or "dst": whose per-device piece V is made from
    times_group: bool = False  # V is that piece times the collective's group size
    jax_call: str | None = None  # the jax.lax function codegen emits
    hlo_op: str | None = None  # the op name in compiled HLO text
    neighbour: bool = False  # a send to the next device along one axis (see the module docstring)

    @property
    def is_collective(self) -> bool:
        return self.factor is not None


TABLE: dict[Op, OpInfo] = {info.op: info for info in (
    OpInfo(Op.ALL_GATHER, "AllGather", Fraction(1), "src", True, "jax.lax.all_gather", "all-gather"),
    OpInfo(Op.REDUCE_SCATTER, "ReduceScatter", Fraction(1), "dst", True, "jax.lax.psum_scatter", "reduce-scatter"),
    OpInfo(Op.ALL_REDUCE, "AllReduce", Fraction(2), "src", False, "jax.lax.psum", "all-reduce"),
    OpInfo(Op.ALL_TO_ALL, "AllToAll", Fraction(1, 4), "src", True, "jax.lax.all_to_all", "all-to-all"),
    OpInfo(Op.SLICE, "Slice"),
    OpInfo(Op.EINSUM, "Einsum", jax_call="jnp.einsum"),
    OpInfo(Op.COPY, "Copy", jax_call="jnp.einsum"),
    OpInfo(Op.ELEMENTWISE, "Elementwise"),
    OpInfo(Op.COLLECTIVE_PERMUTE, "CollectivePermute", Fraction(1), "src", False, "jax.lax.ppermute",
           "collective-permute", neighbour=True),
)}

COLLECTIVES = frozenset(op for op, info in TABLE.items() if info.is_collective)
FACTOR: dict[Op, Fraction] = {op: info.factor for op, info in TABLE.items() if info.factor is not None}
# the HLO ops of plan steps (a collective-permute is the pipeline's, matched apart)
BY_HLO_OP: dict[str, Op] = {info.hlo_op: op for op, info in TABLE.items()
                            if info.hlo_op is not None and not info.neighbour}


_N = TypeVar("_N", int, float, Fraction, Any)


def share(size: _N, devices: _N) -> _N:
    """One device's part of a dim of ``size`` over ``devices``: ``ceil(size / devices)`` for whole numbers.

    XLA pads a dim that its devices do not divide, so each device holds the ceiling.  A
    fractional size (a ``shardc cost --sweep`` point between sizes) or a formula is
    divided exactly.
    """
    if isinstance(size, int) and isinstance(devices, int):
        return -(-size // devices)
    return size / devices


def piece(dims: Iterable[tuple[_N, _N]]) -> _N:
    """Elements of one device's piece: the product of :func:`share` over (dim size, devices sharding it)."""
    count: Any = 1
    for size, devices in dims:
        count *= share(size, devices)
    return count  # type: ignore[no-any-return]


def einsum_flops(occurrences: Iterable[tuple[str, tuple[str, ...]]], size: Callable[[str], _N]) -> tuple[_N, _N]:
    """(per-device FLOPs, model FLOPs) of a local einsum: ``2 * prod`` of its index sizes.

    ``occurrences`` are (index, mesh axes sharding it) over its operands and result;
    ``size`` gives a dim's or an axis's size (a number or a symbol).  An index is
    sharded alike in every operand, and the result may be sliced further: the
    occurrence over the most axes is the piece a device works on (:func:`share`).
    """
    axes_of: dict[str, tuple[str, ...]] = {}
    for index, axes in occurrences:
        if len(axes) >= len(axes_of.get(index, ())):
            axes_of[index] = axes
    local: Any = 2
    model: Any = 2
    for index, axes in axes_of.items():
        local *= share(size(index), math.prod((size(a) for a in axes), start=1))
        model *= size(index)
    return local, model


class _Scalable(Protocol):
    def __mul__(self: _T, other: _T) -> _T: ...


_T = TypeVar("_T", bound=_Scalable)


def volume_elements(op: Op, src_piece: _T, dst_piece: _T, group: _T) -> _T:
    """V from the per-device pieces before and after the collective and the group size.

    Numbers (elements, padded pieces) or :class:`~shardc.ir.plan.Monomial` formulas
    (bytes), so the planner's volumes and the cost's padded ones follow one rule.
    """
    info = TABLE[op]
    base = src_piece if info.volume_side == "src" else dst_piece
    return base * group if info.times_group else base


def split_axes(mesh: Mesh, axes: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The collective's axes over ICI and over DCN, in their given order."""
    ici = tuple(a for a in axes if mesh.axis(a).network is not Network.DCN)
    dcn = tuple(a for a in axes if mesh.axis(a).network is Network.DCN)
    return ici, dcn


def links(axes: tuple[str, ...], spans: Mapping[str, int] | None) -> int:
    """The physical ICI axes (each with its links) that a collective over ``axes`` runs on."""
    return sum((spans or {}).get(a, 1) for a in axes)


def hops(axes: tuple[str, ...], sizes: Mapping[str, int], spans: Mapping[str, int] | None) -> int:
    """Ring hops of a latency-bound collective: ceil(n/2) a ring, an axis of k spans k rings."""
    total = 0
    for axis in axes:
        k = (spans or {}).get(axis, 1)
        if sizes[axis] == 1:
            continue  # a ring of one chip has no hops
        side = sizes[axis] ** (1.0 / k)
        total += k * math.ceil(round(side, 9) / 2)
    return total


def bandwidth_terms(op: Op, volume: _N, axes: tuple[str, ...], mesh: Mesh, size: Callable[[str], _N],
                    spans: Mapping[str, int] | None, number: Callable[[Fraction], _N]) -> dict[str, tuple[_N, _N]]:
    """Per network a collective crosses (``"ici"``, ``"dcn"``): (weighted bytes, divisor of that W).

    Its bandwidth time is the sum of ``weighted / (W * divisor)`` (see the module
    docstring): the ICI part moves ``factor * V`` over the links of its ICI axes, the
    DCN part over the group of its ICI axes.  ``number`` makes a table fraction of
    the volume's kind (``float``, or an exact rational for formulas).
    """
    info = TABLE[op]
    assert info.factor is not None, f"{op} moves nothing"
    weighted = number(info.factor) * volume
    ici, dcn = split_axes(mesh, axes)
    terms: dict[str, tuple[_N, _N]] = {}
    if ici:  # a neighbour's send uses one direction of one link: half the bidirectional W
        terms["ici"] = (weighted, number(Fraction(1, 2)) if info.neighbour else number(Fraction(links(ici, spans))))
    if dcn:
        terms["dcn"] = (weighted, math.prod((size(a) for a in ici), start=number(Fraction(1))))
    return terms


@dataclass(frozen=True)
class CollectiveTime:
    bandwidth_s: float
    latency_s: float
    network: str  # "ici", "dcn" or "ici+dcn"
    serial: bool = False  # the latency adds to the transfer (a neighbour's send) instead of bounding it

    @property
    def seconds(self) -> float:
        if self.serial:
            return self.bandwidth_s + self.latency_s
        return max(self.bandwidth_s, self.latency_s)


def collective_time(op: Op, volume_bytes: float, axes: tuple[str, ...], mesh: Mesh, sizes: Mapping[str, int],
                    hw: Hardware, spans: Mapping[str, int] | None = None) -> CollectiveTime:
    """The time of one collective moving ``volume_bytes`` (V) over ``axes`` (see the module docstring)."""
    if math.prod(sizes[a] for a in axes) == 1:
        return CollectiveTime(0.0, 0.0, "")  # over size-1 axes nothing moves (XLA drops it)
    terms = bandwidth_terms(op, float(volume_bytes), axes, mesh, lambda a: float(sizes[a]), spans, float)
    bandwidth = {"ici": hw.w_ici, "dcn": hw.w_dcn}
    seconds = 0.0
    for network, (weighted, divisor) in terms.items():
        seconds += weighted / (bandwidth[network] * divisor)
    neighbour = TABLE[op].neighbour
    latency = (1 if neighbour else hops(axes, sizes, spans)) * hw.hop_latency
    return CollectiveTime(seconds, latency, "+".join(terms), neighbour)
