"""The knobs that change a step but not a layout, searched beside it: microbatches, schedule, recompute, ZeRO,
host offload.

For a candidate layout, :func:`combinations` gives it under every combination of the knobs' settings
(their product), where the spec allows it; the search (:mod:`shardc.layouts.layout_search`) costs
them, skipping those a bound proves cannot win.  A knob's settings:

* ``microbatches`` (a pipelined candidate): the stage count times 1, 2, 4, 8 and 16, and the candidate's
  own (the count that holds the spec's microbatch size, :mod:`shardc.layouts.microbatches`), that split
  the batch (more microbatches shrink the bubble, (p-1)/m of the ideal step under GPipe and 1F1B, and
  each microbatch's matmuls);
* ``schedule`` (a pipelined candidate): every schedule shardc simulates (``gpipe``, ``1f1b``,
  ``interleaved 2``, ``zb-h1``, ``zbv``, ``dualpipe``, ``dualpipev``), where the spec's stages, layers
  and microbatches allow it;
* ``recompute``: ``none``, ``selective``, ``full``, ``dots`` (what the backward recomputes instead of keeping);
* ``zero``: ZeRO 1, 2 and 3 over the candidate's data-parallel axes (those of size > 1 that shard a
  token dim and no parameter), or none; a spec's own ``zero`` line varies its stage over its axes.
* ``offload`` (a chip with a host link figure): ``none``, ``activations``, ``optimizer`` (where the chip
  has a host Adam rate) and ``both``, as ``shardc cost --offload`` costs them
  (:mod:`shardc.costmodel.offload`): a layout that fits only with its kept values or its optimizer on the
  host is found and priced so.  Offload changes the cost, not the plan: the same template re-costed.

:func:`search_knobs` costs the combinations template by template (a recompute policy, a ZeRO line and
a microbatch count, whose size the stage is searched at: one plan, re-costed at each schedule, its
einsums' solutions shared with the plans made at the same microbatch size), and skips, unplanned, those that
cannot fit while a row fits (a row that fits outranks every one that does not).  The bound is the
training state: the params, gradients and optimizer state a device (a stage) holds are fixed by the
params' declared shardings, the ZeRO line and the stages' layers, whatever the recompute policy,
the microbatch count and the plan; once one combination of a layout, ZeRO line and schedule shows
that state alone over the HBM, every other recompute policy and microbatch count of them is skipped.
A pipelined combination whose simulated schedule with every collective and send free is already
slower than a row that fits is skipped too, unrecosted (a schedule's ops only start later when they
take longer: :func:`shardc.layouts.templates.free_step`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace

from shardc.costmodel.offload import OFFLOADS
from shardc.errors import ShardcError
from shardc.ir.spec import SCHEDULES, Schedule, Spec, Zero
from shardc.layouts.rank import DIGITS, Layout, Options, Skipped, rank_key
from shardc.layouts.templates import Candidate, accepted, by_template, free_step, note, recost
from shardc.planner.graph import build_graph
from shardc.planner.recompute import RECOMPUTE_MODES
from shardc.spec.validate import validate
from shardc.spec.walk import leaves

__all__ = ["KNOBS", "combinations", "search_knobs", "data_axes"]

KNOBS = ("microbatches", "schedule", "recompute", "zero", "offload")
MICROBATCHES_A_STAGE = (1, 2, 4, 8, 16)
INTERLEAVED = 2  # virtual stages a device of the interleaved schedule tried


def data_axes(spec: Spec) -> tuple[str, ...]:
    """The mesh axes of size > 1 that shard a token dim (one no parameter has) and no parameter."""
    params = build_graph(spec).params
    refs = [r for s in spec.statements for r in (s.result, *leaves(s.expr))]
    model = {d.name for r in refs if r.name in params for d in r.dims}
    on_params = {a for r in refs if r.name in params for d in r.dims for a in d.axes}
    on_tokens = {a for r in refs for d in r.dims if d.name not in model for a in d.axes}
    return tuple(a.name for a in spec.mesh.axes if a.size > 1 and a.name in on_tokens - on_params)


def _settings(c: Candidate, knob: str, options: Options) -> list[str]:
    spec = c.spec
    pipe = spec.mesh.pipeline_axis
    staged = pipe is not None and pipe.size > 1
    if knob == "microbatches" and staged:
        assert pipe is not None
        counts = [spec.microbatches or pipe.size, *(pipe.size * k for k in MICROBATCHES_A_STAGE)]
        return [str(m) for m in dict.fromkeys(counts)]
    if knob == "schedule" and staged:
        schedule = str(spec.schedule or Schedule())
        named = [f"interleaved {INTERLEAVED}" if s == "interleaved" else s for s in SCHEDULES]
        return list(dict.fromkeys([schedule, *named]))
    if knob == "recompute":
        return list(dict.fromkeys([c.recompute or options.recompute, *RECOMPUTE_MODES]))
    if knob == "zero":
        axes = spec.zero.axes if spec.zero is not None else data_axes(spec)
        stage = str(spec.zero.stage) if spec.zero is not None else "none"
        return list(dict.fromkeys([stage, "none", "1", "2", "3"])) if axes else []
    if knob == "offload" and options.hardware.host_bandwidth is not None:
        host = options.hardware.host_adam_rate is not None
        return [v for v in OFFLOADS if host or v in ("none", "activations")]
    return []


def _apply(c: Candidate, setting: dict[str, str], options: Options) -> Candidate:
    """``c`` under ``setting`` (knob -> value); raises ShardcError where the spec refuses it."""
    spec = c.spec
    setting = {k: v for k, v in setting.items() if v}
    if "microbatches" in setting:
        spec = replace(spec, microbatches=int(setting["microbatches"]))
    if "schedule" in setting and setting["schedule"] != str(spec.schedule or Schedule()):  # the spec's own kept whole
        name, _, virtual = setting["schedule"].partition(" ")
        spec = replace(spec, schedule=Schedule(name, int(virtual or 1)))
    if "zero" in setting:
        axes = spec.zero.axes if spec.zero is not None else data_axes(spec)
        spec = replace(spec, zero=None if setting["zero"] == "none" else Zero(int(setting["zero"]), axes))
    validate(spec)
    knobs = tuple((k, v) for k, v in setting.items())
    return Candidate(spec, c.sizes, knobs, setting.get("recompute", c.recompute))


def combinations(c: Candidate, knobs: Sequence[str], options: Options) -> list[Candidate]:
    """``c`` under every combination of the settings of ``knobs`` its spec allows, but its own: the product,
    not one knob at a time (knobs interact: a recompute policy that fits only beside a ZeRO stage).  A
    candidate's ``knobs`` name the settings that differ from ``c``'s."""
    settings = [[(knob, value) for value in _settings(c, knob, options)] for knob in KNOBS if knob in knobs]
    settings = [s for s in settings if s]
    own = dict(s[0] for s in settings)  # each knob's first setting is c's own
    out = []
    for combo in itertools.product(*settings):
        changed = {knob: value for knob, value in combo if value != own[knob]}
        if not changed:
            continue
        try:
            out.append(_apply(c, dict(c.knobs) | changed, options))
        except ShardcError:
            continue  # e.g. interleaved with microbatches not a multiple of the stages
    return out


def _state_key(c: Candidate) -> tuple[object, ...]:
    """What a candidate's training state is made of: its layout, ZeRO line, schedule and offload (not its
    recompute policy or microbatch count)."""
    return (c.label, c.sizes, str(c.spec.zero), str(c.spec.schedule), c.offload)


def _over(rows: Sequence[Layout], by_row: dict[tuple[object, ...], Candidate]) -> set[tuple[object, ...]]:
    """The state keys of ``rows`` whose training state alone passes the chip's HBM."""
    return {_state_key(by_row[k]) for r in rows if (k := (r.spec, r.sizes, r.knobs)) in by_row
            and r.state_bytes > r.hbm_bytes}


def search_knobs(best: Sequence[Candidate], rows: Sequence[Layout], options: Options,
                 progress: Callable[[int, int], None] | None = None, bounded: bool = True
                 ) -> tuple[list[Layout], list[Skipped], list[Candidate], dict[str, float]]:
    """Every combination of ``options.knobs`` for each of ``best`` (whose rows are among ``rows``), template
    by template, skipping, while a row fits, those the state bound proves cannot fit, and the pipelined
    ones whose schedule with every collective free is slower than it (``bounded`` false: none); the rows,
    the candidates refused, the candidates made, and counts (``planned``, ``pruned``: candidates skipped)."""
    made = [v for c in best for v in combinations(c, options.knobs, options)]
    groups = by_template(made, options)  # in product order: a policy's ZeRO lines before the next policy's
    by_row: dict[tuple[object, ...], Candidate] = {(c.label, c.sizes, c.knobs): c for c in [*best, *made]}
    over = _over(rows, by_row) if bounded else set()  # state keys whose state alone passes the HBM
    bar = _best(rows) if bounded else None
    out: list[Layout] = []
    refused: list[Skipped] = []
    planned = pruned = 0
    for done, members in enumerate(groups.values(), 1):
        live = [c for c in members if bar is None or _state_key(c) not in over]
        pruned += len(members) - len(live)
        if live:
            found, no, skipped = _costed(live, options, bar)
            out, refused, planned, pruned = out + found, refused + no, planned + 1, pruned + skipped
            if bounded:
                over |= _over(found, by_row)
                bar = _best([*([bar] if bar is not None else []), *found])
        if progress is not None:
            progress(done, len(groups))
    return out, refused, made, {"planned": planned, "pruned": pruned, "combinations": len(made)}


def _best(rows: Sequence[Layout]) -> Layout | None:
    """The first of ``rows`` that fit, by the ranking; None when none fits."""
    fitting = [r for r in rows if r.fits]
    return min(fitting, key=rank_key) if fitting else None


def _costed(members: Sequence[Candidate], options: Options,
            bar: Layout | None) -> tuple[list[Layout], list[Skipped], int]:
    """The first of ``members`` planned, and each costed with its plan but those whose schedule with every
    collective free (:func:`shardc.layouts.templates.free_step`) is slower than ``bar``: the rows, those
    refused, and how many were skipped."""
    rep, template = accepted(members, members[0], options)
    if isinstance(template, str):
        return [], [Skipped(c.label, c.sizes, template) for c in members], 0
    rows: list[Layout] = []
    refused: list[Skipped] = []
    skipped = 0
    for c in members:
        bound = free_step(template, c, options) if bar is not None and c is not rep else None
        if bound is not None and bar is not None and float(f"{bound:.{DIGITS - 1}e}") > \
                float(f"{bar.step_s:.{DIGITS - 1}e}"):
            skipped += 1
            continue
        row = recost(template, c, options)
        if isinstance(row, str):
            refused.append(Skipped(c.label, c.sizes, row))
        else:  # the representative's row is its own plan's
            rows.append(replace(row, planned=True) if c is rep else replace(row, notes=row.notes + (note(rep),)))
    return rows, refused, skipped
