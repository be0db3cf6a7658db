"""The simulation of a plan's pipeline at its own times: the one run ``shardc cost`` steps and ``shardc lower``'s
tick table places (:func:`~shardc.pipeline.ticks.tick_table`).

A microbatch's forward, input gradient (B) and weight gradient (W) through each model chunk are its layers'
times on the chip (:func:`~shardc.costmodel.section_times.section_times`, the ends on the first and the last
chunk), the sends one collective-permute of the block's output (and back, of its gradient, in the gradient's
type), split over a node's replicas where it crosses nodes (:mod:`~shardc.costmodel.boundary_send`); the
schedule is simulated with them. The cost and the lowering both read :func:`simulated`, so the program runs
the order the cost times: the fixed orders are the same at any times, but ZBV's greedy order is found at the
op times (over 4 stages and 8 microbatches at T_B = 2 T_F = 2 T_W the order found at equal times takes 46.5 T_F
where the order found at those times takes 37.5).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardc.collectives import Layout
from shardc.costmodel.boundary_send import boundary_send
from shardc.costmodel.section_times import PartTime, chunk_times, end_timing, phases_of, run_times, section_times
from shardc.device_pieces import local_elements
from shardc.hardware import Hardware
from shardc.ir.plan import Plan
from shardc.pipeline.block_split import chunk_blocks, stage_blocks
from shardc.pipeline.blocking_sends import Held
from shardc.pipeline.boundary import boundary_tensor, carried_refs, check_microbatches, send_bytes
from shardc.pipeline.schedules import ZERO_BUBBLE, Simulation, Timing, simulate
from shardc.spec.stages import Pipeline
from shardc.timing import plan_links

__all__ = ["PipelineTimes", "microbatch_sizes", "simulated", "plan_simulation"]


@dataclass(frozen=True)
class PipelineTimes:
    """A microbatch's times through the pipeline's parts and the schedule simulated with them."""

    parts: dict[str, list[PartTime]]  # section_times': each block's layer, the ends, their reductions
    timing: Timing  # the slowest stage's F, B and W, and a send
    first: Timing  # a microbatch through the statements before the block (the first chunk's)
    last: Timing  # and through those after it (the last chunk's)
    p2p_bytes: float  # one send: a microbatch's shard of the block's output
    sim: Simulation
    # the schedule again with free sends, where the chunks' layers differ (the closed form takes every stage at
    # the slowest's times, so it can exceed the step with its sends) or the sends block (the simulation's work holds
    # them); None for an even split
    free_sim: Simulation | None = None
    # the network the send was priced over ("ici", "dcn"): where the topology lays the stage axis, which on a GPU
    # cluster can cross nodes though the mesh declares it ICI
    p2p_network: str = "ici"
    # the axes a cross-node send is split over (each rank sends 1/t, the receivers all-gather), () sent whole
    p2p_split: tuple[str, ...] = ()


def microbatch_sizes(plan: Plan, pipe: Pipeline, sizes: dict[str, int]) -> tuple[str, dict[str, int]]:
    """The dim microbatches cut and one microbatch's sizes of the whole batch's ``sizes`` (checked to split)."""
    dim = check_microbatches(plan, pipe.microbatches, sizes)
    return dim, dict(sizes) | {dim: sizes[dim] // pipe.microbatches}


def simulated(plan: Plan, pipe: Pipeline, micro: dict[str, int], hw: Hardware, spans: Layout) -> PipelineTimes:
    """``plan``'s pipeline ``pipe`` at one microbatch's sizes ``micro`` (with the mesh's) on ``hw``."""
    parts = section_times(plan, micro, hw, spans, len(pipe.blocks) or 1, pipe.schedule.name in ZERO_BUBBLE)
    ref = boundary_tensor(plan)
    elements = float(sum(local_elements(r, micro) for r in carried_refs(plan)))  # the values riding with it too
    p2p, back = (elements * n for n in send_bytes(plan, ref.name))
    send, send_back = (boundary_send(plan, ref, pipe.axis, size, micro, hw, spans)
                       for size in (p2p, back))  # the activation on, its gradient back
    p2p_s, back_s = send.seconds, send_back.seconds
    slowest = max((run_times(parts, counts) for counts in stage_blocks(pipe)), key=lambda run: run[0].seconds
                  + run[1].seconds + run[2].seconds)  # a stage's F, B and W: its layers' of each block
    timing = Timing(slowest[0].seconds, slowest[1].seconds, slowest[2].seconds, p2p_s, phases_of(slowest),
                    None if back == p2p else back_s)
    first, last = (end_timing(parts[end]) for end in ("first", "last"))
    chunks, held = chunk_times(pipe, parts, first, last), pipe.schedule.sends
    sim = simulate(pipe.schedule.name, pipe.stages, pipe.microbatches, timing, pipe.chunks, chunks,
                   None if held == "async" else Held(send.gather_s, send_back.gather_s, held == "paired"))
    free = None
    if len(set(chunk_blocks(pipe))) > 1 or held != "async":  # blocking or paired: the chunks' ops hold their sends
        free = simulate(pipe.schedule.name, pipe.stages, pipe.microbatches, replace(timing, comm=0.0, comm_back=None),
                        pipe.chunks, chunks)
    return PipelineTimes(parts, timing, first, last, p2p, sim, free_sim=free,
                         p2p_network="dcn" if "dcn" in send.network else "ici", p2p_split=send.split)


def plan_simulation(plan: Plan, pipe: Pipeline, sizes: dict[str, int]) -> Simulation:
    """The simulation ``shardc cost`` runs of ``plan`` by default (on the chip it was planned for, with its
    spans) for the pipeline ``pipe`` at the whole batch's ``sizes`` (with the mesh's): the order the lowered
    program runs."""
    hw = plan.chip.configured("book" if plan.chip.book else None, None)
    _, micro = microbatch_sizes(plan, pipe, sizes)
    return simulated(plan, pipe, micro, hw, plan_links(plan, hw, micro)[0]).sim
