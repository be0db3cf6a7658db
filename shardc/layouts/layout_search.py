"""``shardc layouts``: which mesh layout, for this model, on these chips.

For each spec (the first, and those given with ``--with``: e.g. a DP, an FSDP and an
FSDP+TP variant of one model), every assignment of sizes to its searched mesh axes
whose product is the chip count (:mod:`shardc.layouts.factor`) is planned and costed
(:mod:`shardc.layouts.rank`), and the layouts are ranked.  The chosen layout is the
first: the fastest of those that fit, the reason said in numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shardc.costmodel.cost_report import cost
from shardc.errors import ShardcError
from shardc.ir.spec import Spec
from shardc.layouts.book_optimum import BookOptimum, book_optimum
from shardc.layouts.factor import MAX_WORK, candidates, searched_axes
from shardc.layouts.layouts_text import reason, render, to_json
from shardc.layouts.rank import RULE, Layout, Options, Skipped, prepare, ranked
from shardc.planner.planner import plan
from shardc.spec.overrides import dim_names

__all__ = ["LayoutSearch", "search_layouts"]


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
    for spec in specs:
        _check_sized(spec)
    plans = [candidates(spec, n, fixed & set(spec.mesh.names)) for spec in specs]
    work = sum(len(found) << len(searched_axes(spec, fixed & set(spec.mesh.names)).searched)
               for spec, found in zip(specs, plans, strict=True))
    if work > MAX_WORK:  # each spec is within it (candidates checks): together they are not
        raise ShardcError(f"{len(specs)} specs have {sum(map(len, plans))} layouts on {n} chips together, past the "
                          f"budget of {MAX_WORK} plans x 2^axes", fix="search fewer --with specs at once")
    rows, skipped, stats = ranked(specs, plans, options, jobs, progress)
    optimum = _optimum(specs, rows, options, fixed) if rows else None
    return LayoutSearch(n, options, tuple(rows), tuple(skipped), stats, optimum=optimum)


def _optimum(specs: Sequence[Spec], rows: Sequence[Layout], options: Options,
             fixed: frozenset[str]) -> BookOptimum | None:
    """The book's X_opt, when the chosen layout's spec has two searched axes (FSDP, then tensor parallel),
    at the links of the best layout of that spec using both (the chosen one, unless it switches one off)."""
    spec = next(s for s in specs if (s.filename or "<spec>") == rows[0].spec)
    axes = searched_axes(spec, fixed & set(spec.mesh.names)).searched
    best = next((r for r in rows if r.spec == rows[0].spec and all(dict(r.sizes).get(a, 1) > 1 for a in axes)),
                rows[0])
    candidate = prepare(spec, dict(best.sizes))
    if len(axes) != 2 or not isinstance(candidate, Spec):
        return None
    report = cost(plan(candidate, save=options.save, hardware=options.hardware, recompute=options.recompute,
                       topology=options.topology), mfu=options.mfu, optimizer=options.optimizer)
    return book_optimum(report, axes)


def _check_sized(spec: Spec) -> None:
    sized = dict(spec.dims)
    missing = [d for d in dim_names(spec) if d not in sized]
    if missing:
        raise ShardcError(f"{spec.filename or '<spec>'}: layouts are ranked by step time, which needs a size for "
                          f"every dim; {', '.join(missing)} {'has' if len(missing) == 1 else 'have'} none",
                          fix=f"add them to the dims line, or pass --set {missing[0]}=...")
