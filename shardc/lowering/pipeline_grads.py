"""Weight gradients under a pipeline: summed over the microbatches on each device, reduced once a step.

Megatron-LM, DeepSpeed and torchtitan accumulate each microbatch's partial weight
gradient locally and reduce the sum once a step, and ``shardc cost`` charges the
reductions so (:func:`shardc.pipeline.boundary.gradient_reductions`).  A part's
backward is split here to run that way: the steps each microbatch runs, which hand
on a param's gradient as the partial sum its reduction reads, and the reductions
(with any move of their results after them), run once after the schedule on the sum
of the microbatches' partial sums.  A reduction is a sum, so the reduction of the sum
is the sum of the reductions: the gradients are the same, the collectives run once.

A param read both before the pipelined block and after it (a tied embedding) has two
contributions to its gradient, one on each end stage; the plan sums them before the
first one's reduction (``dW = dW_1 + dW_2``).  That sum reads the other end's
contribution (``incoming``), so it and the reduction run once a step, after the two end
stages have swapped their sums (Megatron-LM's embedding-group AllReduce).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardc.ir.localops import Add
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
    ``partials`` to ``finals``; ``renamed``: each partial sum handed on under another name than its
    gradient's, with that gradient's name, where the sum adds another end's contribution)."""

    each: Plan
    once: tuple[Step, ...] = ()
    partials: tuple[TensorRef, ...] = ()
    finals: tuple[TensorRef, ...] = ()
    renamed: tuple[tuple[str, str], ...] = ()


def _key(ref: TensorRef) -> TensorRef:
    """A value's identity, as the generated code names values: partial-sum axes sorted."""
    return TensorRef(ref.name, ref.dims, tuple(sorted(ref.unreduced)))


def _linear(step: Step) -> bool:
    """A step that may run on sums of partial gradients: a move, a reduction, or a sum."""
    return step.op in _LINEAR or (step.op is Op.ELEMENTWISE and isinstance(step.fn, Add)
                                  and all(s > 0 for s in step.fn.signs))


def split_reductions(plan: Plan, incoming: frozenset[str] = frozenset()) -> Split:
    """``plan``'s weight-gradient reductions and what reads their results (or a contribution in
    ``incoming``, made on another stage) apart; the plan whole (no split) where they read anything but
    one partial sum a gradient (or its contributions), or run anything but moves and sums."""
    marked = gradient_reductions(plan)
    once: list[int] = []
    made: set[TensorRef] = set()
    for k, step in enumerate(plan.backward):
        if k in marked or any(_key(r) in made or r.name in incoming for r in step.reads_with_shapes):
            once.append(k)
            made.add(_key(step.dst))
    kept = tuple(s for k, s in enumerate(plan.backward) if k not in once)
    late = tuple(plan.backward[k] for k in once)
    partials = list(dict.fromkeys(_key(r) for s in late for r in s.reads_with_shapes if _key(r) not in made))
    kept_made = {_key(s.dst) for s in kept}
    finals = tuple(g for g in plan.grads if _key(g) in made)
    own = _own_partials(late, [p for p in partials if p in kept_made], finals)
    if (not late or not all(_linear(s) for s in late) or own is None
            or {p for p in partials if p.name not in incoming} != set(own.values())
            or len(set(own.values())) != len(own)):
        return Split(plan)
    renamed = tuple((own[g.name].name, g.name) for g in finals if own[g.name].name != g.name)
    primal = dict((g, p) for p, g in plan.gradient_names)
    each = replace(plan, backward=kept, grads=tuple(own.get(g.name, g) for g in plan.grads),
                   gradient_names=plan.gradient_names + tuple((primal[g], p) for p, g in renamed))
    return Split(each, late, tuple(partials), finals, renamed)


def _own_partials(late: tuple[Step, ...], own: list[TensorRef],
                  finals: tuple[TensorRef, ...]) -> dict[str, TensorRef] | None:
    """Each final gradient's one partial sum made each microbatch by this part (None where one has
    several): what the once-a-step steps that make it read, traced back."""
    feeds: dict[TensorRef, set[TensorRef]] = {}
    for step in late:
        feeds[_key(step.dst)] = set().union(*({_key(r)} | feeds.get(_key(r), set()) for r in step.reads_with_shapes))
    out = {}
    for g in finals:
        mine = [p for p in own if p in feeds.get(_key(g), set())]
        if len(mine) != 1:
            return None
        out[g.name] = mine[0]
    return out


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
    if split.renamed:  # a partial sum handed on under its own name, and the gradient it ends as
        text += f"{prefix.upper()}FINAL_GRADS = {dict(split.renamed)!r}\n"
    return "\n" + text + "\n\n" + template.function(phase) + "\n", module.variables
