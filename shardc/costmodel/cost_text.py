"""The text ``shardc cost`` prints: a table per phase, totals, memory, verdict, thresholds."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from shardc.costmodel.formulas import text
from shardc.costmodel.pipeline_figures import PipelineCost
from shardc.ir.plan import Op
from shardc.pipeline.block_split import counted_device
from shardc.pipeline.bubbles import EXACT, activation_factor, inflight, sends_per_microbatch
from shardc.pipeline.schedules import PAIRED, ZERO_BUBBLE, paired_seconds
from shardc.step_cost import StepCost
from shardc.units import fmt_bytes, fmt_flops, fmt_seconds

if TYPE_CHECKING:
    from shardc.costmodel.cost_report import CostReport
    from shardc.costmodel.formulas import HardwareSymbols
    from shardc.costmodel.memory import Memory
    from shardc.costmodel.phase_cost import PhaseCost
    from shardc.hardware import Hardware

__all__ = ["render", "render_pipeline", "hardware_line"]


def _row(r: StepCost) -> str:
    if r.is_collective:
        axes = ",".join(r.axes)
        path = "ahead" if r.ahead else "critical"
        lat = " (latency-bound)" if r.latency_s > r.bandwidth_s else ""
        return (f"  {r.index:>3}  {r.op.title:<13} {axes:<6} {fmt_bytes(r.volume):>10}  "
                f"{fmt_seconds(r.comm_s):>9}  {path:<8}  {r.text}{lat}")
    if r.compute_s:
        return (f"  {r.index:>3}  {r.op.title:<13} {'':<6} {fmt_flops(r.flops):>10}  "
                f"{fmt_seconds(r.compute_s):>9}  {'compute':<8}  {r.text}") + _in(r) + _ring(r)
    if r.memory_bytes:
        return (f"  {r.index:>3}  {r.op.title:<13} {'':<6} {fmt_bytes(r.memory_bytes):>10}  "
                f"{fmt_seconds(r.memory_s):>9}  {'memory':<8}  {r.text}")
    return f"  {r.index:>3}  {r.op.title:<13} {','.join(r.axes):<6} {'':>10}  {'':>9}  {'local':<8}  {r.text}"


def _copies(m: Memory) -> str:
    """Of the weights, the copies ``gemm f8`` GEMMs read (:attr:`Memory.quantized_weight_bytes`)."""
    if not m.quantized_weight_bytes:
        return ""
    return (f" (of them {fmt_bytes(m.quantized_weight_bytes)}: the copies the GEMMs read in their `gemm` type, "
            "quantized once a step)")


def _in(r: StepCost) -> str:
    """A matmul run in another type than the spec's (its operands': a `dtype T` line) says which."""
    quantized = f", its inputs quantized: {fmt_bytes(r.quantize_bytes)}" if r.quantize_bytes else ""
    return f"  (in {r.dtype}{quantized})" if r.dtype else ""


def _mark(r: StepCost) -> str:
    """A row of a ``layers`` block after the first says which (its layers count it)."""
    return f"  [layers block {r.block + 1}]" if r.block and not r.once else ""


def _ring(r: StepCost) -> str:
    """A ring kernel's transfers against its compute (ring attention, a collective matmul): each step's
    send, what stays exposed, and (attention) the block length from which a step's compute hides its send;
    an attention kernel's moves of the sequence in the all-gather or Ulysses form against its compute."""
    if r.context_parallel:
        return (f"\n       context parallel ({r.context_parallel}): the sequence's moves take "
                f"{fmt_seconds(r.cp_comm_s)} against the kernel's {fmt_seconds(r.compute_s)}; its compute "
                f"outlasts them from {r.hidden_from:,.0f} tokens a device")
    if not r.ring_steps:
        return ""
    if r.op is Op.EINSUM:  # a collective matmul
        block = r.compute_s / r.ring_steps
        if r.ring_shared:
            return (f"\n       collective matmul over {','.join(r.ring_axes)}: {r.ring_steps} block matmuls of "
                    f"{fmt_seconds(block)}; its blocks are those an earlier ring of this phase sends (one chain "
                    "of sends)")
        return (f"\n       collective matmul over {','.join(r.ring_axes)}: {r.ring_steps} block matmuls of "
                f"{fmt_seconds(block)}, {r.ring_steps - 1} sends of a block ({fmt_bytes(r.volume / r.ring_steps)}) "
                f"in {fmt_seconds(r.transfer_s)} each: {'hidden' if r.transfer_s <= block else 'exposed'}; "
                f"exposed communication {fmt_seconds(r.exposed_comm_s)}")
    hidden = "hidden" if r.transfer_s <= r.compute_s / r.ring_steps else "exposed"
    return (f"\n       ring attention over {','.join(r.ring_axes)}: {r.ring_steps} steps of "
            f"{fmt_seconds(r.compute_s / r.ring_steps)} compute, each sending the next K/V block in "
            f"{fmt_seconds(r.transfer_s)}: {hidden} (a step's compute hides it from {r.hidden_from:,.0f} tokens a "
            "device); "
            f"exposed communication {fmt_seconds(r.exposed_comm_s)}")


def _layer_counts(p: PhaseCost) -> str:
    """The layers each ``layers`` block repeats: ``3`` with one block, ``3 + 58`` with two."""
    return " + ".join(str(n) for n in (p.layers, *p.more_layers))


def _fusion_words(hw: Hardware) -> str:
    """How the memory-bound steps' kernels are fused, as the chip's framework runs them."""
    if hw.fuses_statements:
        return "one hand-fused kernel a statement: fusion statement"
    return "fused as XLA fuses" if hw.fuses else "one kernel an op: fusion none"


def _cross_pod(p: PhaseCost) -> str:
    """Of a phase's critical collectives, the gradient reductions' DCN phase after the backward (``grad_reduce
    after-backward over dcn``); nothing under any other line."""
    if not p.hardware.reduces_dcn_after_backward:
        return ""
    return f" (of it {fmt_seconds(p.grad_reduce_dcn_s)} the gradient reductions' DCN phase, after the backward)"


def _totals(p: PhaseCost, layers: int, at_mfu: tuple[float | None, float] | None = None) -> list[str]:
    """A phase's totals; ``at_mfu``: the step at ``--mfu`` and the model FLOPs it is of (the report's: a
    pipeline's own, the whole pipelined step's, where pipelined)."""
    per = f" ({_layer_counts(p)} layers)" if layers != 1 or p.more_layers else ""
    f = p.formula
    update = f" (the optimizer's update {fmt_seconds(p.update_s)})" if p.update_s else ""
    lines = [
        f"  compute {fmt_seconds(p.compute_s)}{per}: {fmt_flops(p.compute_flops)} a device = {text(f.flops)}",
        f"  memory  {fmt_seconds(p.memory_s)}: {fmt_bytes(p.memory_bytes)} of HBM traffic a device "
        f"(memory-bound steps, {_fusion_words(p.hardware)})"
        f"{update}",
        f"  comm    {fmt_seconds(p.comm_s)}: {fmt_bytes(p.comm_bytes)} = {text(f.comm_bytes)}"
        f"  [critical {fmt_seconds(p.critical_s)}{_cross_pod(p)}, ahead {fmt_seconds(p.ahead_s)}]",
        f"  time    = {f.compute_s_text()} vs {f.comm_s_text()}",
    ]
    if p.hardware.book:
        lines.append(f"  bound: {p.bound}; step {fmt_seconds(p.step_s)} with all collectives overlapped (the book's "
                     f"model), {fmt_seconds(p.step_ahead_only_s)} with only ahead-of-time ones; MFU {p.mfu:.1%}")
    else:
        ends = (f" ({fmt_seconds(p.exposed_ends_s)} of them at the phase's ends, with no compute beside them: "
                f"the gathers its first step waits on, the reductions after its last)") if p.exposed_ends_s else ""
        lines.append(f"  bound: {p.bound}; step {fmt_seconds(p.step_s)}: compute and memory, ahead-of-time "
                     f"collectives overlapped{ends}, critical ones exposed; exposed communication "
                     f"{fmt_seconds(p.exposed_comm_s)}")
    lines.append(f"  MFU {p.mfu:.1%} (model FLOPs {fmt_flops(p.model_flops)}, recomputation not counted, over the "
                 f"{p.dtype} peak {fmt_flops(p.hardware.peak(p.dtype))}/s), "
                 f"HFU {p.hfu:.1%}" + (f"; {p.tokens_per_s_per_chip:,.0f} tokens/s a chip" if p.tokens else ""))
    if p.below_mfu is not None:
        lines.append(f"  {p.below_mfu}")
    if at_mfu is not None and at_mfu[0] is not None and p.mfu_assumed is not None:
        lines.append(f"  at {p.mfu_assumed:.0%} MFU: {fmt_seconds(at_mfu[0])} "
                     f"(model FLOPs {fmt_flops(at_mfu[1])} / (devices * C * MFU))")
    return lines


def _phase(p: PhaseCost, layers: int) -> list[str]:
    title = f"{p.name} (one layer{' of each block' if p.more_layers else ''})" if layers != 1 or p.more_layers \
        else p.name
    if p.repeats > 1:  # a pipelined stage runs a microbatch at a time
        title = f"{p.name} ({'one layer, ' if layers != 1 else ''}one microbatch, run {p.repeats} times a step)"
    lines = [title,
             f"  {'#':>3}  {'op':<13} {'axes':<6} {'V / FLOPs':>10}  {'time':>9}  {'path':<8}  what"]
    lines.extend(_row(r) + _mark(r) for r in p.rows)
    if not p.rows:
        lines.append("  (no steps)")
    return lines + _totals(p, layers, (p.step_at_mfu_s, p.model_flops))


def _memory(report: CostReport) -> list[str]:
    m = report.memory
    verdict = "fits" if m.fits else "does NOT fit"
    total = f"  total      {fmt_bytes(m.total_bytes)}: {verdict} {fmt_bytes(m.hbm_bytes)} of HBM"
    if report.pipeline is not None:  # these are one stage's layers with the whole batch at once
        fullest = report.pipeline.fullest
        held = "fits" if fullest.fits else "does NOT fit"
        total = (f"  total      {fmt_bytes(m.total_bytes)} with the whole batch at once; the pipeline holds only the "
                 f"microbatches in flight: {fmt_bytes(fullest.memory_bytes)} on its fullest stage "
                 f"({fullest.stage}), {held} {fmt_bytes(m.hbm_bytes)} of HBM (the stage table below)")
    zero = ""
    if m.zero:  # `zero N over X`: stage N shards the first N of these
        stage = int(m.zero.split()[1])
        zero = f"; {m.zero}: {', '.join(('optimizer state', 'gradients', 'params')[:stage])} sharded"
    lines = [f"memory per device ({m.accounting}: {m.accounting_text}{zero})",
             f"  params     {m.params:.4g} of {m.params_total:.4g} on this device",
             f"  weights    {fmt_bytes(m.param_bytes)}" + _copies(m),
             f"  grads      {fmt_bytes(m.grad_bytes)}",
             f"  optimizer  {fmt_bytes(m.optimizer_bytes)}",
             f"  residuals  {fmt_bytes(m.residual_bytes)}"
             + (f" ({', '.join(v for v, _ in m.residuals)} a layer)" if m.residuals else ""),
             f"  gathered   {fmt_bytes(m.gathered_bytes)} (weights gathered at once, one layer)",
             *([f"  in flight  {fmt_bytes(m.ring_bytes)} (the blocks a ring's sends arrive in, double-buffered, "
                "one step of one layer)"] if m.ring_bytes else []), total]
    return lines + _offload(report) + _residual_table(m)


def _offload(report: CostReport) -> list[str]:
    """What the host's memory holds (--offload), the link time, the host's update and what of them is exposed
    (a pipeline's: its slowest stage's)."""
    moved = report.offload
    if moved is None:
        return []
    pipe = report.pipeline
    host = max(s.host_bytes for s in pipe.stages) if pipe is not None else report.memory.host_bytes
    where = "its slowest stage's, a step: " if pipe is not None else ""
    kept = ("; the device keeps two layers' kept values (a microbatch's under a pipeline)"
            if moved.activation_bytes else "")
    lines = [f"  host       {fmt_bytes(host)} (--offload {moved.what}: kept values moved "
             f"{fmt_bytes(moved.activation_bytes)}, optimizer state {fmt_bytes(moved.optimizer_bytes)}, "
             f"gradients {fmt_bytes(moved.grad_bytes)}){kept}",
             f"  host link  {where}{fmt_seconds(moved.seconds)} each way at {fmt_bytes(moved.host_bandwidth)}/s: "
             f"out under the forward ({fmt_seconds(moved.forward_busy_s)}), in under the backward "
             f"({fmt_seconds(moved.backward_busy_s)})"]
    if moved.host_update_s:
        when = ("a step late, beside the next forward and backward" if moved.delayed
                else "after the backward")
        lines.append(f"  host Adam  {fmt_seconds(moved.host_update_s)} on the host's CPU (ZeRO-Offload's CPU-Adam), "
                     f"then {fmt_bytes(moved.param_bytes)} of params in: {when}")
    return lines + [f"  exposed    {fmt_seconds(moved.exposed_s)} in the step (copies past their phase's time"
                    + (", the host's update" if moved.host_update_s else "") + ")"]


def _residual_table(m: Memory) -> list[str]:
    """What the backward keeps, a row a tensor (one layer), and what it recomputes instead."""
    if not m.residuals:
        return []
    lines = [f"  kept for the backward, one layer (--recompute {m.recompute}):"]
    whys = m.whys or ("",) * len(m.residuals)
    lines += [f"    {value:<28} {fmt_bytes(nbytes):>9}  {why}"
              for (value, nbytes), why in zip(m.residuals, whys, strict=True)]
    if m.recomputed:
        lines.append("  recomputed in the backward instead: "
                     + ", ".join(f"{v} ({fmt_bytes(b)})" for v, b in m.recomputed))
    return lines


def hardware_line(filename: str | None, hw: Hardware, names: HardwareSymbols) -> str:
    c, w_ici, w_dcn = names.names()
    return (f"{filename or '<spec>'} on {hw.name}: {c}={hw.flops:.3g} FLOP/s, "
            f"{w_ici}={hw.w_ici:.3g} B/s, {w_dcn}={hw.w_dcn:.3g} B/s, HBM {fmt_bytes(hw.hbm_bytes)}")


def render(report: CostReport) -> str:
    hw = report.hardware
    sizes = ", ".join(f"{k}={v:_}" for k, v in report.sizes.items())
    head = [hardware_line(report.plan.spec.filename, hw, report.step.formula.hw),
            f"sizes: {sizes}; {report.step.devices} devices; layers {_layer_counts(report.step)}", ""]
    body: list[str] = []
    phases = [report.forward, report.backward]
    if report.optimizer is not None and report.optimizer.rows:
        phases.append(report.optimizer)
    for phase in phases:
        body += _phase(phase, report.layers) + [""]
    title = " + ".join(p.name for p in phases)
    flops = report.pipeline.model_flops if report.pipeline is not None else report.step.model_flops
    body += [f"step ({title})"] + _totals(report.step, report.layers, (report.step_at_mfu_s, flops)) + [""]
    body += _memory(report) + ["", "thresholds"]
    body += [f"  {t.sentence}" for t in report.thresholds] or ["  (no communication)"]
    if report.pipeline is not None:
        body += [""] + render_pipeline(report.pipeline)
    body += ["", "notes"] + [f"  {n}" for n in report.notes]
    return "\n".join(head + body) + "\n"


def render_pipeline(cost: PipelineCost) -> list[str]:
    """The pipeline section of ``shardc cost``'s text."""
    pipe, sim, closed = cost.pipeline, cost.simulation, cost.closed
    name, sends = pipe.schedule.name, pipe.schedule.sends
    given = "" if pipe.microbatches_given else " (default: one a stage; add a `microbatches` line)"
    lines = [f"pipeline over {pipe.axis}: {pipe.stages} stages, schedule {pipe.schedule}, "
             f"{pipe.microbatches} microbatches of {cost.dim}={cost.microbatch_size:_}{given}",
             f"  {pipe.split_text()}; the tables above are one stage's"
             + (f" (the one holding {' + '.join(map(str, counted_device(pipe)))} layers of the blocks)"
                if pipe.blocks else "")
             + (" (and the steps outside the block, which run on the first and last stage)" if cost.extra else "")
             + ", on the whole batch (a microbatch at a time; at once under the book's model)",
             f"  a microbatch through the slowest stage: F {fmt_seconds(cost.timing.forward)}, "
             f"B {fmt_seconds(cost.timing.backward)}, W {fmt_seconds(cost.timing.weight)}"
             + ("" if name in ZERO_BUBBLE else " (B and W run as one backward)")
             + (f", an overlapped F&B pair {fmt_seconds(paired_seconds(cost.timing, cost.timing))}"
                if name == "dualpipe" else ""),
             f"  bubble {closed.of_ideal:.1%} of the ideal time ({closed.formula}), {closed.of_total:.1%} of the "
             f"step; simulated with the sends {sim.bubble_of_ideal:.1%} / {sim.bubble_of_total:.1%}"
             + ("" if name in EXACT else " (the closed form assumes T_F = T_B = T_W and free sends; the "
                                         "simulated zbv order is a greedy one, not the paper's hand-made one)"
                if name == "zbv" else " (DualPipe's closed form, its repository README's, holds for "
                                      "T_F = T_B >= T_W, F&B = F + B and free sends; the simulation runs the "
                                      "repository's order with the paired F&B times)"),
             *_ends(cost, fmt_seconds),
             f"  step {fmt_seconds(cost.step_s)} = "
             + (f"stage time {fmt_seconds(cost.stage_time_s)} x (m + bubble) "
                if not cost.extra and name not in PAIRED and cost.alike else
                f"the busiest stage's work {fmt_seconds(sim.ideal)} "
                + ("" if sends == "async" else f"(its {sends} sends' time in it) ")
                + f"+ its idle time "
                f"{fmt_seconds(sim.makespan - sim.ideal)} ")
             + (f"+ exposed gradient reductions {fmt_seconds(cost.grad_reduce_exposed_s)} "
                if cost.grad_reduce_exposed_s else "")
             + (f"+ optimizer {fmt_seconds(cost.optimizer_s)} " if cost.optimizer_s else "")
             + (f"+ update {fmt_seconds(cost.update_s)} " if cost.update_s else "")
             + f"[{fmt_seconds(cost.free_sends_step_s)} "
             "with free sends"
             + ((", simulated" + ("" if sends != "async" else ": the stages' layers differ"))
                if cost.free_simulation is not None else
                ", by the closed form's idle time" if name in PAIRED else "") + f"]; MFU {cost.mfu:.1%} "
             f"(over the {cost.peak_dtype} peak)",
             f"  the busiest device a step: compute {fmt_seconds(cost.compute_s)}, communication "
             f"{fmt_seconds(cost.comm_s)} ({fmt_seconds(cost.exposed_comm_s)} of it exposed): bound by {cost.bound}",
             *([f"  gradient reductions: accumulated over the microbatches and reduced once a step, "
                f"{fmt_seconds(cost.grad_reduce_s)} on the busiest stage, issued under the last microbatch's "
                f"backward ({fmt_seconds(cost.grad_reduce_exposed_s)} exposed)"
                + (f"; of it the gradients both ends read (a tied embedding's) swapped between the first and the "
                   f"last stage, {fmt_seconds(cost.tied_exchange_s)}" if cost.tied_exchange_s else "")]
               if cost.grad_reduce_s else []),
             f"  in flight on the first stage: {inflight(name, pipe.stages, pipe.microbatches)} microbatches"
             f" x activation factor {activation_factor(name, pipe.stages, pipe.chunks):.3g}",
             f"  point-to-point: {cost.boundary} a microbatch"
             + "".join(f" with {r}" for r in cost.riders)  # made before the block, riding to the last stage
             + f", {fmt_bytes(cost.p2p_bytes)} a device "
             f"({fmt_bytes(cost.p2p_bytes_global)} in all) per boundary over {cost.network.upper()}"
             + (f", split over {','.join(cost.p2p_split)} and gathered on the receiving side (Megatron-LM's and "
                "DeepSpeed's scatter/gather)" if cost.p2p_split else "")
             + f", {fmt_seconds(cost.p2p_s)}" + (f" (its gradient back, in the gradient's type, "
                                                 f"{fmt_seconds(cost.timing.send_back)})"
                                                 if cost.timing.comm_back is not None else "")
             + f"; {sends_per_microbatch(name, pipe.stages, pipe.chunks)} boundaries "
             "a microbatch, each way"
             + (f"; {', '.join(map(str, cost.riders))} held in the send buffers, up to "
                f"{fmt_bytes(max(s.rider_bytes for s in cost.stages))} a stage (in its total)"
                if any(s.rider_bytes for s in cost.stages) else ""),
             f"  {'stage':>5} {'layers':>6} {'compute':>9} {'comm':>9} {'bound':<13} {'held':>5} "
             f"{'state':>9} {'activations':>11} {'total':>9}"]
    for s in cost.stages:
        layers = "+".join(map(str, s.blocks)) if s.blocks else str(s.layers)  # several blocks: each one's
        lines.append(f"  {s.stage:>5} {layers:>6} {fmt_seconds(s.compute_s):>9} {fmt_seconds(s.comm_s):>9} "
                     f"{s.bound:<13} {s.held:>5.3g} {fmt_bytes(s.state_bytes):>9} "
                     f"{fmt_bytes(s.activation_bytes):>11} {fmt_bytes(s.memory_bytes):>9}"
                     + ("" if s.fits else "  does NOT fit"))
    return lines + [f"  {t}" for t in cost.thresholds]


def _ends(cost: PipelineCost, fmt: Callable[[float], str]) -> list[str]:
    """The line on the first and last stage's extra work (none when the spec has no block)."""
    if not cost.extra:
        return []
    first, last = cost.first, cost.last
    return [f"  the first chunk also runs the statements before the block (F {fmt(first.forward)}, B "
            f"{fmt(first.backward)}, W {fmt(first.weight)} a microbatch), the last those after it (F "
            f"{fmt(last.forward)}, B {fmt(last.backward)}, W {fmt(last.weight)}), as Megatron-LM places the "
            "embedding and the loss; the bubble is the step minus the busiest stage's work"]
