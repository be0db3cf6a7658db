"""A microbatch's times through each section of a pipelined plan: forward, B and W, each layer's and each end's.

:func:`section_times` costs the plan at one microbatch's sizes, cut by its sections: one layer of each
``layers`` block (the block section's steps of that block, :attr:`~shardc.ir.plan.Step.block`), the
statements before the blocks (the first chunk runs them) and those after them (the last chunk); each
section's forward, the backward's input-gradient part (B) and its weight-gradient part (W: the steps on
``dW...``), each ``max(compute, collectives)`` as the report's own step is, and apart the gradient
reductions run once a step on the microbatches' sums.  :func:`run_times` gives a run of layers (a stage's,
a chunk's) from them, :func:`chunk_times` each model chunk's as the schedule's simulation reads them
(:mod:`shardc.costmodel.pipeline_cost` sums them into the pipeline's figures).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardc.collectives import Layout
from shardc.hardware import Hardware
from shardc.ir.plan import Plan, Step
from shardc.pipeline.backward_split import weight_steps
from shardc.pipeline.block_split import chunk_blocks
from shardc.pipeline.boundary import carried_moves, gradient_reductions
from shardc.pipeline.dualpipe import end_chunks
from shardc.pipeline.schedules import Phases, Timing
from shardc.spec.stages import Pipeline
from shardc.step_cost import StepCost
from shardc.timing import phase_rows, phase_time

__all__ = ["PartTime", "part_time", "section_times", "run_times", "phases_of", "end_timing", "chunk_times"]


@dataclass(frozen=True)
class PartTime:
    """A run of rows: compute and memory-bound time, collective time, and its time overlapped; ``paired``:
    its compute and memory-bound time beside collectives running all along (an F&B pair's other op's),
    which hold the chip's share of cores NCCL holds (:func:`shardc.timing.phase_seconds`'s rule)."""

    busy: float
    comm: float
    seconds: float
    paired: float


def part_time(rows: list[StepCost], hw: Hardware) -> PartTime:
    t = phase_time(((r, 1) for r in rows), hw)
    return PartTime(t.busy_s, t.comm_s, t.seconds, t.busy_s + hw.overlap_share * t.comm_s)


def _rows(steps: tuple[Step, ...], plan: Plan, sizes: dict[str, int], hw: Hardware,
          spans: Layout) -> list[StepCost]:
    return list(phase_rows(plan, steps, sizes, hw, spans))


def _runs(plan: Plan, phase: str, rows: list[StepCost]) -> tuple[list[StepCost], list[StepCost], list[StepCost]]:
    """A phase's rows (one a step) in the plan's three sections, in the order the phase runs them."""
    first, block, then = plan.cut.runs(phase, rows)
    return list(first), list(block), list(then)


def section_times(plan: Plan, micro: dict[str, int], hw: Hardware, spans: Layout,
              blocks: int = 1, zero_bubble: bool = False) -> dict[str, list[PartTime]]:
    """(compute, comm) of a microbatch's F, B and W: one layer of each ``layers`` block ("layer 0",
    "layer 1", ...: the block section's steps of that block), the statements before the blocks ("first":
    the first chunk runs them) and those after them ("last"); and of each, the gradient reductions run
    once a step ("... reduce").  Under the zero-bubble schedules the backward before the blocks is all W:
    nothing waits for the gradient of its inputs (token ids, data), so the lowered program runs it whole
    at W's tick (:mod:`shardc.lowering.pipeline_split`)."""
    before, block, after = _runs(plan, "forward", _rows(plan.forward, plan, micro, hw, spans))
    carried = _rows(carried_moves(plan), plan, micro, hw, spans)  # a tied param's gather, again on the last stage
    fwd = (before, block, carried + after)
    again = _runs(plan, "recomputed", _rows(plan.recomputed, plan, micro, hw, spans))  # a recompute runs in the B op
    rows = _rows(plan.backward, plan, micro, hw, spans)
    # W (shardc.pipeline.backward_split, the lowered program's cut), and the reductions run once a step on the sums
    grads, reduced = weight_steps(plan), gradient_reductions(plan)
    after, inside, before = _runs(plan, "backward", rows)  # the backward runs the statements after the block first
    last, layer, first = plan.cut.runs("backward", range(len(rows)))  # each row's step
    out = {}
    runs: list[tuple[str, int, list[StepCost], Sequence[int], int | None]] = [
        ("first", 0, before, first, None), ("last", 2, after, last, None)]
    runs += [(f"layer {b}", 1, inside, layer, b) for b in range(blocks)]
    for key, k, back, index, which in runs:
        def mine(rows: list[StepCost], which: int | None = which) -> list[StepCost]:  # the block's rows
            return rows if which is None else [r for r in rows if r.block == which]

        steps = [(r, i) for r, i in zip(back, index, strict=True) if which is None or r.block == which]
        if zero_bubble and key == "first":  # no B before the blocks: its whole backward is W
            b_rows, w_rows = [], mine(again[k]) + [r for r, i in steps if i not in reduced]
        else:
            b_rows = mine(again[k]) + [r for r, i in steps if i not in grads]
            w_rows = [r for r, i in steps if i in grads and i not in reduced]
        out[key] = [part_time(mine(fwd[k]), hw), part_time(b_rows, hw), part_time(w_rows, hw)]
        out[f"{key} reduce"] = [part_time([r for r, i in steps if i in reduced], hw)]
    return out


def run_times(parts: dict[str, list[PartTime]], counts: tuple[float, ...]) -> list[PartTime]:
    """A microbatch's F, B and W through a run of layers: each block's layers (``counts``) times its layer's."""
    def part(i: int, field: str) -> float:
        return math.fsum(n * getattr(parts[f"layer {b}"][i], field) for b, n in enumerate(counts))

    return [PartTime(part(i, "busy"), part(i, "comm"), part(i, "seconds"), part(i, "paired")) for i in range(3)]


def phases_of(parts: list[PartTime], layers: float = 1.0) -> Phases:
    """The computation and collectives of a forward and of a whole backward (B and W), for an F&B pair."""
    forward, backward, weight = parts[:3]
    return Phases(forward.paired * layers, forward.comm * layers, (backward.paired + weight.paired) * layers,
                  (backward.comm + weight.comm) * layers)


def end_timing(parts: list[PartTime]) -> Timing:
    """A microbatch through the statements before (or after) the block: F, B, W and their phases."""
    forward, backward, weight = parts
    return Timing(forward.seconds, backward.seconds, weight.seconds, phases=phases_of(parts))


def chunk_times(pipe: Pipeline, parts: dict[str, list[PartTime]], first: Timing, last: Timing) -> tuple[Timing, ...]:
    """Each model chunk's times: its layers' of each block (:func:`chunk_blocks`), the first chunk also
    running the statements before the block and the last those after it (Megatron-LM's placement)."""
    n = pipe.stages * pipe.chunks
    heads, tails = end_chunks(pipe.schedule.name, pipe.stages, n)
    out = []
    for c, counts in enumerate(chunk_blocks(pipe)):
        ends = [t for t, here in ((first, c in heads), (last, c in tails)) if here]
        f, b, w = run = run_times(parts, counts)
        out.append(Timing(f.seconds + math.fsum(t.forward for t in ends),
                          b.seconds + math.fsum(t.backward for t in ends),
                          w.seconds + math.fsum(t.weight for t in ends),
                          phases=_added([(phases_of(run), 1.0)] + [(t.phases, 1.0) for t in ends])))
    return tuple(out)


def _added(terms: list[tuple[Phases | None, float]]) -> Phases | None:
    """The sum of some phases, each scaled (None where one is unknown)."""
    if any(ph is None for ph, _ in terms):
        return None
    known = [(ph, k) for ph, k in terms if ph is not None]
    return Phases(*(math.fsum(getattr(ph, f) * k for ph, k in known)
                    for f in ("forward_busy", "forward_comm", "backward_busy", "backward_comm")))
