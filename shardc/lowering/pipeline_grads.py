"""Weight gradients under a pipeline: summed over the microbatches on each device, reduced once a step.

Megatron-LM, DeepSpeed and torchtitan accumulate each microbatch's partial weight
gradient locally and reduce the sum once a step, and ``shardc cost`` charges the
reductions so (:func:`shardc.pipeline.boundary.gradient_reductions`).  A part's
backward is split here to run that way: the steps each microbatch runs, which hand
on a param's gradient as the partial sum its reduction reads, and the reductions
(with any move of their results after them), run once after the schedule on the sum
of the microbatches' partial sums.  A reduction is a sum, so the reduction of the sum
is the sum of the reductions: the gradients are the same, the collectives run once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardc.ir.plan import Op, Plan, Step, TensorInfo
from shardc.ir.spec import TensorRef
from shardc.lowering import template
from shardc.lowering.codegen import Phase, generate
from shardc.pipeline.boundary import gradient_reductions

__all__ = ["Split", "split_reductions", "reduce_source"]

# What may run on a sum of partial gradients: moves and reductions, each linear in its input.
_LINEAR = frozenset({Op.ALL_REDUCE, Op.REDUCE_SCATTER, Op.ALL_GATHER, Op.ALL_TO_ALL, Op.SLICE})


@dataclass(frozen=True)
class Split:
    """A part's backward in two: ``each`` (the part, its backward the steps run each microbatch and
    its gradients the partial sums they hand on) and ``once`` (run once a step on their sums, from
    ``partials`` to ``finals``)."""

    each: Plan
    once: tuple[Step, ...] = ()
    partials: tuple[TensorRef, ...] = ()
    finals: tuple[TensorRef, ...] = ()


def _key(ref: TensorRef) -> TensorRef:
    """A value's identity, as the generated code names values: partial-sum axes sorted."""
    return TensorRef(ref.name, ref.dims, tuple(sorted(ref.unreduced)))


def _reads(step: Step) -> tuple[TensorRef, ...]:
    return step.operands + step.shapes + ((step.src,) if step.src is not None else ())


def split_reductions(plan: Plan) -> Split:
    """``plan``'s weight-gradient reductions and what reads their results, apart; the plan whole (no
    split) where they read anything but one partial sum a gradient, or run anything but moves."""
    marked = gradient_reductions(plan)
    once: list[int] = []
    made: set[TensorRef] = set()
    for k, step in enumerate(plan.backward):
        if k in marked or any(_key(r) in made for r in _reads(step)):
            once.append(k)
            made.add(_key(step.dst))
    kept = tuple(s for k, s in enumerate(plan.backward) if k not in once)
    late = tuple(plan.backward[k] for k in once)
    partials = list(dict.fromkeys(_key(r) for s in late for r in _reads(s) if _key(r) not in made))
    kept_made = {_key(s.dst) for s in kept}
    finals = tuple(g for g in plan.grads if g.name in {p.name for p in partials})
    if (not late or any(s.op not in _LINEAR for s in late) or any(p not in kept_made for p in partials)
            or len({p.name for p in partials}) != len(partials) or len(finals) != len(partials)
            or any(_key(g) not in made for g in finals)):
        return Split(plan)
    handed = {p.name: p for p in partials}
    each = replace(plan, backward=kept, grads=tuple(handed.get(g.name, g) for g in plan.grads))
    return Split(each, late, tuple(partials), finals)


def reduce_source(split: Split, mesh: tuple[tuple[str, int], ...], sizes: dict[str, int], prefix: str,
                  reserved: frozenset[str]) -> tuple[str, frozenset[str]]:
    """The once-a-step function ``{prefix}reduce_local`` and its tables ``{PREFIX}REDUCE_IN`` and
    ``..._OUT`` (the partial sums in, the gradients out, keyed by gradient name), and the variables it
    names; nothing for a part without a split."""
    if not split.once:
        return "", frozenset()
    tensors = tuple(TensorInfo(r.name, r, "input") for r in split.partials)
    tensors += tuple(TensorInfo(r.name, r, "activation") for r in split.finals)
    alone = replace(split.each, forward=split.once, backward=(), recomputed=(), tensors=tensors, residuals=(),
                    cotangents=(), grads=(), sections=None)
    module = generate(alone, mesh, sizes, reserved=reserved)
    phase = Phase(prefix.lower() + "reduce", module.forward.inputs, module.forward.outputs, module.forward.body)
    text = template.specs(prefix.upper() + "REDUCE_IN", phase.inputs)
    text += template.specs(prefix.upper() + "REDUCE_OUT", phase.outputs)
    return "\n" + text + "\n\n" + template.function(phase) + "\n", module.variables
