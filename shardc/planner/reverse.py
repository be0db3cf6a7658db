"""Costs *to* a set of targets from many sources: one Dijkstra over reversed moves.

:func:`shardc.planner.layout.reshard` searches forward from its sources, one search
per source set.  A chain's last step needs the opposite: from each of hundreds of
candidate layouts to one declared result.  Reversing the moves answers all of
them with one search from the targets.

A reverse state is a value; its settled cost is the cost from that value, as a
fresh source, to the cheapest target.
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
    best: dict[int, Cost] = {}
    for target, spent in targets.items():
        state = ctx.number(target)
        best[state] = min(spent, best.get(state, INFINITE))
    tie = itertools.count()
    heap = [(c, next(tie), s) for s, c in best.items()]
    heapq.heapify(heap)
    settled: dict[int, Cost] = {}
    wanted = set(numbers)
    while heap and not wanted <= settled.keys():
        cost, _, state = heapq.heappop(heap)
        if state in settled:
            continue
        settled[state] = cost
        for before, edge in back.get(state, ()):
            new = add_cost(edge.cost, cost)
            if before not in settled and new < best.get(before, INFINITE):
                best[before] = new
                heapq.heappush(heap, (new, next(tie), before))
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
