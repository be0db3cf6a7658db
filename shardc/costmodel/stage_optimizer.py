"""ZeRO-1/2's optimizer phase under a pipeline, once a step, on each stage: its layers' params and the
params outside the ``layers`` block it holds (:func:`stage_optimizer`).  ZeRO-1's gradient reduce-scatters,
which the plan lists in that phase, run as the pipeline's other gradient reductions do, under the last
microbatch's backward (:func:`shardc.stage_phases.zero_reductions`): :func:`stage_reductions` costs them apart."""

from __future__ import annotations

import math
from dataclasses import replace

from shardc.collectives import Layout
from shardc.costmodel.section_times import PartTime, part_time
from shardc.costmodel.stage_memory import held_names
from shardc.hardware import Hardware
from shardc.ir.plan import Plan, Step
from shardc.overlap import gathered_before
from shardc.pipeline.block_split import device_blocks
from shardc.spec.stages import Pipeline
from shardc.spec.walk import block_reads
from shardc.stage_phases import zero_reductions
from shardc.timing import phase_rows

__all__ = ["stage_optimizer", "stage_reductions", "optimizer_exposed"]


def stage_optimizer(plan: Plan, pipe: Pipeline, sizes: dict[str, int], hw: Hardware, spans: Layout) -> PartTime:
    """The optimizer phase's steps left once ZeRO-1's reductions are taken out, on the busiest stage: its
    seconds, and of them its compute and its collectives."""
    return max(_per_stage(plan, pipe, _gathers(plan), sizes, hw, spans), key=lambda t: t.seconds,
               default=PartTime(0.0, 0.0, 0.0))


def optimizer_exposed(plan: Plan, pipe: Pipeline, sizes: dict[str, int], hw: Hardware, spans: Layout,
                      forwards: list[float]) -> float:
    """What the optimizer phase adds to the step, on the stage it costs most: all of it, or under ``param_gather
    overlapped`` what its all-gathers add beside the stage's first forward of the next step (``forwards``:
    each stage's one microbatch; :func:`shardc.overlap.gathered_before`)."""
    times = _per_stage(plan, pipe, _gathers(plan), sizes, hw, spans)
    return max((gathered_before(f, t.seconds, hw.overlap_share, hw.gathers_under_forward)
                for f, t in zip(forwards, times, strict=True)), default=0.0)


def _gathers(plan: Plan) -> tuple[Step, ...]:
    """The optimizer phase's steps left once ZeRO-1's reductions, run in the backward, are taken out."""
    moved = zero_reductions(plan)
    return tuple(s for k, s in enumerate(plan.optimizer) if k not in moved)


def stage_reductions(plan: Plan, pipe: Pipeline, sizes: dict[str, int], hw: Hardware, spans: Layout) -> list[float]:
    """Per stage, the seconds of ZeRO-1's gradient reduce-scatters of the params it holds, issued ahead and
    bucketed as the backward's own reductions are (:func:`shardc.phase_time.comm_split`); none without ZeRO-1."""
    steps = tuple(replace(plan.optimizer[k], ahead=True) for k in sorted(zero_reductions(plan)))
    return [t.seconds for t in _per_stage(plan, pipe, steps, sizes, hw, spans)]


def _per_stage(plan: Plan, pipe: Pipeline, steps: tuple[Step, ...], sizes: dict[str, int], hw: Hardware,
               spans: Layout) -> list[PartTime]:
    """Each stage's time for ``steps`` (of the optimizer phase): one layer of each block times the block's
    layers it holds, plus the steps of the params outside the blocks it holds."""
    if not steps:
        return [PartTime(0.0, 0.0, 0.0) for _ in device_blocks(pipe)]
    rows = list(phase_rows(plan, steps, sizes, hw, spans))
    primal = {g: p for p, g in plan.gradient_names}
    blocks = block_reads(plan.spec)
    repeated = set(blocks)
    inside = [part_time([r for r in rows if blocks.get(primal.get(r.tensor, r.tensor)) == b], hw)
              for b in range(len(pipe.blocks) or 1)]  # one layer of each block
    out = []
    for stage, counts in enumerate(device_blocks(pipe)):
        held = held_names(plan, pipe, stage) or frozenset()
        own = part_time([r for r in rows if primal.get(r.tensor, r.tensor) in held - repeated], hw)
        busy, comm, seconds = (math.fsum(n * getattr(t, f) for n, t in zip(counts, inside, strict=True))
                               + getattr(own, f) for f in ("busy", "comm", "seconds"))
        out.append(PartTime(busy, comm, seconds))
    return out
