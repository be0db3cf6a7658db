"""Large searches: each sharding template planned once, then re-costed at every candidate's sizes and knobs.

A plan's steps are formulas of the dims and the mesh axis sizes (:class:`shardc.ir.plan.Monomial`),
so the plan made for one candidate costs, at another candidate's sizes, what that plan would take
there: ``shardc cost`` of it with the sizes replaced gives, to the last digit, the figures of a plan
made at those sizes whenever the planner chooses the same steps there.  Candidates of one *template*
(one spec, the same mesh axes above size 1 beside the stage axis, one recompute policy and ZeRO
line, and under a pipeline one microbatch size on a data-parallel device) share the plan of one of them, their
*representative*, planned as ``shardc plan`` plans it.  The stage axis is no part of a template: a
stage's plan is the spec's plan without the stage axis, whatever the stage count, and so are the
schedule, which only the pipeline's cost reads, and the order of the mesh axes (which links each lies
on, :mod:`shardc.layouts.orders`), which only the collectives' times read.  The microbatch size is:
a stage is searched at a microbatch's sizes (:func:`shardc.planner.contexts.stage_run_of`), so each
size a candidate uses has its stage planned at it; the layouts of one spec run its microbatch size at
their own counts (:mod:`shardc.layouts.microbatches`), so one size serves them all.  The plans made in one
search share their einsum solutions wherever their stages' sizes are the same
(:func:`shardc.planner.contexts.shared_search`): a recompute policy or a ZeRO line planned at a
microbatch size another template was planned at solves again only the einsum problems it holds apart.

A re-costed row is the cost of a real plan at the candidate's sizes, but not necessarily the plan
the planner would make there; so the best rows are planned at their own sizes, a few at a time,
until the first :data:`EXACT_TOP` rows are each their candidate's own plan (what ``shardc cost
--set ...`` reports for it).  The rows left re-costed say so (``planned`` false, and a note).
A row whose plan holds more than the HBM is planned at its own sizes as ``shardc cost`` plans it (the
fastest plan that fits, :func:`shardc.layouts.rank.fitted_report`) where it could rank among those
first rows once it fits; a row over the HBM left so says that too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace

from shardc.accountings import chosen
from shardc.costmodel.cost_report import cost
from shardc.costmodel.pipeline_cost import pipeline_cost
from shardc.errors import ShardcError
from shardc.ir.plan import Plan
from shardc.ir.spec import Spec
from shardc.layouts.microbatches import microbatch_size
from shardc.layouts.rank import Layout, Options, Skipped, evaluate, layout_of, mapped, processes, rank
from shardc.planner.planner import plan
from shardc.timing import plan_links, plan_time

__all__ = ["EXACT_TOP", "Candidate", "template_key", "recost", "search_templates", "template_rows", "refined",
           "representatives", "by_template", "kept_plans", "plan_template", "accepted", "step_of", "free_step", "note"]

EXACT_TOP = 3  # the rows planned at their own sizes, at least: the chosen one and the two behind it
ROUNDS = 8  # rounds of planning the best re-costed rows, each of EXACT_TOP plans at most
UNWEIGHED = (f"memory: over the HBM, not planned to fit here (slower than {EXACT_TOP} rows that fit, or past the "
             "search's rounds): `shardc cost` at its sizes plans the fastest plan that fits")
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

    @property
    def offload(self) -> str:
        """What the host's memory holds (the ``offload`` knob; ``none`` without it)."""
        return dict(self.knobs).get("offload", "none")


def template_key(c: Candidate, options: Options) -> tuple[object, ...]:
    """What a candidate's plan is made of beside sizes: the spec (its text with the mesh sizes left out),
    which of its non-stage axes shard anything (size > 1, in any order), the recompute policy and the ZeRO
    line, and a pipelined spec's microbatch size on a data-parallel device, which its stage is planned at
    (:func:`shardc.layouts.microbatches.microbatch_size`: layouts of other data-parallel sizes, each at the count
    that holds the spec's microbatch size, share one)."""
    active = tuple(sorted(a.name for a in c.spec.mesh.axes if a.size > 1 and not a.pipeline))
    statements = tuple(str(s) for s in c.spec.statements)
    return (c.label, statements, c.spec.dims, active, c.recompute or options.recompute, str(c.spec.zero),
            microbatch_size(c.spec))


def _at(template: Plan, c: Candidate) -> Plan:
    """``template`` at ``c``'s sizes, mesh order and pipeline lines, its stages' split among them (its own spec
    otherwise: its topology, a ZeRO-3 spec's params sharded)."""
    sizes = tuple(dict(c.spec.dims).items()) + tuple((a.name, a.size) for a in c.spec.mesh.axes)
    spec = replace(template.spec, mesh=c.spec.mesh, dims=c.spec.dims, microbatches=c.spec.microbatches,
                   schedule=c.spec.schedule, stage_layers=c.spec.stage_layers)
    return replace(template, spec=spec, sizes=sizes)


def recost(template: Plan, c: Candidate, options: Options) -> Layout | str:
    """``template`` costed at ``c``'s sizes, mesh order and knobs: a row (``planned`` false), or why cost refuses
    it."""
    try:
        report = cost(_at(template, c), mfu=options.mfu, optimizer=options.optimizer, offload=c.offload)
    except ShardcError as err:
        return err.message.splitlines()[0]
    row = layout_of(report, c.label, c.sizes)
    return replace(row, knobs=c.knobs, planned=False)


def step_of(template: Plan, c: Candidate, options: Options) -> tuple[float, bool, float] | None:
    """The step, whether a mesh axis splits a physical axis, and the critical-path communication of the row
    :func:`recost` gives ``c``, without the rest of its report: the step ``shardc cost`` reports is the one the
    planner minimises (:func:`shardc.timing.plan_time`).  A pipelined candidate gets a bound under them
    instead, the row's at most in the ranking's order: its simulated schedule without the optimizer's update
    after it (and the host's copies under ``--offload``), its split, and its exposed communication, which
    neither changes (the update is in the busiest device's compute as in its step; the host's copies only add
    to it).  None where cost refuses it."""
    at = _at(template, c)
    sizes = dict(at.sizes or ())
    try:
        links, _ = plan_links(at, at.chip, sizes)
        split = any(k.split for k in links.values())
        accounting = chosen(at.spec.optimizer, options.optimizer)
        pipe = pipeline_cost(at, at.chip, sizes, links, accounting) if c.spec.mesh.pipeline_axis else None
        if pipe is not None:  # its update_s left at 0 (None: the pipeline switched off, the plan's own step)
            return pipe.step_s, split, pipe.exposed_comm_s
        took = plan_time(at, sizes=sizes, optimizer=options.optimizer)
    except ShardcError:
        return None
    critical = math.fsum(p.critical_s for p in (took.forward, took.backward, took.optimizer))
    return took.step_s, split, critical


# links that take no time: what a step comes to with its communication free, under any order of its axes
_FREE = {"ici_bandwidth": 1e30, "dcn_bandwidth": 1e30, "hop_latency": 0.0, "collective_base": 0.0}


def free_step(template: Plan, c: Candidate, options: Options) -> float | None:
    """A bound under the step :func:`recost` gives ``c`` in any order of its mesh axes: a pipelined candidate's
    simulated schedule with every collective and send free (a schedule's ops only start later when
    they take longer); None without a pipeline (its compute, ``Layout.floor_s``, is that bound) or
    where cost refuses it."""
    if c.spec.mesh.pipeline_axis is None:
        return None
    at = _at(template, c)
    free = replace(at.chip, **_FREE)  # type: ignore[arg-type]
    sizes = dict(at.sizes or ())
    try:
        links, _ = plan_links(at, free, sizes)
        pipe = pipeline_cost(at, free, sizes, links, chosen(at.spec.optimizer, options.optimizer))
    except ShardcError:
        return None
    return pipe.step_s if pipe is not None else None


# the plans made inside kept_plans(): (template key, sizes, knobs) of a representative -> its plan or refusal
_KEPT: ContextVar[dict[tuple[object, ...], Plan | str] | None] = ContextVar("kept_plans", default=None)


@contextmanager
def kept_plans() -> Iterator[None]:
    """Plans made inside (in this process) are kept, so a template planned once to cost the written order
    of its layouts is not planned again to cost their other orders."""
    token = _KEPT.set({})
    try:
        yield
    finally:
        _KEPT.reset(token)


def _kept_key(c: Candidate, options: Options) -> tuple[object, ...]:
    return (template_key(c, options), c.sizes, c.knobs)


def plan_template(c: Candidate, options: Options) -> Plan | str:
    """``c`` planned (kept inside :func:`kept_plans`), or why the planner refuses it."""
    kept = _KEPT.get()
    key = _kept_key(c, options)
    if kept is not None and key in kept:
        return kept[key]
    try:
        made: Plan | str = plan(c.spec, save=options.save, hardware=options.hardware,
                                recompute=c.recompute or options.recompute, topology=options.topology,
                                collective_matmul=options.collective_matmul)
    except ShardcError as err:
        made = err.message.splitlines()[0]
    if kept is not None:
        kept[key] = made
    return made


def accepted(members: Sequence[Candidate], rep: Candidate, options: Options) -> tuple[Candidate, Plan | str]:
    """``rep`` planned (:func:`plan_template`); where the planner refuses it at its own sizes (a microbatch its
    data-parallel devices do not divide, :func:`shardc.pipeline.boundary.check_microbatches`), the first other
    of ``members`` it plans, so that one candidate's refusal is not its whole template's; ``rep`` and its
    refusal where it plans none."""
    refusal: str | None = None
    for c in (rep, *(m for m in members if m is not rep)):
        made = plan_template(c, options)
        if isinstance(made, Plan):
            return c, made
        refusal = refusal or made
    assert refusal is not None
    return rep, refusal


def _exact(c: Candidate, options: Options) -> Layout | str:
    row = evaluate(c.spec, options, c.recompute, c.offload)
    return row if isinstance(row, str) else replace(row, sizes=c.sizes, knobs=c.knobs)


def representatives(found: Sequence[Candidate], options: Options,
                    ranked: bool = False) -> dict[tuple[object, ...], Candidate]:
    """Each template's representative among ``found`` (as :func:`search_templates` picks it), by template key."""
    return {key: _representative(members, ranked) for key, members in by_template(found, options).items()}


def by_template(found: Sequence[Candidate], options: Options) -> dict[tuple[object, ...], list[Candidate]]:
    """``found`` grouped by template (:func:`template_key`), each group in ``found``'s order."""
    groups: dict[tuple[object, ...], list[Candidate]] = {}
    for c in found:
        groups.setdefault(template_key(c, options), []).append(c)
    return groups


def _representative(members: Sequence[Candidate], first: bool) -> Candidate:
    """The template's first candidate (``first``: they come best first), else its middle one in enumeration
    order (its sizes the least extreme)."""
    return members[0 if first else len(members) // 2]


def note(rep: Candidate) -> str:
    """What a row re-costed with ``rep``'s plan says of it."""
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
    groups = by_template(found, options)
    n = processes(jobs, len(groups), worth=1) if len(found) >= POOLED or jobs > 1 else 1
    reps = [_representative(members, ranked) for members in groups.values()]
    done = mapped(_planned_rows, [(members, rep, options) for members, rep in zip(groups.values(), reps, strict=True)],
                  n, progress)
    rows = [row for made, _, _ in done for row in made]
    skipped = [s for _, refused, _ in done for s in refused]
    kept = _KEPT.get()
    if kept is not None:  # the plans made over processes, kept here too
        kept.update((_kept_key(rep, options), template) for rep, (_, _, template) in zip(reps, done, strict=True))
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
    rows, skipped, _ = _planned_rows(members, rep, options)
    return rows, skipped


def _planned_rows(members: Sequence[Candidate], rep: Candidate,
                  options: Options) -> tuple[list[Layout], list[Skipped], Plan | str]:
    """:func:`template_rows`, and the plan (or the planner's refusal)."""
    rep, template = accepted(members, rep, options)
    rows: list[Layout] = []
    skipped: list[Skipped] = []
    for c in members:
        row = recost(template, c, options) if isinstance(template, Plan) else template
        if isinstance(row, str):
            skipped.append(Skipped(c.label, c.sizes, row))
        else:  # the representative's row is its own plan's
            rows.append(replace(row, planned=True) if c == rep else replace(row, notes=row.notes + (note(rep),)))
    return rows, skipped, template


def _which(row: Layout) -> tuple[str, tuple[tuple[str, int], ...], tuple[tuple[str, str], ...]]:
    return (row.spec, row.sizes, row.knobs)


def refined(rows: Sequence[Layout], found: Sequence[Candidate], options: Options,
            planned: float = 0) -> tuple[list[Layout], list[Skipped], float]:
    """``rows`` (of candidates among ``found``) with the best re-costed ones planned at their own sizes until
    the first EXACT_TOP are all planned, and those that do not fit but could rank among them
    (:func:`_unfitted`) planned to fit; the rows, those the planner refuses at their own sizes, and
    ``planned`` plus the plans made."""
    by_row = {(c.label, c.sizes, c.knobs): c for c in found}
    out, refused = list(rows), []
    weighed: set[tuple[object, ...]] = set()  # planned at their own sizes as `shardc cost` plans: to fit
    for _ in range(ROUNDS):
        out = rank(out)
        todo = {_which(r): r for r in [r for r in out[:EXACT_TOP] if not r.planned] + _unfitted(out, weighed)}
        if not todo:
            break
        for which, r in todo.items():
            c = by_row[which]
            row = _exact(c, options)
            planned += 1
            weighed.add(which)
            out.remove(r)
            if isinstance(row, str):
                refused.append(Skipped(c.label, c.sizes, row))
            else:
                out.append(row)
    return rank([_unweighed(r) if _which(r) not in weighed and not r.fits and r.state_bytes <= r.hbm_bytes
                 else r for r in out]), refused, planned


def _unweighed(row: Layout) -> Layout:
    """A row over the HBM whose layout was not planned to fit, saying so (`shardc cost` would plan it to)."""
    return replace(row, notes=row.notes + (UNWEIGHED,))


def _unfitted(ranked: Sequence[Layout], weighed: set[tuple[object, ...]]) -> list[Layout]:
    """The first EXACT_TOP rows of ``ranked`` that do not fit, are not yet planned to fit (``weighed``), could fit
    and are faster than the EXACT_TOP-th row that fits: their plan (the fastest at their sizes, or re-costed)
    holds too much, but a slower plan of theirs may fit and still rank among the first (a plan that fits is no
    faster than the fastest).  A row whose training state alone passes the HBM cannot fit under any plan: the
    params, gradients and optimizer state are the declared shardings' and the ZeRO line's, whatever the plan
    (:func:`shardc.costmodel.memory.state_refs`)."""
    fitting = [r.step_s for r in ranked if r.fits]
    bar = fitting[EXACT_TOP - 1] if len(fitting) >= EXACT_TOP else math.inf
    return [r for r in ranked if not r.fits and r.state_bytes <= r.hbm_bytes and _which(r) not in weighed
            and r.step_s < bar][:EXACT_TOP]
