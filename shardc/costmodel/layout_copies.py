"""The values a compiler copies to lay them out for a step: a dot's operands and result, a collective's
result (:func:`shardc.costmodel.phase_memory.phase_memory` counts each copy for that step)."""

from __future__ import annotations

from collections.abc import Collection

from shardc.collectives import Op
from shardc.costmodel.ring_blocks import ring_sliced
from shardc.fusion import fusible, is_product
from shardc.ir.plan import Step
from shardc.ir.spec import TensorRef
from shardc.ops.products import einsum_letters

__all__ = ["layout_copies", "blocked", "read_order", "written_into_place"]


def layout_copies(step: Step, canonical: bool = False) -> list[TensorRef]:
    """The values XLA copies to lay them out for a step: a dot's operands ordered
    (batch, free, contracted) or (batch, contracted, free) and its result (batch, the free indices of
    one operand in that operand's order, then the other's: the order XLA's dot emits, so a result
    whose free indices of one operand are permuted is transposed too), each transposed into a
    temporary when stored otherwise; a
    collective's result over a dim that is not its first, gathered (or scattered) along the major
    dim and transposed into place, and an AllGather's of several dims at once (``dim`` None), whose
    pieces land along a new major dim and are transposed into place.  With ``canonical``, a dot XLA's
    dot decomposer rewrites copies its operands into that form instead (:func:`decomposed`)."""
    if step.is_collective:
        several = step.op is Op.ALL_GATHER and step.dim is None
        return [step.dst] if (step.dim or several) and step.op is not Op.ALL_REDUCE else []
    if step.op is not Op.EINSUM or len(step.operands) != 2 or is_product(step):
        return []
    out = [d.name for d in step.dst.dims]
    a, b = ([d.name for d in ref.dims] for ref in step.operands)
    batch = [i for i in out if i in a and i in b]
    rewritten = decomposed(step, batch) if canonical else None
    copies = rewritten if rewritten is not None else [
        ref for ref, names, other in ((step.operands[0], a, b), (step.operands[1], b, a))
        if not blocked(names, batch, [i for i in names if i in out and i not in other])]
    a_free, b_free = ([i for i in names if i in out and i not in batch] for names in (a, b))
    if out not in (batch + a_free + b_free, batch + b_free + a_free):
        copies.append(step.dst)
    return copies


def written_into_place(step: Step, readers: list[Step], outs: Collection[TensorRef]) -> bool:
    """Whether a collective's result over a dim that is not its first (:func:`layout_copies`) is copied into
    place whole, a buffer of its own: where the phase returns it or a step other than a fusion reads it (a dot).
    XLA's layout assignment gives the collective a layout with that dim major (its operand copied into it
    first); a loop fusion reading the result (a collective matmul's ring slicing it into blocks, an elementwise
    map or reduction) takes the copy into place into its own body and reads the collective's buffer as it is
    laid out (fsdp_tp.shard's forward at verify's sizes: W_out gathered over D as f32[2,12]{0,1}, each of
    its four select_dynamic-slice fusions holding a copy of its parameter, no copy written; llama2_13b.shard's
    forward: X0 gathered over S read so by the norm's add_rsqrt and the residual's copy_add fusions, and
    copied whole only as the residual the phase returns)."""
    if step.dim is None or step.op is Op.ALL_REDUCE or step.dst in outs or not readers:
        return True
    return not all(step.dst in ring_sliced(r) if r.collective is not None else fusible(r) and not is_product(r)
                   for r in readers)


def blocked(names: list[str], batch: list[str], group: list[str]) -> bool:
    """Whether ``names`` is ``batch`` (in that order) then ``group`` and the rest, each in one block."""
    rest = names[len(batch):]
    if names[:len(batch)] != batch:
        return False
    k = len(group)
    return set(rest[:k]) == set(group) or set(rest[len(rest) - k:]) == set(group)


def decomposed(step: Step, batch: list[str]) -> list[TensorRef] | None:
    """The operands of a dot (of ``batch`` indices) that XLA's dot decomposer copies, or None where it
    leaves the dot alone.

    ``jnp.einsum`` runs a dot as ``dot_general`` of its operands (the second on the left unless the result
    is then (batch, first's free, second's free): :func:`_dot_form`), the contracted indices in the order
    of their letters.  XLA's
    ``DotDecomposer`` rewrites every dot one of whose operands has other than one contracted index, more
    than one free index or its batch indices not first: the first operand transposed to (batch, free,
    contracted), the second to (batch, contracted, free), each free block in its own order, then both
    reshaped to 3-D; a transpose that changes the order is a copy (``moe_layer.shard``'s backward at 16x
    its sizes: the combine weights [G, S, E, C] copied as [G, E, C, S] for dEx's dot, 604 MB)."""
    form = _dot_form(step, batch)
    if form is None:
        return None
    names, wanted, folded = form
    return [ref for ref in step.operands if names[ref] != wanted[ref] and not folded[ref]]


def read_order(step: Step, ref: TensorRef) -> tuple[str, ...]:
    """The order of ``ref``'s indices as a dot reads it after XLA's dot decomposer (:func:`decomposed`): the
    form it copies the operand into, or its own order where it reads it in place."""
    out = [d.name for d in step.dst.dims]
    a, b = step.operands
    batch = [i for i in out if any(d.name == i for d in a.dims) and any(d.name == i for d in b.dims)]
    form = _dot_form(step, batch)
    if form is None:
        return tuple(d.name for d in ref.dims)
    names, wanted, folded = form
    return tuple(names[ref] if folded[ref] else wanted[ref])


def _dot_form(step: Step, batch: list[str]) -> tuple[dict[TensorRef, list[str]], dict[TensorRef, list[str]],
                                                     dict[TensorRef, bool]] | None:
    """A dot's operands' indices (less those summed out first), the (batch, free, contracted) and (batch,
    contracted, free) orders the dot decomposer wants them in, and whether a transpose of one folds into the
    dot; None where the decomposer leaves the dot alone (:func:`decomposed`).

    ``jnp.einsum`` contracts two operands as ``opt_einsum`` orders them, the second first
    (``contract_inds`` sorted in reverse), and runs ``dot_general(first, second)`` only where the result
    is (batch, first's free, second's free); otherwise ``dot_general(second, first)`` and a transpose
    (``jax._src.numpy.einsum._einsum``): the second is the dot's left-hand operand
    (``moe_transformer.shard``'s At = P · Vl: Vl left, P copied as [B, G, T, R, S])."""
    a, b = step.operands
    out = [d.name for d in step.dst.dims]
    names = {ref: [d.name for d in ref.dims if d.name in out or d in other.dims]  # an index only one
             for ref, other in ((a, b), (b, a))}  # operand sums is summed out before the dot
    letters = einsum_letters((*step.operands, step.dst))
    contracted = sorted((i for i in names[a] if i not in out and i in names[b]), key=lambda i: letters[i])
    free = {ref: [i for i in names[ref] if i in out and i not in batch] for ref in (a, b)}
    lhs, rhs = (a, b) if batch + free[a] + free[b] == out else (b, a)
    if all(len(contracted) == 1 and len(names[ref]) <= len(batch) + 2 and names[ref][:len(batch)] == batch
           for ref in (lhs, rhs)):
        return None
    wanted = {lhs: batch + free[lhs] + contracted, rhs: batch + contracted + free[rhs]}
    # a transpose the reshape after it keeps as it is (one free and one contracted index after the batch) is
    # folded into the dot, which reads the operand in place (XLA's transpose folding)
    folded = {ref: names[ref][:len(batch)] == batch and len(free[ref]) <= 1 and len(contracted) == 1
              for ref in (a, b)}
    return names, wanted, folded
