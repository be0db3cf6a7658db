"""What crosses a stage boundary of a pipelined plan: the activation sent on, and the dim microbatches cut.

Costing (:mod:`shardc.costmodel.pipeline`) and lowering (:mod:`shardc.lowering.pipeline`)
both ask these of a plan; they are questions about the pipeline's structure, answered once here.
"""

from __future__ import annotations

from shardc.errors import ShardcError
from shardc.planner.ir import Plan
from shardc.spec.ir import TensorRef
from shardc.spec.walk import leaves

__all__ = ["microbatch_dim", "boundary_tensor"]


def _block_input(plan: Plan) -> TensorRef | None:
    """What a stage receives: the ``layers`` block's first activation input (the first input without one)."""
    spec = plan.spec
    if spec.block is None:
        return next((i.ref for i in plan.tensors if i.role == "input"), None)
    lo, hi = spec.block
    made = {s.result.name for s in spec.statements[lo:hi]}
    kinds = {i.name: i.role for i in plan.tensors}
    reads = (r for s in spec.statements[lo:hi] for r in leaves(s.expr))
    return next((r for r in reads if r.name not in made and kinds.get(r.name) == "activation"), None)


def microbatch_dim(plan: Plan) -> str:
    """The dim microbatches cut: the first dim of the block's first input that no param has."""
    model = {d.name for info in plan.tensors if info.role == "param" for d in info.ref.dims}
    first = _block_input(plan)
    for ref in [first] if first is not None else []:
        for dim in ref.dims:
            if dim.name not in model:
                return dim.name
    raise ShardcError("a pipeline needs a batch dim to cut into microbatches; every input dim is a param's",
                      fix="give the block's input a batch dim such as B")


def boundary_tensor(plan: Plan) -> TensorRef:
    """The activation a stage sends the next: the block's output shaped like its first input."""
    first = _block_input(plan)
    spec = plan.spec
    if spec.block is not None:
        lo, hi = spec.block
        outputs = [s.result for s in spec.statements[lo:hi]]
    else:
        outputs = [i.ref for i in plan.tensors if i.is_output]
    for ref in reversed(outputs) if spec.block is not None else outputs:
        if first is not None and sorted(ref.indices) == sorted(first.indices):
            return ref
    if not outputs:
        raise ShardcError("the pipelined block has no output to send to the next stage")
    return outputs[-1]
