"""Sharded values of one tensor, the moves between them, and the cheapest path.

A value's *layout* gives, for each tensor dim, the mesh axes that shard it
(major to minor), and its *unreduced* axes (partial sums).  The moves
act on one value at a time; each is valid only at the minor end of
a dim, because that is where a tiled collective adds or removes a factor:

    all_gather      remove a suffix of a dim's axes             (one collective)
                    or of several dims' at once: gathered into a new leading dim over all
                    their axes, then laid out locally, one collective at the speed of
                    every axis it spans (the book: an AllGather over two axes, V/(2W))
    slice           append a replicated axis to a dim            (free)
    all_to_all      move a suffix of one dim to another's end    (one collective)
    reduce_scatter  resolve unreduced axes onto a dim's end      (one collective)
    all_reduce      resolve unreduced axes, replicated           (one collective)

:func:`shardc.sharding.search.reshard` runs Dijkstra over values from any of several
free sources (values the phase already holds) to one target (:mod:`shardc.sharding.reverse`
searches back from one target to many sources).  Costs are tuples compared
lexicographically: (seconds, collectives, activation collectives), so ties go to
fewer collectives, then to moving weights rather than activations.  A move's
seconds are its time on the plan's chip from the table of collectives
(:func:`shardc.collectives.collective_time`: links per axis with torus spans, DCN,
latency), at the padded per-device size where a dim is uneven; the einsum search
adds each configuration's compute (:meth:`CostContext.einsum_seconds`, as ``shardc cost``
times the step), each weighted as the phase counts it (:attr:`CostContext.compute_weight`,
and :attr:`CostContext.ahead_weight` for the collectives issued ahead, :meth:`CostContext.ahead`).

The moves cut a dim's axes only between *units* (:attr:`CostContext.units`):
every axis alone, except past four mesh axes, where axes the spec always writes
together move as one (:func:`shardc.sharding.unit.bonded_axes`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from shardc.collectives import Routed, collective_time, einsum_flops, piece, volume_elements
from shardc.hardware import DEFAULT, PRESETS, Hardware
from shardc.ir.plan import Monomial, Op, Step
from shardc.ir.precision import Precision
from shardc.ir.spec import DType, Mesh, TensorRef
from shardc.sharding.moves import INFINITE, ZERO, Cost, Edge, Layout, Move, SearchTooLong, Value, add_cost, expand
from shardc.sharding.unit import Placements
from shardc.spec.walk import gather_nbytes_of, nbytes_of
from shardc.steptime import einsum_bytes, einsum_time
from shardc.topology import resolve_links

__all__ = ["Layout", "Value", "Move", "expand", "neighbours", "spanning", "Cost", "CostContext", "ZERO", "INFINITE",
           "add_cost", "SearchTooLong"]

# Without dims, every dim is taken to be this large (and the book's rules decide).
PROXY_DIM = 1 << 20

@dataclass
class CostContext:
    """What costs depend on: mesh, dtype, sizes (or proxies), which tensors are weights, and the chip."""

    mesh: Mesh
    dtype: DType
    sizes: dict[str, int] | None  # dims; None: use PROXY_DIM for every dim
    weights: frozenset[str] = frozenset()
    hardware: Hardware = PRESETS[DEFAULT]
    spans: dict[str, int] | None = None  # over the topology's layout (shardc.topology.resolve_links)
    topology: tuple[int, ...] | None = None  # the slice or cluster given; None: the chip's usual one
    padded: frozenset[str] = frozenset()  # dims the spec shards unevenly: the search may too (XLA pads)
    compute_weight: float = 1.0  # seconds of compute count this much beside seconds of communication
    # seconds of the collectives issued ahead (CostContext.ahead) count this much beside the others':
    # 0 where the phase's compute hides them at the margin (shardc.phase_time.phase_seconds)
    ahead_weight: float = 1.0
    # a pipeline's stage: sizes a microbatch's, run this often a step but accumulated tensors' reductions (move_cost)
    repeats: int = 1
    accumulated: frozenset[str] = frozenset()
    # tensor -> bytes an element where not the dtype's (shardc.planner.graph.Graph.element_bytes)
    element_bytes: dict[str, int] = field(default_factory=dict)
    # param -> bytes an element its AllGathers move, where the spec's `param_gather in T` says
    # (shardc.planner.graph.Graph.gathered_bytes); read through gather_nbytes
    gathered: dict[str, int] = field(default_factory=dict)
    gather_axes: frozenset[str] = frozenset()  # the ZeRO axes: only a gather over them alone moves that type
    # the tensors' types where not the dtype, and the GEMMs' (`gemm f8`): an einsum's rate; None: all of dtype
    precision: Precision | None = None
    # each param's value as the device holds it: a GEMM reading it so quantizes nothing (shardc.quantize)
    held: dict[str, Value] = field(default_factory=dict)
    # whether a quantize pass fuses into the step that made its operand (shardc.fusion's rule, where the
    # chip fuses); None: it never does
    fusible: Callable[[Step], bool] | None = None
    # (operand, its indices, the result's, its local value, the GEMM's type) -> its quantize pass's bytes,
    # unfused and fused: shardc.sharding.einsum.quantize_bytes
    passes: dict[tuple[object, ...], tuple[float, float]] = field(default_factory=dict)
    # forward searches, resumed by each query: see shardc.sharding.search.reshard
    _searches: dict[tuple[object, ...], object] = field(default_factory=dict)
    _bytes: dict[tuple[object, ...], Monomial] = field(default_factory=dict)
    # (kind, indices, value) -> its moves and their costs (CostContext.kind); states recur across searches
    _edges: dict[tuple[object, ...], tuple[Edge, ...]] = field(default_factory=dict)
    _numbers: dict[Value, int] = field(default_factory=dict)
    # reverse searches (to one target) and the moves into each value: see shardc.sharding.reverse
    _reverse: dict[tuple[object, ...], object] = field(default_factory=dict)
    _into: dict[tuple[object, ...], tuple[tuple[Move, int, Cost], ...]] = field(default_factory=dict)
    # Search work the planner may do before it gives up (see tick); None: no limit.  A count of
    # work, not of seconds, so whether a spec plans never depends on how busy the machine is.
    budget: int | None = None
    explored: int = 0  # work done so far (see tick), over every candidate plan of this context
    # Whether to keep the alternatives `shardc plan --explain` lists (Plan.choices): only when asked,
    # since building them and searching the runners-up costs time the plan itself never needs.
    explain: bool = False
    # Whether a zig-zag ring is priced as a plan holding the sequence in its order runs it, without the
    # reordering at each call (shardc.planner.zigzag_order); the planner tries it where that may hold.
    zigzag_held: bool = False
    # Mesh axes the search moves as one (major to minor), each axis in exactly one; None: every
    # axis alone (exact).  See shardc.sharding.unit.bonded_axes.
    units: tuple[tuple[str, ...], ...] | None = None
    _heads: frozenset[str] | None = None
    # Past four axes, where each axis may go (shardc.sharding.unit.placements); None: anywhere (exact).
    places: Placements | None = None
    _placed: dict[tuple[str, tuple[str, ...], bool], bool] = field(default_factory=dict)
    _seconds: dict[tuple[Op, float, tuple[str, ...], Routed | None], float] = field(default_factory=dict)
    values: list[Value] = field(default_factory=list)
    _sizes: dict[str, float] | None = None
    _compute: dict[tuple[object, ...], float] = field(default_factory=dict)
    # (expert index, slot index) -> (k, limit, groups) of each node-limited routing (shardc.spec.walk.node_limits)
    routings: dict[tuple[str, str], Routed] = field(default_factory=dict)
    # (name, indices, value) -> its TensorRef and that ref's text: every candidate plan remakes them
    refs: dict[tuple[str, tuple[str, ...], Value], TensorRef] = field(default_factory=dict)
    texts: dict[tuple[str, tuple[str, ...], Value], str] = field(default_factory=dict)
    # (an einsum problem up to names, the compute weight) -> its solutions: the candidate plans of one
    # context (and the plans sharing it: shardc.planner.planner.shared_search) solve the same problems again
    solutions: dict[tuple[object, ...], tuple[Any, list[Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.axis_sizes = {a.name: a.size for a in self.mesh.axes}
        self.links = resolve_links(self.mesh, self.axis_sizes, self.hardware, self.topology, self.spans)[0]

    def dim_size(self, index: str) -> int:
        return PROXY_DIM if self.sizes is None else self.sizes[index]

    def nbytes(self, tensor: str) -> int:
        """Bytes an element of ``tensor``: 4 for token ids (int32), else the dtype's."""
        return nbytes_of(tensor, self.element_bytes, self.dtype)

    def gathered_bytes(self, axes: tuple[str, ...], nbytes: int | None, gathered: int | None) -> int | None:
        """Bytes an element of an AllGather over ``axes`` moves, of a tensor of ``nbytes`` (None: the dtype's) and
        gather type ``gathered`` (:func:`shardc.spec.walk.gather_nbytes_of`)."""
        return gather_nbytes_of(axes, gathered, self.gather_axes, nbytes)

    def matmul_dtype(self, operands: Iterable[str]) -> str:
        """The element type an einsum (or a kernel's matmuls) of these operands runs in
        (:meth:`shardc.ir.precision.Precision.matmul`)."""
        return (self.precision or Precision(self.dtype)).matmul(operands)

    def einsum_dtype(self, result: str, operands: Sequence[str], contracts: bool) -> str:
        """An einsum's type, as cost prices it: a GEMM's (it ``contracts``) ``gemm`` type, else :meth:`matmul_dtype`."""
        kind = self.precision.gemm(result, operands) if contracts and self.precision is not None else None
        return kind.value if kind is not None else self.matmul_dtype(operands)

    def gemm_kind(self, result: str, operands: Sequence[str]) -> DType | None:
        """The type a GEMM making ``result`` quantizes its inputs to (:meth:`Precision.gemm`); None: no such line."""
        return self.precision.gemm(result, operands) if self.precision is not None and self.precision.gemms else None

    def dtype_of(self, tensor: str) -> DType:
        return (self.precision or Precision(self.dtype)).of(tensor)

    def local_elements(self, indices: tuple[str, ...], value: Value) -> float:
        """Elements of a device's piece of ``value`` (padded: each dim's ``ceil(size / devices)``)."""
        return float(piece(self._pieces(indices, value)))

    def quantize_seconds(self, nbytes: float) -> float:
        """Time of a GEMM's quantize passes moving ``nbytes`` through HBM, weighted as its compute
        (:meth:`einsum_seconds`); 0 without sizes."""
        if self.sizes is None or not self.compute_weight:
            return 0.0
        return self.hardware.memory_seconds(nbytes) * self.compute_weight * self.repeats

    def kind(self, tensor: str) -> tuple[bool, int, int | None, bool]:
        """What a tensor's moves' costs depend on beside its indices: weight, element bytes (its gathers' too),
        reduced once a step."""
        return (tensor in self.weights, self.nbytes(tensor), self.gathered.get(tensor),
                self.repeats > 1 and tensor in self.accumulated)

    def local_bytes(self, indices: tuple[str, ...], value: Value, nbytes: int | None = None) -> Monomial:
        """Per-device bytes of ``value`` as a formula: element bytes (``nbytes``, else the dtype's) * dims / axes."""
        size = self.dtype.nbytes if nbytes is None else nbytes
        key = (indices, value.layout, size)
        hit = self._bytes.get(key)
        if hit is None:
            den = tuple(a for axes in value.layout for a in axes)
            hit = self._bytes[key] = Monomial.of(size, num=indices, den=den)
        return hit

    def evaluate(self, volume: Monomial) -> float:
        if self._sizes is None:
            self._sizes = {a.name: float(a.size) for a in self.mesh.axes}
        for symbol, _ in volume.powers:
            if symbol not in self._sizes:
                self._sizes[symbol] = float(self.dim_size(symbol))
        return volume.value(self._sizes)

    def seconds(self, op: Op, volume: Monomial | float, axes: tuple[str, ...], routed: Routed | None = None) -> float:
        """Time of one collective moving ``volume`` (a formula, or bytes) on the plan's chip (``routed``: an
        AllToAll of a node-limited routing's slots)."""
        nbytes = volume if isinstance(volume, float | int) else self.evaluate(volume)
        key = (op, nbytes, axes, routed)
        hit = self._seconds.get(key)
        if hit is None:  # layouts of one size recur across searches
            hit = self._seconds[key] = collective_time(op, nbytes, axes, self.mesh, self.axis_sizes, self.hardware,
                                                       self.links, routed).seconds
        return hit

    def routed(self, op: Op, idx: tuple[str, ...] | None, dims: tuple[int | None, ...]) -> Routed | None:
        """The node-limited routing (k, limit, groups) whose slots an AllToAll of a tensor of indices ``idx``
        moves, splitting or concatenating ``dims``: one holding a routing's expert and slot indices, whose
        expert index is one of ``dims``; None for any other move."""
        if op is not Op.ALL_TO_ALL or not self.routings or idx is None:
            return None
        for (experts, slots), routing in self.routings.items():
            if experts in idx and slots in idx and idx.index(experts) in dims:
                return routing
        return None

    def ahead(self, tensor: str) -> bool:
        """Whether the program can issue ``tensor``'s collectives ahead of the op that reads them, to
        overlap compute: a weight's gathers and a gradient's reductions (``Step.ahead``); an activation's
        the next op waits for."""
        return tensor in self.weights

    def move_cost(self, move: Move, tensor: str, idx: tuple[str, ...] | None = None) -> Cost:
        if move.volume is None:
            return ZERO
        volume: Monomial | float = move.volume
        if idx is not None and self.padded and self.sizes is not None:
            own = self.nbytes(tensor)
            moved = self.gathered_bytes(move.axes, own, self.gathered.get(tensor)) if move.op is Op.ALL_GATHER else own
            volume = self.padded_bytes(move, idx, moved or own)
        seconds = self.seconds(move.op, volume, move.axes, self.routed(move.op, idx, (move.dim, move.dim2)))
        # as often as run a step: a gradient's reduction once, on the microbatches' sums (gradient_reductions)
        once = tensor in self.accumulated and move.op in (Op.ALL_REDUCE, Op.REDUCE_SCATTER)
        return (seconds * (1 if once else self.repeats), 1, 0 if tensor in self.weights else 1)

    def _pieces(self, idx: tuple[str, ...], value: Value) -> list[tuple[int, int]]:
        return [(self.dim_size(i), math.prod(self.axis_sizes[a] for a in axes))
                for i, axes in zip(idx, value.layout, strict=True)]

    def padded_bytes(self, move: Move, idx: tuple[str, ...], nbytes: int) -> float:
        """V of a move at the padded per-device sizes (each dim's piece ``ceil(size / devices)``)."""
        assert move.volume is not None
        src, dst = self._pieces(idx, move.src), self._pieces(idx, move.dst)
        if all(n % k == 0 for n, k in src + dst):
            return self.evaluate(move.volume)
        group = math.prod(self.axis_sizes[a] for a in move.axes)
        elements = volume_elements(move.op, Fraction(piece(src)), Fraction(piece(dst)), Fraction(group))
        return float(elements) * nbytes

    def einsum_seconds(self, operands: Iterable[tuple[tuple[str, ...], Value, int]],
                       result: tuple[tuple[str, ...], Value, int], dtype: str | None = None) -> float:
        """Time of a local einsum over these (indices, local value, element bytes) operands into ``result``
        on the chip's cores; 0 without sizes.  Priced as ``shardc cost`` prices the step, by the one
        :func:`shardc.steptime.einsum_time`: 2 * prod(local index sizes) FLOPs a device (padded pieces) at
        the rate the chip reaches on a matmul of that size in ``dtype`` (its operands': :meth:`matmul_dtype`;
        None: the spec's dtype), or its operands' and
        result's padded bytes over HBM where they take longer (:func:`shardc.steptime.einsum_bytes`); an
        elementwise product (no index contracted) by those bytes alone, before fusion, which it moves
        wherever the program puts it.
        """
        if self.sizes is None or not self.compute_weight:
            return 0.0
        key = (tuple(operands), result, dtype or self.dtype.value)
        hit = self._compute.get(key)
        if hit is None:
            hit = self._compute[key] = self._einsum_seconds(*key)
        return hit * self.compute_weight * self.repeats  # once a microbatch

    def _einsum_seconds(self, operands: tuple[tuple[tuple[str, ...], Value, int], ...],
                        result: tuple[tuple[str, ...], Value, int], dtype: str) -> float:
        occurrences = ((i, axes) for idx, value, _ in operands for i, axes in zip(idx, value.layout, strict=True))
        flops, _ = einsum_flops(occurrences, lambda name: self.axis_sizes.get(name) or self.dim_size(name))
        product = all(i in result[0] for idx, _, _ in operands for i in idx)
        nbytes = einsum_bytes((piece(self._pieces(idx, v)) * size for idx, v, size in operands),
                              piece(self._pieces(result[0], result[1])) * result[2])
        return einsum_time(float(flops), nbytes, product, self.hardware, dtype).seconds

    def edges(self, tensor: str, idx: tuple[str, ...], state: int) -> tuple[Edge, ...]:
        """The moves out of value number ``state`` with their costs, built once per context."""
        key = (self.kind(tensor), idx, state)
        hit = self._edges.get(key)
        if hit is None:
            hit = self._edges[key] = tuple(self._edge(m, tensor, idx)
                                           for m in neighbours(self, idx, self.values[state], self.nbytes(tensor),
                                                              self.gathered.get(tensor)))
            self.tick(len(hit))
        return hit

    def _edge(self, move: Move, tensor: str, idx: tuple[str, ...] | None = None) -> Edge:
        return Edge(move, self.move_cost(move, tensor, idx), self.number(move.dst))

    def unit_list(self) -> tuple[tuple[str, ...], ...]:
        if self.units is None:
            self.units = tuple((a,) for a in self.mesh.names)
        return self.units

    def heads(self) -> frozenset[str]:
        """The first axis of each unit: where a move may cut a dim's axes."""
        if self._heads is None:
            self._heads = frozenset(u[0] for u in self.unit_list())
        return self._heads

    def free_units(self, used: frozenset[str]) -> list[tuple[str, ...]]:
        return [u for u in self.unit_list() if u[0] not in used]

    def suffixes(self, axes: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
        """The minor suffixes of ``axes`` that are whole units, shortest first."""
        heads = self.heads()
        for k in range(1, len(axes) + 1):
            if axes[len(axes) - k] in heads:
                yield axes[len(axes) - k:]

    def tick(self, work: int = 1) -> None:
        """Count ``work``: one search state settled or configuration tried, or the moves built out of
        (or into) a state, each one; past the budget, give up with a clear error rather than search
        for minutes.  Moves count because on a mesh of many axes a state has thousands, each costed."""
        self.explored += work
        if self.budget is not None and self.explored > self.budget:
            raise SearchTooLong(len(self.mesh.axes), self.budget)

    def number(self, value: Value) -> int:
        """A small integer per value: search states hash and compare as ints."""
        n = self._numbers.get(value)
        if n is None:
            n = self._numbers[value] = len(self.values)
            self.values.append(value)
        return n

    def placed(self, index: str, axes: tuple[str, ...], order: bool = True) -> bool:
        """Whether :attr:`places` lets ``index`` be sharded over ``axes`` (these axes, in this order
        unless ``order`` is false)."""
        assert self.places is not None
        key = (index, axes, order)
        hit = self._placed.get(key)
        if hit is None:
            allowed, rank = self.places.get(index, (frozenset(), None))
            hit = set(axes) <= allowed
            if hit and rank is not None and order:
                ranks = [rank[a] for a in axes]
                hit = all(x < y for x, y in zip(ranks, ranks[1:], strict=False))
            self._placed[key] = hit
        return hit

    def divides(self, index: str, axes: tuple[str, ...], order: bool = True) -> bool:
        """Whether the search may shard ``index`` over ``axes``: evenly, or (padded) a dim the spec shards
        unevenly, if every device still gets part of it; past four axes, only where :attr:`places` allows
        (in any order of ``axes`` if ``order`` is false)."""
        if self.places is not None and not self.placed(index, axes, order):
            return False
        return self.fits(index, axes)

    def fits(self, index: str, axes: tuple[str, ...]) -> bool:
        """Whether ``index`` may be sharded over ``axes`` by size alone (see :meth:`divides`)."""
        if self.sizes is None:
            return True
        product = math.prod(self.axis_sizes[a] for a in axes)
        size = self.sizes[index]
        return size % product == 0 or (index in self.padded and size >= product)


def _replace(layout: Layout, dim: int, axes: tuple[str, ...]) -> Layout:
    return layout[:dim] + (axes,) + layout[dim + 1:]


def _gathers(ctx: CostContext, idx: tuple[str, ...], v: Value, nbytes: int | None,
             gathered: int | None = None) -> Iterator[Move]:
    for d, axes in enumerate(v.layout):
        for suffix in ctx.suffixes(axes):
            dst = Value(_replace(v.layout, d, axes[: len(axes) - len(suffix)]), v.unreduced)
            volume = ctx.local_bytes(idx, dst, ctx.gathered_bytes(suffix, nbytes, gathered))
            yield Move(Op.ALL_GATHER, v, dst, suffix, dim=d, volume=volume)


def _multi_gathers(ctx: CostContext, idx: tuple[str, ...], v: Value, nbytes: int | None,
                   gathered: int | None = None) -> Iterator[Move]:
    """Suffixes of two or more dims gathered by one collective (axes in dim order)."""
    options = [[()] + list(ctx.suffixes(axes)) for axes in v.layout]
    for combo in itertools.product(*options):
        if sum(1 for suffix in combo if suffix) < 2:
            continue
        layout = tuple(axes[: len(axes) - len(suffix)] for axes, suffix in zip(v.layout, combo, strict=True))
        dst = Value(layout, v.unreduced)
        axes = tuple(a for suffix in combo for a in suffix)
        volume = ctx.local_bytes(idx, dst, ctx.gathered_bytes(axes, nbytes, gathered))
        yield Move(Op.ALL_GATHER, v, dst, axes, volume=volume)


def _slices(ctx: CostContext, idx: tuple[str, ...], v: Value) -> Iterator[Move]:
    for unit in ctx.free_units(v.used()):
        for d, axes in enumerate(v.layout):
            if ctx.divides(idx[d], axes + unit):
                dst = Value(_replace(v.layout, d, axes + unit), v.unreduced)
                yield Move(Op.SLICE, v, dst, unit, dim=d)


def _all_to_alls(ctx: CostContext, idx: tuple[str, ...], v: Value, nbytes: int | None) -> Iterator[Move]:
    for src_dim, axes in enumerate(v.layout):
        for suffix in ctx.suffixes(axes):
            kept = axes[: len(axes) - len(suffix)]
            for d, other in enumerate(v.layout):
                if d == src_dim or not ctx.divides(idx[d], other + suffix):
                    continue
                layout = _replace(_replace(v.layout, src_dim, kept), d, other + suffix)
                group = Monomial.of(1, num=suffix)  # per-device bytes times the group size
                volume = ctx.local_bytes(idx, v, nbytes) * group
                yield Move(Op.ALL_TO_ALL, v, Value(layout, v.unreduced), suffix, d, src_dim, volume)


def _reductions(ctx: CostContext, idx: tuple[str, ...], v: Value, nbytes: int | None) -> Iterator[Move]:
    unreduced = v.unreduced
    heads = ctx.heads()
    units = {u[0]: u for u in ctx.unit_list()}
    parts = [units[a] for a in unreduced if a in heads]
    for k in range(1, len(parts) + 1):
        for chosen in itertools.combinations(parts, k):
            group = tuple(sorted(a for u in chosen for a in u))
            rest = tuple(a for a in unreduced if a not in group)
            volume = ctx.local_bytes(idx, v, nbytes)  # the array before the reduction
            yield Move(Op.ALL_REDUCE, v, Value(v.layout, rest), group, volume=volume)
            for perm in itertools.permutations(chosen):
                order = tuple(a for u in perm for a in u)
                for d, axes in enumerate(v.layout):
                    if ctx.divides(idx[d], axes + order):
                        dst = Value(_replace(v.layout, d, axes + order), rest)
                        yield Move(Op.REDUCE_SCATTER, v, dst, order, dim=d, volume=volume)


def neighbours(ctx: CostContext, idx: tuple[str, ...], v: Value, nbytes: int | None = None,
               gathered: int | None = None) -> Iterator[Move]:
    """The moves out of ``v``, their volumes at ``nbytes`` an element (else the dtype's), its AllGathers' at
    ``gathered`` where given and they run over the ZeRO axes alone (a param's gather type:
    :meth:`CostContext.gathered_bytes`)."""
    yield from _reductions(ctx, idx, v, nbytes)
    yield from _gathers(ctx, idx, v, nbytes, gathered)
    yield from _multi_gathers(ctx, idx, v, nbytes, gathered)
    yield from _slices(ctx, idx, v)
    yield from _all_to_alls(ctx, idx, v, nbytes)
    if ctx.places is not None:
        for gather in itertools.chain(_gathers(ctx, idx, v, nbytes, gathered),
                                      _multi_gathers(ctx, idx, v, nbytes, gathered)):
            yield from spanning(ctx, idx, gather)


def spanning(ctx: CostContext, idx: tuple[str, ...], gather: Move) -> Iterator[Move]:
    """``gather`` over more links: free units sliced onto its last dim first, then gathered with it.

    Past four axes the search keeps each axis where the spec puts it (:attr:`CostContext.places`),
    so it would not reach the state between; the pair is one move of the search.
    """
    src = gather.src
    d = gather.dim if gather.dim is not None else max(
        k for k, (a, b) in enumerate(zip(src.layout, gather.dst.layout, strict=True)) if a != b)
    free = ctx.free_units(src.used())
    extras = [list(c) for k in range(1, len(free) + 1) for c in itertools.combinations(free, k)] \
        if len(free) <= 2 else [[u] for u in free] + [free]
    for extra in extras:
        axes = tuple(a for u in extra for a in u)
        if not ctx.fits(idx[d], src.layout[d] + axes):
            continue
        steps, cur = [], src
        for unit in extra:
            nxt = Value(_replace(cur.layout, d, cur.layout[d] + unit), cur.unreduced)
            steps.append(Move(Op.SLICE, cur, nxt, unit, dim=d))
            cur = nxt
        last = Move(Op.ALL_GATHER, cur, gather.dst, gather.axes + axes, dim=gather.dim, volume=gather.volume)
        yield Move(Op.ALL_GATHER, src, gather.dst, last.axes, dim=gather.dim, volume=gather.volume,
                   via=(*steps, last))
