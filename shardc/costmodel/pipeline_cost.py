"""The pipeline figures of ``shardc cost``: bubble, memory per stage, point-to-point traffic, the step.

A stage runs its layers of the plan (which never uses the stage axis) on one
microbatch at a time, the batch dim cut M ways, so each stage-time is the plan's
costed at the microbatch's sizes times the stage's layers: forward, the backward's
input-gradient part (B) and its weight-gradient part (W: the steps no gradient a part hands on needs,
:mod:`shardc.pipeline.backward_split`, the lowered program's cut),
each ``max(compute, collectives)`` as the report's own step is
(:mod:`shardc.costmodel.section_times`).  Then:

* a ``layers L { ... }`` block's ends: only the block's steps are costed a layer; the
  steps before it (the embedding) run on the first chunk and those after it (final norm,
  output layer, loss) on the last, Megatron-LM's placement, so those chunks' times grow
  by theirs, and the stages that hold them hold their params, gradients, optimizer state
  and residuals (the other stages none of them); under the zero-bubble schedules their
  backward is cut as the block's, B and W (the embedding's all W: nothing waits for the
  gradient of its inputs), as the lowered program runs it;
* several ``layers`` blocks: the stages hold runs of the model's layers in order, the first
  block's then the next's (:mod:`shardc.pipeline.block_split`), so a stage's times, state and
  residuals are each block's layer's times its layers of that block; one layer of each block is
  the block section's steps of that block (:attr:`Step.block`);
* the bubble: the schedule's closed form (:mod:`shardc.pipeline.bubbles`), over the
  ideal time and over the total step, from the slowest stage's times;
* the step: the discrete-event simulation of the schedule with those times (each chunk's
  own: its own layers', an uneven split's too) and the point-to-point sends
  (:mod:`shardc.pipeline.schedules`), i.e. the stage time per microbatch times (m + bubble),
  plus what the sends add to the fill; its bubble
  is the step minus the busiest device's work;
* the weight gradients' reductions (AllReduce, ReduceScatter of a ``dW``) are accumulated
  over the microbatches and run once a step, as Megatron-LM, DeepSpeed and torchtitan run
  them, issued under the last microbatch's backward: the step adds what they take beyond it;
* point-to-point: a microbatch's block output, one device's shard of it (so divided by
  the tensor-parallel degree when it is sharded), sent one way over one link of the
  stage axis's network (one ICI link's one-way bandwidth, or the chip's DCN figure); a
  replicated one crossing a GPU cluster's nodes split over the node's replicas and gathered
  on the receiving side (:mod:`~shardc.costmodel.boundary_send`);
* memory per stage: params, grads and optimizer state of its layers, the gathered weights
  of one layer, and the residuals the plan's save policy keeps: those with the batch dim
  for one microbatch times the microbatches the stage holds at its peak (simulated; the
  closed forms are gpipe m, 1f1b p - s, interleaved p (1 + (p-1)/(p V)) on the first
  stage), saved weights once; a tick's working set (the temporaries of one microbatch's
  largest phase through a layer or an end the stage runs,
  :func:`~shardc.costmodel.phase_memory.phase_memory`'s); and the microbatches' sums of the
  gradients a ReduceScatter reduces once a step (unsharded, beside the shard);
* ``dualpipe`` (DeepSeek-V3's): device d holds two whole stages, d and p-1-d (so its params,
  gradients and optimizer state are both stages', twice a stage's), and devices 0 and p-1
  both hold the first chunk's and the last chunk's statements (each direction enters at one
  of them); its p + 1 microbatches held are of either stage (counted at the mean of the two
  stages' layers), and its times per microbatch are the mean of its two stages' (each runs
  half the microbatches).  An overlapped F&B pair runs the two chunks' computations one after the
  other, interleaved as DeepSeek-V3's Figure 4 interleaves attention, dispatch, MLP and combine, so
  each one's collectives run under the other's computation, which runs on the cores they leave
  (:func:`~shardc.pipeline.schedules.paired_seconds`, :mod:`shardc.pipeline.pairing`): the pair takes
  the computations added, the share of the cores the collectives held while they ran beside them,
  and what of the collectives nothing was left to hide.  Devices d and p-1-d hold the same two
  stages, so once a step each sends the other its gradients (both stages', as the device holds
  them) to sum the two copies, a swap over the stage axis issued with the other gradient
  reductions (``copies_exchange_s``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING

from shardc.collectives import Layout, Op, collective_time
from shardc.costmodel.memory import Memory
from shardc.costmodel.pipeline_times import microbatch_sizes, simulated
from shardc.costmodel.section_times import (
    PartTime,
    run_times,
)
from shardc.costmodel.stage_memory import (
    accumulator_bytes,
    end_chunks_on,
    held_names,
    kept_bytes,
    stage_memories,
    working_sets,
)
from shardc.costmodel.stage_optimizer import optimizer_exposed, stage_optimizer, stage_reductions
from shardc.device_pieces import local_elements
from shardc.errors import ShardcError
from shardc.hardware import Hardware
from shardc.ir.plan import Plan
from shardc.ir.spec import TensorRef
from shardc.overlap import reduced_after
from shardc.pipeline.block_split import device_blocks
from shardc.pipeline.boundary import (
    boundary_tensor,
    tied_contributions,
)
from shardc.pipeline.bubbles import (
    EXACT,
    Bubble,
    activation_factor,
    bubble,
    inflight,
    microbatches_for,
    sends_per_microbatch,
)
from shardc.pipeline.dualpipe import TWO_WAY
from shardc.pipeline.gantt import draw
from shardc.pipeline.schedules import ZERO_BUBBLE, Simulation, Timing, device_of
from shardc.spec.stages import Pipeline, pipeline_of
from shardc.timing import bound_of, seconds_at_mfu

if TYPE_CHECKING:
    from shardc.costmodel.cost_report import CostReport

__all__ = ["StageCost", "PipelineCost", "pipeline_cost", "draw_schedule"]

BUBBLE_TARGET = 0.05  # the bubble the threshold sentence solves m for


@dataclass(frozen=True)
class StageCost:
    """One stage, one microbatch: times, the verdict, memory at the stage's peak."""

    stage: int
    layers: int
    forward_s: float
    backward_s: float  # input gradients (B)
    weight_s: float  # weight gradients (W)
    compute_s: float  # its einsums and memory-bound steps
    comm_s: float  # its collectives plus its sends and receives
    held: float  # microbatches of activations at its peak
    state_bytes: float  # params, grads, optimizer state of its layers
    activation_bytes: float
    gathered_bytes: float  # weights gathered at once, and the blocks in flight in a ring's buffers
    hbm_bytes: float
    params: float = 0.0  # the parameter count of the stage's layers on one device
    grads: float = 0.0  # their gradients' elements on one device (a ZeRO shard's where the spec says)
    grad_bytes: float = 0.0  # of state_bytes, the gradients'
    optimizer_bytes: float = 0.0  # and the optimizer state's
    host_bytes: float = 0.0  # held in the host's memory instead (shardc.costmodel.offload)
    blocks: tuple[int, ...] = ()  # with several `layers` blocks: its layers of each block
    # a tick's working set: the temporaries of the largest forward or backward of one microbatch through a
    # layer (or an end the stage runs), beside the activations kept (phase_memory's, one section)
    working_bytes: float = 0.0
    # the microbatches' sums of the gradients reduced once a step, where the reduction does not run in
    # their buffer (a ReduceScatter: the unsharded sums beside the shard), held through the schedule
    accumulator_bytes: float = 0.0
    sections: tuple[str, ...] = ("block",)  # the spec's sections the stage runs: its working set's
    host: bool = False  # --offload: its host copies (or the host's update) outlast what they run beside

    @property
    def bound(self) -> str:
        return bound_of(self.compute_s, self.comm_s, self.host)

    @property
    def memory_bytes(self) -> float:
        return (self.state_bytes + self.activation_bytes + self.gathered_bytes + self.working_bytes
                + self.accumulator_bytes)

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.hbm_bytes

    def to_json(self) -> dict[str, object]:
        return {"stage": self.stage, "layers": self.layers,
                **({"block_layers": list(self.blocks)} if self.blocks else {}), "forward_s": self.forward_s,
                "backward_s": self.backward_s, "weight_s": self.weight_s, "compute_s": self.compute_s,
                "comm_s": self.comm_s, "bound": self.bound, "inflight_microbatches": self.held,
                "state_bytes": self.state_bytes, "activation_bytes": self.activation_bytes,
                "gathered_bytes": self.gathered_bytes, "working_bytes": self.working_bytes,
                "accumulator_bytes": self.accumulator_bytes, "memory_bytes": self.memory_bytes,
                "fits": self.fits, **({"host_bytes": self.host_bytes} if self.host_bytes else {})}


@dataclass(frozen=True)
class PipelineCost:
    pipeline: Pipeline
    dim: str  # the batch dim the microbatches cut
    microbatch_size: int
    boundary: TensorRef  # what crosses a stage boundary
    network: str
    p2p_bytes: float  # one microbatch, one boundary, one device
    p2p_bytes_global: float
    p2p_s: float
    timing: Timing  # the slowest stage's
    closed: Bubble
    simulation: Simulation
    stages: tuple[StageCost, ...]
    thresholds: tuple[str, ...]
    # ZeRO-1/2's optimizer phase of the busiest stage, once a step (its AllGathers): what the step counts of it,
    # all but what the next step's first forward hides under `param_gather overlapped` (optimizer_exposed)
    optimizer_s: float = 0.0
    first: Timing = Timing(0.0, 0.0)  # a microbatch through the statements before the block (the first chunk's)
    last: Timing = Timing(0.0, 0.0)  # and through those after it (the last chunk's)
    model_flops: float = 0.0  # the whole step's model FLOPs, every stage (recomputed ones not counted)
    devices: int = 0  # every chip, stages included
    peak: float = 0.0  # a chip's peak FLOPs/s in MFU's type (shardc.ir.spec.Spec.mfu_dtype)
    peak_dtype: str = "bf16"  # that type
    update_s: float = 0.0  # the optimizer's update on the busiest stage, after the schedule
    grad_reduce_s: float = 0.0  # the weight gradients' reductions of the busiest stage, once a step (ZeRO-1's too)
    grad_reduce_exposed_s: float = 0.0  # what of them the last microbatch's backward does not hide
    # a param held by the first and the last stage (a tied embedding): the two stages swapping their sums
    # of its gradient's contributions once a step (Megatron-LM's embedding-group AllReduce), in grad_reduce_s
    tied_exchange_s: float = 0.0
    copies_exchange_s: float = 0.0  # DualPipe: devices d and p-1-d swapping their two stages' gradients, once a step
    offload_s: float = 0.0  # the slowest stage's host copies and host update no compute hides (--offload)
    mfu_assumed: float | None = None  # --mfu: the MFU the step at MFU is given at
    optimizer_busy_s: float = 0.0  # of optimizer_s, the compute and memory-bound steps' time
    optimizer_comm_s: float = 0.0  # and the collectives'
    free_simulation: Simulation | None = None  # the schedule with free sends where the chunks' layers differ
    p2p_split: tuple[str, ...] = ()  # the axes a cross-node send is split over and gathered over (boundary_send)

    @property
    def fullest(self) -> StageCost:
        """The stage holding the most memory: whether the model fits is whether it does."""
        return max(self.stages, key=lambda s: s.memory_bytes)

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation of the whole pipelined step."""
        return self.model_flops / (self.devices * self.peak * self.step_s) if self.devices * self.peak * \
            self.step_s else 0.0

    @cached_property  # read by compute_s, comm_s, exposed_comm_s and bound; DualPipe's work sums every op
    def busiest(self) -> StageCost:
        """The device whose work sets the schedule's ideal time (the simulation's busiest)."""
        return self.stages[max(range(len(self.stages)), key=self.simulation.work)]

    @property
    def compute_s(self) -> float:
        """The busiest device's compute and memory-bound time a step, as the simulation runs it: every
        microbatch through its stages, ZeRO-1/2's optimizer phase's and the optimizer's update after the
        schedule."""
        return self.pipeline.microbatches * self.busiest.compute_s + self.optimizer_busy_s + self.update_s

    @property
    def comm_s(self) -> float:
        """The busiest device's communication a step: every microbatch's collectives and sends, and the
        gradient reductions once a step (the two ends' tied swap and DualPipe's copies' swap among them),
        ZeRO-1/2's optimizer phase's."""
        return self.pipeline.microbatches * self.busiest.comm_s + self.grad_reduce_s + self.optimizer_comm_s

    @property
    def exposed_comm_s(self) -> float:
        """The communication nothing hides (``PhaseCost.exposed_comm_s``'s: the step less its compute), the
        schedule's idle time not counted: a send the next stage waits on is counted in that idle time."""
        return max(0.0, self.step_s - self.compute_s - self.simulation.bubble)

    @property
    def bound(self) -> str:
        """The verdict on the pipelined step, from the busiest device's figures a step."""
        return bound_of(self.compute_s, self.comm_s, any(s.host for s in self.stages))

    @property
    def at_mfu_s(self) -> float | None:
        """The step at ``--mfu``'s MFU (``PhaseCost.step_at_mfu_s``'s, for the pipelined step), None without it."""
        return None if self.mfu_assumed is None else seconds_at_mfu(self.model_flops, self.devices, self.peak,
                                                                    self.mfu_assumed)

    @property
    def extra(self) -> bool:
        """Whether the first or last chunk does work the others do not (a ``layers L { ... }`` block's ends)."""
        return self.first.total > 0 or self.last.total > 0

    @property
    def alike(self) -> bool:
        """Whether every model chunk takes the same times (an even split of one block's layers)."""
        return len(set(self.simulation.chunk_times)) <= 1

    @property
    def stage_time_s(self) -> float:
        """One microbatch through the slowest stage, forward and backward."""
        return self.timing.total

    @property
    def step_s(self) -> float:
        """The simulated schedule, the exposed part of the gradient reductions once a step, then the
        optimizer phase (ZeRO-1/2) and the update after it."""
        return (self.simulation.makespan + self.grad_reduce_exposed_s + self.optimizer_s + self.update_s
                + self.offload_s)

    @property
    def step_closed_s(self) -> float:
        """The busiest device's work plus the closed-form idle time, sends free: with alike stages the
        stage time times (m + bubble); with extra work on the first or last chunk it adds that work,
        m microbatches of it (GPipe's step exactly when one end does extra work).  Where the chunks' layers
        differ the closed form takes every stage at the slowest's times: the schedule simulated with free sends."""
        if self.free_simulation is not None:
            return self.free_simulation.makespan + self.optimizer_s
        return self.simulation.ideal + self.closed.idle_s + self.optimizer_s  # the schedule's, no update

    def to_json(self) -> dict[str, object]:
        pipe, sim = self.pipeline, self.simulation
        return {
            "axis": pipe.axis, "stages": pipe.stages, "microbatches": pipe.microbatches,
            "schedule": str(pipe.schedule), "virtual_stages": pipe.chunks, "layers": list(pipe.stage_layers),
            "microbatch_dim": self.dim, "microbatch_size": self.microbatch_size,
            "bubble_of_ideal": self.closed.of_ideal, "bubble_of_total": self.closed.of_total,
            "bubble_formula": self.closed.formula, "bubble_formula_exact": pipe.schedule.name in EXACT,
            "simulated_bubble_of_ideal": sim.bubble_of_ideal, "simulated_bubble_of_total": sim.bubble_of_total,
            "inflight_microbatches": inflight(pipe.schedule.name, pipe.stages, pipe.microbatches),
            "activation_factor": activation_factor(pipe.schedule.name, pipe.stages, pipe.chunks),
            "boundary": str(self.boundary), "network": self.network, "p2p_bytes": self.p2p_bytes,
            "p2p_bytes_global": self.p2p_bytes_global, "p2p_s": self.p2p_s, "p2p_split": list(self.p2p_split),
            **({"p2p_back_s": self.timing.send_back} if self.timing.comm_back is not None else {}),
            "sends_per_microbatch": sends_per_microbatch(pipe.schedule.name, pipe.stages, pipe.chunks),
            "stage_time_s": self.stage_time_s, "forward_s": self.timing.forward,
            "backward_s": self.timing.backward, "weight_s": self.timing.weight,
            "step_s": self.step_s, "mfu": self.mfu, "mfu_peak_dtype": self.peak_dtype,
            "step_at_mfu_s": self.at_mfu_s, "compute_s": self.compute_s, "comm_s": self.comm_s,
            "exposed_comm_s": self.exposed_comm_s, "bound": self.bound,
            "step_closed_s": self.step_closed_s,
            "optimizer_s": self.optimizer_s, "update_s": self.update_s, "grad_reduce_s": self.grad_reduce_s,
            "grad_reduce_exposed_s": self.grad_reduce_exposed_s,
            **({"tied_exchange_s": self.tied_exchange_s} if self.tied_exchange_s else {}),
            **({"copies_exchange_s": self.copies_exchange_s} if self.copies_exchange_s else {}),
            **({"offload_s": self.offload_s} if self.offload_s else {}),
            "ideal_s": sim.ideal, "first_extra_s": _times(self.first), "last_extra_s": _times(self.last),
            "per_stage": [s.to_json() for s in self.stages], "thresholds": list(self.thresholds),
        }


def _times(t: Timing) -> dict[str, float]:
    return {"forward_s": t.forward, "backward_s": t.backward, "weight_s": t.weight}


def pipeline_cost(plan: Plan, hw: Hardware, sizes: dict[str, int], spans: Layout,
                  optimizer: str) -> PipelineCost | None:
    """The pipeline figures of ``plan`` (None when its spec has no pipeline axis)."""
    pipe = pipeline_of(plan.spec, sizes)  # the layers at sizes=, where a dim names them
    if pipe is None:
        return None
    pipe = replace(pipe, stages=sizes.get(pipe.axis, pipe.stages))  # sizes= may resize the mesh
    if pipe.stages == 1:  # pipelining switched off: the one stage is the plan's own step
        return None
    dim, micro = microbatch_sizes(plan, pipe, sizes)
    times = simulated(plan, pipe, micro, hw, spans)
    parts, timing, first, last, sim = times.parts, times.timing, times.first, times.last, times.sim
    ref, p2p, p2p_s = boundary_tensor(plan), times.p2p_bytes, times.timing.comm
    nbytes = plan.nbytes(ref.name)
    dcn = times.p2p_network == "dcn"  # where the send was priced: a GPU cluster's nodes, whatever the mesh declares
    name = pipe.schedule.name
    mems = stage_memories(plan, pipe, micro, hw, optimizer)
    zero = stage_optimizer(plan, pipe, sizes, hw, spans)
    stages = _stages(plan, pipe, parts, micro, p2p_s + timing.send_back, sim, hw, mems)
    tied_s = _tied_exchange(plan, pipe, sizes, hw, spans)
    copies_s = _copies_exchange(plan, pipe, sizes, hw, spans, mems)
    reduce_s, exposed_s = _grad_reductions(pipe, parts, first, last, tied_s, copies_s, hw.reduces_after_backward,
                                           hw.overlap_share, stage_reductions(plan, pipe, sizes, hw, spans))
    glob = float(math.prod(micro[d.name] for d in ref.dims)) * nbytes
    free = replace(timing, comm=0.0, comm_back=None)  # sends free
    closed = bubble(name, pipe.stages, pipe.microbatches, free, pipe.chunks)
    found = _thresholds(pipe, free, min(parts[f"layer {b}"][0].seconds
                                                             for b in range(len(pipe.blocks) or 1)),
                        p2p_s, "DCN" if dcn else "ICI link")
    opt_s = optimizer_exposed(plan, pipe, sizes, hw, spans, _first_forwards(pipe, parts, first, last))
    return PipelineCost(pipe, dim, micro[dim], ref, "dcn" if dcn else "ici", p2p, glob, p2p_s, timing, closed,
                        sim, stages, found, opt_s, first, last, optimizer_busy_s=zero.busy,
                        optimizer_comm_s=zero.comm,
                        grad_reduce_s=reduce_s, grad_reduce_exposed_s=exposed_s, tied_exchange_s=tied_s,
                        copies_exchange_s=copies_s, free_simulation=times.free_sim, p2p_split=times.p2p_split)


def _tied_exchange(plan: Plan, pipe: Pipeline, sizes: dict[str, int], hw: Hardware, spans: Layout) -> float:
    """The first and the last stage swapping their sums of a tied param's gradient contributions, once a
    step (nothing where one device holds both the first and the last chunk, as ZBV's V places them)."""
    name, n = pipe.schedule.name, pipe.stages * pipe.chunks
    if device_of(name, 0, pipe.stages) == device_of(name, n - 1, pipe.stages):
        return 0.0
    return math.fsum(collective_time(Op.COLLECTIVE_PERMUTE, float(local_elements(c, sizes)) * plan.nbytes(c.name),
                                     (pipe.axis,), plan.spec.mesh, sizes, hw, spans).seconds
                     for _, c in tied_contributions(plan))


def _copies_exchange(plan: Plan, pipe: Pipeline, sizes: dict[str, int], hw: Hardware, spans: Layout,
                     mems: list[Memory]) -> float:
    """DualPipe: the most any device takes to swap its gradients (its two stages', as the optimizer
    accounting holds them, or in the params' dtype where it holds none; ``mems``: each device's memory)
    with device p-1-d, which holds the same two stages; 0 for other schedules."""
    if pipe.schedule.name not in TWO_WAY:
        return 0.0
    grads = [m.grad_bytes or m.param_bytes for m in mems]
    return max(collective_time(Op.COLLECTIVE_PERMUTE, g, (pipe.axis,), plan.spec.mesh, sizes, hw, spans).seconds
               for g in grads)


def _first_forwards(pipe: Pipeline, parts: dict[str, list[PartTime]], first: Timing, last: Timing) -> list[float]:
    """Each stage's forward of one microbatch (its layers and the ends it runs): under ``param_gather overlapped``
    the next step's first, which waits on the optimizer's all-gathers of the params it reads."""
    out = []
    for s, counts in enumerate(device_blocks(pipe)):
        at = end_chunks_on(pipe, s)
        out.append(run_times(parts, counts)[0].seconds + first.forward * bool(at[0]) + last.forward * bool(at[1]))
    return out


def _grad_reductions(pipe: Pipeline, parts: dict[str, list[PartTime]], first: Timing, last: Timing,
                     tied_s: float = 0.0, copies_s: float = 0.0, after_backward: bool = False,
                     share: float = 0.0, zero_s: list[float] | None = None) -> tuple[float, float]:
    """The weight gradients' reductions of the busiest stage, once a step, and the part of them left
    exposed: they are issued as the last microbatch's backward makes each layer's gradient, so they
    hide under that backward (Megatron-LM's overlapped gradient reduction), which runs beside them on the
    ``share`` of the cores they leave, and what is longer shows (:func:`shardc.overlap.reduced_after`);
    ``after_backward`` (``grad_reduce after-backward``): issued after it, all exposed; under ``grad_reduce
    after-backward over dcn`` their DCN phase (:attr:`PartTime.deferred`) after it, the rest beside it.
    ``tied_s``: the end stages' swap of a tied param's gradient sums, before its reduction, on both;
    ``copies_s``: DualPipe's swap of the two copies' gradients, on every device; ``zero_s``: each stage's
    ZeRO-1 gradient reduce-scatters (:func:`shardc.costmodel.stage_optimizer.stage_reductions`)."""
    worst, exposed = 0.0, 0.0
    for s, counts in enumerate(device_blocks(pipe)):
        at = end_chunks_on(pipe, s)  # the ends it runs: each reduced once, whatever chunks hold it
        ends = [(key, t) for key, t, on in (("first", first, at[0]), ("last", last, at[1])) if on]
        layers = run_times(parts, counts)
        own = (math.fsum(n * parts[f"layer {b} reduce"][0].seconds for b, n in enumerate(counts))
               + sum(parts[f"{key} reduce"][0].seconds for key, _ in ends) + tied_s * bool(ends) + copies_s
               + (zero_s[s] if zero_s else 0.0))
        # their DCN phase, where only it waits for the backward (`grad_reduce after-backward over dcn`)
        late = (math.fsum(n * parts[f"layer {b} reduce"][0].deferred for b, n in enumerate(counts))
                + sum(parts[f"{key} reduce"][0].deferred for key, _ in ends))
        backward = layers[1].seconds + layers[2].seconds + sum(t.backward + t.weight for _, t in ends)
        worst = max(worst, own)
        exposed = max(exposed, late + reduced_after(backward, own - late, share, after_backward))
    return worst, max(0.0, exposed)


def _stages(plan: Plan, pipe: Pipeline, parts: dict[str, list[PartTime]], micro: dict[str, int],
            sends_s: float, sim: Simulation, hw: Hardware, mems: list[Memory]) -> tuple[StageCost, ...]:
    """Each stage's figures; ``sends_s``: a boundary's two sends a microbatch, the activation and its gradient."""
    out = []
    name = pipe.schedule.name
    working = working_sets(plan, micro)
    kept = kept_bytes(plan, pipe, sim, micro, native=hw.native_kernels)  # the kernels' saved statistics too
    for s, blocked in enumerate(device_blocks(pipe)):
        outside = held_names(plan, pipe, s)
        mem = mems[s]
        held = sim.peak_inflight(s)
        firsts, lasts = end_chunks_on(pipe, s)
        ends = [parts["first"]] * firsts + [parts["last"]] * lasts  # each end chunk it holds runs them
        share = 0.5 if name in TWO_WAY else 1.0  # DualPipe: each of the device's two stages runs half the microbatches
        residual = kept[s]

        def layers_of(field: str, blocked: tuple[int, ...] = blocked) -> float:  # its layers, each block's
            return math.fsum(k * math.fsum(getattr(p, field) for p in parts[f"layer {b}"])
                             for b, k in enumerate(blocked))

        compute = share * (layers_of("busy") + math.fsum(p.busy for e in ends for p in e))
        sends = sends_s * ((s > 0) + (s < pipe.stages - 1))  # activation in and out, cotangent back
        comm = share * (layers_of("comm") + math.fsum(p.comm for e in ends for p in e)) + sends
        f, b, w = (share * (p.seconds + math.fsum(e[i].seconds for e in ends))
                   for i, p in enumerate(run_times(parts, tuple(map(float, blocked)))))
        runs = ["block"] + ["before"] * bool(firsts) + ["after"] * bool(lasts)
        out.append(StageCost(s, sum(blocked), f, b, w, compute, comm, held,
                             mem.param_bytes + mem.grad_bytes + mem.optimizer_bytes,
                             residual, mem.gathered_bytes + mem.ring_bytes, hw.hbm_bytes, mem.params, mem.grads,
                             mem.grad_bytes, mem.optimizer_bytes, blocks=blocked if pipe.blocks else (),
                             working_bytes=max(working.get(k, 0.0) for k in runs),
                             accumulator_bytes=accumulator_bytes(plan, micro, blocked, outside),
                             sections=tuple(runs)))
    return tuple(out)


def _thresholds(pipe: Pipeline, timing: Timing, layer_f: float, p2p_s: float,
                link: str) -> tuple[str, ...]:
    p, name = pipe.stages, pipe.schedule.name
    here = pipe.microbatches
    need = microbatches_for(name, p, timing, BUBBLE_TARGET, pipe.chunks)  # as the bubble line's closed form
    if name in ZERO_BUBBLE:  # the idle time depends on the three times, not on p alone
        idle = {"zb-h1": "(p-1)*max(T_F+T_B-T_W, T_F, T_B)", "zbv": "(p-1)*T_F/2",
                "dualpipe": "(p/2-1)*(T_F&B+T_B-2*T_W)", "dualpipev": "(p-1)*(T_F&B+T_B-2*T_W)/2"}[name]
        form = f"{idle}/({BUBBLE_TARGET:g}*(T_F+T_B+T_W))"
    else:
        form = f"(p-1)/({pipe.chunks if name == 'interleaved' else 1}*{BUBBLE_TARGET:g})"
    lines = [f"bubble <= {BUBBLE_TARGET:.0%} of ideal iff m >= {form} = {need} "
             f"({name}; here m = {here}: {'holds' if here >= need else 'does not hold'})"]
    if layer_f > 0:
        least = p2p_s / layer_f
        layers = min(pipe.stage_layers)
        lines.append(f"a stage's sends hide behind its compute iff layers per stage > t_send/t_layer = "
                     f"{least:.3g} (here {layers}: {'holds' if layers > least else 'does not hold'}; "
                     f"t_send over one {link})")
    return tuple(lines)


def draw_schedule(report: CostReport, path: str, force: bool = False) -> None:
    """``--schedule-plot``: the simulated schedule of the report's pipeline as a Gantt chart.

    ``force`` replaces a file at ``path`` that is not an image (see :mod:`shardc.images`).
    """
    if report.pipeline is None:
        raise ShardcError("--schedule-plot needs a pipelined spec",
                          fix="mark the stage axis of the mesh, e.g. `mesh P=4 pipeline, X=8`")
    cost = report.pipeline
    sim = cost.simulation
    draw(sim, path, f"{report.plan.spec.filename or 'spec'}: {cost.pipeline.schedule}, p={sim.stages}, "
         f"m={sim.microbatches}, bubble {sim.bubble_of_ideal:.1%} of ideal", force)
