"""What XLA fuses, and so the HBM bytes a memory-bound step of a plan moves.

A memory-bound step (every local step but a matmul) moves the bytes its op family's
:attr:`shardc.ops.registry.Family.traffic` says, less what fusion saves
(:func:`memory_traffic`, the rule as XLA fuses):

* an elementwise map or a reduction reading the result of the step just before
  it, an einsum or another map or reduction, does not read it from HBM (fused into
  that step's kernel: a matmul's epilogue, a loop fusion);
* its result is not written to HBM when the next step, a map or a reduction, is
  its only reader and the backward does not keep it (a residual) nor is it a
  gradient or an output;
* a matmul's operands come from HBM (a producer is not fused into a matmul), a
  slice is fused into its reader, a copy reads and writes, a collective's result
  is in HBM;
* an einsum that contracts no index (``G[B, F] · U[B, F] -> A[B, F]``, SwiGLU's
  product) is an elementwise product: XLA runs it as a multiply, memory-bound and
  fused like a map.
* nothing fuses across the edge of a ``layers`` block: the block runs as a loop
  (a pipeline stage's program), the steps before and after it outside it.

Under ``fusion none`` (:attr:`shardc.hardware.Hardware.fuses` false: PyTorch eager, which launches one
kernel an operator and fuses nothing across them, no matmul epilogue either) none of the first two
savings applies: each memory-bound step reads its operands from HBM and writes its result.

:mod:`shardc.timing` turns those bytes into seconds at the chip's HBM bandwidth.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from shardc.collectives import Op
from shardc.ir.localops import Update
from shardc.ir.plan import Plan, Step
from shardc.ir.spec import TensorRef
from shardc.ops.registry import all_traffic, of_op
from shardc.steptime import einsum_bytes

__all__ = ["memory_traffic", "kept_values", "is_product", "fusible"]


def kept_values(plan: Plan) -> frozenset[TensorRef]:
    """The values a step must write to HBM whatever reads them next: the backward's residuals, the
    gradients and the spec's outputs."""
    outputs = {info.name for info in plan.tensors if info.is_output}
    made = [s.dst for phase in (plan.forward, plan.backward) for s in phase if s.dst.name in outputs]
    return frozenset((*plan.residuals, *plan.grads, *made))


def is_product(step: Step) -> bool:
    """Whether an einsum contracts no index: an elementwise product, which XLA runs as a multiply."""
    if step.op is not Op.EINSUM:
        return False
    kept = {d.name for d in step.dst.dims}
    return all(d.name in kept for ref in step.operands for d in ref.dims)


def fusible(step: Step | None) -> bool:
    """Whether XLA fuses ``step`` with a neighbouring map: an elementwise map or product, or a reduction."""
    if step is not None and is_product(step):
        return True
    if step is None or step.op is not Op.ELEMENTWISE or isinstance(step.fn, Update):
        return False
    family = of_op(step.fn)
    return family is None or family.fusible


def memory_traffic(steps: tuple[Step, ...], local_bytes: Callable[[TensorRef], float],
                   kept: frozenset[TensorRef], fuse: bool = True) -> list[float]:
    """The HBM bytes of each of ``steps`` (one phase, in program order), 0 for collectives; a contracting
    einsum's are its operands read and its result written (its roofline: the time it takes is the larger
    of its FLOPs at the matmul rate and these bytes over HBM, :func:`shardc.steptime.einsum_time`).

    A memory-bound step moves what its family's traffic says, less what XLA's fusion saves (the rule is
    the module's): an operand the step just before made (an einsum, a map or a reduction) is not read
    back, and a result only the next map or reduction reads, and nothing keeps, is not written; without
    ``fuse`` (``fusion none``: one kernel an op) neither saving applies.
    """
    readers: dict[TensorRef, int] = {}
    for step in steps:
        for ref in set(step.operands):
            readers[ref] = readers.get(ref, 0) + 1
    out = []
    for k, step in enumerate(steps):
        if step.op is Op.EINSUM and not is_product(step):
            out.append(einsum_bytes((local_bytes(r) for r in step.operands), local_bytes(step.dst)))
            continue
        if step.is_collective or step.op is Op.SLICE or isinstance(step.fn, Update):
            out.append(0.0)  # link-bound; a slice is fused into its reader; the update apart
            continue
        if step.op is Op.COPY:
            out.append(local_bytes(step.operands[0]) + local_bytes(step.dst))
            continue
        family = of_op(step.fn) if step.op is Op.ELEMENTWISE else None
        reads, write = (family.traffic if family is not None else all_traffic)(step, local_bytes)
        # a `layers` block runs as a loop (or a pipeline's stage program) apart from the steps around it:
        # XLA fuses nothing across that boundary
        before = steps[k - 1] if k > 0 and steps[k - 1].region == step.region else None
        after = steps[k + 1] if k + 1 < len(steps) and steps[k + 1].region == step.region else None
        if not fuse:  # one kernel an op: it reads every operand and writes its result
            before = after = None
        if fusible(step) and before is not None and (before.op is Op.EINSUM or fusible(before)):
            reads = tuple(0.0 if ref == before.dst else r for ref, r in zip(step.operands, reads, strict=True))
        if (fusible(step) and fusible(after) and after is not None and step.dst in after.operands
                and readers.get(step.dst, 0) == 1 and step.dst not in kept):
            write = 0.0
        out.append(math.fsum(reads) + write)
    return out
