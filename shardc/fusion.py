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
savings applies: each memory-bound step reads its operands from HBM and writes its result, except the steps
of an op PyTorch runs as one native kernel (:attr:`shardc.ops.registry.Family.native`: its layer norm),
which are priced by that kernel's reads and writes: each operand from outside it read once, a result written
only where something outside the kernel reads it, and the row statistics it saves for its backward
(:attr:`shardc.ops.registry.Family.saved`: the mean and rstd, float32) written by the forward's kernel and
read by the backward's; and a step PyTorch runs as more kernels than one moves those kernels' bytes
(:attr:`shardc.ops.registry.Family.eager`: cross entropy's backward, ``nll_loss_backward`` then
``_log_softmax_backward_data``).

A fused kernel's further results (:attr:`shardc.ops.registry.Family.further`: attention's logsumexp, dK and
dV) are written inside the kernel's calls: their bytes are the kernel's step's, priced with its FLOPs.

Under ``fusion statement`` (PyTorch eager with a hand-fused kernel a statement, as Megatron-LM runs its
layers: apex's fused LayerNorm, the fused scale-mask-softmax, bias-GeLU and bias-dropout-add, each with its
fused backward) the two savings apply only inside a statement: a value the spec names (a statement's
result, an input, or the gradient of one: :func:`named_values`) is a kernel's output, written to HBM and
read back by the next kernel, and nothing fuses into a matmul (no epilogue: the kernel after it reads its
result).  A norm is apex's kernel, priced as PyTorch's native one above (``FusedLayerNorm`` reads X once and
writes Y and the statistics; its backward reads dY, X and the statistics once and writes dX).

:mod:`shardc.timing` turns those bytes into seconds at the chip's HBM bandwidth.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from shardc.collectives import Op
from shardc.ir.localops import Update
from shardc.ir.plan import Plan, Step
from shardc.ir.spec import TensorRef
from shardc.ops.registry import Family, Traffic, all_traffic, of_op
from shardc.steptime import einsum_bytes

__all__ = ["memory_traffic", "kept_values", "named_values", "is_product", "is_further", "fusible",
           "saved_statistics"]


def kept_values(plan: Plan) -> frozenset[TensorRef]:
    """The values a step must write to HBM whatever reads them next: the backward's residuals, the
    gradients and the spec's outputs."""
    outputs = {info.name for info in plan.tensors if info.is_output}
    made = [s.dst for phase in (plan.forward, plan.backward) for s in phase if s.dst.name in outputs]
    return frozenset((*plan.residuals, *plan.grads, *made))


def named_values(plan: Plan) -> frozenset[str]:
    """The values ``fusion statement`` writes to HBM between kernels: each statement's result, each input
    of the spec, and their gradients (a statement's intermediates, a partial gradient, a row statistic or a
    dropout's mask are not named: they fuse as XLA fuses them)."""
    names = {st.result.name for st in plan.spec.statements} | {i.name for i in plan.tensors if i.role != "activation"}
    grads = dict(plan.gradient_names)
    return frozenset(names | {grads[n] for n in names if n in grads})


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
                   kept: frozenset[TensorRef], fuse: bool = True, named: frozenset[str] | None = None,
                   elements: Callable[[TensorRef], float] | None = None) -> list[float]:
    """The HBM bytes of each of ``steps`` (one phase, in program order), 0 for collectives; a contracting
    einsum's are its operands read and its result written (its roofline: the time it takes is the larger
    of its FLOPs at the matmul rate and these bytes over HBM, :func:`shardc.steptime.einsum_time`).

    A memory-bound step moves what its family's traffic says, less what XLA's fusion saves (the rule is
    the module's): an operand the step just before made (an einsum, a map or a reduction) is not read
    back, and a result only the next map or reduction reads, and nothing keeps, is not written; without
    ``fuse`` (``fusion none``: one kernel an op) neither saving applies, and a family's ``eager`` traffic
    replaces its ``traffic``; with ``named`` (``fusion statement``: :func:`named_values`) neither applies to a
    value of those names nor to a matmul's result.  Under either, a native kernel's steps are priced as that
    kernel (:func:`_native_traffic`; ``elements``: a value's local elements, for the statistics it saves).
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
        reads, write = _traffic(_family_of(step), fuse)(step, local_bytes)
        # a `layers` block runs as a loop (or a pipeline's stage program) apart from the steps around it:
        # XLA fuses nothing across that boundary
        before = steps[k - 1] if k > 0 and steps[k - 1].region == step.region else None
        after = steps[k + 1] if k + 1 < len(steps) and steps[k + 1].region == step.region else None
        if not fuse:  # one kernel an op: it reads every operand and writes its result
            before = after = None
        if named is not None:  # a kernel a statement: its output is written, a matmul's result read back
            before = None if before is None or before.op is Op.EINSUM or before.dst.name in named else before
            after = None if step.dst.name in named else after
        if fusible(step) and before is not None and (before.op is Op.EINSUM or fusible(before)):
            reads = tuple(0.0 if ref == before.dst else r for ref, r in zip(step.operands, reads, strict=True))
        if (fusible(step) and fusible(after) and after is not None and step.dst in after.operands
                and readers.get(step.dst, 0) == 1 and step.dst not in kept):
            write = 0.0
        out.append(math.fsum(reads) + write)
    if not fuse or named is not None:  # the framework's own kernels: PyTorch's, apex's
        assert elements is not None, "a native kernel's saved statistics are priced by their elements"
        for start, end in _native_runs(steps):
            out[start:end] = _native_traffic(steps[start:end], local_bytes, kept, readers, elements)
    return _to_kernels(steps, out)


def _family_of(step: Step) -> Family | None:
    return of_op(step.fn) if step.op is Op.ELEMENTWISE else None


def _traffic(family: Family | None, fuse: bool) -> Traffic:
    """How a step of ``family`` moves its bytes: as its eager kernels do under ``fusion none`` where the family
    says (:attr:`shardc.ops.registry.Family.eager`), else its own traffic (every operand and result, without one)."""
    if family is None:
        return all_traffic
    return family.eager if not fuse and family.eager is not None else family.traffic


def is_further(step: Step) -> bool:
    """Whether ``step`` is a further result of the kernel an earlier step of the same operands runs
    (:attr:`shardc.ops.registry.Family.further`: attention's logsumexp, dK and dV), written by that kernel."""
    family = _family_of(step)
    return family is not None and family.further(step)


def _native_runs(steps: tuple[Step, ...]) -> list[tuple[int, int]]:
    """The runs ``[start, end)`` of two or more steps that are one native kernel of the framework
    (:attr:`shardc.ops.registry.Family.native`: PyTorch's layer norm, forward or backward), each ending at
    a step that is not part of one, or after its kernel's last step."""
    runs: list[tuple[int, int]] = []
    start: int | None = None
    for k, step in enumerate(steps):
        family = _family_of(step)
        part = family is not None and family.native(step)
        if start is not None and not part:
            runs.append((start, k))
            start = None
        if part:
            start = k if start is None else start
            if family is not None and family.native_last(step):
                runs.append((start, k + 1))
                start = None
    if start is not None:
        runs.append((start, len(steps)))
    return [(a, b) for a, b in runs if b - a > 1]


def _native_traffic(run: tuple[Step, ...], local_bytes: Callable[[TensorRef], float], kept: frozenset[TensorRef],
                    readers: dict[TensorRef, int], elements: Callable[[TensorRef], float]) -> list[float]:
    """The HBM bytes of each step of one native kernel: it reads each operand from outside the kernel once
    (the step that first reads it), and writes a result only where a step outside it reads it or the backward
    keeps it; the statistics it saves (:attr:`shardc.ops.registry.Family.saved`, at their own bytes) the forward's
    kernel writes and the backward's reads, where its step reads them (PyTorch's layer norm, and apex's, reads X
    once and writes Y, the mean and the rstd; its backward reads dY, X, the mean and the rstd, writes dX)."""
    saved = {ref: n for step in run for ref, n in _saved(step)}
    made: set[TensorRef] = set()
    read: set[TensorRef] = set()
    out = []
    for step in run:
        reads, write = _traffic(_family_of(step), True)(step, local_bytes)
        moved = [r for ref, r in zip(step.operands, reads, strict=True)
                 if ref not in made and ref not in read and ref not in saved]
        read.update(step.operands)
        made.add(step.dst)
        inside = sum(step.dst in set(s.operands) for s in run)
        writes = step.dst not in saved and (readers.get(step.dst, 0) > inside or step.dst in kept)
        stats = math.fsum(elements(ref) * n for ref, n in _saved(step))
        out.append(math.fsum(moved) + (write if writes else 0.0) + stats)
    return out


def _saved(step: Step) -> tuple[tuple[TensorRef, int], ...]:
    family = _family_of(step)
    return family.saved(step) if family is not None else ()


def saved_statistics(plan: Plan) -> tuple[tuple[TensorRef, int], ...]:
    """The row statistics the framework's native kernels of ``plan``'s forward save for the backward
    (:attr:`shardc.ops.registry.Family.saved`), each with its bytes an element: residuals beside the plan's
    under ``fusion none`` and ``statement`` (autograd keeps what the kernel's backward reads), which XLA, running
    the plan, makes again; none of a step the backward recomputes (its kernel runs again there)."""
    again = {s.dst for s in plan.recomputed}
    found = {ref: n for step in plan.forward if step.dst not in again for ref, n in _saved(step)}
    return tuple(found.items())


def _to_kernels(steps: tuple[Step, ...], out: list[float]) -> list[float]:
    """``out`` with each further result's bytes (:attr:`shardc.ops.registry.Family.further`: a fused attention
    kernel's logsumexp, dK and dV) moved onto the step that runs its kernel (the nearest earlier one of the
    same operands): its writes are inside the kernel's calls, priced with the kernel's FLOPs."""
    out = list(out)
    for k, step in enumerate(steps):
        family = _family_of(step)
        if family is None or not family.further(step) or not out[k]:
            continue
        owner = next((j for j in range(k - 1, -1, -1) if steps[j].operands == step.operands
                      and _family_of(steps[j]) is family and not family.further(steps[j])), None)
        if owner is not None:
            out[owner] += out[k]
            out[k] = 0.0
    return out
