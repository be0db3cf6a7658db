"""Lowering a pipelined spec: its schedule's tick table over the stage axis, the stage's own plan on
the other axes.

The generated module is the stage plan's module (``forward_local``/``backward_local``
on one microbatch) followed by a pipeline section: the schedule as a tick table
(:func:`run_ticks`: the order of the simulation ``shardc cost`` steps at the plan's own times, a group
a tick, where each device runs at most one forward, one backward and one weight gradient a tick) and a
:class:`~shardc.lowering.pipeline_runtime.Pipeline` that runs any table the same way,
with the block's plan as each layer
(:mod:`shardc.lowering.pipeline_runtime`).  A ``layers L { ... }`` block with
statements around it adds their two plans as the block's ends (before it on stage
0, after it on the last virtual stage: :mod:`shardc.lowering.pipeline_ends`); several blocks add each
later block's functions (:mod:`shardc.lowering.pipeline_more`).  GPipe, 1F1B,
interleaved, ZB-H1, ZBV, DualPipeV and DualPipe lower with their own tables; the zero-bubble ones
with three, F, B and W, the block's backward cut in two (:mod:`shardc.lowering.pipeline_split`);
ZBV and DualPipeV with two chunks a device in a V, DualPipe with two whole stages a device, s and
P-1-s, microbatches entering from both ends and the two copies' gradients summed once a step
(:mod:`shardc.lowering.pipeline_routes`); the two DualPipes' F&B pairs each at one tick, the pair's
forward and whole backward in the same loop iteration (:mod:`shardc.pipeline.ticks`).

The program is a ``fori_loop`` of the table's ticks (2(m+p-1) for GPipe and 1F1B),
with one collective-permute down and one up in its body (two each way in a V), each moving one
microbatch's shard of the block's output, and the weight gradients' reductions after it
(:mod:`shardc.lowering.pipeline_grads`); ``shardc verify`` checks that and the stages'
planned collectives in the compiled HLO (:mod:`shardc.verification.pipeline_hlo`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from shardc.costmodel.pipeline_times import plan_simulation
from shardc.errors import ShardcError
from shardc.ir.plan import Plan, backward_program
from shardc.ir.spec import TensorRef
from shardc.lowering.codegen import Module, generate
from shardc.lowering.load import check_devices, load_module, lowered_mesh, lowered_sizes
from shardc.lowering.pipeline_ends import Ends, constants, cut_parts, ends_source, pipeline_lines
from shardc.lowering.pipeline_grads import reduce_source, split_reductions
from shardc.lowering.pipeline_more import more_blocks_source
from shardc.lowering.pipeline_split import split_source
from shardc.lowering.template import defined_names
from shardc.pipeline.boundary import boundary_tensor, microbatch_dim
from shardc.pipeline.ticks import TickTable, tick_table, unit_ticks
from shardc.planner.zigzag_order import sequence_order
from shardc.spec.stages import Pipeline, pipeline_of, splits, stage_spec

__all__ = ["PipelineLowered", "lower_pipeline", "pipeline_source", "tick_tables", "weight_ticks", "schedule_tables",
           "run_ticks", "LOWERED_SCHEDULES", "TIMED_ORDERS", "SPLIT_SCHEDULES"]

LOWERED_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev", "dualpipe")
SPLIT_SCHEDULES = ("zb-h1", "zbv", "dualpipev", "dualpipe")  # each backward in two: B and W in tables of their own
V_SHAPED = ("zbv", "dualpipev", "dualpipe")  # two chunks a device on a V's places (shardc.lowering.pipeline_routes)
TWO_WAY_LOWERED = ("dualpipe",)  # two directions, each chunk a whole stage held twice
TIMED_ORDERS = ("zbv",)  # its greedy order is found at the op times: the plan's, from the cost (run_ticks)


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
    ends: Ends | None = None  # a `layers` block's three parts, its plan's sections (shardc.lowering.pipeline_ends)
    blocks: tuple[int, ...] = ()  # each `layers` block's layers in the program (its layers with one block)
    ticks: TickTable | None = None  # the schedule's tick table: the cost's simulation at these sizes (run_ticks)


def _block(plan: Plan, fed: tuple[str, ...] = ()) -> tuple[TensorRef, TensorRef]:
    """The block's input (the first input but those ``fed`` beside it: ``E`` beside ``X0``) and output."""
    first = next((i.ref for i in plan.tensors if i.role == "input" and i.name not in fed), None)
    out = boundary_tensor(plan)
    if first is None or first.dims != out.dims or first.unreduced or out.unreduced:
        raise ShardcError(f"a pipelined block's output must be laid out as its input to repeat: "
                          f"{out} vs {first}", fix="declare the output with the input's sharding")
    return first, out


def tick_tables(schedule: str, stages: int, microbatches: int,
                virtual: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """(forward, backward): what each stage runs forward / backward at each tick, or -1, in the
    schedule's simulated order at equal op times (:func:`schedule_tables`: a lowered program's but zbv's), a
    group of it a tick (:mod:`shardc.pipeline.ticks`: a DualPipe F&B pair's
    F and B in one row): the microbatch j of the device's chunk c as c x microbatches + j (c is 0 but under
    interleaved, whose ``virtual`` chunks a device hold virtual stages c x stages + stage, and zbv, dualpipev and
    dualpipe, whose two are virtual stages s and 2 stages - 1 - s: :mod:`shardc.lowering.pipeline_routes`)."""
    tables = schedule_tables(schedule, stages, microbatches, virtual)
    return tables["F"], tables["B"]


def weight_ticks(schedule: str, stages: int, microbatches: int) -> list[list[int]] | None:
    """What each stage runs of the weights' gradient (W) at each tick, or -1, under a schedule that
    lowers its backward in two (ZB-H1, ZBV, DualPipe(V): its B table then runs the input's gradient only, and a
    DualPipe whole backward's W sits at its B's tick); None under the others, whose backward runs whole at its B
    tick."""
    return schedule_tables(schedule, stages, microbatches)["W"] if schedule in SPLIT_SCHEDULES else None


def schedule_tables(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> dict[str, list[list[int]]]:
    """The F, B and W tick tables of ``schedule``'s orders found with a chunk's F, B and W one unit each
    (:func:`~shardc.pipeline.ticks.unit_ticks`): a lowered program's for every schedule but zbv, whose
    greedy order the program takes from the cost's simulation at the plan's own times (:func:`run_ticks`)."""
    ticks = unit_ticks(schedule, stages, microbatches, virtual)
    return {kind: ticks.table(kind) for kind in "FBW"}


def run_ticks(plan: Plan, mesh: tuple[tuple[str, int], ...], sizes: dict[str, int], layers: int,
              microbatches: int, split: tuple[int, ...] | None = None, blocks: tuple[int, ...] = ()) -> TickTable:
    """The tick table of the pipelined ``plan`` lowered on ``mesh`` at the whole batch's ``sizes``: the
    simulation ``shardc cost`` steps at those sizes and the plan's chip (:func:`plan_simulation`), so the
    program runs the order the cost times (zbv's greedy order is found at the op times)."""
    pipe = pipeline_of(plan.spec)
    assert pipe is not None
    stages = dict(mesh)[pipe.axis]
    dim = microbatch_dim(plan)
    if sizes[dim] % microbatches:
        raise ShardcError(f"{dim}={sizes[dim]} does not split into {microbatches} microbatches",
                          fix=f"make {dim} a multiple of {microbatches}")
    run = replace(pipe, stages=stages, layers=layers, microbatches=microbatches,
                  split=_stage_layers(pipe, stages, layers, split), blocks=blocks if pipe.blocks else ())
    return tick_table(plan_simulation(plan, run, sizes))


def pipeline_source(plan: Plan, mesh: tuple[tuple[str, int], ...], sizes: dict[str, int],
                    layers: int, microbatches: int, reserved: frozenset[str] = frozenset(),
                    held: tuple[int, ...] | None = None,
                    blocks: tuple[int, ...] | None = None,
                    ticks: TickTable | None = None, fed: tuple[str, ...] = ()) -> tuple[Module, str, int]:
    """The stage module and the pipeline section's constants for ``plan`` pipelined on ``mesh``
    (``sizes`` are the whole batch's; ``blocks``: each ``layers`` block's layers, the first's ``plan``'s;
    ``ticks``: the schedule's tick table, by default :func:`run_ticks`'s for ``plan``; ``fed``: the values
    made before the block that it reads beside its input, :func:`shardc.pipeline.boundary.fed_beside`), and
    the batch size."""
    pipe = pipeline_of(plan.spec)
    assert pipe is not None
    stages = dict(mesh)[pipe.axis]
    held, chunks = _stage_layers(pipe, stages, layers, held), _chunks(pipe)
    first, out = _block(plan, fed)
    dim = microbatch_dim(plan)
    ticks = ticks or run_ticks(plan, mesh, sizes, layers, microbatches, held, blocks or ())
    stage_plan = replace(plan, spec=stage_spec(plan.spec))
    stage_mesh = tuple((n, s) for n, s in mesh if n != pipe.axis)
    micro = lowered_sizes(stage_plan, {**sizes, dim: sizes[dim] // microbatches}, stage_mesh)
    assert micro is not None
    split = split_reductions(stage_plan)  # the weight gradients' reductions: once a step, on the sums
    module = generate(split.each, stage_mesh, micro, title=" (one stage, one microbatch)", reserved=reserved)
    reduce, more = reduce_source(split, stage_mesh, micro, "", reserved)
    module = replace(module, variables=module.variables | more)
    head = module.source.split('\nif __name__ == "__main__":')[0].rstrip() + "\n" + reduce
    w_table = ticks.table("W") if pipe.schedule.name in SPLIT_SCHEDULES else None
    if w_table is not None:  # B and W apart: the block's backward cut in two
        head += split_source(backward_program(split.each), module.backward, module.grads[first.name],
                             frozenset(module.cotangents), beside=tuple(module.grads[n] for n in fed))
    params = [i.name for i in plan.tensors if i.role == "param"]
    f_table, b_table = ticks.table("F"), ticks.table("B")
    text = _HEAD.format(schedule=pipe.schedule.name, axis=pipe.axis)
    text += constants((("PIPELINE_AXIS", pipe.axis, ""), ("STAGES", stages, ""),
                       ("LAYERS", layers, "in all; the first LAYERS % STAGES stages hold one more"),
                       ("BLOCK_LAYERS", blocks or (layers,), "each `layers` block's, in the model's order"),
                       ("MICROBATCHES", microbatches, ""),
                       ("RUN_SIZES", dict(sizes), "the whole batch's dims this run was written for: the tick "
                                                   "tables are the cost's simulation at them"),
                       ("BLOCK_INPUT", first.name, "what a stage receives"), ("BLOCK_OUTPUT", out.name, "and sends"),
                       ("FED", fed, "made before the block, read beside BLOCK_INPUT: the first layer reads stage "
                                    "0's, each later one its input, which the layer's output feeds both"),
                       ("PARAMS", tuple(params), "each passed stacked: [BLOCK_LAYERS[0], ...]"),
                       ("PIPE_MESH_AXES", dict(mesh), ""),
                       ("CHUNKS", chunks, "model chunks a device holds (the interleaved order's virtual stages)"),
                       ("V_SHAPE", pipe.schedule.name in V_SHAPED,
                        "chunk 0 of stage s is virtual stage s, chunk 1 is 2 STAGES - 1 - s (else c STAGES + s)"),
                       ("TWO_WAY", pipe.schedule.name in TWO_WAY_LOWERED,
                        "virtual stage u runs model stage u % STAGES, microbatches j >= MICROBATCHES / 2 the "
                        "second way; the two copies' gradients summed once a step"),
                       ("STAGE_LAYERS", held, "the layers each stage holds (None: the first LAYERS % STAGES "
                                               "one more)"),
                       ("MICROBATCH", (dim, microbatches),
                        "keep_mask: a microbatch draws its slice of the whole batch's mask")))
    text += f"F_TABLE = {_table(f_table)}\nB_TABLE = {_table(b_table)}\n"
    text += "W_TABLE = " + ("None  # each backward whole, at its B tick\n" if w_table is None else
                            f"{_table(w_table)}  # the weights' gradients; B_TABLE's run the input's only\n")
    return module, head + text, micro[dim] * microbatches


def _chunks(pipe: Pipeline) -> int:
    """Chunks a device holds in the lowered program: the schedule's."""
    return pipe.chunks


def _stage_layers(pipe: Pipeline, stages: int, layers: int, held: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The layers each stage holds where given (``held``, or the spec's ``stage_layers`` at its own
    layer and stage counts); None: the even split.  Raises where the layers cannot fill the stages."""
    chunks = _chunks(pipe) if pipe.schedule.name not in TWO_WAY_LOWERED else 1  # DualPipe's: whole stages
    if layers < stages * chunks:
        raise ShardcError(f"{layers} layers cannot fill {stages * chunks} stages ({stages} x {chunks} chunks)",
                          fix=f"use {stages * chunks} layers or more")
    if held is None and pipe.split is not None and layers == pipe.layers and stages == pipe.stages:
        held = pipe.split
    if held is not None and not splits(held, stages, layers):
        raise ShardcError(f"the split {held} is not {layers} layers over {stages} stages",
                          fix="give each stage one layer or more, summing to the layers")
    return held


def _table(rows: list[list[int]]) -> str:
    """A tick table as a tuple literal, one tick a line."""
    return "(\n" + "".join(f"    {tuple(row)!r},\n" for row in rows) + ")"


def _run_blocks(pipe: Pipeline, layers: int, given: tuple[int, ...] | None) -> tuple[int, ...]:
    """Each ``layers`` block's layers in the program: ``given``, else the spec's at its own layer count."""
    counts = given if given is not None else pipe.blocks if layers == pipe.layers else None
    if not pipe.blocks:
        return (layers,)
    if counts is None or len(counts) != len(pipe.blocks) or sum(counts) != layers or min(counts) < 1:
        raise ShardcError(f"{layers} layers do not split into the spec's {len(pipe.blocks)} `layers` blocks as "
                          f"{counts}", fix="give each block one layer or more, summing to the layers")
    return counts


def _block_section(plan: Plan, module: Module) -> str:
    """The pipeline of a block alone: stage 0 reads the microbatches, the last stage returns the outputs."""
    first, out = _block(plan)
    dim = microbatch_dim(plan)
    (cot,) = [name for name, o in module.cotangents.items() if o == out.name]
    dims = {first.name: first.indices.index(dim), out.name: out.indices.index(dim)}
    text = constants((("OUTPUT_COTANGENT", cot, "the cotangent of BLOCK_OUTPUT, given to grad"),
                      ("DATA_DIM", dims, "the batch dim of BLOCK_INPUT and BLOCK_OUTPUT, cut into microbatches")))
    return "\n" + text + pipeline_lines("block_pipeline", "pipeline")


def _zigzag_section(plan: Plan, mesh: tuple[tuple[str, int], ...]) -> str:
    """``SEQUENCE_ZIGZAG`` (each array entering or leaving the pipeline with a sequence dim the plan holds in
    zig-zag order -> its axes) and ``SEQUENCE_CHUNKS`` (2n, a ring of n devices): the order is taken once
    as the data enters, kept through every stage and send, and undone once as the results leave
    (:mod:`shardc.planner.zigzag_order`); empty where the plan holds none."""
    order = sequence_order(plan, dict(mesh))
    if order is None:
        return ("SEQUENCE_ZIGZAG: dict[str, tuple[int, ...]] = {}\n"
                "SEQUENCE_CHUNKS = 0  # the sequence in its own order\n")
    dims, chunks = order
    held: dict[str, tuple[int, ...]] = {}
    made = {g.name for g in plan.grads} | {c.name for c in plan.cotangents}
    grads = {name: grad for name, grad in plan.gradient_names if grad in made}
    for info in plan.tensors:
        axes = tuple(i for i, d in enumerate(info.ref.dims) if d.name in dims)
        if axes and info.role != "param" and (info.role == "input" or info.is_output):
            held[info.name] = axes  # data entering, or a block alone's output
            if info.name in grads:  # an input's gradient, an output's cotangent
                held[grads[info.name]] = axes
    return constants((("SEQUENCE_ZIGZAG", held, "arrays whose sequence axes the pipeline holds in zig-zag order"),
                      ("SEQUENCE_CHUNKS", chunks, f"device i of the ring holds chunks i and {chunks - 1} - i")))


def _ends_text(ends: Ends, mesh: tuple[tuple[str, int], ...], block: Module,
               reserved: frozenset[str]) -> tuple[str, frozenset[str]]:
    """The ends' functions and the whole model's pipeline, at one microbatch's sizes."""
    pipe = pipeline_of(ends.block.spec)
    assert pipe is not None
    stage_mesh = tuple((n, s) for n, s in mesh if n != pipe.axis)
    micro = dict(block.sizes or {})
    dim = microbatch_dim(ends.block)
    incoming = frozenset(c for _, c, _ in ends.tied)  # a tied param's contribution from the last stage
    splits = [split_reductions(ends.pre, incoming), split_reductions(ends.post)]
    if incoming and not incoming <= {p.name for p in splits[0].partials}:
        raise ShardcError("a param or an input read on both ends of the pipelined block lowers only where its "
                          "gradient's sum runs on the sums over the microbatches (its steps are moves and sums)",
                          ends.block.spec.span_of("layers"), fix="read it once on each side of the block")
    modules = [generate(split.each, stage_mesh, micro, reserved=reserved) for split in splits]
    reduce = ""
    if pipe.schedule.name in SPLIT_SCHEDULES:  # the head's backward in two, as the block's (before it: all W)
        post, out = modules[1], boundary_tensor(ends.blocks[-1]).name
        reduce = split_source(backward_program(splits[1].each), post.backward, post.grads[out],
                              frozenset(post.cotangents), "POST", tuple(post.grads[n] for n in ends.riders))
    data = {b.key: b.ref.indices.index(dim) for m in modules for b in m.forward.inputs if dim in b.ref.indices}
    variables = modules[0].variables | modules[1].variables
    for split, prefix in zip(splits, ("PRE_", "POST_"), strict=True):
        text, more = reduce_source(split, stage_mesh, micro, prefix, reserved)
        reduce, variables = reduce + text, variables | more
    return ends_source(ends, modules[0], modules[1], data, reduce), variables


def lower_pipeline(plan: Plan, sizes: dict[str, int] | None = None, layers: int | None = None,
                   microbatches: int | None = None, load: bool = True,
                   split: tuple[int, ...] | None = None, blocks: tuple[int, ...] | None = None) -> PipelineLowered:
    """Lower a pipelined plan (``sizes`` may resize the mesh and dims, as for :func:`shardc.lower`);
    ``split``: the layers each stage holds, where ``layers`` is not the spec's (by default the spec's
    ``stage_layers`` at its own layer count, else the even split); ``blocks``: each ``layers`` block's
    layers, where the spec has several and ``layers`` is not theirs."""
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
        ends = cut_parts(plan)
    counts = _run_blocks(pipe, layers, blocks)
    ticks = run_ticks(plan, mesh, full, layers, microbatches, split, counts)  # the cost's order, at these sizes
    reserved: frozenset[str] = frozenset()
    while True:  # no tensor's variable takes a global of the module: written again if one did
        module, source, batch = pipeline_source(ends.block if ends else plan, mesh, full, layers, microbatches,
                                                reserved, split, counts, ticks, ends.fed if ends else ())
        variables = module.variables
        source += _zigzag_section(plan, mesh)  # before the ends' text, which builds the pipeline from the tables
        if ends is not None and ends.more:  # each later block's layer, its functions prefixed B2_, B3_, ...
            text, more = more_blocks_source(ends, mesh, full, microbatches, reserved)
            source, variables = source + text, variables | more
        if ends is not None:
            text, more = _ends_text(ends, mesh, module, reserved)
            source, variables = source + text, variables | more
        else:
            source += _block_section(plan, module)
        defined = defined_names(source)
        if not variables & defined:
            break
        reserved |= defined
    pipe = replace(pipe, layers=layers, microbatches=microbatches, stages=dict(mesh)[pipe.axis])
    lowered = PipelineLowered(plan, pipe, module, source, dict(module.sizes or {}) | dict(mesh), batch, ends=ends,
                              blocks=counts, ticks=ticks)
    if load:
        check_devices(mesh)
        lowered.namespace = load_module(source, plan.spec.filename or "spec")
    return lowered


_HEAD = '''

# ---- pipeline: {schedule} over {axis} ----------------------------------------------
# The SPMD pipeline of JAX's shard_map documentation, in the schedule's order: at tick t stage s
# runs the forward of microbatch F_TABLE[t][s] and the backward of B_TABLE[t][s] (-1: none), each
# layer with the planned forward_local and backward_local, and jax.lax.ppermute hands activations
# to the next stage and cotangents to the one before (shardc.lowering.pipeline_runtime).  Where
# W_TABLE is a table, B_TABLE's ticks run input_backward_local and W_TABLE's weight_backward_local.

from shardc.lowering.pipeline_build import block_pipeline, model_pipeline

'''
