"""The values a compiler copies to lay them out for a step: a dot's operands and result, a collective's
result (:func:`shardc.costmodel.phase_memory.phase_memory` counts each copy for that step)."""

from __future__ import annotations

from shardc.collectives import Op
from shardc.fusion import is_product
from shardc.ir.plan import Step
from shardc.ir.spec import TensorRef

__all__ = ["layout_copies", "blocked"]


def layout_copies(step: Step) -> list[TensorRef]:
    """The values XLA copies to lay them out for a step: a dot's operands ordered
    (batch, free, contracted) or (batch, contracted, free) and its result (batch, the free indices of
    one operand in that operand's order, then the other's: the order XLA's dot emits, so a result
    whose free indices of one operand are permuted is transposed too), each transposed into a
    temporary when stored otherwise; a
    collective's result over a dim that is not its first, gathered (or scattered) along the major
    dim and transposed into place, and an AllGather's of several dims at once (``dim`` None), whose
    pieces land along a new major dim and are transposed into place."""
    if step.is_collective:
        several = step.op is Op.ALL_GATHER and step.dim is None
        return [step.dst] if (step.dim or several) and step.op is not Op.ALL_REDUCE else []
    if step.op is not Op.EINSUM or len(step.operands) != 2 or is_product(step):
        return []
    out = [d.name for d in step.dst.dims]
    a, b = ([d.name for d in ref.dims] for ref in step.operands)
    batch = [i for i in out if i in a and i in b]
    copies = [ref for ref, names, other in ((step.operands[0], a, b), (step.operands[1], b, a))
              if not blocked(names, batch, [i for i in names if i in out and i not in other])]
    a_free, b_free = ([i for i in names if i in out and i not in batch] for names in (a, b))
    if out not in (batch + a_free + b_free, batch + b_free + a_free):
        copies.append(step.dst)
    return copies


def blocked(names: list[str], batch: list[str], group: list[str]) -> bool:
    """Whether ``names`` is ``batch`` (in that order) then ``group`` and the rest, each in one block."""
    rest = names[len(batch):]
    if names[:len(batch)] != batch:
        return False
    k = len(group)
    return set(rest[:k]) == set(group) or set(rest[len(rest) - k:]) == set(group)
