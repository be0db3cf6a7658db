"""DualPipe's overlapped F&B pair: a forward chunk of one microbatch and the whole backward of another, run
on one GPU as DeepSeek-V3 runs them (technical report, arXiv 2412.19437, section 3.2.1 and Figure 4).

Each chunk is a chain of segments, a computation then the collective the chain's next computation waits
for (a layer's forward: attention, its dispatch AllToAll, the MLP, its combine AllToAll; its backward
the reverse, each MLP and attention running its input's then its weights' gradients).  The report
interleaves the two chains' computations so that each one's AllToAll runs under the other's computation:
the GPU's computations run one after the other, never two at once, and its collectives one at a time
beside them (Figure 4's two rows).  A computation that has a collective running beside it runs on the
cores the collective leaves (section 3.2.2: 20 of the H800's 132 SMs for the all-to-all kernels, so 112
compute; :func:`shardc.overlap.beside`).  A chunk's collectives issued ahead (nothing waits on them) run
whenever the collective stream is idle.

:func:`pair_seconds` simulates the two streams: the computation stream takes the other chain's ready
computation before its own (Figure 4's alternation), never idling while one is ready; the collective
stream runs the ready collectives first come first served.  Which chunk computes first is the one of the
two that ends sooner (the report's hand-made order places each collective under a computation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from shardc.overlap import beside

__all__ = ["Segment", "Phases", "scaled", "joined", "pair_seconds"]

Segment = tuple[float, float]  # (computation's seconds, then the collective's the next computation waits for)


@dataclass(frozen=True)
class Phases:
    """A chunk's forward and its whole backward (B and W, in the order the backward runs them) as chains of
    segments, their collectives issued ahead (``*_ahead``), and the share of the cores a collective holds
    (:attr:`shardc.hardware.Hardware.overlap_share`): what an F&B pair can overlap."""

    forward: tuple[Segment, ...]
    backward: tuple[Segment, ...]
    forward_ahead: float = 0.0
    backward_ahead: float = 0.0
    share: float = 0.0

    def scaled(self, k: float) -> Phases:
        """Every time times ``k`` (a part of a stage's layers)."""
        return Phases(scaled(self.forward, k), scaled(self.backward, k), self.forward_ahead * k,
                      self.backward_ahead * k, self.share)

    def then(self, other: Phases) -> Phases:
        """This run of layers, then ``other``'s: its forward after this one's, its backward before."""
        return Phases(joined(self.forward, other.forward), joined(other.backward, self.backward),
                      self.forward_ahead + other.forward_ahead, self.backward_ahead + other.backward_ahead,
                      max(self.share, other.share))


def scaled(segments: tuple[Segment, ...], k: float) -> tuple[Segment, ...]:
    """A chain with every time times ``k``."""
    return tuple((c * k, m * k) for c, m in segments)


def joined(first: tuple[Segment, ...], then: tuple[Segment, ...]) -> tuple[Segment, ...]:
    """Two chains one after the other: a computation that ends ``first`` with no collective after it runs on
    into ``then``'s first."""
    if first and then and first[-1][1] == 0.0:
        return first[:-1] + ((first[-1][0] + then[0][0], then[0][1]),) + then[1:]
    return first + then


def pair_seconds(forward: Phases, backward: Phases) -> float:
    """The seconds of ``forward``'s forward chain paired with ``backward``'s backward chain, two streams."""
    chains = (forward.forward, backward.backward)
    pool = forward.forward_ahead + backward.backward_ahead
    share = max(forward.share, backward.share)
    return min(_streams(chains, pool, share, 0), _streams(chains, pool, share, 1))


@dataclass
class _Chain:
    segments: tuple[Segment, ...]
    at: int = 0  # the segment it is in
    computed: bool = False  # its computation done: its collective next
    ready_s: float = 0.0  # when its next item became ready

    @property
    def done(self) -> bool:
        return self.at >= len(self.segments)

    def step(self, now: float) -> None:
        """Its current item ended at ``now``: on to its collective, or to the next segment's computation."""
        if not self.computed and self.segments[self.at][1] > 0.0:
            self.computed = True
        else:
            self.at, self.computed = self.at + 1, False
        self.ready_s = now


@lru_cache(maxsize=4096)
def _streams(chains: tuple[tuple[Segment, ...], ...], pool: float, share: float, first: int) -> float:
    """The two chains on one computation stream and one collective stream, chain ``first`` computing first."""
    runs = [_Chain(c) for c in chains]
    now, last = 0.0, 1 - first
    work: tuple[int, float] | None = None  # the chain computing, its seconds of work left
    comm: tuple[int, float] | None = None  # the chain whose collective runs (-1: the ahead ones), its seconds left
    while True:
        if work is None:
            work = _next_work(runs, last)
            last = work[0] if work else last
        comm, pool = _next_comm(runs, comm, pool)
        if work is None and comm is None:
            return now
        dt, left = _advance(work, comm, share)
        now += dt
        if work is not None:
            work = (work[0], left)
            if left <= 0.0:
                runs[work[0]].step(now)
                work = None
        if comm is not None:
            comm = (comm[0], comm[1] - dt)
            if comm[1] <= 1e-15:
                if comm[0] >= 0:
                    runs[comm[0]].step(now)
                comm = None


def _next_work(runs: list[_Chain], last: int) -> tuple[int, float] | None:
    """The computation to run: the other chain's where it is ready (Figure 4 alternates them), else this one's."""
    for i in (1 - last, last):
        chain = runs[i]
        if not chain.done and not chain.computed:
            return i, chain.segments[chain.at][0]
    return None


def _next_comm(runs: list[_Chain], comm: tuple[int, float] | None,
               pool: float) -> tuple[tuple[int, float] | None, float]:
    """The collective to run (and the ahead ones' seconds left): a running chain's goes on; a chain's
    collective that waits pre-empts the ahead ones', the longest waiting first; else the ahead ones run."""
    if comm is not None and comm[0] >= 0:
        return comm, pool
    waiting = [(chain.ready_s, i) for i, chain in enumerate(runs) if not chain.done and chain.computed]
    if waiting:
        i = min(waiting)[1]
        pool += comm[1] if comm is not None else 0.0
        return (i, runs[i].segments[runs[i].at][1]), pool
    if comm is not None or pool <= 0.0:
        return comm, pool
    return (-1, pool), 0.0


def _advance(work: tuple[int, float] | None, comm: tuple[int, float] | None, share: float) -> tuple[float, float]:
    """Seconds to the next end of a computation or a collective, and the computation's work left then."""
    if work is None:
        return (comm[1] if comm is not None else 0.0), 0.0
    if comm is None:
        return work[1], 0.0
    dt, left = beside(work[1], comm[1], share)
    return (dt, left) if math.isfinite(dt) else (comm[1], work[1])
