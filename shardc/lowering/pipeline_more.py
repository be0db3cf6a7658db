"""A pipelined module's later ``layers`` blocks: each block's layer as functions of its own.

A spec of several ``layers`` blocks (DeepSeek-V3's 3 dense layers, then 58 MoE layers) pipelines
the model's layers in order, so a stage may hold layers of two blocks
(:mod:`shardc.pipeline.block_split`).  The first block's layer is the module's ``forward_local``
and ``backward_local``, as for one block; block b's (b = 2, 3, ...) is its section of the whole
model's plan (:func:`shardc.lowering.pipeline_ends.cut_parts`: the steps ``shardc cost`` priced),
generated at one microbatch's sizes with its names prefixed (``b2_forward_local``,
``B2_FORWARD_IN``, ``b2_reduce_local``, ...).  ``MORE_BLOCKS`` names each block's prefix, input,
output and params, the module's ``BLOCK_LAYERS`` every block's layers; the program runs each slot's
layer with its block's functions (:mod:`shardc.lowering.pipeline_bodies`).  Every block hands the
next the same activation: its input and output are laid out as the first block's input.
"""

from __future__ import annotations

from dataclasses import replace

from shardc.errors import ShardcError
from shardc.ir.plan import Plan, backward_program, uses_dropout
from shardc.lowering.codegen import generate
from shardc.lowering.load import lowered_sizes
from shardc.lowering.pipeline_ends import Ends, constants, prefixed
from shardc.lowering.pipeline_grads import reduce_source, split_reductions
from shardc.lowering.pipeline_split import split_source
from shardc.pipeline.boundary import boundary_tensor, microbatch_dim
from shardc.pipeline.schedules import ZERO_BUBBLE
from shardc.spec.stages import pipeline_of, stage_spec

__all__ = ["more_blocks_source"]


def _boundary(plan: Plan, first: Plan, number: int) -> tuple[str, str]:
    """Block ``number``'s input and output, once both are laid out as the first block's input."""
    given = next((i.ref for i in first.tensors if i.role == "input"), None)
    mine = next((i.ref for i in plan.tensors if i.role == "input"), None)
    out = boundary_tensor(plan)
    if given is None or mine is None or {mine.dims, out.dims} != {given.dims} or mine.unreduced or out.unreduced:
        raise ShardcError(f"`layers` block {number} hands on {out} from {mine}: a pipeline's stages pass one "
                          f"activation, laid out as the first block's input {given}",
                          plan.spec.span_of("layers"), fix="declare each block's input and output with one sharding")
    return mine.name, out.name


def more_blocks_source(ends: Ends, mesh: tuple[tuple[str, int], ...],
                       sizes: dict[str, int], microbatches: int,
                       reserved: frozenset[str]) -> tuple[str, frozenset[str]]:
    """The later blocks' functions and tables at one microbatch's sizes (``sizes`` the whole batch's), and
    the variables their functions name."""
    pipe = pipeline_of(ends.block.spec)
    assert pipe is not None
    stage_mesh = tuple((n, s) for n, s in mesh if n != pipe.axis)
    dim = microbatch_dim(ends.block)
    text, variables, rows = "\n\n# ---- the later `layers` blocks: each one layer's functions " + "-" * 20 + "\n\n", \
        frozenset[str](), []
    for number, plan in enumerate(ends.more, start=2):
        prefix = f"B{number}"
        name, out = _boundary(plan, ends.block, number)
        stage_plan = replace(plan, spec=stage_spec(plan.spec))
        micro = lowered_sizes(stage_plan, {**sizes, dim: sizes[dim] // microbatches}, stage_mesh)
        split = split_reductions(stage_plan)
        module = generate(split.each, stage_mesh, micro, reserved=reserved)
        # a dropout's layer draws under its model-wide layer number's key (the runtime's layer_key counts
        # every block's layers), so block b's masks differ from block 1's by layer as well as by salt
        text += prefixed(module, prefix, uses_dropout(plan.forward))
        if pipe.schedule.name in ZERO_BUBBLE:  # B and W apart, as the first block's
            text += split_source(backward_program(split.each), module.backward, module.grads[name],
                                 frozenset(module.cotangents), prefix)
        reduce, more = reduce_source(split, stage_mesh, micro or {}, prefix + "_", reserved)
        text, variables = text + reduce, variables | module.variables | more
        params = tuple(i.name for i in plan.tensors if i.role == "param")
        rows.append({"prefix": prefix, "input": name, "output": out, "params": params})
    text += constants((("MORE_BLOCKS", tuple(rows), "each later block: its functions' prefix, its input and "
                                                    "output, its params (stacked [its layers, ...])"),))
    return text, variables
