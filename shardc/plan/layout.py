"""Sharded values of one tensor, the moves between them, and the cheapest path.

A value's *layout* gives, for each tensor dim, the mesh axes that shard it
(major to minor), and its *unreduced* axes (partial sums).  The moves of design
section 2 act on one value at a time; each is valid only at the minor end of
a dim, because that is where a tiled collective adds or removes a factor:

    all_gather      remove a suffix of a dim's axes             (one collective)
    slice           append a replicated axis to a dim            (free)
    all_to_all      move a suffix of one dim to another's end    (one collective)
    reduce_scatter  resolve unreduced axes onto a dim's end      (one collective)
    all_reduce      resolve unreduced axes, replicated           (one collective)

:func:`reshard` runs Dijkstra over values from any of several free sources
(values the phase already holds) to one target.  Costs are tuples compared
lexicographically: (communication time, collectives, activation collectives),
so ties go to fewer collectives, then to moving weights rather than activations.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from shardc.plan.ir import Monomial, Op
from shardc.spec.ir import Dim, DType, Mesh, Network, TensorRef

__all__ = ["Layout", "Value", "Move", "Cost", "CostContext", "reshard", "ZERO", "add_cost"]

Layout = tuple[tuple[str, ...], ...]

# Planning bandwidths (bytes/s, bidirectional) of the default hardware, TPU v5p:
# only their ratio matters for choices, and only when a mesh axis crosses DCN.
W_ICI = 1.8e11
W_DCN = 6.25e9
# Without dims, every dim is taken to be this large (and the seeds' rules decide).
PROXY_DIM = 1 << 20

Cost = tuple[float, int, int]
ZERO: Cost = (0.0, 0, 0)


def add_cost(a: Cost, b: Cost) -> Cost:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2])


@dataclass(frozen=True, order=True)
class Value:
    """A layout and unreduced axes (sorted): a planner state for one tensor."""

    layout: Layout
    unreduced: tuple[str, ...] = ()

    def used(self) -> frozenset[str]:
        return frozenset(a for axes in self.layout for a in axes) | frozenset(self.unreduced)

    def ref(self, name: str, indices: tuple[str, ...]) -> TensorRef:
        dims = tuple(Dim(i, axes) for i, axes in zip(indices, self.layout, strict=True))
        return TensorRef(name, dims, self.unreduced)

    @staticmethod
    def of(ref: TensorRef) -> Value:
        return Value(ref.layout, tuple(sorted(ref.unreduced)))


@dataclass(frozen=True)
class Move:
    """One edge of the search: ``op`` over ``axes`` taking ``src`` to ``dst``."""

    op: Op
    src: Value
    dst: Value
    axes: tuple[str, ...]
    dim: int | None = None
    dim2: int | None = None
    volume: Monomial | None = None


@dataclass
class CostContext:
    """What costs depend on: mesh, dtype, sizes (or proxies) and which tensors are weights."""

    mesh: Mesh
    dtype: DType
    sizes: dict[str, int] | None  # dims; None: use PROXY_DIM for every dim
    weights: frozenset[str] = frozenset()
    # (True, found) for a finished search; (None, (bound, ())) when nothing was found up to bound
    _cache: dict[tuple[object, ...], tuple[bool | None, tuple[Cost, tuple[Move, ...]]]] = field(
        default_factory=dict)
    _bytes: dict[tuple[object, ...], Monomial] = field(default_factory=dict)
    _sizes: dict[str, float] | None = None

    def dim_size(self, index: str) -> int:
        return PROXY_DIM if self.sizes is None else self.sizes[index]

    def local_bytes(self, indices: tuple[str, ...], value: Value) -> Monomial:
        """Per-device bytes of ``value`` as a formula: dtype * dims / axes."""
        key = (indices, value.layout)
        hit = self._bytes.get(key)
        if hit is None:
            den = tuple(a for axes in value.layout for a in axes)
            hit = self._bytes[key] = Monomial.of(self.dtype.nbytes, num=indices, den=den)
        return hit

    def evaluate(self, volume: Monomial) -> float:
        if self._sizes is None:
            self._sizes = {a.name: float(a.size) for a in self.mesh.axes}
        for symbol, _ in volume.powers:
            if symbol not in self._sizes:
                self._sizes[symbol] = float(self.dim_size(symbol))
        return volume.value(self._sizes)

    def bandwidth(self, axes: tuple[str, ...]) -> float:
        """n_axes times the slowest axis's bandwidth (design section 3)."""
        slow = any(self.mesh.axis(a).network is Network.DCN for a in axes)
        return (W_DCN if slow else W_ICI) * len(axes)

    def seconds(self, op: Op, volume: Monomial, axes: tuple[str, ...]) -> float:
        """Bandwidth time of one collective (design section 3), on the planning hardware."""
        factor = {Op.ALL_REDUCE: 2.0, Op.ALL_TO_ALL: 0.25}.get(op, 1.0)
        return factor * self.evaluate(volume) / self.bandwidth(axes)

    def move_cost(self, move: Move, tensor: str) -> Cost:
        if move.volume is None:
            return ZERO
        seconds = self.seconds(move.op, move.volume, move.axes)
        return (seconds, 1, 0 if tensor in self.weights else 1)

    def divides(self, index: str, axes: tuple[str, ...]) -> bool:
        if self.sizes is None:
            return True
        product = 1
        for a in axes:
            product *= self.mesh.size(a)
        return self.sizes[index] % product == 0


def _suffixes(axes: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    for k in range(1, len(axes) + 1):
        yield axes[len(axes) - k:]


def _replace(layout: Layout, dim: int, axes: tuple[str, ...]) -> Layout:
    return layout[:dim] + (axes,) + layout[dim + 1:]


def _gathers(ctx: CostContext, idx: tuple[str, ...], v: Value) -> Iterator[Move]:
    for d, axes in enumerate(v.layout):
        for suffix in _suffixes(axes):
            dst = Value(_replace(v.layout, d, axes[: len(axes) - len(suffix)]), v.unreduced)
            yield Move(Op.ALL_GATHER, v, dst, suffix, dim=d, volume=ctx.local_bytes(idx, dst))


def _slices(ctx: CostContext, idx: tuple[str, ...], v: Value) -> Iterator[Move]:
    free = [a for a in ctx.mesh.names if a not in v.used()]
    for a in free:
        for d, axes in enumerate(v.layout):
            if ctx.divides(idx[d], axes + (a,)):
                dst = Value(_replace(v.layout, d, axes + (a,)), v.unreduced)
                yield Move(Op.SLICE, v, dst, (a,), dim=d)


def _all_to_alls(ctx: CostContext, idx: tuple[str, ...], v: Value) -> Iterator[Move]:
    for src_dim, axes in enumerate(v.layout):
        for suffix in _suffixes(axes):
            kept = axes[: len(axes) - len(suffix)]
            for d, other in enumerate(v.layout):
                if d == src_dim or not ctx.divides(idx[d], other + suffix):
                    continue
                layout = _replace(_replace(v.layout, src_dim, kept), d, other + suffix)
                group = Monomial.of(1, num=suffix)  # per-device bytes times the group size
                volume = ctx.local_bytes(idx, v) * group
                yield Move(Op.ALL_TO_ALL, v, Value(layout, v.unreduced), suffix, d, src_dim, volume)


def _reductions(ctx: CostContext, idx: tuple[str, ...], v: Value) -> Iterator[Move]:
    unreduced = v.unreduced
    for k in range(1, len(unreduced) + 1):
        for group in itertools.combinations(unreduced, k):
            rest = tuple(a for a in unreduced if a not in group)
            volume = ctx.local_bytes(idx, v)  # the array before the reduction
            yield Move(Op.ALL_REDUCE, v, Value(v.layout, rest), group, volume=volume)
            for order in itertools.permutations(group):
                for d, axes in enumerate(v.layout):
                    if ctx.divides(idx[d], axes + order):
                        dst = Value(_replace(v.layout, d, axes + order), rest)
                        yield Move(Op.REDUCE_SCATTER, v, dst, order, dim=d, volume=volume)


def neighbours(ctx: CostContext, idx: tuple[str, ...], v: Value) -> Iterator[Move]:
    yield from _reductions(ctx, idx, v)
    yield from _gathers(ctx, idx, v)
    yield from _slices(ctx, idx, v)
    yield from _all_to_alls(ctx, idx, v)


INFINITE: Cost = (float("inf"), 0, 0)


def reshard(ctx: CostContext, tensor: str, idx: tuple[str, ...], sources: Iterable[Value],
            target: Value, bound: Cost | None = None) -> tuple[Cost, tuple[Move, ...]]:
    """Cheapest moves from any source (free) to ``target``; cached per context.

    With ``bound``, a search that finds nothing at or below it gives up and returns
    :data:`INFINITE`; the cache then remembers that bound as a lower bound, so the
    einsum search can prune configurations without exploring every layout.
    """
    starts = tuple(sorted(set(sources)))
    key = (tensor in ctx.weights, idx, starts, target)
    hit = ctx._cache.get(key)
    if hit is not None and hit[0] is not None:
        return hit[1]
    if hit is not None and bound is not None and bound <= hit[1][0]:
        return INFINITE, ()  # an earlier search found nothing up to a larger bound
    found = _dijkstra(ctx, tensor, idx, starts, target, bound)
    if found is None:
        assert bound is not None
        ctx._cache[key] = (None, (bound, ()))
        return INFINITE, ()
    ctx._cache[key] = (True, found)
    return found


def _dijkstra(ctx: CostContext, tensor: str, idx: tuple[str, ...], starts: tuple[Value, ...],
              target: Value, bound: Cost | None = None) -> tuple[Cost, tuple[Move, ...]] | None:
    """States are (value, axes sliced on the way): a sliced axis is never gathered or moved again.

    Under the bandwidth model a collective over more axes is faster, so without
    this the cheapest path would slice a replicated axis only to gather over it
    as well; that moves the same bytes over more links, not fewer bytes.
    Returns None when every path costs more than ``bound``.
    """
    State = tuple[Value, frozenset[str]]
    best: dict[State, Cost] = {(s, frozenset()): ZERO for s in starts}
    back: dict[State, tuple[Move, State]] = {}
    tie = itertools.count()  # keeps heap entries comparable without comparing Values
    heap: list[tuple[Cost, int, State]] = [(ZERO, next(tie), (s, frozenset())) for s in starts]
    heapq.heapify(heap)
    while heap:
        cost, _, state = heapq.heappop(heap)
        if bound is not None and cost > bound:
            return None  # every remaining path is dearer still
        if cost > best.get(state, cost):
            continue
        v, sliced = state
        if v == target:
            return cost, _path(back, state)
        for move in neighbours(ctx, idx, v):
            if move.op in (Op.ALL_GATHER, Op.ALL_TO_ALL) and sliced & set(move.axes):
                continue
            nxt = (move.dst, sliced | frozenset(move.axes) if move.op is Op.SLICE else sliced)
            new = add_cost(cost, ctx.move_cost(move, tensor))
            if new < best.get(nxt, INFINITE):
                best[nxt] = new
                back[nxt] = (move, state)
                heapq.heappush(heap, (new, next(tie), nxt))
    if bound is not None:
        return None
    raise ValueError(f"no moves reach {target} for {tensor}")  # a planner bug, not a user error


def _path(back: dict[tuple[Value, frozenset[str]], tuple[Move, tuple[Value, frozenset[str]]]],
          end: tuple[Value, frozenset[str]]) -> tuple[Move, ...]:
    moves: list[Move] = []
    state = end
    while state in back:
        move, state = back[state]
        moves.append(move)
    return tuple(reversed(moves))
