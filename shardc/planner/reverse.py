"""Costs *to* a set of targets from many sources: one Dijkstra over reversed moves.

:func:`shardc.planner.layout.reshard` searches forward from its sources, one search
per source set.  A chain's last step needs the opposite: from each of hundreds of
candidate layouts to one declared result.  Reversing the moves answers all of
them with one search from the targets.

The forward rule "a sliced axis is never gathered or moved again" reads, on a
path walked backwards: a slice may be prepended only if no later move gathers
or moves its axes.  A reverse state is therefore (value, axes gathered or moved
further on), and the cheapest cost found for a value over all such states is
its cost from that value as a fresh source.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable

from shardc.planner.layout import INFINITE, Cost, CostContext, Edge, Value, add_cost

__all__ = ["costs_to"]


def costs_to(ctx: CostContext, tensor: str, idx: tuple[str, ...], sources: Iterable[Value],
             targets: dict[Value, Cost]) -> dict[Value, Cost]:
    """For each source, the least over targets of (moves from the source to it) + its given cost."""
    numbers = [ctx.number(s) for s in sources]
    back = _reversed_edges(ctx, tensor, idx, numbers)
    shift = len(ctx.mesh.names)
    best: dict[int, Cost] = {}
    for target, spent in targets.items():
        state = ctx.number(target) << shift
        best[state] = min(spent, best.get(state, INFINITE))
    tie = itertools.count()
    heap = [(c, next(tie), s) for s, c in best.items()]
    heapq.heapify(heap)
    settled: dict[int, Cost] = {}
    wanted = set(numbers)
    while heap and not wanted <= settled.keys():
        cost, _, state = heapq.heappop(heap)
        if cost > best[state]:
            continue
        value, later = state >> shift, state & ((1 << shift) - 1)
        settled.setdefault(value, cost)
        for before, edge in back.get(value, ()):
            if edge.sliced & later:
                continue  # slicing an axis that a later move gathers or moves: not a valid path
            prev = (before << shift) | later | edge.blocked
            new = add_cost(edge.cost, cost)
            if new < best.get(prev, INFINITE):
                best[prev] = new
                heapq.heappush(heap, (new, next(tie), prev))
    return {ctx.values[n]: settled[n] for n in numbers if n in settled}


def _reversed_edges(ctx: CostContext, tensor: str, idx: tuple[str, ...],
                    starts: list[int]) -> dict[int, list[tuple[int, Edge]]]:
    """Every move among the values reachable from ``starts``, keyed by the value it reaches."""
    back: dict[int, list[tuple[int, Edge]]] = {}
    seen = set(starts)
    todo = list(starts)
    while todo:
        value = todo.pop()
        for edge in ctx.edges(tensor, idx, value):
            back.setdefault(edge.dst, []).append((value, edge))
            if edge.dst not in seen:
                seen.add(edge.dst)
                todo.append(edge.dst)
    return back
