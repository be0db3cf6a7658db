"""Which mesh axis sizes a layout search tries: every assignment whose product is the chip count.

The axes searched are the spec's ICI axes (a ``pipeline`` axis among them: its size is
the stage count, 1 turning pipelining off).  A DCN axis (``over dcn``) keeps its size:
it counts slices or nodes joined by the data-centre network, a fact of the machine
rather than a choice of layout, and so does an axis fixed with ``--set``; the ICI axes
share the chips left, ``chips / (product of the kept axes)``.  On a GPU cluster given as
``NODESxGPUS`` (``cluster``) every axis not fixed is searched, DCN ones too: the devices
are numbered node by node and the mesh laid on them in mesh order, so which axes cross
nodes follows from the sizes (:func:`shardc.topology.axis_links`), not from the mark.
An axis of size 1 is the parallelism switched off (the planner strips it).

>>> factorisations(12, 2)
((1, 12), (2, 6), (3, 4), (4, 3), (6, 2), (12, 1))
>>> len(factorisations(4096, 3))  # 2^12 over 3 axes: C(14, 2)
91
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from shardc.errors import ShardcError, clip
from shardc.ir.spec import Network, Spec

__all__ = ["MAX_CHIPS", "MAX_WORK", "MAX_CANDIDATES", "Axes", "searched_axes", "factorisations", "check_chips",
           "check_topology", "candidates"]

MAX_CHIPS = 1 << 20  # a million chips: past any machine built, and the enumeration stays small
# A plan's search grows about twofold with each searched axis (0.1-0.5 s a plan at 2-3 axes), so
# candidates x 2^axes is the work a search takes: 1024 keeps it within a minute in one process.
MAX_WORK = 1024
# Past MAX_WORK a search plans each template once and re-costs it per candidate (a cost report,
# about 0.05 s for a pipelined LLaMA-2 13B): this many candidates keeps that within minutes.
MAX_CANDIDATES = 4096


@dataclass(frozen=True)
class Axes:
    """The mesh axes of one spec split into those searched and those kept at their size."""

    searched: tuple[str, ...]
    kept: tuple[tuple[str, int], ...]

    @property
    def kept_devices(self) -> int:
        return math.prod(size for _, size in self.kept)


def searched_axes(spec: Spec, fixed: frozenset[str] = frozenset(), cluster: bool = False) -> Axes:
    """The ICI axes not in ``fixed`` are searched (on a GPU ``cluster``, DCN ones too); the others keep
    their size."""
    searched = tuple(a.name for a in spec.mesh.axes
                     if (cluster or a.network is Network.ICI) and a.name not in fixed)
    kept = tuple((a.name, a.size) for a in spec.mesh.axes if a.name not in searched)
    return Axes(searched, kept)


@cache
def factorisations(n: int, k: int) -> tuple[tuple[int, ...], ...]:
    """Every ordered k-tuple of positive integers whose product is n, in lexicographic order."""
    if k == 0:
        return ((),) if n == 1 else ()
    if k == 1:
        return ((n,),)
    out: list[tuple[int, ...]] = []
    for d in _divisors(n):
        out.extend((d, *rest) for rest in factorisations(n // d, k - 1))
    return tuple(out)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def check_chips(chips: int, axes: Axes, label: str) -> int:
    """The chips the searched axes share; a count that leaves nothing to search is an error."""
    if isinstance(chips, bool) or not isinstance(chips, int) or chips < 1:
        raise ShardcError(f"--chips must be a positive whole number, got {chips!r}", fix="write e.g. --chips 4096")
    if chips > MAX_CHIPS:
        raise ShardcError(f"--chips {clip(str(chips))} is more than {MAX_CHIPS} chips, past any machine",
                          fix=f"use at most --chips {MAX_CHIPS}")
    kept = axes.kept_devices
    if chips % kept:
        held = ", ".join(f"{name}={size}" for name, size in axes.kept)
        raise ShardcError(f"{label}: --chips {chips} is not a multiple of the {kept} devices of the axes kept "
                          f"at their size ({held})",
                          fix=f"use a multiple of {kept}, or change those axes with --set")
    left = chips // kept
    if not axes.searched and left != 1:
        raise ShardcError(f"{label}: no mesh axis left to search, yet {left} chips to place",
                          fix="leave an ICI axis out of --set, or give --chips the kept axes' product")
    if len(axes.searched) > 1 and _is_prime(left):
        past = "" if kept == 1 else f" (--chips {chips} past the {kept} devices of the axes kept at their size)"
        # left + 1 is even and over 2 for an odd prime: it has factors (left - 1 may not: 3 - 1 = 2)
        raise ShardcError(f"{label}: {left} chips{past} is a prime number: every layout would put them all on one "
                          f"axis of {', '.join(axes.searched)}, with nothing to trade between them",
                          fix=f"use a chip count with factors (e.g. --chips {kept * (left + 1 if left > 2 else 4)})")
    return left


def check_topology(spec: Spec, chips: int, fixed: frozenset[str] = frozenset(), cluster: bool = False) -> None:
    """A spec's `topology` line holds the devices its mesh lies on (a TPU slice its ICI axes, a GPU cluster
    every axis): a --chips count that puts another number there would be refused at every candidate, so it
    is an error at the flag; a --topology flag replaces the line (the caller checks only without one)."""
    axes = searched_axes(spec, fixed, cluster)
    if spec.topology is None or chips % axes.kept_devices:
        return  # check_chips says what is wrong with a count the kept axes do not divide
    lying = {a.name for a in spec.mesh.axes if cluster or a.network is Network.ICI}
    placed = chips // axes.kept_devices * math.prod(size for name, size in axes.kept if name in lying)
    held = math.prod(spec.topology)
    if placed != held:
        shape = "x".join(map(str, spec.topology))
        other = f", or --chips {chips * held // placed}" if chips * held % placed == 0 else ""
        raise ShardcError(f"{spec.filename or '<spec>'}: --chips {chips} puts {placed} devices on the spec's "
                          f"`topology {shape}`, which holds {held}",
                          fix=f"give the slice or cluster they lie on with --topology SHAPE{other}")


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def candidates(spec: Spec, chips: int, fixed: frozenset[str] = frozenset(),
               cluster: bool = False) -> list[dict[str, int]]:
    """The searched axes' sizes of every candidate layout, each a ``--set`` mapping of all axes."""
    axes = searched_axes(spec, fixed, cluster)
    left = check_chips(chips, axes, spec.filename or "<spec>")
    found = factorisations(left, len(axes.searched))
    if len(found) > MAX_CANDIDATES:
        raise ShardcError(f"{spec.filename or '<spec>'}: {len(found)} layouts of {left} chips over "
                          f"{len(axes.searched)} axes, past the budget of {MAX_CANDIDATES} candidates",
                          fix="fix some axes with --set AXIS=SIZE, or search fewer chips")
    kept = dict(axes.kept)
    out = []
    for sizes in found:
        chosen = dict(zip(axes.searched, sizes, strict=True)) | kept
        out.append({name: chosen[name] for name in spec.mesh.names})  # in mesh order
    return out
