"""The plan lowering runs in place of a ZeRO-1/2 plan (the same spec planned without its ``zero`` line).

Lowering sits above the planner, so planning a spec again for lowering's sake lives here,
not in :mod:`shardc.planner.zero` (which the planner itself imports).
"""

from __future__ import annotations

from dataclasses import replace

from shardc.ir.plan import Plan
from shardc.planner.planner import plan as make_plan

__all__ = ["unlowered_optimizer"]


def unlowered_optimizer(plan: Plan) -> tuple[Plan, str | None]:
    """The plan whose forward and backward lowering runs, and a note when it is not ``plan``.

    A ZeRO-1/2 plan's backward leaves gradients for its optimizer phase (partial sums,
    or shards); the lowered ``forward`` and ``grad`` instead run the same spec planned
    without the ``zero`` line (same policy and chip), whose backward reduces every
    gradient, so ``jax.grad`` is a true gradient, and the optimizer phase is lowered
    beside them (:mod:`shardc.lowering.optimizer`).  ZeRO-3 lowers as is.
    """
    if not plan.optimizer:
        return plan, None
    # `param_gather` times the optimizer phase's gathers, lowered beside: without the zero line it is refused
    spec = replace(plan.spec, zero=None, param_gather=None)
    spans = dict(plan.spans) or None
    alone = make_plan(spec, save=plan.save, hardware=plan.chip, spans=spans,
                      recompute=plan.recompute)
    note = (f"`{plan.spec.zero}`: forward and grad run the spec without the zero line (whose backward "
            "reduces each gradient); the optimizer phase runs as optimizer_step, from the gradients as the "
            "ZeRO backward leaves them")
    return alone, note
