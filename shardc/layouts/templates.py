"""Large searches: each sharding template planned once, then re-costed at every candidate's sizes and knobs.

A plan's steps are formulas of the dims and the mesh axis sizes (:class:`shardc.ir.plan.Monomial`),
so the plan made for one candidate costs, at another candidate's sizes, what that plan would take
there: ``shardc cost`` of it with the sizes replaced gives, to the last digit, the figures of a plan
made at those sizes whenever the planner chooses the same steps there.  Candidates of one *template*
(one spec, the same mesh axes above size 1 beside the stage axis, one recompute policy and ZeRO
line) share the plan of one of them, their *representative*, planned as ``shardc plan`` plans it.
The stage axis is no part of a template: a stage's plan is the spec's plan without the stage axis,
whatever the stage count, and so are the microbatch count and the schedule, which only the
pipeline's cost reads.

A re-costed row is the cost of a real plan at the candidate's sizes, but not necessarily the plan
the planner would make there; so the best rows are planned at their own sizes, a few at a time,
until the first :data:`EXACT_TOP` rows are each their candidate's own plan (what ``shardc cost
--set ...`` reports for it).  The rows left re-costed say so (``planned`` false, and a note).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from shardc.costmodel.cost_report import cost
from shardc.errors import ShardcError
from shardc.ir.plan import Plan
from shardc.ir.spec import Mesh, Spec
from shardc.layouts.rank import Layout, Options, Skipped, evaluate, layout_of, mapped, processes, rank
from shardc.planner.planner import plan

__all__ = ["EXACT_TOP", "Candidate", "template_key", "recost", "search_templates", "template_rows", "refined"]

EXACT_TOP = 3  # the rows planned at their own sizes, at least: the chosen one and the two behind it
ROUNDS = 8  # rounds of planning the best re-costed rows, each of EXACT_TOP plans at most
POOLED = 64  # candidates from which the templates are spread over processes (with jobs 0, one a core)


@dataclass(frozen=True)
class Candidate:
    """One candidate: its spec at its sizes and knobs (validated), its row's axes, knobs and recompute."""

    spec: Spec
    sizes: tuple[tuple[str, int], ...]
    knobs: tuple[tuple[str, str], ...] = ()
    recompute: str | None = None  # None: the search's (Options.recompute)

    @property
    def label(self) -> str:
        return self.spec.filename or "<spec>"


def template_key(c: Candidate, options: Options) -> tuple[object, ...]:
    """What a candidate's plan is made of beside sizes: the spec (its text with the mesh sizes left out),
    which of its non-stage axes shard anything (size > 1), the recompute policy and the ZeRO line."""
    active = tuple(a.name for a in c.spec.mesh.axes if a.size > 1 and not a.pipeline)
    statements = tuple(str(s) for s in c.spec.statements)
    return (c.label, statements, c.spec.dims, active, c.recompute or options.recompute, str(c.spec.zero))


def recost(template: Plan, c: Candidate, options: Options) -> Layout | str:
    """``template`` costed at ``c``'s sizes and knobs: a row (``planned`` false), or why cost refuses it."""
    sizes = tuple(dict(c.spec.dims).items()) + tuple((a.name, a.size) for a in c.spec.mesh.axes)
    axes = {a.name: a for a in c.spec.mesh.axes}
    # the plan's own spec (its topology, a ZeRO-3 spec's params sharded), at c's sizes and pipeline lines
    spec = replace(template.spec, mesh=Mesh(tuple(axes[a.name] for a in template.spec.mesh.axes)), dims=c.spec.dims,
                   microbatches=c.spec.microbatches, schedule=c.spec.schedule)
    try:
        report = cost(replace(template, spec=spec, sizes=sizes), mfu=options.mfu, optimizer=options.optimizer)
    except ShardcError as err:
        return err.message.splitlines()[0]
    row = layout_of(report, c.label, c.sizes)
    return replace(row, knobs=c.knobs, planned=False)


def _plan(c: Candidate, options: Options) -> Plan | str:
    try:
        return plan(c.spec, save=options.save, hardware=options.hardware, recompute=c.recompute or options.recompute,
                    topology=options.topology, collective_matmul=options.collective_matmul)
    except ShardcError as err:
        return err.message.splitlines()[0]


def _exact(c: Candidate, options: Options) -> Layout | str:
    row = evaluate(c.spec, options, c.recompute)
    return row if isinstance(row, str) else replace(row, sizes=c.sizes, knobs=c.knobs)


def _representative(members: Sequence[Candidate], first: bool) -> Candidate:
    """The template's first candidate (``first``: they come best first), else its middle one in enumeration
    order (its sizes the least extreme)."""
    return members[0 if first else len(members) // 2]


def _note(rep: Candidate) -> str:
    sizes = " ".join(f"{k}={v}" for k, v in rep.sizes)
    return f"re-costed: the plan made at {sizes}, costed at this row's sizes (not planned at them)"


def search_templates(found: Sequence[Candidate], options: Options,
                     progress: Callable[[int, int], None] | None = None, refine: bool = True,
                     ranked: bool = False, jobs: int = 1) -> tuple[list[Layout], list[Skipped], dict[str, float]]:
    """Every candidate costed with its template's plan, the best planned at their own sizes (``refine``:
    else see :func:`refined`); ranked rows, the candidates refused, and counts.  ``ranked``: ``found``
    comes best first (a knob's settings of the best layouts), so each template is planned at its first.
    ``jobs``: processes the templates are spread over (0: one a core, from :data:`POOLED` candidates)."""
    start = time.perf_counter()
    groups: dict[tuple[object, ...], list[Candidate]] = {}
    for c in found:
        groups.setdefault(template_key(c, options), []).append(c)
    n = processes(jobs, len(groups), worth=1) if len(found) >= POOLED or jobs > 1 else 1
    done = mapped(template_rows, [(members, _representative(members, ranked), options) for members in groups.values()],
                  n, progress)
    rows = [row for made, _ in done for row in made]
    skipped = [s for _, refused in done for s in refused]
    stats = {"candidates": len(found), "planned": len(groups), "reused": 0, "recosted": 0,
             "templates": len(groups), "jobs": n, "seconds": 0.0}
    if refine:
        rows, more, stats["planned"] = refined(rows, found, options, stats["planned"])
        skipped += more
    rows = rank(rows)
    stats["recosted"] = sum(not r.planned for r in rows)
    stats["seconds"] = time.perf_counter() - start
    return rows, skipped, stats


def template_rows(members: Sequence[Candidate], rep: Candidate,
                  options: Options) -> tuple[list[Layout], list[Skipped]]:
    """``rep`` planned, and every member costed with its plan: their rows, and those refused."""
    template = _plan(rep, options)
    rows: list[Layout] = []
    skipped: list[Skipped] = []
    for c in members:
        row = recost(template, c, options) if isinstance(template, Plan) else template
        if isinstance(row, str):
            skipped.append(Skipped(c.label, c.sizes, row))
        else:  # the representative's row is its own plan's
            rows.append(replace(row, planned=True) if c == rep else replace(row, notes=row.notes + (_note(rep),)))
    return rows, skipped


def _which(row: Layout) -> tuple[str, tuple[tuple[str, int], ...], tuple[tuple[str, str], ...]]:
    return (row.spec, row.sizes, row.knobs)


def refined(rows: Sequence[Layout], found: Sequence[Candidate], options: Options,
            planned: float = 0) -> tuple[list[Layout], list[Skipped], float]:
    """``rows`` (of candidates among ``found``) with the best re-costed ones planned at their own sizes until
    the first EXACT_TOP are all planned; the rows, those the planner refuses at their own sizes, and
    ``planned`` plus the plans made."""
    by_row = {(c.label, c.sizes, c.knobs): c for c in found}
    out, refused = list(rows), []
    for _ in range(ROUNDS):
        out = rank(out)
        todo = [r for r in out[:EXACT_TOP] if not r.planned]
        if not todo:
            break
        for r in todo:
            c = by_row[_which(r)]
            row = _exact(c, options)
            planned += 1
            out.remove(r)
            if isinstance(row, str):
                refused.append(Skipped(c.label, c.sizes, row))
            else:
                out.append(row)
    return rank(out), refused, planned
