"""The zero-bubble backward in two, B and W: one rule, which ``shardc cost`` times and ``shardc lower`` runs.

Qi et al. 2023 ("Zero Bubble Pipeline Parallelism", section 2) split a layer's backward: B computes
the gradient of the layer's input, which the previous stage waits for; W the gradients of its
weights, which nothing waits for, so the schedule may run it later.  Here B is every backward step the
gradient a part hands on needs, directly or through another step, and W is the rest: a part is the
head after the ``layers`` blocks, each block, or the statements before them, and what it hands on is
each value it makes that another part's backward reads (the block output's cotangent, a block input's
gradient) and the gradient of an input that is no param.  A param's gradient, or a contribution to it
(a tied embedding's from the head), is never handed on: the statements before the blocks hand on
nothing, so their whole backward is W.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from shardc.ir.plan import Op, Plan, Step
from shardc.ir.spec import TensorRef
from shardc.pipeline.boundary import tied_contributions

__all__ = ["value_key", "step_reads", "needed", "weight_steps"]


def value_key(ref: TensorRef) -> TensorRef:
    """A value's identity, as the generated code names values: partial-sum axes sorted."""
    return TensorRef(ref.name, ref.dims, tuple(sorted(ref.unreduced)))


def step_reads(step: Step) -> tuple[TensorRef, ...]:
    """What a step's line names (as :mod:`shardc.lowering.codegen` writes it): its operands and the
    values it reads the shape of, or its source."""
    if step.op in (Op.EINSUM, Op.COPY, Op.ELEMENTWISE):
        return tuple(map(value_key, step.operands + step.shapes))
    return (value_key(step.src),) if step.src is not None else ()


def needed(steps: Sequence[Step], targets: Iterable[TensorRef]) -> set[int]:
    """The steps ``targets`` need, directly or through another step: B."""
    need, steps_of_b = {value_key(t) for t in targets}, set()
    for k in reversed(range(len(steps))):
        if value_key(steps[k].dst) in need:
            steps_of_b.add(k)
            need.update(step_reads(steps[k]))
    return steps_of_b


def weight_steps(plan: Plan) -> frozenset[int]:
    """Indices of ``plan.backward``'s W steps: in each part, those no gradient it hands on needs."""
    steps = plan.backward
    after, block, before = plan.cut.runs("backward", range(len(steps)))
    part = {k: ("after",) for k in after} | {k: ("block", steps[k].block) for k in block}
    part |= {k: ("before",) for k in before}
    grads = {plan.grad_name(i.name) for i in plan.tensors if i.role == "param"}
    grads |= {c.name for _, c in tied_contributions(plan)}  # the head's contribution to a tied param's gradient
    handed: dict[tuple[object, ...], list[TensorRef]] = {}
    maker: dict[TensorRef, int] = {}
    for k, step in enumerate(steps):
        for ref in step_reads(step):
            if (m := maker.get(ref)) is not None and part[m] != part[k] and steps[m].tensor not in grads:
                handed.setdefault(part[m], []).append(ref)
        maker[value_key(step.dst)] = k
    inputs = {plan.grad_name(i.name) for i in plan.tensors if i.role == "input" and _has_grad(plan, i.name)}
    for name in inputs:  # an input's gradient, as the backward leaves it
        last = max((k for k, s in enumerate(steps) if s.dst.name == name), default=None)
        if last is not None:
            handed.setdefault(part[last], []).append(steps[last].dst)
    in_b: set[int] = set()
    for key, targets in handed.items():
        mine = [k for k in range(len(steps)) if part[k] == key]
        in_b.update(mine[i] for i in needed([steps[k] for k in mine], targets))
    return frozenset(k for k in range(len(steps)) if k not in in_b)


def _has_grad(plan: Plan, tensor: str) -> bool:
    return any(primal == tensor for primal, _ in plan.gradient_names)
