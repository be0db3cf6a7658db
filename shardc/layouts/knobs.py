"""The knobs that change a step but not a layout, searched beside it: microbatches, schedule, recompute, ZeRO.

For a candidate layout, :func:`variants` gives it under every other setting of one knob, where the
spec allows it (the search varies the knobs one at a time, each from the best setting of those
before it):

* ``microbatches`` (a pipelined candidate): the stage count times 1, 2, 4, 8 and 16, and the spec's
  own, that split the batch (more microbatches shrink the bubble, (p-1)/m of the ideal step under
  GPipe and 1F1B, and each microbatch's matmuls);
* ``schedule`` (a pipelined candidate): every schedule shardc simulates (``gpipe``, ``1f1b``,
  ``interleaved 2``, ``zb-h1``, ``zbv``), where the spec's stages and layers allow it;
* ``recompute``: ``none``, ``selective``, ``full`` (what the backward recomputes instead of keeping);
* ``zero``: ZeRO 1, 2 and 3 over the candidate's data-parallel axes (those of size > 1 that shard a
  token dim and no parameter), or none; a spec's own ``zero`` line varies its stage over its axes.

Host offload of activations or optimizer state is not a knob here: shardc's cost model has no host link.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from shardc.errors import ShardcError
from shardc.ir.spec import SCHEDULES, Schedule, Spec, Zero
from shardc.layouts.rank import Options
from shardc.layouts.templates import Candidate
from shardc.planner.graph import build_graph
from shardc.planner.recompute import RECOMPUTE_MODES
from shardc.spec.validate import validate
from shardc.spec.walk import leaves

__all__ = ["KNOBS", "variants", "data_axes"]

KNOBS = ("microbatches", "schedule", "recompute", "zero")
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
    return []


def _apply(c: Candidate, setting: dict[str, str], options: Options) -> Candidate:
    """``c`` under ``setting`` (knob -> value); raises ShardcError where the spec refuses it."""
    spec = c.spec
    setting = {k: v for k, v in setting.items() if v}
    if "microbatches" in setting:
        spec = replace(spec, microbatches=int(setting["microbatches"]))
    if "schedule" in setting:
        name, _, virtual = setting["schedule"].partition(" ")
        spec = replace(spec, schedule=Schedule(name, int(virtual or 1)))
    if "zero" in setting:
        axes = spec.zero.axes if spec.zero is not None else data_axes(spec)
        spec = replace(spec, zero=None if setting["zero"] == "none" else Zero(int(setting["zero"]), axes))
    validate(spec)
    knobs = tuple((k, v) for k, v in setting.items())
    return Candidate(spec, c.sizes, knobs, setting.get("recompute", c.recompute))


def variants(c: Candidate, knob: str, options: Options) -> Iterator[Candidate]:
    """``c`` (at the knob settings it has) under every other setting of ``knob`` its spec allows."""
    values = _settings(c, knob, options)
    for value in values[1:]:  # the first is c's own
        try:
            yield _apply(c, dict(c.knobs) | {knob: value}, options)
        except ShardcError:
            continue  # e.g. interleaved with microbatches not a multiple of the stages
