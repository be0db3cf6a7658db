"""A plan's memory a device as ``shardc cost`` counts it, and the planner told to fit it.

The planner weighs step time; whether a plan fits is ``shardc cost``'s verdict: the memory section's
total (params, gradients, optimizer state, residuals, gathered weights, ring buffers), or for a
pipeline its fullest stage's (the microbatches in flight, a tick's working set, the gradient sums).
:func:`device_memory` reads that figure off a report, :func:`plan_memory` costs a plan for it, and
:func:`fitting_plan` plans a spec with it (:mod:`shardc.planner.memory_fit`): one count of memory,
the report's, wherever a plan is judged by what it holds.
"""

from __future__ import annotations

from typing import Any

from shardc.accountings import chosen
from shardc.costmodel.cost_report import CostReport, cost, missing_sizes, resolve_sizes
from shardc.costmodel.memory import checkpoint_refs, step_memory
from shardc.costmodel.pipeline_cost import pipeline_cost
from shardc.costmodel.pipeline_times import microbatch_sizes
from shardc.costmodel.stage_memory import kept_bytes
from shardc.errors import ShardcError
from shardc.ir.plan import Plan
from shardc.ir.spec import Spec
from shardc.pipeline.dualpipe import TWO_WAY
from shardc.planner.planner import plan
from shardc.quantize import quantized_weights
from shardc.timing import plan_links

__all__ = ["PLAN_HELD", "device_memory", "plan_memory", "least_memory", "fitting_plan", "fitting_report"]

# The schedules whose microbatches in flight on a device depend on the plan, not on the schedule's fixed order
# alone: zbv's order is searched greedily from the plan's times, DualPipe's held chunks weighed by its kept
# bytes (shardc.pipeline.schedules.simulate, shardc.costmodel.stage_memory.dualpipe_held).
PLAN_HELD = frozenset({"zbv"}) | TWO_WAY


def device_memory(report: CostReport) -> float:
    """Bytes a device holds at its peak, as the report's verdict weighs them (a pipeline's fullest stage)."""
    if report.pipeline is not None:
        return report.pipeline.fullest.memory_bytes
    return report.memory.total_bytes


def plan_memory(planned: Plan, optimizer: str | None = None, offload: str = "none",
                spans: dict[str, int] | None = None) -> float:
    """``planned``'s bytes a device, as ``shardc cost --optimizer OPTIMIZER --offload OFFLOAD`` costs it;
    0 where it cannot be costed (a dim without a size, or a plan ``shardc cost`` refuses, which says why
    itself): nothing to weigh, so the planner keeps its fastest plan."""
    if planned.sizes is None or missing_sizes(planned, planned.size_map or {}):
        return 0.0
    optimizer = chosen(planned.spec.optimizer, optimizer)
    try:
        if offload == "none":  # the report's figure, without the rest of the report
            values = resolve_sizes(planned, None)
            pipe = None
            if planned.spec.mesh.pipeline_axis is not None:  # the fullest stage's (None: the pipeline switched off)
                links, _ = plan_links(planned, planned.chip, values, spans)
                pipe = pipeline_cost(planned, planned.chip, values, links, optimizer)
            if pipe is not None:
                return pipe.fullest.memory_bytes
            return step_memory(planned, values, planned.chip.hbm_bytes, optimizer,
                               native=planned.chip.native_kernels).total_bytes
        return device_memory(cost(planned, optimizer=optimizer, offload=offload, spans=spans))
    except ShardcError:
        return 0.0


def least_memory(report: CostReport) -> float:
    """Bytes a device holds under every plan the planner's memory search weighs for this report's spec
    (:mod:`shardc.planner.memory_fit`: the same recompute policy, microbatches and schedule), as
    :func:`device_memory` counts them: its training state, the params, gradients and optimizer state of the
    declared shardings and the ZeRO line, which no plan changes, and the checkpoints it keeps, the values
    recomputation starts from at their declared shardings (the inputs, and under ``full`` and ``dots`` each
    layer's input: :func:`shardc.costmodel.memory.checkpoint_refs`), each layer and microbatch in flight as
    the report counts them (a pipeline's: its fullest stage in both; the state alone under the schedules whose
    microbatches in flight are the plan's, :data:`PLAN_HELD`).  The plans differ in what else they keep,
    gather and recompute, not in what they own nor start from; a held weight's narrower copy (``gemm f8``) is
    the plan's, so it is left out (a pipeline's stages do not say it apart: 0 there), and so is what
    ``--offload`` moves to the host (0 under it)."""
    if report.offload is not None:
        return 0.0
    if report.pipeline is not None:
        if quantized_weights(report.plan):
            return 0.0
        pipe = report.pipeline
        if pipe.pipeline.schedule.name in PLAN_HELD:  # what a device holds in flight is the plan's there
            return max(s.state_bytes for s in pipe.stages)
        _, micro = microbatch_sizes(report.plan, pipe.pipeline, report.sizes)
        kept = kept_bytes(report.plan, pipe.pipeline, pipe.simulation, micro, checkpoint_refs(report.plan))
        return max(s.state_bytes + k for s, k in zip(pipe.stages, kept, strict=True))
    mem = report.memory
    return mem.param_bytes - mem.quantized_weight_bytes + mem.grad_bytes + mem.optimizer_bytes + mem.checkpoint_bytes


def fitting_plan(spec: Spec, optimizer: str | None = None, offload: str = "none", **options: Any) -> Plan:
    """:func:`shardc.planner.planner.plan` (``options``: its own, ``memory_limit`` among them): the fastest
    plan that fits the chip's memory as ``shardc cost`` with ``optimizer`` and ``offload`` counts it."""
    spans = options.get("spans")
    return plan(spec, memory=lambda p: plan_memory(p, optimizer, offload, spans), **options)


def fitting_report(spec: Spec, optimizer: str | None = None, offload: str = "none", mfu: float | None = None,
                   **options: Any) -> CostReport:
    """``shardc cost`` of :func:`fitting_plan`'s plan, each plan costed once: the report that weighed a plan's
    memory (a pipeline's, or under ``offload``) is the one returned for it, and the fastest plan is planned
    once, where it fits and where the memory search plans the others beside it.  Where the fastest plan's
    :func:`least_memory` passes the limit, nothing else is planned: no plan fits, and the fastest is the
    one the search would return (its note aside)."""
    spans = options.get("spans")
    reports: dict[int, tuple[Plan, CostReport]] = {}

    def report_of(p: Plan) -> CostReport:
        hit = reports.get(id(p))
        if hit is None or hit[0] is not p:
            hit = reports[id(p)] = (p, cost(p, mfu=mfu, optimizer=optimizer, offload=offload, spans=spans))
        return hit[1]

    def memory(p: Plan) -> float:  # plan_memory's; the fastest plan's from its report, kept for it
        if reports or p.sizes is None or missing_sizes(p, p.size_map or {}):
            return plan_memory(p, optimizer, offload, spans)
        try:
            return device_memory(report_of(p))
        except ShardcError:
            return 0.0

    def floor(p: Plan) -> float:  # the fastest plan's floor, from its report
        try:
            return least_memory(report_of(p))
        except ShardcError:
            return 0.0

    return report_of(plan(spec, memory=memory, memory_floor=floor, **options))
