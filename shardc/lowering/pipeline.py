"""Lowering a pipelined spec: GPipe over the stage axis, the stage's own plan on the other axes.

The generated module is the stage plan's module (``forward_local``/``backward_local``
on one microbatch) followed by a pipeline section, the SPMD pipeline pattern of JAX's
``shard_map`` documentation: one ``shard_map`` over every mesh axis, each device
holding its stage's L/P layers (params stacked on a leading layer dim sharded over
the stage axis), and m + p - 1 ticks in which every stage runs its layers on what it
holds and ``jax.lax.ppermute`` passes the result to the next stage.  Stage 0 reads
microbatch t at tick t; the last stage's output at tick t is microbatch t - (p - 1).
The last tick sends nothing (no stage would read it), so the program has m + p - 2
collective-permutes forward, and ``jax.vjp`` of it on each device (inside a second
``shard_map``), whose transpose of each ``ppermute`` carries cotangents back a stage,
as many backward (after as many forward ones: the backward program recomputes the
forward).  The microbatches enter
on stage 0 (the input is stacked over the stages, zeros elsewhere), so their
gradient needs no reduction over the stage axis.  Each layer is a
``jax.custom_vjp`` whose backward is the plan's own, so the collectives on the other
axes are the planned ones in both directions.

``schedule 1f1b`` adds a second program, the 1F1B order as a tick table
(:mod:`shardc.lowering.pipeline_1f1b`), which ``shardc verify`` runs instead.  The
other schedules (interleaved, zb-h1, zbv) are costed and drawn, and lower as GPipe
(every schedule computes the same values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from shardc.errors import ShardcError
from shardc.lowering.codegen import Module, generate
from shardc.lowering.load import check_devices, load_module, lowered_mesh, lowered_sizes
from shardc.lowering.pipeline_1f1b import SECTION, tick_tables
from shardc.lowering.pipeline_ends import Ends, ends_source, plan_parts
from shardc.lowering.template import defined_names
from shardc.pipeline.boundary import boundary_tensor, microbatch_dim
from shardc.pipeline.stages import Pipeline, pipeline_of, stage_spec
from shardc.planner.ir import Plan
from shardc.spec.ir import TensorRef

__all__ = ["PipelineLowered", "lower_pipeline", "pipeline_source", "permutes_expected"]


@dataclass
class PipelineLowered:
    """A lowered pipeline: ``.source`` is the module text, ``.namespace`` the module loaded."""

    plan: Plan
    pipeline: Pipeline
    stage: Module
    source: str
    sizes: dict[str, int]  # one microbatch's, and the mesh's
    batch: int  # the batch dim's size, all microbatches
    namespace: Any = None
    ends: Ends | None = None  # a `layers L { ... }` block's three plans (shardc.lowering.pipeline_ends)


def _block(plan: Plan) -> tuple[TensorRef, TensorRef]:
    first = next((i.ref for i in plan.tensors if i.role == "input"), None)
    out = boundary_tensor(plan)
    if first is None or first.dims != out.dims or first.unreduced or out.unreduced:
        raise ShardcError(f"a pipelined block's output must be laid out as its input to repeat: "
                          f"{out} vs {first}", fix="declare the output with the input's sharding")
    return first, out


def pipeline_source(plan: Plan, mesh: tuple[tuple[str, int], ...], sizes: dict[str, int],
                    layers: int, microbatches: int, reserved: frozenset[str] = frozenset()) -> tuple[Module, str, int]:
    """The module text for ``plan`` pipelined on ``mesh``; ``sizes`` are the whole batch's."""
    pipe = pipeline_of(plan.spec)
    assert pipe is not None
    stages = dict(mesh)[pipe.axis]
    if layers % stages:
        raise ShardcError(f"{layers} layers do not split evenly over {stages} stages, which lowering needs",
                          fix=f"use a multiple of {stages} layers (costs allow an uneven split)")
    first, out = _block(plan)
    dim = microbatch_dim(plan)
    if sizes[dim] % microbatches:
        raise ShardcError(f"{dim}={sizes[dim]} does not split into {microbatches} microbatches",
                          fix=f"make {dim} a multiple of {microbatches}")
    stage_plan = replace(plan, spec=stage_spec(plan.spec))
    stage_mesh = tuple((n, s) for n, s in mesh if n != pipe.axis)
    micro = lowered_sizes(stage_plan, {**sizes, dim: sizes[dim] // microbatches}, stage_mesh)
    assert micro is not None
    module = generate(stage_plan, stage_mesh, micro, title=" (one stage, one microbatch)", reserved=reserved)
    head = module.source.split('\nif __name__ == "__main__":')[0].rstrip() + "\n"
    params = [i.name for i in plan.tensors if i.role == "param"]
    text = _SECTION.format(
        axis=pipe.axis, stages=stages, layers=layers, micro=microbatches, first=first.name, out=out.name,
        params=tuple(params), mesh={n: s for n, s in mesh}, in_dim=first.indices.index(dim),
        out_dim=out.indices.index(dim), dim=dim, perm=[(s, s + 1) for s in range(stages - 1)])
    if pipe.schedule.name not in ("gpipe", "1f1b"):
        # Every schedule computes the same values; only GPipe's and 1F1B's orders are lowered.
        text += (f"\n# schedule {pipe.schedule.name} lowers as GPipe (same values); `shardc cost` costs and "
                 f"draws its own order\n")
    if pipe.schedule.name == "1f1b":
        f_table, b_table = tick_tables(stages, microbatches)
        text += SECTION.format(axis=pipe.axis, f_table=f_table, b_table=b_table)
    return module, head + text, micro[dim] * microbatches


def _ends_text(ends: Ends, mesh: tuple[tuple[str, int], ...], block: Module,
               reserved: frozenset[str]) -> tuple[str, frozenset[str]]:
    """The ends' functions and the whole model's programs, at one microbatch's sizes."""
    pipe = pipeline_of(ends.block.spec)
    assert pipe is not None
    stage_mesh = tuple((n, s) for n, s in mesh if n != pipe.axis)
    micro = dict(block.sizes or {})
    dim = microbatch_dim(ends.block)
    modules = [generate(part, stage_mesh, micro, reserved=reserved) for part in (ends.pre, ends.post)]
    data = {b.key: b.ref.indices.index(dim) for m in modules for b in m.forward.inputs if dim in b.ref.indices}
    variables = modules[0].variables | modules[1].variables
    return ends_source(ends, modules[0], modules[1], data, pipe.schedule.name), variables


def permutes_expected(stages: int, microbatches: int) -> int:
    """Collective-permutes of the forward (and again of the backward): one a tick but the last."""
    return microbatches + stages - 2


def lower_pipeline(plan: Plan, sizes: dict[str, int] | None = None, layers: int | None = None,
                   microbatches: int | None = None, load: bool = True) -> PipelineLowered:
    """Lower a pipelined plan (``sizes`` may resize the mesh and dims, as for :func:`shardc.lower`)."""
    pipe = pipeline_of(plan.spec)
    if pipe is None:
        raise ShardcError("not a pipelined spec", fix="mark the stage axis, e.g. `mesh P=4 pipeline, X=8`")
    mesh = lowered_mesh(plan, sizes)
    full = lowered_sizes(replace(plan, spec=stage_spec(plan.spec)), sizes, mesh) or {}
    if any(d.name not in full for i in plan.tensors for d in i.ref.dims):
        raise ShardcError("lowering a pipeline needs the size of every dim", fix="add a `dims` line")
    layers = layers or pipe.layers
    microbatches = microbatches or pipe.microbatches
    ends = None
    if plan.spec.block is not None:  # the statements around the block on the first and last stage
        ends = plan_parts(plan)
    reserved: frozenset[str] = frozenset()
    while True:  # no tensor's variable takes a global of the module: written again if one did
        module, source, batch = pipeline_source(ends.block if ends else plan, mesh, full, layers, microbatches,
                                                reserved)
        variables = module.variables
        if ends is not None:
            text, more = _ends_text(ends, mesh, module, reserved)
            source, variables = source + text, variables | more
        defined = defined_names(source)
        if not variables & defined:
            break
        reserved |= defined
    pipe = replace(pipe, layers=layers, microbatches=microbatches, stages=dict(mesh)[pipe.axis])
    lowered = PipelineLowered(plan, pipe, module, source, dict(module.sizes or {}) | dict(mesh), batch, ends=ends)
    if load:
        check_devices(mesh)
        lowered.namespace = load_module(source, plan.spec.filename or "spec")
    return lowered


def device_count(mesh: tuple[tuple[str, int], ...]) -> int:
    return math.prod(s for _, s in mesh)


_SECTION = '''

# ---- pipeline: GPipe over {axis} ---------------------------------------------
# The SPMD pipeline of JAX's shard_map documentation: every device runs its stage's layers each
# tick and jax.lax.ppermute hands the result to the next stage; jax.vjp of the program carries the
# cotangents back the same way.

import functools
import math

from jax.sharding import AxisType, NamedSharding

PIPELINE_AXIS = {axis!r}
STAGES = {stages}
LAYERS = {layers}  # in all; LAYERS // STAGES on each stage
MICROBATCHES = {micro}
TICKS = MICROBATCHES + STAGES - 1  # microbatch j is on stage s at tick j + s
BLOCK_INPUT, BLOCK_OUTPUT = {first!r}, {out!r}  # what a stage receives and sends
PARAMS = {params!r}  # each passed stacked: [LAYERS, ...]
PIPE_MESH_AXES = {mesh!r}
MICRO_DIM = ({in_dim}, {out_dim})  # the batch dim in BLOCK_INPUT and BLOCK_OUTPUT, cut into microbatches
MICROBATCH = ({dim!r}, MICROBATCHES)  # keep_mask: a microbatch draws its slice of the whole batch's mask
SENDS = {perm!r}  # stage s -> s + 1


def make_pipeline_mesh() -> jax.sharding.Mesh:
    shape, names = tuple(PIPE_MESH_AXES.values()), tuple(PIPE_MESH_AXES)
    if jax.device_count() < math.prod(shape):
        raise RuntimeError(f"the pipeline mesh needs {{math.prod(shape)}} devices, jax sees {{jax.device_count()}}")
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def layer_key(key, stage, k, j):
    """The dropout key of layer k of ``stage`` on microbatch j: (key * LAYERS + its layer number, j),
    the masks layer number l of the unpipelined stack draws under key * LAYERS + l."""
    number = stage * (LAYERS // STAGES) + k
    return (jnp.asarray(key, jnp.uint32) * jnp.uint32(LAYERS) + jnp.asarray(number, jnp.uint32),
            jnp.asarray(j, jnp.int32))


@jax.custom_vjp
def layer(x, params, key):
    """One layer on one device: the planned forward; its VJP is the planned backward."""
    return _layer_fwd(x, params, key)[0]


def _layer_fwd(x, params, key):
    pool = {{BLOCK_INPUT: x, **dict(zip(PARAMS, params))}}
    saved = dict(zip(FORWARD_OUT, forward_local(*[pool[k] for k in FORWARD_IN], *[key] * KEYED)))
    return saved[BLOCK_OUTPUT], (pool, saved)


def _layer_bwd(residuals, d_out):
    pool, saved = residuals  # a dropout's keep-mask is a saved forward value: no key needed
    cot = {{name: d_out if out == BLOCK_OUTPUT else jnp.zeros_like(saved[out]) for name, out in COTANGENTS.items()}}
    values = {{**pool, **saved, **cot}}
    grads = dict(zip(BACKWARD_OUT, backward_local(*[values[k] for k in BACKWARD_IN])))
    return grads[GRADS[BLOCK_INPUT]], tuple(grads[GRADS[p]] for p in PARAMS)


def _layer_vjp(residuals, d_out):
    return (*_layer_bwd(residuals, d_out), None)  # the key has no cotangent


layer.defvjp(_layer_fwd, _layer_vjp)


def pipeline_local(key, xs, *params):
    """GPipe on one device: ``xs`` [1, MICROBATCHES, block] (stage 0's are read), params [LAYERS/STAGES, ...],
    ``key`` the dropout key."""
    stage = jax.lax.axis_index(PIPELINE_AXIS)
    xs = xs[0]
    state = jnp.zeros_like(xs[0])
    outs = jnp.zeros_like(xs)
    for t in range(TICKS):
        x = jnp.where(stage == 0, xs[min(t, MICROBATCHES - 1)], state)
        for k in range(LAYERS // STAGES):  # stage s runs microbatch t - s at tick t
            x = layer(x, tuple(w[k] for w in params), layer_key(key, stage, k, t - stage))
        j = t - (STAGES - 1)
        if j >= 0:  # the last stage finishes microbatch j
            outs = outs.at[j].set(jnp.where(stage == STAGES - 1, x, outs[j]))
        if t < TICKS - 1:  # the last tick's result has no next tick to go to
            state = jax.lax.ppermute(x, PIPELINE_AXIS, SENDS)
    return outs[None]  # stacked over the stages; the last stage's is the output


PIPE_IN = (P(), P(PIPELINE_AXIS, None, *FORWARD_IN[BLOCK_INPUT]))  # the dropout key, the microbatches
PIPE_IN += tuple(P(PIPELINE_AXIS, *FORWARD_IN[p]) for p in PARAMS)
PIPE_OUT = P(PIPELINE_AXIS, None, *FORWARD_OUT[BLOCK_OUTPUT])


@functools.cache
def pipeline_programs():
    """The mesh, the forward program and the backward program (jit of jax.vjp), compiled on first call."""
    mesh = make_pipeline_mesh()
    fwd = jax.shard_map(pipeline_local, mesh=mesh, in_specs=PIPE_IN, out_specs=PIPE_OUT, check_vma=False)

    def bwd_local(d_outs, key, *args):
        # jax.vjp on each device, inside the shard_map: the transpose of a shard_map without
        # replication checks would rescale the cotangent of an output replicated over an axis
        # (tensor parallelism's Y), and the planned backward already sums what it must.
        _, vjp = jax.vjp(functools.partial(pipeline_local, key), *args)
        return vjp(d_outs)

    bwd = jax.shard_map(bwd_local, mesh=mesh, in_specs=(PIPE_OUT,) + PIPE_IN, out_specs=PIPE_IN[1:],
                        check_vma=False)
    return mesh, jax.jit(fwd), jax.jit(bwd)


def _split(x, dim):
    return jnp.stack(jnp.split(jnp.asarray(x), MICROBATCHES, axis=dim))


def _join(xs, dim):
    return jnp.concatenate(list(xs), axis=dim)


def _args(inputs, key=0):
    """The program's arguments: the dropout key, the microbatches on stage 0 (zeros elsewhere), the
    stacked params."""
    mesh, _, _ = pipeline_programs()
    xs = _split(inputs[BLOCK_INPUT], MICRO_DIM[0])
    xs = jnp.zeros((STAGES,) + xs.shape, xs.dtype).at[0].set(xs)
    args = [jnp.asarray(key, jnp.uint32), xs] + [jnp.asarray(inputs[p]) for p in PARAMS]
    return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, PIPE_IN)]


def pipeline_forward(inputs, key=0):
    """{{BLOCK_OUTPUT: ...}} after all LAYERS layers, from BLOCK_INPUT and each param stacked [LAYERS, ...];
    ``key`` draws the dropout masks (layer l's under key * LAYERS + l)."""
    _, fwd, _ = pipeline_programs()
    return {{BLOCK_OUTPUT: _join(fwd(*_args(inputs, key))[-1], MICRO_DIM[1])}}


def pipeline_grad(inputs, cotangent, key=0):
    """d<Name> of BLOCK_INPUT and of each stacked param, from d<BLOCK_OUTPUT>, under dropout ``key``."""
    mesh, fwd, bwd = pipeline_programs()
    args = _args(inputs, key)
    d_last = _split(cotangent["d" + BLOCK_OUTPUT], MICRO_DIM[1])
    d_outs = jnp.zeros((STAGES,) + d_last.shape, d_last.dtype).at[-1].set(d_last)
    grads = bwd(jax.device_put(d_outs, NamedSharding(mesh, PIPE_OUT)), *args)
    return {{"d" + BLOCK_INPUT: _join(grads[0][0], MICRO_DIM[0]), **{{"d" + p: g for p, g in zip(PARAMS, grads[1:])}}}}
'''
