"""Lowering a pipelined ``layers L { ... }`` block with the statements around it.

Megatron-LM places the embedding on the first pipeline stage and the final norm,
output layer and loss on the last.  The spec is cut in three: the statements before
the block, the block, and those after it (:func:`split_spec`).  Each is planned as a
spec of its own on the stage mesh (the block with the pipeline axis, as a block alone
is pipelined), so each has its own planned forward and backward functions; the
block's boundaries are its declared shardings, which all three plans keep.

The generated module is the block's pipeline module (:mod:`shardc.lowering.pipeline_lowering`)
with the two ends' functions (``pre_forward_local``, ``post_backward_local``, ...) as
the ends of its pipeline (:class:`shardc.lowering.pipeline_runtime.ModelEnds`): in the
tick where stage 0 runs a microbatch's forward it first runs the statements before the
block on it, and in the tick where the last stage finishes one it runs those after it,
the loss and their backward (SPMD: every device computes them, masked by its stage
index, as JAX's shard_map pipeline example does).  The ends' params are passed stacked
over the stage axis, only the first (last) stage's copy non-zero, so their gradients
need no reduction over it.

The loss after the block is a ``cross_entropy``: the mean over the tokens, so with
equal microbatches the batch's loss is the mean of the microbatches' losses, and the
cotangent of each is the loss's cotangent over M.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardc.errors import ShardcError
from shardc.ir.plan import Plan, uses_dropout
from shardc.ir.spec import Call, Mesh, Spec, Statement
from shardc.lowering import template
from shardc.lowering.codegen import Module, Phase
from shardc.pipeline.boundary import boundary_tensor
from shardc.planner.planner import plan as make_plan
from shardc.spec.walk import leaves

__all__ = ["Ends", "split_spec", "plan_parts", "ends_source"]


@dataclass(frozen=True)
class Ends:
    """The three plans of a pipelined block spec: before the block, the block, after it."""

    pre: Plan
    block: Plan
    post: Plan


def _names(statements: tuple[Statement, ...]) -> set[str]:
    return {s.result.name for s in statements} | {r.name for s in statements for r in leaves(s.expr)}


def split_spec(spec: Spec) -> tuple[Spec, Spec, Spec]:
    """The statements before the block, the block (pipelined) and those after it, each a spec."""
    if spec.block is None:
        raise ShardcError("not a `layers L { ... }` spec", fix="write the repeated statements in a block")
    lo, hi = spec.block
    stage_mesh = Mesh(tuple(a for a in spec.mesh.axes if not a.pipeline))

    def part(statements: tuple[Statement, ...], pipelined: bool) -> Spec:
        names = _names(statements)
        params = None if spec.params is None else tuple(p for p in spec.params if p in names)
        return replace(spec, statements=statements, block=None, header_spans=(),
                       params=params, const=tuple(c for c in spec.const if c in names),
                       layers=spec.layers if pipelined else None, mesh=spec.mesh if pipelined else stage_mesh,
                       microbatches=spec.microbatches if pipelined else None,
                       schedule=spec.schedule if pipelined else None,
                       topology=spec.topology if pipelined else None)  # one stage's chips: its usual slice

    pre, block, post = spec.statements[:lo], spec.statements[lo:hi], spec.statements[hi:]
    _check_ends(spec, pre, post)
    return part(pre, False), part(block, True), part(post, False)


def _check_ends(spec: Spec, pre: tuple[Statement, ...], post: tuple[Statement, ...]) -> None:
    """The parts meet only at the block's input and output, and the spec ends in one loss."""
    fix = ("write the model as an embedding, a `layers` block and a head ending in `Loss[] = "
           "cross_entropy(...)`, each reading only its own params")
    if not pre or not post:
        raise ShardcError("lowering a pipelined block needs statements before and after it", spec.span_of("layers"),
                          fix=fix)
    shared = _names(pre) & _names(post)
    if shared:
        raise ShardcError(f"{', '.join(sorted(shared))} is read both before and after the pipelined block "
                          "(on the first and the last stage)", spec.span_of("layers"), fix=fix)
    last = post[-1]
    if not (isinstance(last.expr, Call) and last.expr.func == "cross_entropy") or last.result.dims:
        raise ShardcError("lowering a pipelined block needs the statements after it to end in a "
                          "cross_entropy loss (the microbatches' losses are averaged)", last.span, fix=fix)


def plan_parts(plan: Plan) -> Ends:
    """Plan the three parts as ``plan`` was planned (its policy, recompute mode, chip and gradient
    names: a part alone would name ``W``'s gradient ``dW`` where the whole spec has a tensor ``dW``)."""
    spans = dict(plan.spans) or None
    # each part as the whole was planned: the candidate it chose (strategy and compute weights), never a
    # choice of its own, so the parts' steps are the whole plan's (the costed ones)
    parts = [make_plan(s, save=plan.save, hardware=plan.chip, spans=spans, recompute=plan.recompute,
                       gradients=dict(plan.gradient_names), strategy=plan.strategy, weights=plan.weights)
             for s in split_spec(plan.spec)]
    for part in (parts[0], parts[2]):
        if uses_dropout(part.forward):
            raise ShardcError("a dropout outside the pipelined block does not lower yet",
                              fix="put the dropout inside the `layers` block")
    return Ends(*parts)


def _renamed(module: Module, prefix: str) -> str:
    """One end's boundary tables and functions, each name prefixed (``PRE_FORWARD_IN``, ``pre_forward_local``)."""
    text = ""
    for phase, key in ((module.forward, "FORWARD"), (module.backward, "BACKWARD")):
        named = Phase(f"{prefix.lower()}_{phase.name}", phase.inputs, phase.outputs, phase.body)
        text += template.specs(f"{prefix}_{key}_IN", phase.inputs) + template.specs(f"{prefix}_{key}_OUT",
                                                                                   phase.outputs)
        text += "\n\n" + template.function(named) + "\n\n"
    text += f"{prefix}_COTANGENTS = {module.cotangents!r}\n{prefix}_GRADS = {module.grads!r}\n"
    return text


def ends_source(ends: Ends, pre: Module, post: Module, data_dims: dict[str, int]) -> str:
    """The ends' section of the pipeline module: their functions and tables, and the pipeline over
    the whole model (:class:`~shardc.lowering.pipeline_runtime.ModelEnds`)."""
    pre_params = tuple(i.name for i in ends.pre.tensors if i.role == "param")
    post_params = tuple(i.name for i in ends.post.tensors if i.role == "param")
    pre_data = tuple(b.key for b in pre.forward.inputs if b.key not in pre_params)
    post_data = tuple(b.key for b in post.forward.inputs if b.key not in post_params
                      and b.key != _block_output(ends))
    text = "\n\n# ---- the block's ends: the statements before it on stage 0, after it on the last " + "-" * 4
    text += "\n\n" + _renamed(pre, "PRE") + "\n" + _renamed(post, "POST")
    return text + _SECTION.format(pre_params=pre_params, post_params=post_params, pre_data=pre_data,
                                  post_data=post_data, loss=ends.post.spec.statements[-1].result.name,
                                  data_dims=data_dims, pre_result=ends.pre.spec.statements[-1].result.name)


def _block_output(ends: Ends) -> str:
    return boundary_tensor(ends.block).name


_SECTION = '''

PRE_PARAMS, POST_PARAMS = {pre_params!r}, {post_params!r}  # passed stacked over the stages: [STAGES, ...]
PRE_DATA, POST_DATA = {pre_data!r}, {post_data!r}  # cut into microbatches, stacked over the stages
DATA_DIM = {data_dims!r}  # the microbatch dim of each
PRE_RESULT, LOSS = {pre_result!r}, {loss!r}  # stage 0's output; the loss (a mean over the tokens)
PRE = Part(pre_forward_local, PRE_FORWARD_IN, PRE_FORWARD_OUT, pre_backward_local, PRE_BACKWARD_IN, PRE_BACKWARD_OUT,
           PRE_COTANGENTS, PRE_GRADS, PRE_RESULT)
POST = Part(post_forward_local, POST_FORWARD_IN, POST_FORWARD_OUT, post_backward_local, POST_BACKWARD_IN,
            POST_BACKWARD_OUT, POST_COTANGENTS, POST_GRADS, LOSS)
PIPELINE = Pipeline(PIPE_MESH_AXES, PIPELINE_AXIS, LAYERS, MICROBATCHES, F_TABLE, B_TABLE, BLOCK, BLOCK_INPUT, PARAMS,
                    ModelEnds(PRE, POST, PRE_DATA, POST_DATA, PRE_PARAMS, POST_PARAMS, BLOCK_OUTPUT), DATA_DIM)
model_forward, model_grad = PIPELINE.outputs, PIPELINE.gradients
'''
