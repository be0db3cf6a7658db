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

from shardc.costmodel.cost_report import CostReport, cost, missing_sizes, resolve_sizes
from shardc.costmodel.memory import step_memory
from shardc.errors import ShardcError
from shardc.ir.plan import Plan
from shardc.ir.spec import Spec
from shardc.planner.planner import plan

__all__ = ["device_memory", "plan_memory", "fitting_plan"]


def device_memory(report: CostReport) -> float:
    """Bytes a device holds at its peak, as the report's verdict weighs them (a pipeline's fullest stage)."""
    if report.pipeline is not None:
        return report.pipeline.fullest.memory_bytes
    return report.memory.total_bytes


def plan_memory(planned: Plan, optimizer: str = "adam10", offload: str = "none",
                spans: dict[str, int] | None = None) -> float:
    """``planned``'s bytes a device, as ``shardc cost --optimizer OPTIMIZER --offload OFFLOAD`` costs it;
    0 where it cannot be costed (a dim without a size, or a plan ``shardc cost`` refuses, which says why
    itself): nothing to weigh, so the planner keeps its fastest plan."""
    if planned.sizes is None or missing_sizes(planned, planned.size_map or {}):
        return 0.0
    try:
        if planned.spec.mesh.pipeline_axis is None and offload == "none":  # the memory section's total itself
            return step_memory(planned, resolve_sizes(planned, None), planned.chip.hbm_bytes, optimizer).total_bytes
        return device_memory(cost(planned, optimizer=optimizer, offload=offload, spans=spans))
    except ShardcError:
        return 0.0


def fitting_plan(spec: Spec, optimizer: str = "adam10", offload: str = "none", **options: Any) -> Plan:
    """:func:`shardc.planner.planner.plan` (``options``: its own, ``memory_limit`` among them): the fastest
    plan that fits the chip's memory as ``shardc cost`` with ``optimizer`` and ``offload`` counts it."""
    spans = options.get("spans")
    return plan(spec, memory=lambda p: plan_memory(p, optimizer, offload, spans), **options)
