"""Costs *to* a target from many sources: one Dijkstra over reversed moves.

:func:`shardc.sharding.search.reshard` searches forward from its sources, one search
per source set.  An einsum's result needs the opposite: from each of hundreds of
local results (one per configuration) to one declared value, and a chain's last
step the same from each candidate layout.  Walking the moves backwards from the
target answers all of them with one search, resumed by each query.

The moves into a value are the moves out of it read backwards (:func:`predecessors`):
each is the same :class:`~shardc.sharding.layout.Move` the forward search makes, so it
costs the same.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator

from shardc.ir.plan import Monomial, Op
from shardc.sharding.layout import INFINITE, ZERO, Cost, CostContext, Move, Value, add_cost, expand, spanning

__all__ = ["costs_to", "reshard_to", "predecessors"]


def costs_to(ctx: CostContext, tensor: str, idx: tuple[str, ...], sources: Iterable[Value],
             targets: dict[Value, Cost]) -> dict[Value, Cost]:
    """For each source, the least over targets of (moves from the source to it) + its given cost."""
    search = _Reverse(ctx, tensor, idx, targets)
    out = {}
    for source in sources:
        found = search.find(ctx.number(source), None)
        if found is not None:
            out[source] = found[0]
    return out


def reshard_to(ctx: CostContext, tensor: str, idx: tuple[str, ...], source: Value, target: Value,
               bound: Cost | None = None, partial: frozenset[str] | None = None
               ) -> tuple[Cost, tuple[Move, ...]] | None:
    """Cheapest moves from ``source`` to ``target``, or None above ``bound`` (or unreachable).

    One reverse search per (:meth:`CostContext.kind`, indices, target, ``partial``) lives in the context
    and is resumed by each query: every configuration of an einsum asks it for its local result.
    ``partial``: axes every source's partial sums lie within.  Moves never make partial sums,
    so no path from such a source passes a value with others, and the search never walks
    back to one: the same costs and moves, from fewer values.
    """
    key = (ctx.kind(tensor), idx, target, partial)
    search = ctx._reverse.get(key)
    if not isinstance(search, _Reverse):
        search = ctx._reverse[key] = _Reverse(ctx, tensor, idx, {target: ZERO}, partial)
    return search.find(ctx.number(source), bound)


class _Reverse:
    """Dijkstra from the targets over reversed moves; a settled value's cost is its cost to them."""

    def __init__(self, ctx: CostContext, tensor: str, idx: tuple[str, ...], targets: dict[Value, Cost],
                 partial: frozenset[str] | None = None) -> None:
        self.ctx, self.tensor, self.idx, self.partial = ctx, tensor, idx, partial
        self.best: dict[int, Cost] = {}
        for target, spent in targets.items():
            state = ctx.number(target)
            self.best[state] = min(spent, self.best.get(state, INFINITE))
        self.next: dict[int, tuple[Move, int]] = {}
        self.tie = itertools.count()
        self.heap = [(c, next(self.tie), s) for s, c in self.best.items()]
        heapq.heapify(self.heap)
        self.settled: dict[int, Cost] = {}

    def find(self, source: int, bound: Cost | None) -> tuple[Cost, tuple[Move, ...]] | None:
        while source not in self.settled:
            if not self.heap or (bound is not None and self.heap[0][0] > bound):
                return None
            self._step()
        cost = self.settled[source]
        if bound is not None and cost > bound:
            return None
        moves = []
        state = source
        while state in self.next:
            move, state = self.next[state]
            moves.append(move)
        return cost, expand(moves)

    def _step(self) -> None:
        cost, _, state = heapq.heappop(self.heap)
        if state in self.settled:
            return
        self.settled[state] = cost
        self.ctx.tick()
        for move, before, price in self._into(state):
            if before in self.settled:
                continue
            new = add_cost(price, cost)
            if new < self.best.get(before, INFINITE):
                self.best[before] = new
                self.next[before] = (move, state)
                heapq.heappush(self.heap, (new, next(self.tie), before))

    def _into(self, state: int) -> tuple[tuple[Move, int, Cost], ...]:
        ctx = self.ctx
        key = (ctx.kind(self.tensor), self.idx, state, self.partial)
        hit = ctx._into.get(key)
        if hit is None:
            moves = predecessors(ctx, self.idx, ctx.values[state], self.partial, ctx.nbytes(self.tensor),
                                 ctx.gathered.get(self.tensor))
            hit = ctx._into[key] = tuple((m, ctx.number(m.src), ctx.move_cost(m, self.tensor, self.idx))
                                         for m in moves)
            ctx.tick(len(hit))
        return hit


def _replace(layout: tuple[tuple[str, ...], ...], dim: int, axes: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    return layout[:dim] + (axes,) + layout[dim + 1:]


def predecessors(ctx: CostContext, idx: tuple[str, ...], v: Value,
                 partial: frozenset[str] | None = None, nbytes: int | None = None,
                 gathered: int | None = None) -> Iterator[Move]:
    """Every move that makes ``v``: the forward moves (:func:`shardc.sharding.layout.neighbours`) backwards,
    at ``nbytes`` an element (else the dtype's), AllGathers at ``gathered`` where given; with ``partial``, only
    those from values whose partial sums lie within it."""
    lay = v.layout
    free = ctx.free_units(v.used())
    reducible = free if partial is None else [u for u in free if partial.issuperset(u)]
    for d, axes in enumerate(lay):
        last = next(iter(ctx.suffixes(axes)), None)
        if last is not None:  # a slice appended the dim's last unit
            yield Move(Op.SLICE, Value(_replace(lay, d, axes[: len(axes) - len(last)]), v.unreduced), v, last, dim=d)
    for gather in _gathered_into(ctx, idx, v, free, nbytes, gathered):
        yield gather
        if ctx.places is not None:
            yield from spanning(ctx, idx, gather)
    for e, axes in enumerate(lay):
        for moved in ctx.suffixes(axes):
            kept = axes[: len(axes) - len(moved)]
            for d, other in enumerate(lay):  # an all-to-all moved the suffix from dim d onto dim e
                if d != e and ctx.divides(idx[d], other + moved):
                    src = Value(_replace(_replace(lay, e, kept), d, other + moved), v.unreduced)
                    volume = ctx.local_bytes(idx, src, nbytes) * Monomial.of(1, num=moved)
                    yield Move(Op.ALL_TO_ALL, src, v, moved, e, d, volume)
            if partial is not None and not partial.issuperset(moved):
                continue
            # a reduce-scatter resolved these partial sums onto the dim
            src = Value(_replace(lay, e, kept), tuple(sorted(v.unreduced + moved)))
            yield Move(Op.REDUCE_SCATTER, src, v, moved, dim=e, volume=ctx.local_bytes(idx, src, nbytes))
    for k in range(1, len(reducible) + 1):
        for chosen in itertools.combinations(reducible, k):
            group = tuple(sorted(a for u in chosen for a in u))
            src = Value(lay, tuple(sorted(v.unreduced + group)))
            yield Move(Op.ALL_REDUCE, src, v, group, volume=ctx.local_bytes(idx, src, nbytes))


def _gathered_into(ctx: CostContext, idx: tuple[str, ...], v: Value, free: list[tuple[str, ...]],
                   nbytes: int | None, gathered: int | None = None) -> Iterator[Move]:
    """Gathers that make ``v``: one or more dims held free units more, at their minor ends (at ``gathered``
    bytes an element over the ZeRO axes, :meth:`CostContext.gathered_bytes`)."""
    lay = v.layout
    # a unit can only go to a dim that may hold it beside the dim's axes (in some order): the
    # rest of the product below would fail the full test anyway
    options = [[-1, *(d for d in range(len(lay)) if ctx.divides(idx[d], tuple(sorted(lay[d] + unit)), order=False))]
               for unit in free]
    for owners in itertools.product(*options):
        groups: dict[int, list[tuple[str, ...]]] = {}
        for unit, d in zip(free, owners, strict=True):
            if d >= 0:
                groups.setdefault(d, []).append(unit)
        if not groups:
            continue
        dims = sorted(groups)
        for perms in itertools.product(*(itertools.permutations(groups[d]) for d in dims)):
            extra = {d: tuple(a for u in perm for a in u) for d, perm in zip(dims, perms, strict=True)}
            if not all(ctx.divides(idx[d], lay[d] + extra[d]) for d in dims):
                continue
            src = Value(tuple(axes + extra.get(d, ()) for d, axes in enumerate(lay)), v.unreduced)
            axes = tuple(a for d in dims for a in extra[d])
            volume = ctx.local_bytes(idx, v, ctx.gathered_bytes(axes, nbytes, gathered))
            if len(dims) == 1:
                yield Move(Op.ALL_GATHER, src, v, axes, dim=dims[0], volume=volume)
            else:
                yield Move(Op.ALL_GATHER, src, v, axes, volume=volume)
