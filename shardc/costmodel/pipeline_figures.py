"""The pipeline's figures as ``shardc cost`` reports them: a stage's (:class:`StageCost`) and the step's
(:class:`PipelineCost`), with what each derives from them (the step, its bound, MFU, the fullest stage).

:func:`shardc.costmodel.pipeline_cost.pipeline_cost` computes them from a plan; these values only hold and
combine them, so every reader (the report's text and JSON, the layouts, the memory check) reads one figure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from shardc.ir.spec import TensorRef
from shardc.phase_time import bound_of, seconds_at_mfu
from shardc.pipeline.bubbles import EXACT, Bubble, activation_factor, inflight, sends_per_microbatch
from shardc.pipeline.schedules import Simulation, Timing
from shardc.spec.stages import Pipeline

__all__ = ["StageCost", "PipelineCost"]

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
    # the values riding with the activation in the send buffers (stage_memory.rider_bytes), read by no backward
    rider_bytes: float = 0.0
    host: bool = False  # --offload: its host copies (or the host's update) outlast what they run beside

    @property
    def bound(self) -> str:
        return bound_of(self.compute_s, self.comm_s, self.host)

    @property
    def memory_bytes(self) -> float:
        return (self.state_bytes + self.activation_bytes + self.gathered_bytes + self.working_bytes
                + self.accumulator_bytes + self.rider_bytes)

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
                "fits": self.fits, **({"host_bytes": self.host_bytes} if self.host_bytes else {}),
                **({"rider_bytes": self.rider_bytes} if self.rider_bytes else {})}


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
    riders: tuple[TensorRef, ...] = ()  # values made before the block riding with the boundary (in p2p_bytes)

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

    @property
    def free_sends_step_s(self) -> float:
        """The whole step with only the point-to-point sends made free (the report's "with free sends"): the
        schedule with free sends (``step_closed_s`` less the optimizer phase it counts) plus all the step adds
        after the schedule (exposed gradient reductions, optimizer phase, update, host copies)."""
        return self.step_s - self.simulation.makespan + self.step_closed_s - self.optimizer_s

    def to_json(self) -> dict[str, object]:
        pipe, sim = self.pipeline, self.simulation
        return {
            "axis": pipe.axis, "stages": pipe.stages, "microbatches": pipe.microbatches,
            "schedule": str(replace(pipe.schedule, sends="async")), "virtual_stages": pipe.chunks,
            "sends": pipe.schedule.sends, "layers": list(pipe.stage_layers),
            "microbatch_dim": self.dim, "microbatch_size": self.microbatch_size,
            "bubble_of_ideal": self.closed.of_ideal, "bubble_of_total": self.closed.of_total,
            "bubble_formula": self.closed.formula, "bubble_formula_exact": pipe.schedule.name in EXACT,
            "simulated_bubble_of_ideal": sim.bubble_of_ideal, "simulated_bubble_of_total": sim.bubble_of_total,
            "inflight_microbatches": inflight(pipe.schedule.name, pipe.stages, pipe.microbatches),
            "activation_factor": activation_factor(pipe.schedule.name, pipe.stages, pipe.chunks),
            "boundary": str(self.boundary), "network": self.network, "p2p_bytes": self.p2p_bytes,
            "p2p_bytes_global": self.p2p_bytes_global, "p2p_s": self.p2p_s, "p2p_split": list(self.p2p_split),
            **({"riders": [str(r) for r in self.riders]} if self.riders else {}),
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
