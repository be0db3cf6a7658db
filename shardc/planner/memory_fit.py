"""The fastest plan that fits the chip's memory: the planner's step-time search, constrained.

The planner minimises the step time (:func:`shardc.planner.candidates.objective`); what a plan holds
per device is counted by ``shardc cost`` (one function, in the cost layer above the planner, handed
in as ``memory``).  When the fastest plan holds more than the limit (the chip's HBM unless told),
the planner searches the plans its choices make that differ in what they hold, and takes the
fastest of those that fit:

- the residual policy, where the caller left it to the plan (``save="default"``, which gathers a
  weight again for each use rather than keeping it gathered): ``none`` also moves a gathered
  activation again in the backward instead of keeping the gathered copy (``all``, keeping the
  gathered weights across their uses, only holds more);
- collective matmul off, where it was on: no ring's double buffer of blocks in flight;
- each of the search's candidate plans (:func:`shardc.planner.candidates.candidate_weights`, the
  book's rules), not only the fastest: their einsums keep other copies of a weight or an activation
  gathered, and leave the weight gradients' sums in other layouts.

The space is a few dozen plans at most (2 policies x 2 x the candidates); the search plans each,
orders them by step time and counts memory in that order until one fits, so it is exact over that
space (``tests/test_bruteforce.py`` counts every plan of it and checks the planner's pick).  Where
nothing fits, the plan is the fastest, and a note gives the least memory any of them needs.  A caller
that knows a floor under every plan of the space (the training state and the checkpoints recomputation
starts from, which no choice above changes: :func:`shardc.costmodel.fitting.least_memory`) skips the search
where the floor alone passes the limit: the search would plan every variant to return the fastest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace

from shardc.errors import ShardcError, clip
from shardc.ir.plan import MemoryChoice, Plan
from shardc.units import fmt_bytes, fmt_seconds

__all__ = ["MemoryOf", "Weigh", "Variant", "beyond", "variants", "fit", "fastest_fitting", "check_limit", "ranked",
           "candidate_rank", "current_rank", "remembered"]

MemoryOf = Callable[[Plan], float]  # bytes a device as `shardc cost` counts them (its fullest stage's)
# the memory function, the limit (None: the chip's HBM), and a floor: of a plan, bytes a device that no plan
# of the search (:func:`variants`) holds less than, as the memory function counts them (None: 0)
Weigh = tuple[MemoryOf | None, float | None, MemoryOf | None]

# which of the search's candidates, fastest first, the planner returns (0: the fastest), and how many it
# compared: set by :func:`ranked` around one plan, read by the planner where it picks its candidate
_RANK: ContextVar[int] = ContextVar("memory_fit_rank", default=0)
_SEEN: ContextVar[list[int] | None] = ContextVar("memory_fit_seen", default=None)
# inside :func:`fastest_fitting`: each search's candidates (fastest first) by what they were searched for, so
# that asking for another of them plans nothing again
_MEMO: ContextVar[dict[object, list[Plan]] | None] = ContextVar("memory_fit_memo", default=None)


@dataclass(frozen=True, order=True)
class Variant:
    """One plan of the constrained search: a residual policy, collective matmul on or off, and
    which of the search's candidates (0: its fastest)."""

    save: str
    collective_matmul: bool
    rank: int

    def label(self) -> str:
        cm = "" if self.collective_matmul else ", no collective matmul"
        return f"save {self.save}{cm}, the search's candidate {self.rank + 1}"


def variants(save: str, collective_matmul: bool, count: int) -> list[Variant]:
    """Every plan the search weighs: the caller's own choices first (the unconstrained plan is the first)."""
    saves = (save,) + (("none",) if save == "default" else ())
    matmuls = (collective_matmul,) + ((False,) if collective_matmul else ())
    return [Variant(s, c, k) for s in saves for c in matmuls for k in range(count)]


@contextmanager
def ranked(rank: int) -> Iterator[list[int]]:
    """Inside, the planner returns its ``rank``-th candidate (fastest first, the last where it has fewer);
    the list yielded gets how many candidates each of its searches compared."""
    seen: list[int] = []
    tokens = (_RANK.set(rank), _SEEN.set(seen))
    try:
        yield seen
    finally:
        _SEEN.reset(tokens[1])
        _RANK.reset(tokens[0])


def current_rank() -> int:
    """The candidate asked for around this plan (0, the fastest, unless inside :func:`ranked`)."""
    return _RANK.get()


def candidate_rank(count: int) -> int:
    """The candidate the planner returns of ``count`` (ordered fastest first); records ``count``."""
    seen = _SEEN.get()
    if seen is not None:
        seen.append(count)
    return min(_RANK.get(), count - 1)


def candidates_seen(seen: list[int]) -> int:
    """How many candidates a plan's searches compared (1 without a search)."""
    return max(seen, default=1)


def remembered(key: object, search: Callable[[], list[Plan]]) -> list[Plan]:
    """``search()``'s candidates, searched once for each ``key`` inside :func:`fastest_fitting`."""
    memo = _MEMO.get()
    if memo is None:
        return search()
    if key not in memo:
        memo[key] = search()
    return memo[key]


def check_limit(limit: object) -> None:
    """A memory limit is bytes above 0 (or None: the chip's HBM)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int | float) or not limit > 0):
        raise ShardcError(f"memory_limit={clip(repr(limit))}: must be a number of bytes above 0",
                          fix="leave it out for the chip's HBM, or write e.g. 80e9")


def fastest_fitting(make: Callable[[str], Plan], fuse: Callable[[Plan], Plan], save: str, collective_matmul: bool,
                    weigh: Weigh, time: Callable[[Plan], tuple[float, float]]) -> Plan:
    """The planner's plan: ``make(save)`` (the step-time search's, before collective matmuls are fused by
    ``fuse``), or where ``weigh`` gives a memory function and it holds more than the limit (the chip's HBM
    where the limit is None), the fastest by ``time`` of the :func:`variants` that fits (:func:`fit`); where
    ``weigh``'s floor (bytes no plan of the search holds less than) passes the limit, the fastest, unsearched."""
    token = _MEMO.set({}) if _MEMO.get() is None else None
    try:
        return _fastest_fitting(make, fuse, save, collective_matmul, weigh, time)
    finally:
        if token is not None:
            _MEMO.reset(token)


def _fastest_fitting(make: Callable[[str], Plan], fuse: Callable[[Plan], Plan], save: str, collective_matmul: bool,
                     weigh: Weigh, time: Callable[[Plan], tuple[float, float]]) -> Plan:
    rank = current_rank()
    with ranked(rank) as seen:
        unfused = {(save, rank): make(save)}

    fused: dict[tuple[str, int], Plan] = {}

    def made(v: Variant) -> Plan:  # collective matmul on and off share the plan they fuse
        key = (v.save, v.rank)
        if key not in unfused:
            with ranked(v.rank):
                unfused[key] = make(v.save)
        if not v.collective_matmul:
            return unfused[key]
        if key not in fused:
            fused[key] = fuse(unfused[key])
        return fused[key]

    planned = made(Variant(save, collective_matmul, rank))
    memory, limit, floor = weigh
    if memory is None:
        return planned
    held, limit = memory(planned), limit or planned.chip.hbm_bytes
    if held <= limit:
        return planned
    least = floor(planned) if floor is not None else 0.0
    if least > limit:  # every plan of the search holds at least that: none fits, so none is planned
        return beyond(planned, held, least, limit)
    return fit(planned, held, made, variants(save, collective_matmul, candidates_seen(seen)), memory, limit, time)


def fit(first: Plan, first_memory: float, make: Callable[[Variant], Plan], space: list[Variant],
        memory: MemoryOf, limit: float, time: Callable[[Plan], tuple[float, float]]) -> Plan:
    """The fastest plan of ``space`` (each made by ``make``; ``first`` is ``space[0]``'s, holding
    ``first_memory``) whose ``memory`` is at most ``limit``, by ``time`` (ties: the earlier in ``space``);
    where none fits, ``first`` with a note of the least memory any needs."""
    plans = _by_time(first, make, space, time)
    known: list[tuple[Plan, float]] = [(first, first_memory)]  # two choices often make one plan: costed once

    def weighed(p: Plan) -> float:
        found = next((m for q, m in known if q is p or q == p), None)
        if found is None:
            found = memory(p)
            known.append((p, found))
        return found

    held: dict[int, float] = {}
    fastest = MemoryChoice("the fastest plan (" + space[0].label() + ")", next(k[0] for k, i, _ in plans if i == 0),
                           first_memory, False)
    for key, i, p in plans:  # memory counted in order of step time: the first that fits is the answer
        held[i] = weighed(p)
        if held[i] <= limit:
            if i == 0:
                return first
            chosen = MemoryChoice("the fastest that fits (" + space[i].label() + ")", key[0], held[i], True)
            note = (f"memory: the fastest plan needs {fmt_bytes(first_memory)} a device, over the "
                    f"{fmt_bytes(limit)} it may hold; this one ({space[i].label()}) needs {fmt_bytes(held[i])}, "
                    f"{fmt_seconds(key[0])} a step against {fmt_seconds(fastest.step_s)} as the planner times "
                    "them (`shardc plan --explain`)")
            return replace(p, notes=p.notes + (note,), memory_choices=(fastest, chosen))
    least = min(held, key=lambda i: (held[i], i))
    note = (f"memory: no plan fits the {fmt_bytes(limit)} a device may hold: this, the fastest, needs "
            f"{fmt_bytes(first_memory)}; the least any plan of the planner's choices needs is "
            f"{fmt_bytes(held[least])} ({space[least].label()}): recompute more (--recompute), shard more "
            "or a ZeRO stage may fit")
    lean = MemoryChoice("the least memory (" + space[least].label() + ")",
                        next(k[0] for k, i, _ in plans if i == least), held[least], False)
    return replace(first, notes=first.notes + (note,), memory_choices=(replace(fastest, chosen=True), lean))


def beyond(first: Plan, first_memory: float, least: float, limit: float) -> Plan:
    """``first``, the fastest, where no plan of the search can fit: every one holds ``least`` or more (a floor
    :func:`fit` would only confirm, planning each variant), over the ``limit``."""
    note = (f"memory: no plan fits the {fmt_bytes(limit)} a device may hold: this, the fastest, needs "
            f"{fmt_bytes(first_memory)}; every plan of the planner's choices needs {fmt_bytes(least)} or more "
            "(its training state and the checkpoints it keeps): shard more, recompute more, a ZeRO stage or "
            "offload may fit")
    return replace(first, notes=first.notes + (note,))


def _by_time(first: Plan, make: Callable[[Variant], Plan], space: list[Variant],
             time: Callable[[Plan], tuple[float, float]]) -> list[tuple[tuple[float, float], int, Plan]]:
    """Each plan of ``space`` (``first``, then each made by ``make``) with its time and index, fastest first
    (ties: the earlier in ``space``)."""
    timed: dict[int, tuple[float, float]] = {}  # by identity: two choices often make one plan (nothing fused)
    plans = []
    for i, v in enumerate(space):
        p = first if i == 0 else make(v)
        if id(p) not in timed:  # each plan timed stays in ``plans``: its id stays its own
            timed[id(p)] = time(p)
        plans.append((timed[id(p)], i, p))
    return sorted(plans, key=lambda t: (t[0], t[1]))
