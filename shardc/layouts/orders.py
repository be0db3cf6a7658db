"""Which mesh axis runs where: the order of a layout's mesh axes, searched where it changes the links.

JAX lays a mesh on the chips by its axis order (:mod:`shardc.topology`): on a GPU cluster the devices
are numbered node by node and the mesh reshaped from them, so the last axes run inside a node
(NVLink) and the first across nodes (InfiniBand); on a TPU slice ``mesh_utils.create_device_mesh``
gives the last axis first the largest set of whole physical axes.  The same sizes written in
another order lie on other links, so a layout is its sizes and its order.  :func:`orders` gives a
candidate under every order of its mesh axes above size 1 (not those ``over dcn``: a DCN axis joins
slices wherever it is written) that lays them on other links than the orders before it, the
spec's own first; two orders whose every axis gets the same links cost the same, and only the first
is kept.  :func:`search_orders` costs them with each layout's template plan, skipping those a bound
proves cannot be chosen; the best rows are then planned at their own order, as at their own sizes
(:func:`shardc.layouts.templates.refined`).  Dims name their axes major to minor themselves
(``B_XY``), so an order changes where the axes lie, never what a device holds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import lru_cache

from shardc.errors import ShardcError
from shardc.ir.spec import Mesh, Network, Spec, parse_topology
from shardc.layouts.rank import DIGITS, Layout, Options, Skipped, pairs, rank_key
from shardc.layouts.templates import (
    Candidate,
    accepted,
    by_template,
    free_step,
    note,
    recost,
    representatives,
    step_of,
)
from shardc.topology import AxisLinks, resolve_links

__all__ = ["MAX_ORDERS", "orders", "reorder", "search_orders"]

# 6 axes above size 1 (720 orders) at most: each order kept is one more row to cost, and a mesh of
# more such axes keeps its written order
MAX_ORDERS = 720


def reorder(spec: Spec, names: Sequence[str]) -> Spec:
    """``spec`` with its mesh axes in the order ``names`` (every axis's name)."""
    axes = {a.name: a for a in spec.mesh.axes}
    return replace(spec, mesh=Mesh(tuple(axes[name] for name in names)))


def _placed(links: AxisLinks) -> AxisLinks:
    """``links`` up to which physical axes they are (two axes alike cost alike): the rings' sizes, wraparound,
    splits and strides, in a fixed order."""
    rings = sorted((replace(r, axis=-1) for r in links.rings), key=lambda r: (r.chips, r.wrapped, r.split, r.stride))
    return replace(links, rings=tuple(rings))


def orders(candidate: Spec, options: Options) -> list[Spec]:
    """``candidate`` under each order of its movable axes that puts them on other links, its own first."""
    return list(_orders(candidate, candidate.filename, options))


# a search asks for a layout's orders twice: to count its work, then to cost them.  The key holds the spec's
# file name, which a Spec's equality leaves out: two files of the same text are two searches' rows, each named
# by its own file (tests/test_layouts.py::test_a_copy_searched_first_leaves_each_file_its_own_rows)
@lru_cache(maxsize=1024)
def _orders(candidate: Spec, filename: str | None, options: Options) -> tuple[Spec, ...]:
    hw = options.hardware
    axes = candidate.mesh.axes
    movable = [i for i, a in enumerate(axes) if a.size > 1 and a.network is not Network.DCN]
    if hw.book or len(movable) < 2 or math.factorial(len(movable)) > MAX_ORDERS:
        return (candidate,)  # the book's spans and a single axis lie alike in any order
    topology = options.topology if options.topology is not None else candidate.topology
    shape = parse_topology(topology) if isinstance(topology, str) else topology
    sizes = {a.name: a.size for a in axes}
    seen: set[frozenset[object]] = set()
    out = []
    for perm in itertools.permutations(movable):
        names = [a.name for a in axes]
        for slot, i in zip(movable, perm, strict=True):
            names[slot] = axes[i].name
        spec = reorder(candidate, names)
        try:
            links, _ = resolve_links(spec.mesh, sizes, hw, shape)
        except ShardcError:
            continue  # sizes this order cannot lay on the slice: another order may
        placed = frozenset((name, _placed(links[name])) for name, size in sizes.items() if size > 1 and name in links)
        if placed not in seen:
            seen.add(placed)
            out.append(spec)
    return tuple(out) or (candidate,)


def _digits(x: float) -> float:
    return float(f"{x:.{DIGITS - 1}e}")


def search_orders(found: Sequence[Candidate], rows: Sequence[Layout], options: Options,
                  progress: Callable[[int, int], None] | None = None, bounded: bool = True
                  ) -> tuple[list[Layout], list[Skipped], list[Candidate], dict[str, float]]:
    """The other orders of each of ``found`` (written in its spec's order; its rows among ``rows``), each costed
    with its template's plan, except where it cannot be chosen: while some row fits, an order of a
    layout that does not fit (an order moves no byte of memory), of one whose compute alone
    (``floor_s``: the same plan's compute, which no order changes) passes the fastest fitting row's
    step, of a pipelined one whose schedule with its communication free does
    (:func:`shardc.layouts.templates.free_step`), or one whose step alone does
    (:func:`shardc.layouts.templates.step_of`, without the rest of its report).  ``bounded`` false:
    none skipped.  The rows, the candidates refused, the orders made, and counts (``orders``, and
    ``pruned``: those skipped)."""
    fitting = [r for r in rows if r.fits]
    bar = min(fitting, key=rank_key) if fitting and bounded else None
    made, total = _made(found, rows, options, bar)
    groups = by_template(made, options)
    reps = representatives(found, options)
    written = by_template(found, options)
    out: list[Layout] = []
    refused: list[Skipped] = []
    skipped = 0
    for done, (key, members) in enumerate(groups.items(), 1):
        rep, template = accepted(written.get(key, []), reps[key], options)  # the written order's, kept
        free: dict[tuple[tuple[str, int], ...], float | None] = {}  # a layout's free_step, whatever its order
        for c in members:
            if bar is not None and not isinstance(template, str):
                layout = tuple(sorted(c.sizes))
                if layout not in free:
                    free[layout] = free_step(template, c, options)
                bound = free[layout]
                if bound is not None and _digits(bound) > _digits(bar.step_s):
                    skipped += 1  # slower than a row that fits with its communication free
                    continue
            quick = step_of(template, c, options) if not isinstance(template, str) else None
            if bar is not None and quick is not None and _behind(quick, bar):
                skipped += 1  # ranked after a row that fits: no row is needed
                continue
            row = recost(template, c, options) if not isinstance(template, str) else template
            if isinstance(row, str):
                refused.append(Skipped(c.label, c.sizes, row))
                continue
            out.append(replace(row, notes=row.notes + (note(rep),)))
            if bounded and row.fits and (bar is None or rank_key(row) < rank_key(bar)):
                bar = row
        if progress is not None:
            progress(done, len(groups))
    return out, refused, made, {"orders": total, "pruned": total - len(made) + skipped}


def _behind(quick: tuple[float, bool, float], bar: Layout) -> bool:
    """Whether a row of step, split and critical-path communication ``quick`` (its memory its layout's, which
    fits) ranks after ``bar`` (:func:`shardc.layouts.rank.rank_key`), critical paths compared to 9 digits."""
    step, split, critical = quick
    mine, theirs = (_digits(step), split), (_digits(bar.step_s), bar.split)
    return mine > theirs or mine == theirs and _digits(critical) > _digits(bar.critical_s)


def _made(found: Sequence[Candidate], rows: Sequence[Layout], options: Options,
          bar: Layout | None) -> tuple[list[Candidate], int]:
    """The other orders of each of ``found`` but those of a layout that does not fit or whose compute alone
    passes ``bar``'s step (``bar``: the best row that fits); and how many orders there are in all."""
    by = {(r.spec, r.sizes): r for r in rows}
    made: list[Candidate] = []
    total = 0
    for c in found:
        row = by.get((c.label, c.sizes))
        if row is None:
            continue  # refused at its written order: every order is the same spec
        others = [Candidate(spec, pairs(spec), c.knobs, c.recompute) for spec in orders(c.spec, options)[1:]]
        total += len(others)
        if bar is None or row.fits and _digits(row.floor_s) <= _digits(bar.step_s):
            made += others
    return made, total
