"""Running fixed device orders: which group runs next and what it reads (the walk), then when (the timeline).

The walk depends on the orders alone, never on the times, so a simulation re-costed with other
times reuses it (:mod:`shardc.pipeline.schedules` keeps it); the timeline gives each op its start
and end from a walk and the times.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from shardc.errors import ShardcError
from shardc.pipeline.dualpipe import TWO_WAY, Group
from shardc.pipeline.greedy import op_inputs
from shardc.pipeline.simulation import Op, Runs, Timing, device_of, operations, paired_seconds

__all__ = ["run_orders", "Step", "Ones", "walk", "ones", "timeline", "one_timeline", "sends_of"]


def run_orders(schedule: str, p: int, m: int, durations: list[dict[str, float]], comm: float,
               orders: list[list[Group]] | tuple[tuple[Group, ...], ...], chunk_times: tuple[Timing, ...] = (),
               tick: bool = False, back: float | None = None) -> list[Op]:
    """Each device runs its ``orders`` in turn, each group as soon as its inputs and the device are free.

    A group is one op, or ops run as one unit (DualPipe's whole backward, B then its W; its
    overlapped F&B pair): the unit starts when every input of its ops is there, its outputs are
    all sent at its end, and a pair takes :func:`paired_seconds`.  Start times follow from the
    orders alone (a device's previous group, the ops it reads), so one pass that advances each
    device until it waits on another's op gives them, in time linear in the ops (:func:`walk`); a
    device that waits is resumed when that op is done.  With ``tick`` every group takes one unit, all its ops
    spanning it (a lowered program's tick: :mod:`shardc.pipeline.ticks`), and no op of a group may read
    its forward (the program's body runs a tick's backward on what the tick found, not on its forward).
    An input from another device arrives ``comm`` after its op ends, a backward's gradient ``back`` (or ``comm``).
    """
    steps = walk(schedule, p, m, len(durations), orders, tick)
    return timeline(p, steps, durations, comm, chunk_times, tick, back)


# A step of a walk: the device, the group it runs, and what the group reads: (the step that made the
# input, how it comes: 0 on the device, 1 a forward's send, 2 a backward's gradient's; a timeline of
# ``sends paired`` also 3 and 4, the same sent alone: shardc.pipeline.paired_sends.megatron_steps)
Step = tuple[int, Group, tuple[tuple[int, int], ...]]


@dataclass(frozen=True)
class Ones:
    """A walk whose groups are each one op (the most common walk's), a column each: the runs' own columns
    (:class:`~shardc.pipeline.simulation.Runs`, shared by every timing of the walk) and each op's reads, at most
    two (B reads its F and the next chunk's B): the step that made the input (-1: none) and how it comes (a
    :data:`Step`'s).  About 20 bytes an op, where the steps' tuples take a few hundred."""

    device: array[int]
    kind: str
    microbatch: array[int]
    chunk: array[int]
    first: array[int]
    first_how: array[int]
    second: array[int]
    second_how: array[int]

    def __len__(self) -> int:
        return len(self.kind)


def ones(steps: tuple[Step, ...]) -> Ones | None:
    """``steps`` as columns, where every group is one op (None where not)."""
    if any(len(group) != 1 for _, group, _ in steps):
        return None
    reads = [reads + ((-1, 0),) * (2 - len(reads)) for _, _, reads in steps]
    return Ones(array("i", [d for d, _, _ in steps]), "".join(group[0][0] for _, group, _ in steps),
                array("i", [group[0][1] for _, group, _ in steps]), array("i", [group[0][2] for _, group, _ in steps]),
                array("i", [r[0][0] for r in reads]), array("b", [r[0][1] for r in reads]),
                array("i", [r[1][0] for r in reads]), array("b", [r[1][1] for r in reads]))


def sends_of(comm: float, back: float | None) -> tuple[float, float, float]:
    """The time an input takes to come, by how it comes (a :data:`Step`'s reads)."""
    return 0.0, comm, comm if back is None else back


def walk(schedule: str, p: int, m: int, n: int, orders: list[list[Group]] | tuple[tuple[Group, ...], ...],
          tick: bool = False) -> tuple[Step, ...]:
    """The groups of ``orders`` in the order :func:`run_orders` runs them, ``n`` model chunks: which group
    runs next and what it waits on depend on the orders alone, never on the times."""
    made: dict[tuple[str, int, int], int] = {}  # an op run -> its step
    position = [0] * p
    blocked: dict[tuple[str, int, int], list[int]] = {}  # an op not yet run -> the devices waiting on it
    runnable = list(range(p - 1, -1, -1))
    steps: list[Step] = []
    home = [device_of(schedule, c, p) for c in range(n)]
    spans = [_span(schedule, p, m, j, n) for j in range(m)]
    while runnable:
        d = runnable.pop()
        order, i = orders[d], position[d]
        while i < len(order):
            group = order[i]
            reads: list[tuple[int, int]] = []
            missing = None
            for kind, j, c in group:
                for dep in op_inputs(kind, j, c, *spans[j]):
                    if (at := made.get(dep)) is not None:
                        reads.append((at, 0 if home[dep[2]] == d else 2 if dep[0] == "B" else 1))
                    elif dep not in group:
                        missing = dep
                        break
                    elif tick and dep[0] == "F":
                        raise ShardcError(f"{schedule}'s group {group} reads its own forward (a bug in its order)")
                if missing is not None:
                    break
            if missing is not None:
                blocked.setdefault(missing, []).append(d)
                break
            for key in group:
                made[key] = len(steps)
                if key in blocked:
                    runnable += blocked.pop(key)
            steps.append((d, group, tuple(reads)))
            i += 1
        position[d] = i
    if sum(len(group) for _, group, _ in steps) < operations(schedule, p, m, n // p) or blocked:
        raise ShardcError(f"schedule {schedule} deadlocked (a bug in its order)")
    return tuple(steps)


def timeline(p: int, steps: tuple[Step, ...], durations: list[dict[str, float]], comm: float,
              chunk_times: tuple[Timing, ...] = (), tick: bool = False, back: float | None = None) -> list[Op]:
    """The ops of a walk's ``steps``, in its order: each group starts when its device is free and its
    inputs are there (a send's time after the op that made them, where it ran on another device)."""
    sends = sends_of(comm, back)
    ends: list[float] = []  # each step's end
    free = [0.0] * p
    result: list[Op] = []
    for d, group, reads in steps:
        start = free[d]
        for at, how in reads:
            end = ends[at] + sends[how] if how else ends[at]
            if end > start:  # max(start, end), the same float
                start = end
        if tick:
            t = start + 1
            result += [Op(start, t, d, *key) for key in group]
        elif len(group) == 1:  # one op: it runs its own time (what _placed gives it, without the scaling)
            kind, j, c = group[0]
            t = start + durations[c][kind]
            result.append(Op(start, t, d, kind, j, c))
        else:
            result += _placed(group, start, d, durations, chunk_times)
            t = result[-1].end
        ends.append(t)
        free[d] = t
    return result


def one_timeline(p: int, steps: Ones, durations: list[dict[str, float]], sends: tuple[float, ...],
                 seconds: list[float] | None = None) -> Runs:
    """:func:`timeline` of a walk whose groups are each one op, without its cases: a re-cost's hot loop, its
    ops left as columns (made into :class:`Op` tuples, and sorted, only where read).  ``seconds``: each step's
    own, where an op's time is not its chunk's (``sends paired``'s warm-up and cool-down ops)."""
    starts: list[float] = []
    ends: list[float] = []
    free = [0.0] * p
    if seconds is None:
        seconds = [durations[c][kind] for c, kind in zip(steps.chunk, steps.kind, strict=True)]
    for d, took, a, a_how, b, b_how in zip(steps.device, seconds, steps.first, steps.first_how, steps.second,
                                           steps.second_how, strict=True):
        start = free[d]
        if a >= 0:
            end = ends[a] + sends[a_how] if a_how else ends[a]
            if end > start:  # max(start, end), the same float
                start = end
            if b >= 0:
                end = ends[b] + sends[b_how] if b_how else ends[b]
                if end > start:
                    start = end
        t = start + took
        starts.append(start)
        ends.append(t)
        free[d] = t
    return Runs(steps.device, steps.kind, steps.microbatch, steps.chunk, array("d", starts), array("d", ends))


def _placed(group: tuple[tuple[str, int, int], ...], start: float, d: int, durations: list[dict[str, float]],
            chunk_times: tuple[Timing, ...]) -> list[Op]:
    """A group's ops from ``start``: one after another, an F&B pair's each drawn as its share of the pair."""
    own = [durations[c][kind] for kind, _, c in group]
    kinds = [key[0] for key in group]
    span = sum(own)
    paired = "F" in kinds and "B" in kinds
    if paired:
        span = paired_seconds(chunk_times[group[0][2]], chunk_times[group[kinds.index("B")][2]])
    scale = span / sum(own) if sum(own) else 0.0
    out, t = [], start
    for key, seconds in zip(group, own, strict=True):
        end = start + span if key is group[-1] else t + seconds * scale
        out.append(Op(t, end, d, *key, paired))
        t = end
    return out


def _span(schedule: str, p: int, m: int, j: int, n: int) -> tuple[int, int]:
    """The first and the last chunk microbatch ``j`` runs through (DualPipe's second half: the way back)."""
    if schedule in TWO_WAY:
        return (p, n - 1) if j >= m // 2 else (0, p - 1)
    return 0, n - 1
