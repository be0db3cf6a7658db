"""A pipelined block's backward in two, for the zero-bubble schedules: B (the input's gradient) and W
(the weights').

Qi et al. 2023 ("Zero Bubble Pipeline Parallelism", section 2) split a layer's backward: B
computes the gradient of the layer's input, which the previous stage waits for; W the
gradients of its weights, which nothing waits for, so the schedule runs it at a later tick
(ZB-H1: stage s's W of a microbatch s microbatches after its B).  Here B is every step of
the stage plan's backward that the block input's gradient needs, directly or through another
step (:func:`shardc.pipeline.backward_split.needed`, the rule the cost times too); W is the rest
(each microbatch's partial weight gradients; their reductions run once a step,
:mod:`shardc.lowering.pipeline_grads`).

W reads only what the forward saved (its residuals, as the whole backward reads them) and
what B hands it: the values B made that W reads (the gradient of an intermediate, dH of
``H = X · W1`` for ``dW1 = X^T · dH``) and the layer output's cotangent, which inside a stage
of several layers is the next layer's B's result.  So W can run at any tick after B, and
needs nothing of the ticks between.

The two functions are cut from the stage module's backward phase (one line a step, in the
plan's order), so they run the very lines the whole backward runs, each line once.

The statements after the block (the head: final norm, output layer, loss) are cut the same way,
B making the gradient of the block's output, which the last virtual stage's B waits for, and W
the head's weights' (:mod:`shardc.lowering.pipeline_ends`).  Those before it (the embedding)
have no B: nothing waits for the gradient of their inputs (token ids, data), so their whole
backward is W and runs at W's tick.
"""

from __future__ import annotations

from dataclasses import replace

from shardc.errors import InternalError
from shardc.ir.plan import Step
from shardc.lowering import template
from shardc.lowering.codegen import Boundary, Phase
from shardc.pipeline.backward_split import needed, step_reads, value_key

__all__ = ["split_backward", "split_source"]


def split_backward(steps: tuple[Step, ...], backward: Phase, input_grad: str,
                   cotangents: frozenset[str], beside: tuple[str, ...] = ()) -> tuple[Phase, Phase]:
    """``backward`` (the phase :mod:`shardc.lowering.codegen` wrote from ``steps``; ``cotangents``: its
    inputs' keys that are cotangents) as B, which makes the gradient ``input_grad`` (and ``beside``: those of
    the values fed beside the block's input, which the stage before's B reads too,
    :func:`shardc.pipeline.boundary.fed_beside`) and hands W what it reads, and W, which makes every other
    gradient."""
    if len(steps) != len(backward.body):
        raise InternalError("the backward phase does not have one line a step", fix="this is a shardc bug")
    (target,) = [b for b in backward.outputs if b.key == input_grad]
    also = tuple(b for b in backward.outputs if b.key in beside)
    in_b = needed(steps, [target.ref, *(b.ref for b in also)])
    made_by_b = {value_key(steps[k].dst) for k in in_b}
    boundary = {b.ref: b for b in backward.inputs}
    for k, step in enumerate(steps):  # a line is `var = ...  # ...`: the variable it binds
        var = backward.body[k].split(" = ", 1)[0]
        boundary.setdefault(value_key(step.dst), Boundary(var, var, value_key(step.dst)))
    w_lines = [k for k in range(len(steps)) if k not in in_b]
    w_made = {value_key(steps[k].dst) for k in w_lines}
    outputs = tuple(b for b in backward.outputs if b.key != input_grad and b.key not in beside)
    w_reads = [r for k in w_lines for r in step_reads(steps[k])] + [b.ref for b in outputs]
    w_external = [boundary[r] for r in dict.fromkeys(w_reads) if r not in w_made]
    # what B hands W: the values B made that W reads, and the cotangents W reads (passed on by B)
    handed = tuple(b for b in w_external if b.ref in made_by_b or b.key in cotangents)
    saved = tuple(b for b in w_external if b not in handed)
    b_reads = {r for k in in_b for r in step_reads(steps[k])} | {b.ref for b in handed}
    b_inputs = tuple(b for b in backward.inputs if b.ref in b_reads)
    b_out = (target, *also) + tuple(b for b in handed if b.key != target.key and b not in also)
    b = Phase("input_backward", b_inputs, b_out, tuple(backward.body[k] for k in sorted(in_b)))
    w = Phase("weight_backward", saved + handed, outputs, tuple(backward.body[k] for k in w_lines))
    return b, w


def split_source(steps: tuple[Step, ...], backward: Phase, input_grad: str, cotangents: frozenset[str],
                 prefix: str = "", beside: tuple[str, ...] = ()) -> str:
    """B's and W's functions (``input_backward_local``, ``weight_backward_local``) and their tables
    (``INPUT_BACKWARD_IN``, ``..._OUT``, ``WEIGHT_BACKWARD_IN``, ``..._OUT``), as module text; an end's
    ``prefix``ed (``post_input_backward_local``, ``POST_INPUT_BACKWARD_IN``)."""
    text = ""
    for phase in split_backward(steps, backward, input_grad, cotangents, beside):
        if prefix:
            phase = replace(phase, name=f"{prefix.lower()}_{phase.name}")
        name = phase.name.upper()
        text += "\n" + template.specs(f"{name}_IN", phase.inputs) + template.specs(f"{name}_OUT", phase.outputs)
        text += "\n\n" + template.function(phase) + "\n"
    return text
