"""The sum a pipelined program runs in each layer's backward where the first ``layers`` block reads a value
beside its input (``E`` beside the carried ``X0``, both fed by the layer's output:
:func:`shardc.pipeline.boundary.fed_beside`).

Past the model's first layer, ``E`` is the layer's input, so a layer's input gradient is its ``dX0`` plus its
``dE``: the lowered program adds them in every layer's backward (``dx + dE``,
:func:`shardc.lowering.pipeline_carried.input_grad`; in the model's first layer it adds zeros, the first
layer's ``dE`` going to the statements before the block), one microbatch's activation.  The plan, costing one
layer whose ``X0`` and ``E`` are two values made before the block, has no step for it: :func:`fed_sums` makes
one a value fed, placed after the layer's backward, which :func:`fed_sum_rows` prices as every memory-bound step
is priced (:func:`shardc.fusion.memory_traffic`: read from HBM unless the step just before made it, as XLA
fuses an add into its producer's loop fusion).
"""

from __future__ import annotations

from dataclasses import replace

from shardc.collectives import Layout, Op
from shardc.hardware import Hardware
from shardc.ir.localops import add_op
from shardc.ir.plan import Plan, Step
from shardc.pipeline.boundary import fed_beside
from shardc.step_cost import StepCost
from shardc.timing import phase_rows

__all__ = ["fed_sums", "fed_sum_rows"]


def fed_sums(plan: Plan) -> tuple[Step, ...]:
    """Each value fed beside the first block's input: the add of its gradient to the input's, in the layer's
    backward (of that block), after the steps that make the two."""
    spec = plan.spec
    fed, blocks = fed_beside(spec), spec.blocks()
    if not fed or plan.sections is None:
        return ()
    carried = spec.statements[blocks[0][0] - 1].result.name
    made = {s.dst.name: s.dst for s in plan.section("block").backward if s.block == 0}  # the last step's
    given = made.get(plan.grad_name(carried))
    if given is None:
        return ()
    return tuple(Step(Op.ELEMENTWISE, given.name, given, operands=(given, made[plan.grad_name(n)]), fn=add_op(2),
                      note="the gradient of a value fed beside the block's input, added to the input's")
                 for n in fed if plan.grad_name(n) in made)


def fed_sum_rows(plan: Plan, micro: dict[str, int], hw: Hardware, spans: Layout) -> list[StepCost]:
    """The rows of :func:`fed_sums` at one microbatch's sizes ``micro`` on ``hw``, each priced after the
    layer's backward steps (which the step just before it made, it reads from the fusion)."""
    sums = fed_sums(plan)
    if not sums:
        return []
    layer = tuple(s for s in plan.section("block").backward if s.block == 0)
    rows = phase_rows(plan, layer + sums, micro, hw, spans)[len(layer):]
    return [replace(r, text=f"(the pipeline's) {r.text}") for r in rows]
