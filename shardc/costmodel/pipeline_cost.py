"""The pipeline figures of ``shardc cost``: bubble, memory per stage, point-to-point traffic, the step.

Computed here; the values they fill, a stage's and the step's, are :mod:`shardc.costmodel.pipeline_figures`'s.

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
from dataclasses import replace
from typing import TYPE_CHECKING

from shardc.collectives import Layout, Op, collective_time
from shardc.costmodel.memory import Memory
from shardc.costmodel.pipeline_figures import PipelineCost, StageCost
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
    rider_bytes,
    rider_slots,
    stage_memories,
    working_sets,
)
from shardc.costmodel.stage_optimizer import optimizer_exposed, stage_optimizer, stage_reductions
from shardc.device_pieces import local_elements
from shardc.errors import ShardcError
from shardc.hardware import Hardware
from shardc.ir.plan import Plan
from shardc.overlap import reduced_after
from shardc.pipeline.block_split import device_blocks
from shardc.pipeline.boundary import (
    boundary_tensor,
    carried_refs,
    tied_contributions,
)
from shardc.pipeline.bubbles import (
    bubble,
    microbatches_for,
)
from shardc.pipeline.dualpipe import TWO_WAY
from shardc.pipeline.gantt import draw
from shardc.pipeline.schedules import ZERO_BUBBLE, Simulation, Timing, device_of
from shardc.spec.stages import Pipeline, pipeline_of

if TYPE_CHECKING:
    from shardc.costmodel.cost_report import CostReport

__all__ = ["pipeline_cost", "draw_schedule"]

BUBBLE_TARGET = 0.05  # the bubble the threshold sentence solves m for


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
    glob = float(sum(math.prod(micro[d.name] for d in r.dims) for r in carried_refs(plan))) * nbytes  # riders too
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
                        copies_exchange_s=copies_s, free_simulation=times.free_sim, p2p_split=times.p2p_split,
                        riders=carried_refs(plan)[1:])


def _tied_exchange(plan: Plan, pipe: Pipeline, sizes: dict[str, int], hw: Hardware, spans: Layout) -> float:
    """The first and the last stage swapping their sums of a tied param's gradient contributions, once a
    step (nothing where one device holds both the first and the last chunk, as ZBV's V places them), in the
    type the gradient is held and reduced in: DeepSpeed's pipeline engine all-reduces ``weight._hp_grad``,
    BF16_Optimizer's fp32 gradient, under bf16 (deepspeed/runtime/pipe/engine.py, _exec_reduce_tied_grads)."""
    name, n = pipe.schedule.name, pipe.stages * pipe.chunks
    if device_of(name, 0, pipe.stages) == device_of(name, n - 1, pipe.stages):
        return 0.0
    return math.fsum(collective_time(Op.COLLECTIVE_PERMUTE,
                                     float(local_elements(c, sizes)) * plan.nbytes(plan.grad_name(param)),
                                     (pipe.axis,), plan.spec.mesh, sizes, hw, spans).seconds
                     for param, c in tied_contributions(plan))


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
    riding = rider_bytes(plan, micro, 1.0)  # a slot of the send buffers
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
                             sections=tuple(runs), rider_bytes=riding * rider_slots(pipe, s)))
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
