"""Lowering a pipelined ``layers L { ... }`` block with the statements around it.

Megatron-LM places the embedding on the first pipeline stage and the final norm,
output layer and loss on the last.  The spec is cut in three: the statements before
the block, the block, and those after it (:func:`split_spec`).  Each is planned as a
spec of its own on the stage mesh (the block with the pipeline axis, as a block alone
is pipelined), so each has its own planned forward and backward functions; the
block's boundaries are its declared shardings, which all three plans keep.

The generated module is the block's pipeline module (:mod:`shardc.lowering.pipeline`)
with the two ends' functions (``pre_forward_local``, ``post_backward_local``, ...) and
a program in which, each tick, stage 0 runs the statements before the block on its
next microbatch and the last stage those after it on the microbatch it finished (SPMD:
every device computes them, masked by its stage index, as JAX's shard_map pipeline
example does).  The ends' params are passed stacked over the stage axis, only the
first (last) stage's copy non-zero, so their gradients need no reduction over it.

The loss after the block is a ``cross_entropy``: the mean over the tokens, so with
equal microbatches the batch's loss is the mean of the microbatches' losses, and the
cotangent of each is the loss's cotangent over M.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardc.errors import ShardcError
from shardc.lowering import template
from shardc.lowering.codegen import Module, Phase
from shardc.lowering.pipeline_ends_1f1b import SECTION
from shardc.pipeline.boundary import boundary_tensor
from shardc.planner.ir import Plan, uses_dropout
from shardc.planner.planner import plan as make_plan
from shardc.spec.ir import Call, Mesh, Spec, Statement
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
                       schedule=spec.schedule if pipelined else None)

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
    """Plan the three parts as ``plan`` was planned (its policy, recompute mode and chip)."""
    spans = dict(plan.spans) or None
    parts = [make_plan(s, save=plan.save, hardware=plan.chip, spans=spans,
                       recompute=plan.recompute) for s in split_spec(plan.spec)]
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


def ends_source(ends: Ends, pre: Module, post: Module, data_dims: dict[str, int], schedule: str) -> str:
    """The ends' section of the pipeline module: their functions, the GPipe program over the whole model,
    and with ``schedule 1f1b`` the 1F1B one."""
    pre_params = tuple(i.name for i in ends.pre.tensors if i.role == "param")
    post_params = tuple(i.name for i in ends.post.tensors if i.role == "param")
    pre_data = tuple(b.key for b in pre.forward.inputs if b.key not in pre_params)
    post_data = tuple(b.key for b in post.forward.inputs if b.key not in post_params
                      and b.key != _block_output(ends))
    loss = ends.post.spec.statements[-1].result.name
    text = "\n\n# ---- the block's ends: the statements before it on stage 0, after it on the last " + "-" * 4
    text += "\n\n" + _renamed(pre, "PRE") + "\n" + _renamed(post, "POST")
    text += _SECTION.format(pre_params=pre_params, post_params=post_params, pre_data=pre_data,
                            post_data=post_data, loss=loss, data_dims=data_dims,
                            pre_result=ends.pre.spec.statements[-1].result.name,
                            d_loss=next(iter(post.cotangents)))
    if schedule == "1f1b":
        text += SECTION
    return text


def _block_output(ends: Ends) -> str:
    return boundary_tensor(ends.block).name


_SECTION = '''

PRE_PARAMS, POST_PARAMS = {pre_params!r}, {post_params!r}  # passed stacked over the stages: [STAGES, ...]
PRE_DATA, POST_DATA = {pre_data!r}, {post_data!r}  # cut into microbatches, stacked over the stages
DATA_DIM = {data_dims!r}  # the microbatch dim of each
PRE_RESULT, LOSS, D_LOSS = {pre_result!r}, {loss!r}, {d_loss!r}  # stage 0's output; the loss (a mean), its cotangent
ENDS = PRE_PARAMS + POST_PARAMS
DATA = PRE_DATA + POST_DATA


def _end(fwd_local, fwd_in, fwd_out, bwd_local, bwd_in, cotangents, grads, bwd_out, result):
    """One end on one device: the planned forward; its VJP the planned backward."""
    names = tuple(fwd_in)

    def run_fwd(*args):
        pool = dict(zip(names, args))
        saved = dict(zip(fwd_out, fwd_local(*args)))
        return saved[result], (pool, saved)

    def run_bwd(residuals, d_out):
        pool, saved = residuals
        cot = {{n: d_out if o == result else jnp.zeros_like(saved[o]) for n, o in cotangents.items()}}
        values = {{**pool, **saved, **cot}}
        got = dict(zip(bwd_out, bwd_local(*[values[k] for k in bwd_in])))
        return tuple(got[grads[k]] if k in grads else None for k in names)

    run = jax.custom_vjp(lambda *args: run_fwd(*args)[0])
    run.defvjp(run_fwd, run_bwd)
    return run, run_fwd, run_bwd


pre_end, pre_end_fwd, pre_end_bwd = _end(pre_forward_local, PRE_FORWARD_IN, PRE_FORWARD_OUT, pre_backward_local,
                                         PRE_BACKWARD_IN, PRE_COTANGENTS, PRE_GRADS, PRE_BACKWARD_OUT, PRE_RESULT)
post_end, post_end_fwd, post_end_bwd = _end(post_forward_local, POST_FORWARD_IN, POST_FORWARD_OUT,
                                            post_backward_local, POST_BACKWARD_IN, POST_COTANGENTS, POST_GRADS,
                                            POST_BACKWARD_OUT, LOSS)


def _pre_args(data, ends, j):
    return [data[k][j] if k in PRE_DATA else ends[k] for k in PRE_FORWARD_IN]


def _post_args(x, data, ends, j):
    return [x if k == BLOCK_OUTPUT else data[k][j] if k in POST_DATA else ends[k] for k in POST_FORWARD_IN]


def model_local(key, *args):
    """GPipe over the whole model on one device: ``args`` the microbatched data [1, M, ...], the ends'
    params [1, ...] (this stage's copy), the block's params [LAYERS/STAGES, ...]; returns the last
    stage's loss of each microbatch, [1, M]."""
    stage = jax.lax.axis_index(PIPELINE_AXIS)
    data = {{k: x[0] for k, x in zip(DATA, args)}}
    ends = {{k: w[0] for k, w in zip(ENDS, args[len(DATA):])}}
    params = args[len(DATA) + len(ENDS):]
    state, losses = None, []
    for t in range(TICKS):
        x0 = pre_end(*_pre_args(data, ends, min(t, MICROBATCHES - 1)))
        x = jnp.where(stage == 0, x0, x0 * 0 if state is None else state)
        for k in range(LAYERS // STAGES):  # stage s runs microbatch t - s at tick t
            x = layer(x, tuple(w[k] for w in params), layer_key(key, stage, k, t - stage))
        j = t - (STAGES - 1)
        if j >= 0:  # the last stage finishes microbatch j: its loss
            losses.append(jnp.where(stage == STAGES - 1, post_end(*_post_args(x, data, ends, j)), 0.0))
        if t < TICKS - 1:
            state = jax.lax.ppermute(x, PIPELINE_AXIS, SENDS)
    return jnp.stack(losses)[None]


def _data_spec(k):
    table = PRE_FORWARD_IN if k in PRE_DATA else POST_FORWARD_IN
    return P(PIPELINE_AXIS, None, *table[k])


def _end_spec(k):
    table = PRE_FORWARD_IN if k in PRE_PARAMS else POST_FORWARD_IN
    return P(PIPELINE_AXIS, *table[k])


MODEL_IN = (P(), *[_data_spec(k) for k in DATA], *[_end_spec(k) for k in ENDS],
            *[P(PIPELINE_AXIS, *FORWARD_IN[p]) for p in PARAMS])
MODEL_OUT = P(PIPELINE_AXIS, None)


@functools.cache
def model_programs():
    """The mesh, the forward program (the microbatches' losses) and the backward program (jit of jax.vjp)."""
    mesh = make_pipeline_mesh()
    fwd = jax.shard_map(model_local, mesh=mesh, in_specs=MODEL_IN, out_specs=MODEL_OUT, check_vma=False)

    def bwd_local(d_losses, key, *args):
        data = args[:len(DATA)]  # token ids: no gradient
        _, vjp = jax.vjp(lambda *rest: model_local(key, *data, *rest), *args[len(DATA):])
        return vjp(d_losses)

    bwd = jax.shard_map(bwd_local, mesh=mesh, in_specs=(MODEL_OUT,) + MODEL_IN, out_specs=MODEL_IN[1 + len(DATA):],
                        check_vma=False)
    return mesh, jax.jit(fwd), jax.jit(bwd)


def _model_args(inputs, key=0):
    """The dropout key, each data input cut into microbatches on the stage that reads it, each end's
    params on its stage (zeros elsewhere), the block's params stacked [LAYERS, ...]."""
    mesh = make_pipeline_mesh()
    args = [jnp.asarray(key, jnp.uint32)]
    for k in DATA:
        xs = _split(inputs[k], DATA_DIM[k])
        args.append(jnp.zeros((STAGES,) + xs.shape, xs.dtype).at[0 if k in PRE_DATA else -1].set(xs))
    for k in ENDS:
        w = jnp.asarray(inputs[k])
        args.append(jnp.zeros((STAGES,) + w.shape, w.dtype).at[0 if k in PRE_PARAMS else -1].set(w))
    args += [jnp.asarray(inputs[p]) for p in PARAMS]
    return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, MODEL_IN)]


def model_forward(inputs, key=0):
    """{{LOSS: the batch's loss}}: the mean of the microbatches' (each a mean over its tokens)."""
    _, fwd, _ = model_programs()
    return {{LOSS: jnp.mean(fwd(*_model_args(inputs, key))[-1])}}


def _model_grads(grads):
    out = {{}}
    for k, g in zip(ENDS, grads):
        table = PRE_GRADS if k in PRE_PARAMS else POST_GRADS
        out[table[k]] = g[0 if k in PRE_PARAMS else -1]
    out.update({{GRADS[p]: g for p, g in zip(PARAMS, grads[len(ENDS):])}})
    return out


def model_grad(inputs, cotangent, key=0):
    """The gradient of each param (the block's stacked [LAYERS, ...]) from the loss's cotangent."""
    mesh, _, bwd = model_programs()
    d = jnp.asarray(cotangent[D_LOSS]) / MICROBATCHES  # each microbatch's share of the mean
    d_losses = jnp.zeros((STAGES, MICROBATCHES), d.dtype).at[-1].set(d)
    return _model_grads(bwd(jax.device_put(d_losses, NamedSharding(mesh, MODEL_OUT)), *_model_args(inputs, key)))
'''
