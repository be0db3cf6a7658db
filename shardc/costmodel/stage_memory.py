"""A pipeline stage's memory beyond its times: which tensors outside the ``layers`` block a device holds,
each device's memory report (devices alike share one), a tick's working set (the temporaries of one
microbatch through a layer or an end, :func:`shardc.costmodel.phase_memory.phase_memory`'s of that
section), and the microbatches' gradient sums a once-a-step ReduceScatter reads."""

from __future__ import annotations

import math
from collections.abc import Sequence

from shardc.collectives import Op
from shardc.costmodel.memory import Memory, kept_once, memory, residual_sizes, residual_values, value_blocks
from shardc.costmodel.phase_memory import phase_memory
from shardc.device_pieces import local_elements
from shardc.hardware import Hardware
from shardc.ir.plan import SECTIONS, Plan
from shardc.ir.spec import TensorRef
from shardc.pipeline.block_split import chunk_blocks, device_blocks
from shardc.pipeline.boundary import boundary_tensor, carried_refs, gradient_reductions, microbatch_dim, shared_inputs
from shardc.pipeline.dualpipe import TWO_WAY, end_chunks
from shardc.pipeline.schedules import ZERO_BUBBLE, Simulation, device_of
from shardc.spec.stages import Pipeline

__all__ = ["RIDER_SLOTS", "accumulator_bytes", "chunk_copies", "dualpipe_held", "end_chunks_on", "held_names",
           "kept_copies", "outside_names", "rider_bytes", "rider_slots", "stage_memories", "working_sets"]

# The send buffers a device holds a rider in: the activation's, where a microbatch's activation and its riders
# arrive and wait for the forward that reads them, and the gradient's, where their gradients arrive and wait for
# the backward.  Under 1F1B (and ZB-H1) each holds one microbatch at a time: a stage receives a microbatch the
# tick before it runs it (Narayanan et al. 2021, section 2.2.1; Megatron-LM's recv_forward / recv_backward
# each receive one tensor an op), as the lowered program's rings of received values have one slot each
# (:mod:`shardc.lowering.pipeline_slots`).  A rider is read by no backward on the stages it passes, so it is
# kept nowhere else (:func:`kept_copies` counts the values the backward reads).  Under the zero-bubble schedules
# the device running the statements before the block holds their gradients one more slot, from the first
# virtual stage's B to its W, where that backward runs (:func:`rider_slots`).
RIDER_SLOTS = 2


def outside_names(plan: Plan) -> tuple[frozenset[str], frozenset[str]]:
    """The tensors the plan's steps before the ``layers`` block(s) make or read, and those after them (none
    without a block): the plan's values, not only the spec's names, for the planner makes values of its own
    there (the loss's row logsumexp ``Loss_lse``, a value's resharded copy), which the stage running that
    section holds (:func:`shardc.lowering.pipeline_ends.cut_parts` gives each end its section's steps)."""
    if plan.spec.block is None:
        return frozenset(), frozenset()

    def names(section: str) -> frozenset[str]:
        steps = plan.section(section)
        return frozenset(r.name for phase in (steps.forward, steps.backward, steps.recomputed) for s in phase
                         for r in (s.dst, *s.reads_with_shapes))

    return names("before"), names("after")


def end_chunks_on(pipe: Pipeline, stage: int) -> tuple[int, int]:
    """How many of the chunks that run the statements before the block (the first virtual stage's, or each
    of DualPipe's directions') and after it device ``stage`` holds: Megatron-LM's placement, the V's
    (both ends on device 0) or DualPipe's (both on devices 0 and p-1)."""
    name = pipe.schedule.name
    heads, tails = end_chunks(name, pipe.stages, pipe.stages * pipe.chunks)
    return (sum(device_of(name, c, pipe.stages) == stage for c in heads),
            sum(device_of(name, c, pipe.stages) == stage for c in tails))


def held_names(plan: Plan, pipe: Pipeline, stage: int) -> frozenset[str] | None:
    """The tensors outside the block that ``stage`` holds: the first chunk's and the last's, where they sit."""
    if plan.spec.block is None:
        return None
    before, after = outside_names(plan)
    first, last = end_chunks_on(pipe, stage)
    return (before if first else frozenset()) | (after if last else frozenset())


def stage_memories(plan: Plan, pipe: Pipeline, micro: dict[str, int], hw: Hardware, optimizer: str) -> list[Memory]:
    """Each device's memory report; devices alike (their layers and the end tensors they hold) share one."""
    made: dict[tuple[tuple[int, ...], frozenset[str] | None], Memory] = {}
    out = []
    for s, counts in enumerate(device_blocks(pipe)):  # its layers of each block
        held = held_names(plan, pipe, s)
        if (counts, held) not in made:  # the middle stages are alike
            made[counts, held] = memory(plan, micro, counts[0], hw.hbm_bytes, optimizer, held,
                                        more_layers=counts[1:], native=hw.native_kernels)
        out.append(made[counts, held])
    return out


def kept_copies(plan: Plan, pipe: Pipeline, held: Sequence[float], chunks: Sequence[dict[int, int]] | None = None,
                native: bool = False) -> list[dict[TensorRef, float]]:
    """For each device, how many copies of each value the backward reads (:func:`residual_values`) it keeps
    with ``held[d]`` microbatches in flight on device d: a microbatch's value once a layer of its block the
    device runs, for each microbatch held (under DualPipe, ``chunks[d]``'s of each of the device's two
    stages, :func:`dualpipe_held`); a value without the microbatch index (a saved weight) once a layer; a
    value outside the block once, on a device holding it; an input the block reads without the microbatch dim
    once on every device, which holds it whole (:func:`shardc.pipeline.boundary.shared_inputs`: the lowered
    pipeline's argument, not a copy a layer); ``native``: the framework's kernels' saved statistics among the
    values (:func:`shardc.costmodel.memory.residual_values`)."""
    dim = microbatch_dim(plan)
    values = residual_values(plan, native)
    once = kept_once(plan, values) if plan.spec.block is not None else set()
    shared = shared_inputs(plan)
    blocks = value_blocks(plan)
    per_chunk = chunk_copies(plan, pipe, native) if chunks is not None else []
    out = []
    for stage, layers in enumerate(device_blocks(pipe)):
        outside = held_names(plan, pipe, stage)
        counts = {r: 1 if r.name in shared else (1 if outside is None or r.name in outside else 0) if r in once
                  else layers[blocks.get(r.name, 0)] for r in values}
        mine = {} if chunks is None else chunks[stage]
        out.append({r: (math.fsum(n * per_chunk[c][r] for c, n in mine.items()) if chunks is not None
                        else k * held[stage]) if dim in r.indices else float(k) for r, k in counts.items()})
    return out


def kept_bytes(plan: Plan, pipe: Pipeline, sim: Simulation, micro: dict[str, int],
               only: frozenset[TensorRef] | None = None, native: bool = False) -> list[float]:
    """Each device's bytes of the values the backward keeps (of those in ``only``; ``native``: the framework's
    kernels' saved statistics too), one microbatch's at ``micro`` times the copies it keeps of each with its
    microbatches in flight (:func:`kept_copies`)."""
    sizes = residual_sizes(plan, micro, native)
    held = [sim.peak_inflight(s) for s in range(len(device_blocks(pipe)))]
    kept = kept_copies(plan, pipe, held, dualpipe_held(plan, pipe, sim, micro, native), native)
    return [math.fsum(v * copies[r] for r, v in sizes.items() if only is None or r in only) for copies in kept]


def chunk_copies(plan: Plan, pipe: Pipeline, native: bool = False) -> list[dict[TensorRef, float]]:
    """Each model chunk's copies of each value one microbatch through it keeps: once a layer of the chunk's
    of each block, a value outside the block once where the chunk runs those statements."""
    dim = microbatch_dim(plan)
    values = [r for r in residual_values(plan, native) if dim in r.indices]
    once = kept_once(plan, values) if plan.spec.block is not None else set()
    blocks = value_blocks(plan)
    before, after = outside_names(plan)
    heads, tails = end_chunks(pipe.schedule.name, pipe.stages, pipe.stages * pipe.chunks)
    out = []
    for c, layers in enumerate(chunk_blocks(pipe)):
        ends = (before if c in heads else frozenset()) | (after if c in tails else frozenset())
        out.append({r: (1.0 if plan.spec.block is None or r.name in ends else 0.0) if r in once
                    else layers[blocks.get(r.name, 0)] for r in values})
    return out


def dualpipe_held(plan: Plan, pipe: Pipeline, sim: Simulation, micro: dict[str, int],
                  native: bool = False) -> list[dict[int, int]] | None:
    """Under DualPipe, the microbatches each device holds of each of its two chunks when its kept bytes peak
    (:meth:`Simulation.peak_chunks`, a chunk's microbatch weighing its values' bytes); None elsewhere, where a
    device's chunks keep alike (a stage's equal shares) and :meth:`Simulation.peak_inflight` counts them."""
    if pipe.schedule.name not in TWO_WAY:
        return None
    sizes = residual_sizes(plan, micro, native)
    weights = [math.fsum(sizes[r] * k for r, k in copies.items()) for copies in chunk_copies(plan, pipe, native)]
    return [sim.peak_chunks(d, dict(enumerate(weights))) for d in range(pipe.stages)]


def working_sets(plan: Plan, micro: dict[str, int]) -> dict[str, float]:
    """The temporaries of one microbatch's largest phase through each section a stage runs (the block's
    one layer, the statements before it, those after it): what a tick holds beside the kept values."""
    sections = SECTIONS if plan.spec.block is not None else ("block",)
    return {k: max(p.temporaries for p in phase_memory(plan, micro, section=k)) for k in sections}


def accumulator_bytes(plan: Plan, sizes: dict[str, int], layers: tuple[int, ...], held: frozenset[str] | None) -> float:
    """The bytes of the microbatches' gradient sums a stage holds through the schedule beyond its
    gradients: a ReduceScatter run once a step reads the unsharded sums (as Megatron-LM's distributed
    optimizer keeps its full gradient buffer); an AllReduce runs in its sums' buffer (NCCL in place)."""
    total = 0.0
    for k in gradient_reductions(plan):
        step = plan.backward[k]
        if step.op is not Op.REDUCE_SCATTER or step.src is None:
            continue
        if step.once and held is not None and plan.primal(step.tensor) not in held:
            continue
        count = 1 if step.once else layers[step.block]  # the stage's layers of the step's block
        total += float(local_elements(step.src, sizes)) * plan.nbytes(step.src.name) * count
    return total


def rider_slots(pipe: Pipeline, stage: int) -> int:
    """The send buffers' slots ``stage`` holds a rider in (:data:`RIDER_SLOTS`), and under the zero-bubble
    schedules on a device running the statements before the block one more, its gradient from B to W (the
    lowered program's ring of the block input's gradients, ``pre``, of one slot under ZB-H1)."""
    return RIDER_SLOTS + (pipe.schedule.name in ZERO_BUBBLE and end_chunks_on(pipe, stage)[0] > 0)


def rider_bytes(plan: Plan, micro: dict[str, int], slots: float = RIDER_SLOTS) -> float:
    """The bytes of the values sent with the activation (:func:`shardc.pipeline.boundary.carried_refs`: the
    riders, and a value the block hands on beside it, which the lowering refuses), one microbatch's shard
    each in the boundary's type (as they are sent, laid end to end with it), in ``slots
    of the send buffers: :func:`rider_slots` for ``shardc cost``, the lowered program's rings' slots for the
    pipeline memory check (:func:`shardc.verification.pipeline_memory.stage_memory_check`)."""
    element = plan.nbytes(boundary_tensor(plan).name)
    return slots * math.fsum(float(local_elements(r, micro)) * element for r in carried_refs(plan)[1:])
