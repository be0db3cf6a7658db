"""zbv's greedy order (:mod:`shardc.pipeline.schedules`), and what each op reads and who reads it.

Qi et al. 2024: a device runs a ready B first, else an F while it holds fewer than p stage-microbatches
of activations, else a W; among all devices the op that can start first is committed.
"""

from __future__ import annotations

from shardc.errors import ShardcError

__all__ = ["op_inputs", "greedy_order", "Run"]

Run = tuple[float, float, int, str, int, int]  # an op run: start, end, device, kind, microbatch, chunk


def op_inputs(kind: str, j: int, c: int, first: int, last: int) -> tuple[tuple[str, int, int], ...]:
    """The ops whose outputs (kind, j, c) reads, microbatch j running through chunks ``first`` to ``last``."""
    if kind == "F":
        return (("F", j, c - 1),) if c > first else ()
    if kind == "B":
        return (("F", j, c), ("B", j, c + 1)) if c < last else (("F", j, c),)
    return (("B", j, c),)


def _dependents(kind: str, j: int, c: int, last: int, zb: bool) -> list[tuple[str, int, int]]:
    """The ops that read what (kind, j, c) makes (the inverse of :func:`op_inputs`)."""
    if kind == "F":
        return ([("F", j, c + 1)] if c < last else []) + [("B", j, c)]
    if kind == "B":
        return ([("B", j, c - 1)] if c else []) + ([("W", j, c)] if zb else [])
    return []


def greedy_order(schedule: str, p: int, m: int, durations: list[dict[str, float]], devices: list[int],
                 comm: float = 0.0, zb: bool = True) -> list[Run]:
    """zbv's greedy order: each step commits, among all devices, the op that can start first (``devices``:
    each model chunk's device)."""
    n_chunks = len(durations)
    kinds = ("F", "B", "W") if zb else ("F", "B")
    todo = [(k, j, c) for k in kinds for j in range(m) for c in range(n_chunks)]
    home = {key: devices[key[2]] for key in todo}
    ends: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    inflight = [0] * p
    # Activations a device may hold (forward started, weight gradient not done: W reads them too)
    # before it must run a B or a W instead of an F: p stage-microbatches, 1F1B's peak, as in the
    # paper.  zb-h1 has a fixed order; this limit is zbv's, in chunks of half a stage.
    limit = 2 * p  # chunks
    # Ops whose inputs are all made, per device (the greedy order picks among them).
    # The first chunk's forwards need nothing and are ready at once; of those, the lowest
    # microbatch is always the one chosen, so only it is pending (the next joins as it runs).
    pending: list[set[tuple[str, int, int]]] = [set() for _ in range(p)]
    # when each pending op's inputs are all on its device (its start, but for the device being free)
    arrival: dict[tuple[str, int, int], float] = {("F", 0, 0): 0.0}
    pending[home[("F", 0, 0)]].add(("F", 0, 0))
    result: list[Run] = []
    # A device's choice depends on its own state only (its pending ops' inputs are all made),
    # so it is kept until that state changes: the device that ran, and those that got an op.
    choices = [_choose(d, pending, arrival, comm, free, inflight, limit) for d in range(p)]
    while len(result) < len(todo):
        best = min((c for c in choices if c is not None), key=lambda c: c[:3], default=None)
        if best is None:  # every device waits on memory (sends delayed a B): one F goes over the limit
            best = _next(p, pending, arrival, comm, free, inflight)
        if best is None:
            raise ShardcError(f"schedule {schedule} deadlocked (a bug in its order)")
        start, _, d, key = best
        end = start + durations[key[2]][key[0]]
        ends[key], free[d] = end, end
        pending[d].discard(key)
        changed = {d}
        if key[0] == "F" and key[2] == 0 and key[1] + 1 < m:
            pending[d].add(("F", key[1] + 1, 0))
            arrival["F", key[1] + 1, 0] = 0.0
        for after in _dependents(*key, n_chunks - 1, zb):
            deps = op_inputs(*after, 0, n_chunks - 1)
            if all(dep in ends for dep in deps):
                e = home[after]
                arrival[after] = max(ends[dep] + comm if home[dep] != e else ends[dep] for dep in deps)
                pending[e].add(after)
                changed.add(e)
        inflight[d] += {"F": 1, "B": 0, "W": -1}[key[0]]
        for e in changed:
            choices[e] = _choose(e, pending, arrival, comm, free, inflight, limit)
        result.append((start, end, d, *key))
    return result


def _next(p: int, pending: list[set[tuple[str, int, int]]], arrival: dict[tuple[str, int, int], float],
          comm: float, free: list[float], inflight: list[int]) -> tuple[float, int, int, tuple[str, int, int]] | None:
    """The op that can start first on any device, over the memory limit (ties: the lowest device)."""
    best: tuple[float, int, int, tuple[str, int, int]] | None = None
    for d in range(p):
        choice = _choose(d, pending, arrival, comm, free, inflight, None)
        if choice is not None and (best is None or choice[:3] < best[:3]):
            best = choice
    return best


def _choose(d: int, pending: list[set[tuple[str, int, int]]], arrival: dict[tuple[str, int, int], float],
            comm: float, free: list[float], inflight: list[int],
            limit: int | None) -> tuple[float, int, int, tuple[str, int, int]] | None:
    """The op device ``d`` would run next and when: (start, priority, d, op), or None if none is ready.
    A pending op can start once the device is free and its inputs are there (``arrival``)."""
    times = {key: max(free[d], arrival[key]) for key in pending[d]}
    if not times:
        return None
    start = min(times.values())
    now = [key for key, t in times.items() if t <= start + comm]  # worth idling one send for a higher priority
    allowed = [k for k in now if k[0] != "F" or limit is None or inflight[d] < limit]
    if not allowed:  # only forwards are ready and memory is full: wait for anything else
        later = {key: t for key, t in times.items() if key[0] != "F"}
        if not later:
            return None
        start = min(later.values())
        allowed = [key for key, t in later.items() if t <= start]
    key = min(allowed, key=_priority)
    return (max(start, times[key]), 0, d, key)


def _priority(key: tuple[str, int, int]) -> tuple[int, int, int]:
    """Zero-bubble priorities: B unblocks the previous stage (the oldest microbatch, then the latest chunk);
    F, only under the memory limit, the latest chunk first; W fills (the oldest microbatch first)."""
    kind, j, c = key
    return ({"B": 0, "F": 1, "W": 2}[kind], -c if kind == "F" else j, j if kind == "F" else -c)
