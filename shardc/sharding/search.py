"""The cheapest moves from a value's sources to a target: a resumable Dijkstra.

:func:`reshard` searches forward from any of several free sources (values the phase
already holds) to one target; :func:`least_costs` from sources that have each cost
something so far.  The states are the values of :mod:`shardc.sharding.layout`, the
edges its moves with their costs (:meth:`CostContext.edges`); costs are tuples
compared lexicographically (seconds, collectives, activation collectives).
:mod:`shardc.sharding.reverse` searches the other way, from one target back to many sources.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable

from shardc.sharding.layout import INFINITE, ZERO, Cost, CostContext, Move, Value, add_cost, expand

__all__ = ["reshard", "least_costs"]


def reshard(ctx: CostContext, tensor: str, idx: tuple[str, ...], sources: Iterable[Value],
            target: Value, bound: Cost | None = None) -> tuple[Cost, tuple[Move, ...]]:
    """Cheapest moves from any source (free) to ``target``.

    One search per (:meth:`CostContext.kind`, indices, sources) lives in the context and is
    resumed by each query, so asking for many targets from the same sources costs
    one Dijkstra in all.  With ``bound``, a query that finds nothing at or below it
    returns :data:`INFINITE` (the search stops there, to resume if asked for more),
    so the einsum search prunes configurations without exploring every layout.
    """
    starts = tuple(sorted(set(sources)))
    key = (ctx.kind(tensor), idx, starts)
    search = ctx._searches.get(key)
    if not isinstance(search, _Search):
        search = ctx._searches[key] = _Search(ctx, tensor, idx, starts)
    found = search.find(ctx.number(target), bound)
    if found is None:
        if bound is None:
            raise ValueError(f"no moves reach {target} for {tensor}")  # a planner bug, not a user error
        return INFINITE, ()
    return found


def least_costs(ctx: CostContext, tensor: str, idx: tuple[str, ...], spent: dict[Value, Cost],
                targets: Iterable[Value]) -> dict[Value, Cost]:
    """For each target, the least of ``spent[source]`` plus the reshard from that source.

    One Dijkstra from all sources at once, each starting at what it has cost so far,
    instead of one search per source.
    """
    search = _Search(ctx, tensor, idx, tuple(spent), tuple(spent.values()))
    out = {}
    for target in targets:
        found = search.find(ctx.number(target), None)
        if found is not None:
            out[target] = found[0]
    return out


class _Search:
    """Dijkstra from a set of sources, resumable: settled values are kept for later queries.

    A state is a value number.  Any move may follow any other: slicing a replicated
    axis before a gather or an all-to-all over it as well is a real saving under the
    book's model (the collective then spans more axes' links, or moves fewer bytes).
    """

    def __init__(self, ctx: CostContext, tensor: str, idx: tuple[str, ...], starts: tuple[Value, ...],
                 spent: tuple[Cost, ...] | None = None) -> None:
        self.ctx, self.tensor, self.idx = ctx, tensor, idx
        self.best: dict[int, Cost] = {}
        for value, cost in zip(starts, spent or (ZERO,) * len(starts), strict=True):
            state = ctx.number(value)
            self.best[state] = min(cost, self.best.get(state, INFINITE))
        self.back: dict[int, tuple[Move, int]] = {}
        self.tie = itertools.count()  # first pushed first among equal costs: deterministic plans
        self.heap: list[tuple[Cost, int, int]] = [(c, next(self.tie), s) for s, c in self.best.items()]
        heapq.heapify(self.heap)
        self.settled: dict[int, Cost] = {}

    def find(self, goal: int, bound: Cost | None) -> tuple[Cost, tuple[Move, ...]] | None:
        """The cheapest path to value ``goal``, or None if it costs more than ``bound`` (or is unreachable)."""
        while goal not in self.settled:
            if not self.heap or (bound is not None and self.heap[0][0] > bound):
                return None  # every remaining path is dearer still
            self._step()
        cost = self.settled[goal]
        if bound is not None and cost > bound:
            return None
        return cost, _path(self.back, goal)

    def _step(self) -> None:
        cost, _, state = heapq.heappop(self.heap)
        if state in self.settled:
            return  # a stale entry: the state was settled cheaper
        self.settled[state] = cost
        self.ctx.tick()
        for edge in self.ctx.edges(self.tensor, self.idx, state):
            new = add_cost(cost, edge.cost)
            if edge.dst not in self.settled and new < self.best.get(edge.dst, INFINITE):
                self.best[edge.dst] = new
                self.back[edge.dst] = (edge.move, state)
                heapq.heappush(self.heap, (new, next(self.tie), edge.dst))


def _path(back: dict[int, tuple[Move, int]], end: int) -> tuple[Move, ...]:
    moves: list[Move] = []
    state = end
    while state in back:
        move, state = back[state]
        moves.append(move)
    return expand(reversed(moves))

