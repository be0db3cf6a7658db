"""A microbatch's times through each section of a pipelined plan: forward, B and W, each layer's and each end's.

:func:`section_times` costs the plan at one microbatch's sizes, cut by its sections: one layer of each
``layers`` block (the block section's steps of that block, :attr:`~shardc.ir.plan.Step.block`), the
statements before the blocks (the first chunk runs them) and those after them (the last chunk); each
section's forward, the backward's input-gradient part (B) and its weight-gradient part (W: the steps on
``dW...``), each ``max(compute, collectives)`` as the report's own step is, and apart the gradient
reductions run once a step on the microbatches' sums.  :func:`run_times` gives a run of layers (a stage's,
a chunk's) from them, :func:`chunk_times` each model chunk's as the schedule's simulation reads them
(:mod:`shardc.costmodel.pipeline_cost` sums them into the pipeline's figures).  Each part also keeps its
steps' chain of computations and the collectives each next one waits for (:attr:`PartTime.segments`),
which DualPipe's F&B pairs interleave (:mod:`shardc.pipeline.pairing`); a backward's chain is the whole
backward in the order a pair runs it (:func:`pair_order`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardc.collectives import Layout
from shardc.costmodel.fed_sum import fed_sum_rows
from shardc.hardware import Hardware
from shardc.ir.plan import Plan, Step
from shardc.phase_time import comm_split, phase_time
from shardc.pipeline.backward_split import weight_steps
from shardc.pipeline.block_split import chunk_blocks
from shardc.pipeline.boundary import carried_moves, gradient_reductions
from shardc.pipeline.dualpipe import end_chunks
from shardc.pipeline.pairing import Phases, Segment, joined, scaled
from shardc.pipeline.schedules import Timing
from shardc.spec.stages import Pipeline
from shardc.step_cost import StepCost
from shardc.timing import phase_rows

__all__ = ["PartTime", "part_time", "pair_order", "section_times", "run_times", "phases_of", "end_timing",
           "chunk_times"]


@dataclass(frozen=True)
class PartTime:
    """A run of rows: compute and memory-bound time, collective time, and its time overlapped; ``segments``:
    its computations and the collectives each next one waits for, in the order they run (a backward's B
    holds its whole backward's, W's among them, as an F&B pair runs it: :class:`Phases`), ``ahead`` its
    collectives nothing waits for, ``share`` the cores a collective holds (:attr:`Hardware.overlap_share`)."""

    busy: float
    comm: float
    seconds: float
    segments: tuple[Segment, ...] = ()
    ahead: float = 0.0
    share: float = 0.0
    deferred: float = 0.0  # of comm, the gradient reductions' DCN phase after the backward (timing.deferred_dcn)


def part_time(rows: list[StepCost], hw: Hardware, chain: list[StepCost] | None = None) -> PartTime:
    """``rows``' times, and as its segments ``chain``'s (by default the rows'), one row at a time in order."""
    t = phase_time(((r, 1) for r in rows), hw)
    segments, ahead = _segments(rows if chain is None else chain, hw)
    return PartTime(t.busy_s, t.comm_s, t.seconds, segments, ahead, hw.overlap_share, t.deferred_s)


def _segments(rows: list[StepCost], hw: Hardware) -> tuple[tuple[Segment, ...], float]:
    """The rows' computations, each with the collective the next one waits for (a critical one: the
    collectives' rule, :func:`shardc.phase_time.comm_split`, with its bucketing), and the seconds of the ones
    issued ahead."""
    ahead, critical = comm_split(((r, 1) for r in rows), hw)
    out: list[Segment] = []
    busy, waited = 0.0, 0.0
    for r in rows:
        busy += r.busy_s
        wait = r.exposed_comm_s + (r.comm_s if r.is_collective and not r.ahead else 0.0)
        if wait > 0.0:
            out.append((busy, wait))
            busy, waited = 0.0, waited + wait
    extra = max(0.0, critical - waited)  # bucketed reductions the framework runs after the backward
    if busy > 0.0 or extra > 0.0:
        out.append((busy, extra))
    return tuple(out), ahead


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
    summed = fed_sum_rows(plan, micro, hw, spans)  # the program's dX0 + dE, the first block's, in its B
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
            b_rows = mine(again[k]) + [r for r, i in steps if i not in grads] + summed * (which == 0)
            w_rows = [r for r, i in steps if i in grads and i not in reduced]
        whole = (mine(again[k]) + pair_order([(r, i in grads) for r, i in steps if i not in reduced])
                 + summed * (which == 0))
        out[key] = [part_time(mine(fwd[k]), hw), part_time(b_rows, hw, whole), part_time(w_rows, hw, [])]
        out[f"{key} reduce"] = [part_time([r for r, i in steps if i in reduced], hw)]
    return out


def pair_order(rows: list[tuple[StepCost, bool]]) -> list[StepCost]:
    """A backward's rows (each with whether it is a weight gradient) as an F&B pair runs them: a weight
    gradient after the next collective a later step waits for, which does not wait for it (DeepSeek-V3's
    Figure 4 runs the MLP's weight gradient after issuing the AllToAll its input gradient feeds)."""
    out: list[StepCost] = []
    held: list[StepCost] = []
    for row, weight in rows:
        if weight:
            held.append(row)
            continue
        out.append(row)
        if row.exposed_comm_s > 0.0 or (row.is_collective and not row.ahead):
            out, held = out + held, []
    return out + held


def run_times(parts: dict[str, list[PartTime]], counts: tuple[float, ...]) -> list[PartTime]:
    """A microbatch's F, B and W through a run of layers: each block's layers (``counts``) times its layer's,
    their segments the layers' one after another."""
    def part(i: int, field: str) -> float:
        return math.fsum(n * getattr(parts[f"layer {b}"][i], field) for b, n in enumerate(counts))

    out = []
    for i in range(3):
        chains = [_repeated(parts[f"layer {b}"][i].segments, n) for b, n in enumerate(counts)]
        if i > 0:  # the backward runs the last block's layers first
            chains.reverse()
        segments: tuple[Segment, ...] = ()
        for chain in chains:
            segments = joined(segments, chain)
        out.append(PartTime(part(i, "busy"), part(i, "comm"), part(i, "seconds"), segments, part(i, "ahead"),
                            max((parts[f"layer {b}"][i].share for b in range(len(counts))), default=0.0)))
    return out


def _repeated(segments: tuple[Segment, ...], n: float) -> tuple[Segment, ...]:
    """A layer's segments ``n`` times over (a part of a layer: its times scaled)."""
    whole = int(n)
    out: tuple[Segment, ...] = ()
    for _ in range(whole):
        out = joined(out, segments)
    if n > whole:
        out = joined(out, scaled(segments, n - whole))
    return out


def phases_of(parts: list[PartTime]) -> Phases:
    """The chains of a forward and of a whole backward (B's segments hold W's), for an F&B pair."""
    forward, backward, weight = parts[:3]
    return Phases(forward.segments, backward.segments, forward.ahead, backward.ahead + weight.ahead,
                  max(p.share for p in parts[:3]))


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
        phases: Phases | None = phases_of(run)
        if c in heads:
            phases = _then(first.phases, phases)
        if c in tails:
            phases = _then(phases, last.phases)
        out.append(Timing(f.seconds + math.fsum(t.forward for t in ends),
                          b.seconds + math.fsum(t.backward for t in ends),
                          w.seconds + math.fsum(t.weight for t in ends), phases=phases))
    return tuple(out)


def _then(first: Phases | None, then: Phases | None) -> Phases | None:
    """A run of layers, then another (None where either's phases are unknown)."""
    return None if first is None or then is None else first.then(then)
