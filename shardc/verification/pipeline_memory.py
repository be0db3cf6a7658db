"""A pipelined step's memory per device beside the compiler's: shardc's fullest stage
(:class:`shardc.costmodel.pipeline_figures.StageCost`, costed at the sizes, layers and microbatches the
pipelined verify runs) set beside XLA's buffer assignment of the schedule's program
(``compiled.memory_analysis()``), reported, not judged.

The schedule is one SPMD program (every tick, forward and backward), so XLA's figures are one
device's, sized for the fullest stage.  Its categories are not shardc's: the program takes every
param of the device's stage (the block's stacked, the ends' on their stage) and the whole batch's
inputs, returns the gradients and the ends' accumulator, and keeps the activations of the
microbatches in flight, the gathered weights and its loop's own buffers as temporaries; shardc counts
the stage's params, their gradients (the program returns one a param, on its ZeRO shard where the
spec shards it; it updates no optimizer state), the activations its save policy keeps for the
microbatches the stage holds at its peak (the program's ring holds as many:
:mod:`shardc.lowering.pipeline_slots`), one layer's gathered weights, a tick's working set (one
microbatch's largest phase, laid out as XLA's CPU backend lays it, with the schedule loop's control
scalars), the microbatches' gradient sums a once-a-step ReduceScatter reads and the values riding with
the activation in the program's rings of received activations and gradients (every device's, the
program being one for all: :func:`~shardc.costmodel.stage_memory.rider_bytes`), and beside the stage
the run's data the program takes and returns (the whole batch's inputs and outputs, their cotangents
and gradients, and the tuple of pointers it returns its results in) and the other ends' params and
gradients, which the program, one for every device, takes and returns on each.  Both are counted at
the run's float element (its inputs' dtype).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from shardc.costmodel.cost_report import cost
from shardc.costmodel.memory import kept_once, residual_values, state_refs, value_bytes
from shardc.costmodel.phase_memory import phase_memory
from shardc.costmodel.pipeline_figures import StageCost
from shardc.costmodel.stage_memory import held_names, outside_names, rider_bytes
from shardc.device_pieces import local_elements, size_of
from shardc.ir.localops import Attention
from shardc.ir.plan import Plan
from shardc.lowering.pipeline_lowering import PipelineLowered
from shardc.pipeline.boundary import boundary_tensor, microbatch_dim
from shardc.spec.stages import Pipeline
from shardc.spec.walk import block_reads
from shardc.units import fmt_bytes
from shardc.verification.memory_check import XLA_CPU
from shardc.verification.pipeline_layers import at_run_blocks

__all__ = ["StageMemoryCheck", "stage_memory_check", "control_scalars", "other_ends", "results", "run_fixed_bytes",
           "render_stage_memory"]

_XLA = (("arguments", "argument_size_in_bytes"), ("outputs", "output_size_in_bytes"),
        ("temporaries", "temp_size_in_bytes"))


@dataclass(frozen=True)
class StageMemoryCheck:
    """shardc's fullest stage and XLA's schedule program, each by its own parts, in bytes a device."""

    stage: int
    element: int  # the bytes of a floating-point element in the run
    held: float  # the microbatches whose activations shardc counts: the stage's peak in flight
    microbatches: int  # the run's
    slots: int  # the microbatches whose residuals the lowered schedule keeps at once: its ring's slots
    shardc_parts: tuple[tuple[str, float], ...]  # params, gradients, activations, gathered
    xla_parts: tuple[tuple[str, float], ...]  # arguments, outputs, temporaries; less the aliased bytes
    scalars: int = 0  # the schedule loop's control scalars counted in the working set (control_scalars)
    loss_graph: float = 0.0  # what the program keeps of the statements after the block less shardc's (loss_graph)

    @property
    def shardc_bytes(self) -> float:
        return sum(n for _, n in self.shardc_parts)

    @property
    def xla_bytes(self) -> float:
        return sum(n for _, n in self.xla_parts)

    @property
    def ratio(self) -> float | None:
        return self.shardc_bytes / self.xla_bytes if self.xla_bytes else None

    def notes(self) -> list[str]:
        return [f"shardc counts the activations of the {self.held:g} microbatches the stage holds at its peak; "
                f"the lowered schedule keeps its residuals in a ring of {self.slots} slots (of "
                f"{self.microbatches} microbatches), alive through the loop",
                "a tick's working set is one microbatch's largest phase through a layer (or an end) of the "
                "stage, the block's copies of its arguments (with the slices of the rings' slots a dot reads) "
                "once for each layer a tick runs (XLA's CPU backend makes them all at the start of the "
                f"backward), with the schedule loop's {self.scalars} control scalars (the tick tables' lookups "
                "and predicates), each on a 64-byte line; XLA also packs its buffers with a few per cent of gaps",
                "the program updates no optimizer state (it returns the gradients): shardc cost's optimizer "
                "bytes have no counterpart here"] + ([
                f"the program runs the loss's backward at each microbatch's forward tick, keeping the block output's "
                f"cotangent where a framework keeps the loss's graph to the microbatch's backward (shardc cost "
                f"counts that): its activations are counted as the program keeps them ({fmt_bytes(self.loss_graph)})"]
                if self.loss_graph else []) + ([
                "the program takes every end's params on every device and returns their gradients: the other "
                f"ends' ({fmt_bytes(dict(self.shardc_parts)['other ends'])}) are counted as the program's own, "
                "a framework's stage holds only its own"] if dict(self.shardc_parts).get("other ends") else [])

    def to_json(self) -> dict[str, object]:
        return {"pipelined": True, "stage": self.stage, "element_bytes": self.element, "held": self.held,
                "microbatches": self.microbatches, "slots": self.slots, "control_scalars": self.scalars,
                "notes": self.notes(),
                "shardc_bytes": self.shardc_bytes, "xla_bytes": self.xla_bytes, "ratio": self.ratio,
                "shardc_parts": dict(self.shardc_parts), "xla_parts": dict(self.xla_parts)}


def stage_memory_check(plan: Plan, lowered: PipelineLowered, stats: Any, element: int) -> StageMemoryCheck:
    """shardc's fullest stage of ``plan`` run as ``lowered`` runs it (its sizes with the whole batch,
    layers, microbatches, stage split) beside XLA's memory analysis ``stats`` of its compiled schedule;
    ``element``: the bytes of a float in the run (the spec's dtype's bytes scaled to it)."""
    pipe = lowered.pipeline
    spec = plan.spec
    sizes = {**lowered.sizes, microbatch_dim(plan): lowered.batch}
    spec = at_run_blocks(spec, sizes, lowered.blocks)
    # the split the program runs (STAGE_LAYERS: verify's run of a spec's own `stage_layers`, BLOOM's 5, 6, ..., 5
    # of 70 layers cut to 2 a stage), not the spec's at its own layers: that priced stage 1 at 6 of the run's 24
    # every float at the run's element, a `dtype` line's too (an f8 value: the module rounds it to FP8 and
    # stores it in the run's float, XLA:CPU having no FP8 dot): DeepSeek-V3's f8 residuals counted at half
    # the bytes its ring holds them at (2.1 MB of its 6.7 MB); ids and masks keep their own (fixed_bytes)
    run = replace(plan, spec=replace(spec, microbatches=pipe.microbatches, stage_layers=lowered.namespace.STAGE_LAYERS),
                  element_bytes=tuple(sorted(run_fixed_bytes(plan).items())))
    report = cost(run, sizes=sizes)
    assert report.pipeline is not None
    scale = element / plan.spec.dtype.nbytes
    program = lowered.namespace.PIPELINE
    micro = sizes | {report.pipeline.dim: report.pipeline.microbatch_size}
    graph = {s.stage: loss_graph(run, s, micro, program.weight_ticks is not None) for s in report.pipeline.stages}
    stage = max(report.pipeline.stages, key=lambda s: s.memory_bytes + graph[s.stage])  # as the program holds it
    scalars = control_scalars(program, _gradient_shapes(plan, lowered.sizes, program))
    shardc = (("params", stage.params * element), ("gradients", stage.grads * element),
              ("other ends", other_ends(run, pipe, stage.stage, sizes) * element),
              ("activations", (stage.activation_bytes + graph[stage.stage]) * scale),
              ("gathered weights", stage.gathered_bytes * scale),
              ("working set", _working_set(run, micro, stage, element, program.slots) + scalars * XLA_CPU.align),
              ("gradient sums", stage.accumulator_bytes * scale),
              ("riders", rider_bytes(run, micro, _rider_slots(program)) * scale),
              ("data", _data(plan, sizes, element) + XLA_CPU.pointer * results(program)))
    xla = tuple((name, float(getattr(stats, attr))) for name, attr in _XLA)
    slots = program.rings.kept.count
    return StageMemoryCheck(stage.stage, element, stage.held, pipe.microbatches, slots, shardc,
                            xla + (("aliased", -float(stats.alias_size_in_bytes)),), scalars,
                            graph[stage.stage] * scale)


def loss_graph(plan: Plan, stage: StageCost, micro: dict[str, int], split: bool) -> float:
    """What the lowered program keeps of the statements after the block on ``stage``, less what ``shardc
    cost`` counts (bytes at the spec's dtype, at the microbatch's sizes ``micro``), for the comparison
    only.  A framework computes the loss at a microbatch's forward and runs its backward at the
    microbatch's backward (``torch.distributed.pipelining``'s ScheduleGPipe and Schedule1F1B, which
    torchtitan runs: ``_maybe_compute_loss`` in the forward, ``backward_one_chunk(loss=...)`` later),
    keeping the loss's graph (its residuals: the final norm's input, the logits) for every microbatch
    the stage holds, as shardc counts it (GPipe's last stage: all M).  The lowered program, whose
    loss's backward reads nothing a later tick makes, runs it at the forward's tick
    (:meth:`~shardc.lowering.pipeline_parts.ModelEnds.last`) and keeps the block output's cotangent
    instead.  The zero-bubble schedules' program (``split``) keeps what the loss's W reads: not changed."""
    if split or "after" not in stage.sections:
        return 0.0
    values = residual_values(plan)
    _, after = outside_names(plan)
    dim = microbatch_dim(plan)
    graph = sum(value_bytes(plan, r, micro) for r in kept_once(plan, values) if r.name in after and dim in r.indices)
    cotangent = float(local_elements(boundary_tensor(plan), micro)) * plan.spec.dtype.nbytes
    return stage.held * (cotangent - graph)


def run_fixed_bytes(plan: Plan) -> dict[str, int]:
    """The element sizes the run holds whatever its float: :meth:`Plan.fixed_bytes` (token ids, keep-masks)
    less the attention kernels' row logsumexps.  ``shardc cost`` keeps those at 4 bytes whatever the spec's
    dtype (:data:`~shardc.ops.ring_attention.LSE_BYTES`, as the kernels keep them in float32), but the run's
    kernel holds them at its compute type, float32 or wider (``compute_dtype`` in the runtime's
    ``_attention``: the run's float, 4 or 8 bytes): counted at the spec's dtype, they scale to the run's
    element with the other floats (at 4 bytes scaled they were twice what a float32 run holds of a bf16
    spec's, and DeepSeek-V3's float64 verify counted them at 16 bytes where it holds 8)."""
    lse = {s.dst.name for s in plan.forward if isinstance(s.fn, Attention) and s.fn.part == "lse"}
    return {t: n for t, n in plan.fixed_bytes().items() if t not in lse}


def other_ends(plan: Plan, pipe: Pipeline, stage: int, sizes: dict[str, int]) -> float:
    """The elements on a device of the params outside the ``layers`` block that ``stage`` does not hold
    (the other end's: the embedding on the last stage, the head on the first), and of their gradients:
    the program, one SPMD program for every device, takes each end's params on every device and returns
    their gradients (the buffer assignments: yi_34b's stage 0 takes W_out, f32[1,8,5], 160 B, and returns
    its gradient), where a framework's stage holds only its own.  Counted for the comparison only, as the
    program's own (``shardc cost`` counts none)."""
    held = held_names(plan, pipe, stage)
    if held is None:
        return 0.0
    before, after = outside_names(plan)
    inside = block_reads(plan.spec)
    others = {info.name for info in plan.tensors if info.role == "param"
              and info.name in before | after and info.name not in held | inside.keys()}
    grads, _ = state_refs(plan)
    refs = [info.ref for info in plan.tensors if info.name in others] + [r for r in grads if r.name in others]
    return sum(float(local_elements(r, sizes)) for r in refs)


def control_scalars(program: Any, gradient_shapes: int) -> int:
    """The scalars the schedule's loop body keeps through a tick on XLA's CPU backend, from what it reads
    of the tick tables (:meth:`shardc.lowering.pipeline_runtime.Pipeline._local`), for the backward program
    (the one the check compiles): each a buffer of its own on a 64-byte line, alive from the tick's start
    (they read only the loop's state, so its scheduler makes them first) to the phase that reads them.
    ``gradient_shapes``: the block params' distinct shapes on a device.  Counted for the comparison only
    (shardc cost counts none), read off the buffer assignments (``*-buffer-assignment.txt``, each scalar's
    source line through the HLO's stack frames) of pipeline_llama, pipeline_llama2_13b and yi_34b and of
    pipeline_llama run as gpipe, zb-h1, interleaved 2, zbv, dualpipe and dualpipev: 35, 34, 40, 37, 38,
    23, 35, 32 and 36 pred[] and s32[] values in the loop body's temporaries, of which this counts 28, 28,
    29, 28, 31, 17, 18, 18 and 18; not counted: the residual ring's writes' tests (3 or 4), the layer's own
    scalars (its params' slots, a dropout key's) and, with several chunks, the rest of the hand-ons'."""
    split = program.weight_ticks is not None
    counter = 3  # the tick t, the body's copy of it and t + 1
    # a phase's hand-on (pipeline_routes.Placement.hand_on; F's and B's): the sender's entry clamped and
    # whether it sent, and the write's in-bounds test (XLA turns a scatter at a traced index into a dynamic-
    # update-slice behind one); where a device holds one chunk (1f1b, gpipe, zb-h1) also its next virtual
    # stage in range (two compares), whether it lands here and its slot's offset, and the predicates below:
    # with several chunks (interleaved, the V schedules) XLA fuses those into the writes (the buffer
    # assignments: 14 scalars of the hand-ons under 1f1b, 6 under interleaved 2, 16 under zbv, 10 under
    # dualpipe, none of the stage predicates but under 1f1b, gpipe and zb-h1)
    one_chunk = program.placement.chunks == 1
    hand_ons = 2 * (7 if one_chunk else 3)
    phases = 3 if split else 2  # F, B and the zero-bubble schedules' W, each its own table's entry
    # each phase's slot of the layer params, the device's row of the rings' slot tables, the ends' cotangent
    # write; the predicates: F's first and last virtual stage, B's first (W's first and last where split)
    lookups = phases + 2
    predicates = (3 + 2 * split) * one_chunk
    # each gradient sum written at its layer's slot: one in-bounds test a distinct shape (XLA's CSE folds
    # the tests of equal shapes at the same index)
    return counter + hand_ons + lookups + predicates + gradient_shapes


def _gradient_shapes(plan: Plan, sizes: dict[str, int], program: Any) -> int:
    """The distinct shapes of the pipelined blocks' params on a device at the microbatch's ``sizes``."""
    refs = {info.name: info.ref for info in plan.tensors}
    names = {p for body in program.bodies for p in body.params}
    return len({tuple(-(-size_of(sizes, d.name) // math.prod(size_of(sizes, a) for a in d.axes))
                      for d in refs[n].dims) for n in names})


def results(program: Any) -> int:
    """The arrays the schedule's backward program returns (the leaves of its ``out_specs``: the ends'
    accumulator, the outputs, every param's gradient).  XLA's CPU backend returns them in a tuple, an output
    allocation of one pointer a result (:attr:`~shardc.costmodel.phase_memory.Buffers.pointer`, as the
    unpipelined check counts it): pipeline_llama's buffer assignment, 9 results in 72 bytes, yi_34b's 10 in
    80.  Counted with the run's data, the program's own."""
    import jax

    spec = jax.sharding.PartitionSpec
    return len(jax.tree.leaves(program.specs()[1], is_leaf=lambda x: isinstance(x, spec)))


def _rider_slots(program: Any) -> int:
    """The slots the program holds a rider in, on every device (one program for all): its rings of received
    activations and gradients, and split (the zero-bubble schedules), of the block input's gradients from B
    to W (``pre``, which holds each rider's beside it)."""
    rings = program.rings
    return rings.acts.count + rings.cots.count + (rings.pre.count if program.weight_ticks is not None else 0)


def _data(plan: Plan, sizes: dict[str, int], element: int) -> float:
    """The run's data as the schedule's program holds it, at the whole batch's ``sizes``: it takes the
    inputs and the outputs' cotangents and returns the outputs and the inputs' gradients (a stage of
    ``shardc cost`` holds its microbatches' activations, not the step's data: a data loader's).  Every
    float at ``element``, a ``dtype`` line's too, as the program is compiled: only ids and masks keep
    their own (:meth:`~shardc.ir.plan.Plan.fixed_bytes`, as the unpipelined check counts them)."""
    own = plan.fixed_bytes()
    inputs = {info.name for info in plan.tensors if info.role == "input"}
    grads = {grad for primal, grad in plan.gradient_names if primal in inputs}
    refs = [info.ref for info in plan.tensors if info.role == "input" or info.is_output]
    refs += [*plan.cotangents, *(g for g in plan.grads if g.name in grads)]
    return sum(float(local_elements(ref, sizes)) * own.get(ref.name, element) for ref in dict.fromkeys(refs))


def _working_set(plan: Plan, micro: dict[str, int], stage: StageCost, element: int, layers: int) -> float:
    """The stage's working set at the microbatch's sizes ``micro`` as XLA's CPU backend lays it out
    (:data:`~shardc.verification.memory_check.XLA_CPU`, as the unpipelined check counts it): the largest
    phase of one microbatch through the sections the stage runs, the block's with the copies of its
    arguments (params, saved values) made first for each of the ``layers`` a tick runs, not one: the
    loop body's scheduler makes them all before the first layer runs.  The saved values are the
    microbatch's slots of the schedule's rings, each a dot reads sliced out into a buffer of its own
    (:attr:`~shardc.costmodel.phase_memory.Buffers.ring_slices`)."""
    sliced = replace(XLA_CPU, ring_slices=True)
    sets = {k: max(p.temporaries + (layers - 1) * p.argument_copies * (k == "block")
                   for p in phase_memory(plan, micro, element, sliced, k)) for k in stage.sections}
    return max(sets.values())


def render_stage_memory(check: StageMemoryCheck) -> str:
    """The lines ``shardc verify`` prints for a pipelined spec: both sides' parts and totals."""
    def parts(items: tuple[tuple[str, float], ...]) -> str:
        return ", ".join(f"{what} {fmt_bytes(n)}" for what, n in items if n)

    ratio = f"{check.ratio:.2f}" if check.ratio is not None else "-"
    return (f"memory per device ({check.element}-byte floats), shardc's fullest stage (stage {check.stage}) against "
            f"XLA's buffer assignment of the schedule's program (reported, not judged):\n"
            f"  shardc {fmt_bytes(check.shardc_bytes)} ({parts(check.shardc_parts)})\n"
            f"  XLA    {fmt_bytes(check.xla_bytes)} ({parts(check.xla_parts)})\n"
            f"  ratio  {ratio}\n" + "".join(f"  note: {n}\n" for n in check.notes()))
