"""``shardc layouts``: which mesh layout, for this model, on these chips.

For each spec (the first, and those given with ``--with``: e.g. a DP, an FSDP and an
FSDP+TP variant of one model), every assignment of sizes to its searched mesh axes
whose product is the chip count (:mod:`shardc.layouts.factor`) is planned and costed
(:mod:`shardc.layouts.rank`), and the layouts are ranked.  The chosen layout is the
first: the fastest of those that fit, the reason said in numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from shardc.accountings import chosen
from shardc.costmodel.cost_report import cost
from shardc.errors import ShardcError
from shardc.ir.spec import Mesh, Spec
from shardc.layouts.book_optimum import BookOptimum, book_optimum
from shardc.layouts.factor import MAX_CANDIDATES, MAX_WORK, candidates, check_topology, searched_axes
from shardc.layouts.knobs import search_knobs
from shardc.layouts.layouts_text import reason, render, to_json
from shardc.layouts.orders import orders, reorder, search_orders
from shardc.layouts.rank import RULE, Layout, Options, Skipped, on_cluster, pairs, prepare, prepare_noted, rank, ranked
from shardc.layouts.templates import Candidate, kept_plans, refined, search_templates
from shardc.planner.planner import plan, shared_search
from shardc.spec.overrides import dim_names

__all__ = ["EXACT_CANDIDATES", "KNOB_LAYOUTS", "LayoutSearch", "search_layouts"]

# Up to this many candidates (within MAX_WORK) each is planned at its own sizes; past it, each template
# is planned once and re-costed (shardc.layouts.templates), unless --exact asks otherwise.
EXACT_CANDIDATES = 64
KNOB_LAYOUTS = 4  # the best layouts at the spec's own knobs whose knobs are then searched


@dataclass(frozen=True)
class LayoutSearch:
    """The ranked layouts (best first), the candidates skipped, and what the search took."""

    chips: int
    options: Options
    layouts: tuple[Layout, ...]
    skipped: tuple[Skipped, ...]
    stats: dict[str, float]
    rule: str = RULE
    optimum: BookOptimum | None = None  # the book's X_opt for the chosen layout (FSDP x tensor parallel)
    written: tuple[tuple[str, Mesh], ...] = ()  # each spec's mesh as written (its order, pipeline and dcn axes)

    @property
    def chosen(self) -> Layout | None:
        return self.layouts[0] if self.layouts else None

    def reason(self) -> str:
        return reason(self)

    def render(self, top: int = 0) -> str:
        return render(self, top)

    def to_json(self, top: int = 0) -> dict[str, object]:
        return to_json(self, top)


def search_layouts(specs: Sequence[Spec], options: Options, chips: int | None = None,
                   fixed: frozenset[str] = frozenset(), jobs: int = 1,
                   progress: Callable[[int, int], None] | None = None) -> LayoutSearch:
    """Rank every layout of ``specs`` on ``chips`` (default: the first spec's devices).

    ``fixed`` names axes kept at their size (as DCN axes are); every spec needs a size for each dim.
    ``jobs`` processes plan the candidates (0: one a core, when there are enough to repay them);
    ``progress(done, total)`` is called after each plan.
    """
    if not specs:
        raise ShardcError("no spec to search", fix="pass a .shard file")
    n = specs[0].mesh.devices if chips is None else chips
    options = replace(options, optimizer=chosen(specs[0].optimizer, options.optimizer))  # as `shardc layouts`
    for spec in specs:
        _check_sized(spec)
        if options.topology is None:
            check_topology(spec, n, fixed & set(spec.mesh.names), on_cluster(spec, options))
    plans = [candidates(spec, n, fixed & set(spec.mesh.names), on_cluster(spec, options)) for spec in specs]
    total = sum(map(len, plans))
    if total > MAX_CANDIDATES:
        raise ShardcError(f"{len(specs)} specs have {total} layouts on {n} chips together, past the budget of "
                          f"{MAX_CANDIDATES} candidates", fix="search fewer --with specs at once")
    searched = {s.filename or "<spec>": len(searched_axes(s, fixed & set(s.mesh.names),
                                                          on_cluster(s, options)).searched) for s in specs}
    as_written = sum(len(p) << searched[s.filename or "<spec>"] for s, p in zip(specs, plans, strict=True))
    if options.exact and as_written > MAX_WORK:  # before preparing them: their orders only add to it
        raise ShardcError(f"--exact: {total} layouts on {n} chips, past the budget of {MAX_WORK} plans x 2^axes "
                          "for planning each", fix="leave out --exact (each template planned once, re-costed), "
                                                   "or fix some axes with --set AXIS=SIZE")
    found, refused, notes = _prepared(specs, plans, options)
    every = [(spec, pairs(spec)) for c in found for spec in orders(c.spec, options)]
    work = sum(1 << searched[spec.filename or "<spec>"] for spec, _ in every)
    if options.exact and work > MAX_WORK:
        raise ShardcError(f"--exact: {total} layouts on {n} chips ({len(every)} with the orders of their mesh axes "
                          f"that lie on other links), past the budget of {MAX_WORK} plans x 2^axes for planning "
                          "each", fix="leave out --exact (each template planned once, re-costed), "
                                      "or fix some axes with --set AXIS=SIZE")
    if options.exact or (work <= MAX_WORK and len(every) <= EXACT_CANDIDATES and not options.knobs):
        rows, skipped, stats = ranked(every, refused, options, jobs, progress)
        stats["orders"] = len(every) - len(found)
    else:
        with shared_search(), kept_plans():  # a layout planned under several knobs shares its search caches
            rows, skipped, stats = _templates(found, options, progress, jobs)
        stats["candidates"] += len(refused)
        skipped = refused + skipped
    rows = _noted(rows, notes)
    optimum = _optimum(specs, rows, options, fixed) if rows else None
    written = tuple((s.filename or "<spec>", s.mesh) for s in specs)
    return LayoutSearch(n, options, tuple(rows), tuple(skipped), stats, optimum=optimum, written=written)


def _prepared(specs: Sequence[Spec], plans: Sequence[list[dict[str, int]]],
              options: Options) -> tuple[list[Candidate], list[Skipped], dict[tuple[object, ...], str]]:
    """Each spec at each of its candidates' sizes, in its written order, those the spec refuses, and the note
    of each pipelined one saying which microbatch count it runs (by :func:`_noted`'s key)."""
    found: list[Candidate] = []
    refused: list[Skipped] = []
    notes: dict[tuple[object, ...], str] = {}
    for spec, sizes_list in zip(specs, plans, strict=True):
        for sizes in sizes_list:
            made = prepare_noted(spec, sizes, on_cluster(spec, options))
            if isinstance(made, Skipped):
                refused.append(made)
                continue
            candidate, note = made
            found.append(Candidate(candidate, pairs(candidate)))
            if note is not None:
                notes[candidate.filename or "<spec>", tuple(sorted(sizes.items()))] = note
    return found, refused, notes


def _noted(rows: Sequence[Layout], notes: dict[tuple[object, ...], str]) -> list[Layout]:
    """``rows`` with the note of their microbatch count (not the rows whose ``microbatches`` knob sets it)."""
    out = []
    for row in rows:
        note = notes.get((row.spec, tuple(sorted(row.sizes))))
        keep = note is None or "microbatches" in dict(row.knobs)
        out.append(row if note is None or keep else replace(row, notes=(*row.notes, note)))
    return out


def _templates(found: list[Candidate], options: Options, progress: Callable[[int, int], None] | None,
               jobs: int) -> tuple[list[Layout], list[Skipped], dict[str, float]]:
    """The template search: every layout at the spec's own knobs (its templates over ``jobs`` processes), the
    other orders of its mesh axes, then the knobs (``options.knobs``) of the best :data:`KNOB_LAYOUTS` rows."""
    start = time.perf_counter()
    rows, skipped, stats = search_templates(found, options, progress, refine=False, jobs=jobs)
    tried, also, every, extra = search_orders(found, rows, options, progress)
    rows, skipped, every = rank([*rows, *tried]), skipped + also, [*found, *every]
    stats["candidates"] += extra["orders"]
    stats["orders"], stats["orders_pruned"] = extra["orders"], extra["pruned"]
    if options.knobs:  # the product of the knobs' settings for the best layouts
        by = {(c.label, c.sizes): c for c in every}
        best = [by[r.spec, r.sizes] for r in rows[:KNOB_LAYOUTS]]
        tried, also, made, extra = search_knobs(best, rows, options, progress)
        rows, skipped, every = rows + tried, skipped + also, every + made
        stats["candidates"] += extra["combinations"]
        stats["templates"] += extra["planned"]
        stats["planned"] += extra["planned"]
        stats["pruned"] = extra["pruned"]
    rows, also, stats["planned"] = refined(rows, every, options, stats["planned"])
    stats["recosted"] = sum(not r.planned for r in rows)
    stats["seconds"] = time.perf_counter() - start
    return rows, skipped + also, stats


def _optimum(specs: Sequence[Spec], rows: Sequence[Layout], options: Options,
             fixed: frozenset[str]) -> BookOptimum | None:
    """The book's X_opt, when the chosen layout's spec has two searched axes (FSDP, then tensor parallel),
    at the links of the best layout of that spec using both (the chosen one, unless it switches one off)."""
    spec = next(s for s in specs if (s.filename or "<spec>") == rows[0].spec)
    axes = searched_axes(spec, fixed & set(spec.mesh.names), on_cluster(spec, options)).searched
    best = next((r for r in rows if r.spec == rows[0].spec and all(dict(r.sizes).get(a, 1) > 1 for a in axes)),
                rows[0])
    candidate = prepare(spec, dict(best.sizes), on_cluster(spec, options))
    if len(axes) != 2 or not isinstance(candidate, Spec):
        return None
    candidate = reorder(candidate, [name for name, _ in best.sizes])  # the row's mesh order
    report = cost(plan(candidate, save=options.save, hardware=options.hardware, recompute=options.recompute,
                       topology=options.topology, collective_matmul=options.collective_matmul),
                  mfu=options.mfu, optimizer=options.optimizer)
    return book_optimum(report, axes)


def _check_sized(spec: Spec) -> None:
    sized = dict(spec.dims)
    missing = [d for d in dim_names(spec) if d not in sized]
    if missing:
        raise ShardcError(f"{spec.filename or '<spec>'}: layouts are ranked by step time, which needs a size for "
                          f"every dim; {', '.join(missing)} {'has' if len(missing) == 1 else 'have'} none",
                          fix=f"add them to the dims line, or pass --set {missing[0]}=...")
