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
* With W the bandwidth of one mesh axis (:attr:`Hardware.w_ici`: on a torus twice the one-way
  link figure, as the book uses it; on a GPU its NVLink egress), AllGather and ReduceScatter
  take ``V / (W * links)``, AllReduce ``2V / (W * links)``, AllToAll ``V / (4 * W * links)``
  (:attr:`OpInfo.factor`: the book's weighting).
* ``links`` is what the collective's axes lie on (:class:`shardc.topology.AxisLinks`, from the
  topology: :func:`shardc.topology.resolve_links`): the physical ICI axes of each mesh axis (the
  book's M_X: X = 1024 chips of a 16x16x16 pod spans 3), each a wrapped ring (1) or an open line
  of n chips (n / 2(n-1): 2(n-1)/n times the time, "How To Scale Your Model", part 2).  A count
  of physical axes (``--spans``, the book's assumptions) is that many wrapped rings.  An
  AllToAll over several physical axes laid on a slice takes the book's torus formula,
  ``V * max(n_d) / (4 N W)``: the traffic along each axis loads its links with ``V n_d / 4N`` and
  the axes run at once.
* A collective whose axes all cross DCN uses ``W_dcn`` (a chip's DCN figure is one
  number, so DCN axes do not multiply it).  One that mixes ICI axes I and DCN axes
  is costed hierarchically, as such collectives are run: the ICI part moves V over I,
  the DCN part moves the ``V / |I|`` each chip is left with.  That is what makes
  data parallelism across pods compute-bound iff tokens per pod > C / W_dcn, the
  book's 73,440 on v5p.
* On a GPU cluster (a topology ``NODESxGPUS``) a collective over ``inner`` GPUs of each of
  ``outer`` nodes runs as NCCL's hierarchical ring: (n-1)/n of V over NVLink, then 1/inner of it
  over each GPU's InfiniBand rail, the phases pipelined, so the slower one sets the time; an
  AllToAll by the bisection (:func:`_node_terms`).  An AllReduce inside one node whose NVSwitches
  reduce (NVLink SHARP) runs as the faster of the ring and NVLS, which moves V (n+1)/n through each
  GPU's links at the chip's NVLS rate; AllGather and ReduceScatter stay rings.
* Latency: on a torus about ``hop_latency`` (1 us) a hop, ``ceil(n/2)`` hops around a ring of
  n chips and ``n-1`` along a line, summed over the collective's physical axes; a collective
  takes ``max(bandwidth term, latency)``: latency only bounds small arrays.  On a GPU cluster,
  NCCL's own model: a base per collective plus a latency per ring step (:data:`NCCL_BASE_S`),
  added to the transfer.  Formulas carry the bandwidth terms only.
* CollectivePermute (a pipeline's send of a stage's output to the next stage,
  :attr:`OpInfo.neighbour`) moves its V one way over one link: half the axis's
  bidirectional W_ici on a torus (a GPU's W_ici and W_dcn are one-way figures already), one
  hop, and its latency adds to the transfer (one message, nothing to hide it behind).

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
from shardc.topology import AxisLinks, Ring

__all__ = ["Op", "OpInfo", "TABLE", "COLLECTIVES", "FACTOR", "BY_HLO_OP", "CollectiveTime", "collective_time",
           "links", "hops", "split_axes", "Layout", "axis_links", "share", "piece", "volume_elements",
           "bandwidth_terms", "einsum_flops", "NCCL_BASE_S", "NCCL_NVLINK_STEP_S", "NCCL_NET_STEP_S", "Routed"]


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


Layout = Mapping[str, "AxisLinks | int"]  # per mesh axis its links, or (the book's M_X) a count of torus axes


def axis_links(layout: Layout | None, axis: str, chips: int) -> AxisLinks:
    """An axis's :class:`AxisLinks`: as given, or from a span count k (k wrapped rings of n ** (1/k)),
    by default one ring."""
    value = (layout or {}).get(axis, 1)
    if isinstance(value, AxisLinks):
        return value
    return AxisLinks(tuple(Ring(chips ** (1.0 / value)) for _ in range(value)) if chips > 1 else ())


def _chips(mesh: Mesh, sizes: Mapping[str, int] | None, axis: str) -> int:
    return (sizes or {}).get(axis, mesh.axis(axis).size)


def links(axes: tuple[str, ...], layout: Layout | None, mesh: Mesh | None = None,
          sizes: Mapping[str, int] | None = None) -> Fraction:
    """The physical ICI axes' worth of links a collective over ``axes`` runs on (open lines count less)."""
    return sum((axis_links(layout, a, _chips(mesh, sizes, a) if mesh is not None else 1).links for a in axes),
               Fraction(0))


def hops(axes: tuple[str, ...], sizes: Mapping[str, int], layout: Layout | None) -> int:
    """Hops of a latency-bound collective on a torus: per physical ring ceil(n/2), per open line n-1."""
    return sum(r.hops for a in axes if sizes[a] > 1 for r in axis_links(layout, a, sizes[a]).rings or
               (Ring(sizes[a]),))


def _nodes(axes: tuple[str, ...], mesh: Mesh, sizes: Mapping[str, int] | None,
           layout: Layout | None) -> tuple[int, int, float, float] | None:
    """(GPUs a node, nodes, W_ici / W_dcn, NVLS rate / W_ici) of a collective on a GPU cluster's layout;
    None elsewhere."""
    found = [axis_links(layout, a, _chips(mesh, sizes, a)) for a in axes]
    if not found or not all(f.nodes for f in found):
        return None
    return (math.prod(f.inner for f in found), math.prod(f.outer for f in found), found[0].speed, found[0].nvls)


def _torus_all_to_all(rings: list[Ring]) -> Fraction:
    """The divisor of an AllToAll's V/4 on a torus (the book's torus formula): traffic along each
    physical axis of n_d chips loads its links with V * n_d / (4 N), and the axes run at once, so the
    most loaded sets the time, V * max(n_d) / (4 N W); an open line's load counts as its links do."""
    chips = math.prod(r.chips for r in rings)
    worst = max((r.chips / float(r.links) for r in rings if r.links), default=1.0)
    return Fraction(chips / worst).limit_denominator(1 << 20)


# (k, limit, groups) of a node-limited routing whose slots an AllToAll moves (``k over E, M, G``)
Routed = tuple[int, int, int]


def _routed_terms(inner: int, outer: int, routed: Routed) -> tuple[Fraction | None, Fraction | None]:
    """(ICI, DCN) divisors of an AllToAll's V/4 that moves the slots of a node-limited routing, run as
    DeepSeek-V3 runs it ("DeepSeek-V3 Technical Report", arXiv 2412.19437, section 3.2.2).

    A token's row crosses InfiniBand once to each node it routes to (to the GPU of its own index
    there), then NVLink forwards it to its experts' GPUs.  Its k experts lie in at most ``limit``
    groups, so on at most ``min(k, outer, limit * ceil(outer / groups))`` nodes (the experts laid on
    the nodes in order, ``groups`` blocks of them), each another node with probability
    (outer-1)/outer: that share of a routed row's k copies crosses nodes where the unlimited
    AllToAll sends every copy to its expert's GPU.  Inside the destination node every copy moves
    to its expert's GPU but the (1/inner) landing where it arrived.  V is the piece a GPU sends, k
    copies of each of its tokens, times the group.
    """
    k, limit, groups = routed
    n = inner * outer
    nodes = min(k, outer, limit * -(-outer // groups))
    ici = Fraction(n * inner, 4 * (inner - 1)) if inner > 1 else None
    dcn = Fraction(n * outer * k, 4 * nodes * (outer - 1)) if outer > 1 else None
    return ici, dcn


def _node_terms(op: Op, inner: int, outer: int, speed: float, nvls: float = 0.0,
                routed: Routed | None = None) -> dict[str, Fraction]:
    """Per network, the divisor of ``factor * V`` on a GPU cluster, and only the slower phase's.

    A collective over ``inner`` GPUs of each of ``outer`` nodes runs as NCCL's hierarchical
    collectives do: a ring inside each node over NVLink, (n-1)/n of V out of each GPU at its egress
    W_ici, and, each GPU holding 1/inner of the data, a ring across nodes over its own InfiniBand
    rail, (outer-1)/outer of that at W_dcn.  The phases are pipelined (chunks of one cross nodes while
    the next moves in the node), so the slower one sets the time.  An AllToAll sends each peer
    V / n^2: inside the node (inner-1) of them at W_ici, across nodes (n-inner) at W_dcn (the
    bisection), at once; one moving a node-limited routing's slots (``routed``), as
    :func:`_routed_terms` says.  An AllReduce inside one node takes the faster of the ring and NVLink
    SHARP (``nvls`` > 0, :func:`_nvls_divisor`).
    """
    n = inner * outer
    if op is Op.ALL_TO_ALL and routed is not None and outer > 1:
        ici, dcn = _routed_terms(inner, outer, routed)
    elif op is Op.ALL_TO_ALL:  # the table's V/4 weighting undone: V * peers / n^2
        ici = Fraction(n * n, 4 * (inner - 1)) if inner > 1 else None
        dcn = Fraction(n * n, 4 * (n - inner)) if outer > 1 else None
    else:
        ici = Fraction(inner, inner - 1) if inner > 1 else None
        dcn = Fraction(n, outer - 1) if outer > 1 else None
    if op is Op.ALL_REDUCE and outer == 1 and ici is not None and nvls > 0:
        ici = max(ici, _nvls_divisor(inner, nvls))
    if ici is not None and dcn is not None:  # pipelined: the slower phase (W_ici = speed * W_dcn)
        return {"ici": ici} if 1 / (float(ici) * speed) >= 1 / float(dcn) else {"dcn": dcn}
    return {k: v for k, v in (("ici", ici), ("dcn", dcn)) if v is not None}


def _nvls_divisor(gpus: int, nvls: float) -> Fraction:
    """The divisor of an AllReduce's 2V at W_ici when NVLink SHARP runs it on ``gpus`` GPUs of a node.

    NVLS (NCCL 2.17 and later on an NVSwitch 3 node) reduces in the switches: each GPU's share of
    V is read from every GPU by a reducing load and written back once by a multicast store, so each
    GPU sends V (its data into every share's load) plus V/n (its share's store), and takes as much in:
    V (n+1)/n at the chip's NVLS rate, ``nvls`` x W_ici.  NCCL takes the ring where that is slower
    (up to 4 GPUs of an H100 node, as measured: NVIDIA/nccl issue 1455).
    """
    return Fraction(2 * gpus * nvls / (gpus + 1)).limit_denominator(1 << 20)


def bandwidth_terms(op: Op, volume: _N, axes: tuple[str, ...], mesh: Mesh, size: Callable[[str], _N],
                    layout: Layout | None, number: Callable[[Fraction], _N],
                    sizes: Mapping[str, int] | None = None, routed: Routed | None = None) -> dict[str, tuple[_N, _N]]:
    """Per network a collective crosses (``"ici"``, ``"dcn"``): (weighted bytes, divisor of that W).

    Its bandwidth time is the sum of ``weighted / (W * divisor)`` (see the module
    docstring): the ICI part moves ``factor * V`` over the links of its ICI axes, the
    DCN part over the group of its ICI axes; on a GPU cluster's layout, the slower phase
    (:func:`_node_terms`; ``routed``: an AllToAll of a node-limited routing's slots).  ``number``
    makes a table fraction of the volume's kind (``float``, or an exact rational for formulas); the
    divisors are numbers, from the mesh's sizes (``sizes`` over them).
    """
    info = TABLE[op]
    assert info.factor is not None, f"{op} moves nothing"
    weighted = number(info.factor) * volume
    nodes = _nodes(axes, mesh, sizes, layout)
    if nodes is not None and info.neighbour:  # one way at a GPU's egress, or its rail across nodes
        return {"dcn" if nodes[1] > 1 else "ici": (weighted, number(Fraction(1)))}
    if nodes is not None:
        return {k: (weighted, number(v)) for k, v in _node_terms(op, *nodes, routed=routed).items()}
    ici, dcn = split_axes(mesh, axes)
    terms: dict[str, tuple[_N, _N]] = {}
    if ici:
        terms["ici"] = (weighted, number(_ici_divisor(op, ici, mesh, sizes, layout)))
    if dcn:
        terms["dcn"] = (weighted, math.prod((size(a) for a in ici), start=number(Fraction(1))))
    return terms


def _ici_divisor(op: Op, ici: tuple[str, ...], mesh: Mesh, sizes: Mapping[str, int] | None,
                 layout: Layout | None) -> Fraction:
    found = [axis_links(layout, a, _chips(mesh, sizes, a)) for a in ici]
    if TABLE[op].neighbour:  # one direction of one link: half the torus's bidirectional W, a GPU's egress
        return Fraction(1) if any(f.gpu for f in found) else Fraction(1, 2)
    rings = [r for f in found for r in f.rings if r.chips > 1]
    if op is Op.ALL_TO_ALL and len(rings) > 1 and all(f.torus for f in found):  # the book's spans: V/(4 W links)
        return _torus_all_to_all(rings)
    return sum((f.links for f in found), Fraction(0))


# NCCL's own latency model (src/graph/tuning.cc): a base per collective plus a latency per step, for
# the LL protocol it picks for small messages: base 6.6 us, a step 0.6 us over NVLink and 2.7 us over
# the network (the Ring row of baseLat and hwLat)
NCCL_BASE_S = 6.6e-6
NCCL_NVLINK_STEP_S = 0.6e-6
NCCL_NET_STEP_S = 2.7e-6


def _nccl_latency(op: Op, inner: int, outer: int, base: float | None = None) -> float:
    """NCCL's latency of a ring collective: base + steps; a ring of n takes n-1 steps (AllReduce twice).
    ``base``: the chip's measured base (:attr:`Hardware.collective_base`), else NCCL's."""
    first = NCCL_BASE_S if base is None else base
    if TABLE[op].neighbour:  # one send: one step, across nodes if the stage axis spans them
        return first + (NCCL_NET_STEP_S if outer > 1 else NCCL_NVLINK_STEP_S)
    rounds = 2 if op is Op.ALL_REDUCE else 1
    return first + rounds * ((inner - 1) * NCCL_NVLINK_STEP_S + (outer - 1) * NCCL_NET_STEP_S)


@dataclass(frozen=True)
class CollectiveTime:
    bandwidth_s: float
    latency_s: float
    network: str  # "ici", "dcn" or "ici+dcn"
    serial: bool = False  # the latency adds to the transfer (a neighbour's send) instead of bounding it
    # of bandwidth_s, the DCN phase's (a hierarchical collective's cross-pod step, which a framework may run
    # apart from its ICI phase: `grad_reduce after-backward over dcn`)
    dcn_s: float = 0.0

    @property
    def seconds(self) -> float:
        if self.serial:
            return self.bandwidth_s + self.latency_s
        return max(self.bandwidth_s, self.latency_s)


def collective_time(op: Op, volume_bytes: float, axes: tuple[str, ...], mesh: Mesh, sizes: Mapping[str, int],
                    hw: Hardware, spans: Layout | None = None, routed: Routed | None = None) -> CollectiveTime:
    """The time of one collective moving ``volume_bytes`` (V) over ``axes`` (see the module docstring;
    ``routed``: an AllToAll of a node-limited routing's slots, :func:`_routed_terms`)."""
    if math.prod(sizes[a] for a in axes) == 1:
        return CollectiveTime(0.0, 0.0, "")  # over size-1 axes nothing moves (XLA drops it)
    terms = bandwidth_terms(op, float(volume_bytes), axes, mesh, lambda a: float(sizes[a]), spans, float, sizes,
                            routed)
    bandwidth = {"ici": hw.w_ici, "dcn": hw.w_dcn}
    parts = {network: weighted / (bandwidth[network] * divisor) for network, (weighted, divisor) in terms.items()}
    seconds, dcn_s = sum(parts.values(), 0.0), parts.get("dcn", 0.0)
    nodes = _nodes(axes, mesh, sizes, spans)
    if nodes is not None:  # a GPU cluster: NCCL's latency adds to the transfer
        return CollectiveTime(seconds, _nccl_latency(op, nodes[0], nodes[1], hw.collective_base), "+".join(terms),
                              True, dcn_s)
    neighbour = TABLE[op].neighbour
    latency = (1 if neighbour else hops(axes, sizes, spans)) * hw.hop_latency
    return CollectiveTime(seconds, latency, "+".join(terms), neighbour, dcn_s)
