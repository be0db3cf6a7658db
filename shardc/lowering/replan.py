"""The plan lowering runs in place of a ZeRO-1/2 plan (the same spec planned without its ``zero`` line),
and in place of a pipeline of several ``layers`` blocks (its end blocks written out, :mod:`shardc.spec.unroll`).

Lowering sits above the planner, so planning a spec again for lowering's sake lives here,
not in :mod:`shardc.planner.zero` (which the planner itself imports).
"""

from __future__ import annotations

from dataclasses import replace

from shardc.ir.plan import Plan
from shardc.planner.planner import plan as make_plan
from shardc.spec.unroll import unrolled

__all__ = ["unlowered_optimizer", "unrolled_blocks"]


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
    spec = replace(plan.spec, zero=None)
    spans = dict(plan.spans) or None
    alone = make_plan(spec, save=plan.save, hardware=plan.chip, spans=spans,
                      recompute=plan.recompute)
    note = (f"`{plan.spec.zero}`: forward and grad run the spec without the zero line (whose backward "
            "reduces each gradient); the optimizer phase runs as optimizer_step, from the gradients as the "
            "ZeRO backward leaves them")
    return alone, note


def unrolled_blocks(plan: Plan) -> tuple[Plan, str | None]:
    """The plan a pipeline of several ``layers`` blocks lowers as, and a note when it is not ``plan``: its
    spec with every block but the longest written out on the first or last stage (:func:`unrolled`, which
    refuses blocks that lie across stages), planned as ``plan`` was (same policy and chip)."""
    spec = unrolled(plan.spec)
    if spec is plan.spec:
        return plan, None
    alone = make_plan(spec, save=plan.save, hardware=plan.chip, spans=dict(plan.spans) or None,
                      recompute=plan.recompute)
    written = len(plan.spec.layer_counts()) - 1
    note = (f"the pipeline runs {written} `layers` block{'s' if written > 1 else ''} written out layer by layer on "
            f"its first or last stage (each layer's params named apart, as `W_b1l0`), beside the longest block "
            f"its stages repeat: `stage_layers {', '.join(map(str, spec.stage_layers or ()))}`")
    return alone, note
