"""The search's values and moves: a sharded value of one tensor (:class:`Value`), one collective or
slice taking it to another (:class:`Move`), and the lexicographic costs the search adds up
(:mod:`shardc.sharding.layout` searches over them)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shardc.ir.plan import Monomial, Op
from shardc.ir.spec import Dim, TensorRef

__all__ = ["Layout", "Value", "Move", "Edge", "expand", "Cost", "ZERO", "INFINITE", "add_cost", "SearchTooLong"]

Layout = tuple[tuple[str, ...], ...]


class SearchTooLong(Exception):
    """The search did more work than its budget allows (the planner turns this into a ShardcError)."""

    def __init__(self, axes: int, work: int) -> None:
        super().__init__(axes, work)
        self.axes = axes
        self.work = work


Cost = tuple[float, int, int]
ZERO: Cost = (0.0, 0, 0)
INFINITE: Cost = (float("inf"), 0, 0)


def add_cost(a: Cost, b: Cost) -> Cost:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2])


@dataclass(frozen=True, order=True)
class Value:
    """A layout and unreduced axes (sorted): a planner state for one tensor."""

    layout: Layout
    unreduced: tuple[str, ...] = ()

    def reaches(self, other: Value) -> bool:
        """Whether moves can take this value to ``other``'s partial sums: they resolve
        partial sums (its unreduced axes may only shrink), they never make them."""
        return set(other.unreduced) <= set(self.unreduced)

    def used(self) -> frozenset[str]:
        return frozenset(a for axes in self.layout for a in axes) | frozenset(self.unreduced)

    def ref(self, name: str, indices: tuple[str, ...]) -> TensorRef:
        dims = tuple(Dim(i, axes) for i, axes in zip(indices, self.layout, strict=True))
        return TensorRef(name, dims, self.unreduced)

    @staticmethod
    def of(ref: TensorRef) -> Value:
        """A sharded value without its name: TensorRef, which sorts its unreduced axes when
        made, is the one normal form; Value only ever copies it (and :meth:`ref` goes back)."""
        return Value(ref.layout, ref.unreduced)


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
    # The moves this one stands for, when it is several (free slices, then the collective):
    # past four axes the search keeps axes in place, and a gather may still span more links.
    via: tuple[Move, ...] = ()


def expand(moves: Iterable[Move]) -> tuple[Move, ...]:
    """``moves`` with each move that stands for several replaced by them."""
    out = tuple(moves)
    for move in out:
        if move.via:
            return tuple(m for move in out for m in (move.via or (move,)))
    return out


@dataclass(frozen=True)
class Edge:
    """A move out of a search state: its cost and the value number it reaches."""

    move: Move
    cost: Cost
    dst: int
