"""Lowering a pipelined ``layers L { ... }`` block with the statements around it.

Megatron-LM places the embedding on the first pipeline stage and the final norm,
output layer and loss on the last.  The planner cuts the whole model's plan in three
sections (:attr:`shardc.ir.plan.Plan.sections`): the steps of the statements before the
block, the block's (one layer), and those after it.  Each part here is its section's
steps on its part of the spec (:func:`split_spec`; the ends on the stage mesh, the block
with the pipeline axis, as a block alone is pipelined), so the program runs the steps
``shardc cost`` priced, and each part has its own forward and backward functions; the
block's boundaries are its declared shardings, where the sections meet.

The generated module is the block's pipeline module (:mod:`shardc.lowering.pipeline_lowering`)
with the two ends' functions (``pre_forward_local``, ``post_backward_local``, ...) as
the ends of its pipeline (:class:`shardc.lowering.pipeline_parts.ModelEnds`): in the
tick where stage 0 runs a microbatch's forward it first runs the statements before the
block on it, and in the tick where the last stage finishes one it runs those after it,
the loss and their backward (SPMD: every device computes them, masked by its stage
index, as JAX's shard_map pipeline example does).  The ends' params are passed stacked
over the stage axis, only the first (last) stage's copy non-zero, so their gradients
need no reduction over it.

A param read both before and after the block (an embedding tied to the output layer; so too
an input without the batch dim, a position table) is held by both end stages, as Megatron-LM
holds it (Shoeybi et al. 2019; Narayanan et al. 2021): each computes its contribution to the
gradient, and once a step the two stages swap their sums, so both run the plan's sum of the
two and its reduction and hold the same gradient (:attr:`Ends.tied`; the swap is the cost
model's exchange between the first and last stage).

The loss after the block is a ``cross_entropy``: the mean over the tokens, so with
equal microbatches the batch's loss is the mean of the microbatches' losses, and the
cotangent of each is the loss's cotangent over M.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardc.errors import ShardcError
from shardc.ir.plan import Plan, Section, Step, uses_dropout
from shardc.ir.spec import Add, Call, Mesh, Spec, Statement, TensorRef
from shardc.lowering import template
from shardc.lowering.codegen import Module, Phase
from shardc.pipeline.boundary import (
    boundary_tensor,
    carried_moves,
    check_riders,
    fed_beside,
    rider_contributions,
    rider_sums,
    riders,
    tied_contributions,
)
from shardc.spec.stages import block_layers
from shardc.spec.walk import leaves

__all__ = ["Ends", "split_spec", "cut_parts", "ends_source", "constants", "pipeline_lines", "prefixed"]


@dataclass(frozen=True)
class Ends:
    """The three parts of a pipelined block spec, its plan's sections: before the block, the block, after it."""

    pre: Plan
    block: Plan
    post: Plan
    # a param read on both ends: (param, its gradient's contribution made after the block, the gradient)
    tied: tuple[tuple[str, str, str], ...] = ()
    more: tuple[Plan, ...] = ()  # each later `layers` block's part (one layer), in order: the block is the first's
    fed: tuple[str, ...] = ()  # made before the block, read beside its input (boundary.fed_beside)
    riders: tuple[str, ...] = ()  # made before the block, read after it: riding with its activation

    @property
    def blocks(self) -> tuple[Plan, ...]:
        """Every ``layers`` block's part, in order."""
        return (self.block, *self.more)


def _names(statements: tuple[Statement, ...]) -> set[str]:
    return {s.result.name for s in statements} | {r.name for s in statements for r in leaves(s.expr)}


def split_spec(spec: Spec) -> tuple[Spec, tuple[Spec, ...], Spec]:
    """The statements before the blocks, each ``layers`` block (pipelined: one layer of it, the pipeline's
    layers all the blocks') and those after them, each a spec."""
    if spec.block is None:
        raise ShardcError("not a `layers L { ... }` spec", fix="write the repeated statements in a block")
    blocks = spec.blocks()
    lo, hi = blocks[0][0], blocks[-1][1]
    # each block follows the one before it: a pipelined spec's validation refuses a statement between
    # (shardc.spec.stages.check_pipeline)
    layers = sum(block_layers(spec))
    stage_mesh = Mesh(tuple(a for a in spec.mesh.axes if not a.pipeline))

    def part(statements: tuple[Statement, ...], pipelined: bool) -> Spec:
        names = _names(statements)
        params = None if spec.params is None else tuple(p for p in spec.params if p in names)
        return replace(spec, statements=statements, block=None, header_spans=(),
                       params=params, const=tuple(c for c in spec.const if c in names),
                       tensor_dtypes=tuple((t, kind) for t, kind in spec.tensor_dtypes if t in names),
                       gemm_tensors=tuple((t, kind) for t, kind in spec.gemm_tensors if t in names),
                       layers=layers if pipelined else None, more_blocks=(),
                       mesh=spec.mesh if pipelined else stage_mesh,
                       microbatches=spec.microbatches if pipelined else None,
                       schedule=spec.schedule if pipelined else None,
                       topology=spec.topology if pipelined else None)  # one stage's chips: its usual slice

    pre, post = spec.statements[:lo], spec.statements[hi:]
    _check_ends(spec, pre, post)
    return part(pre, False), tuple(part(spec.statements[a:b], True) for a, b, _ in blocks), part(post, False)


def _check_ends(spec: Spec, pre: tuple[Statement, ...], post: tuple[Statement, ...]) -> None:
    """The parts meet only at the block's input and output, and the spec ends in one loss (or a sum of
    losses: a second head's, as DeepSeek-V3's multi-token prediction adds)."""
    fix = ("write the model as an embedding, a `layers` block and a head ending in `Loss[] = "
           "cross_entropy(...)`, each reading only its own params")
    if not pre or not post:
        raise ShardcError("lowering a pipelined block needs statements before and after it", spec.span_of("layers"),
                          fix=fix)
    # a param or an input read on both ends is held by both end stages (a tied embedding, a position table:
    # ModelEnds.stages_of); a value made before the block rides with the activation to the last stage
    # (boundary.riders), laid end to end with it in one array: of its type (boundary.check_riders: cut_parts)
    types, carried = dict(spec.tensor_dtypes), pre[-1].result.name
    for name in riders(spec):
        if types.get(name) != types.get(carried):
            read = next(r for s in post for r in leaves(s.expr) if r.name == name)
            raise ShardcError(f"{name} is made before the pipelined block and read after it, so it rides to the "
                              f"last stage with {carried}, in one array: but its type is not {carried}'s", read.span,
                              fix=f"give {name} and {carried} one type, or compute {name} after the block")
    last = post[-1]
    terms = last.expr.terms if isinstance(last.expr, Add) else (last.expr,)  # several heads' losses summed
    if not all(isinstance(t, Call) and t.func == "cross_entropy" for t in terms) or last.result.dims:
        raise ShardcError("lowering a pipelined block needs the statements after it to end in a "
                          "cross_entropy loss (the microbatches' losses are averaged)", last.span, fix=fix)


def cut_parts(plan: Plan) -> Ends:
    """The three parts of ``plan``, each its section's steps (:meth:`Plan.section`) on its part of the
    spec (:func:`split_spec`): the steps the cost priced, never planned again."""
    pre_spec, block_specs, post_spec = split_spec(plan.spec)
    tied = tied_contributions(plan)
    whole = plan.section("block")
    sections = [_own(whole, b) for b in range(len(block_specs))] if len(block_specs) > 1 else [whole]
    sections.append(plan.section("after"))
    # each block's outputs' cotangents: made by the backward of the part after it
    blocks = [_part(plan, "block", sections[b], spec, (block_specs + (post_spec,))[b + 1], sections[b + 1].backward,
                    tied=rider_contributions(plan, "block") if b == 0 else ())  # its input's, read by the head too
              for b, spec in enumerate(block_specs)]
    check_riders(plan)
    # the block's input read by the head too: its two gradient contributions handed back apart (the head's as a
    # rider's), the statements before the block taking their sum, the plan's step, as their cotangent
    sums = tuple(rider_sums(plan).values())
    before = plan.section("before")
    before = replace(before, backward=tuple(s for s in before.backward if s not in sums))
    pre = _part(plan, "before", before, pre_spec, block_specs[0],
                whole.backward + plan.section("after").backward + sums, riders(plan.spec))
    post = _part(plan, "after", sections[-1], post_spec, None, (), tied=tied + rider_contributions(plan, "after"))
    return Ends(pre, blocks[0], post, tuple((p, c.name, plan.grad_name(p)) for p, c in tied), tuple(blocks[1:]),
                fed_beside(plan.spec), riders(plan.spec))


def _own(section: Section, block: int) -> Section:
    """The steps of ``section`` that repeat in ``layers`` block ``block`` (:attr:`Step.block`)."""
    return Section(*(tuple(s for s in steps if s.block == block)
                     for steps in (section.forward, section.backward, section.recomputed)))


def _made(steps: tuple[Step, ...]) -> dict[str, TensorRef]:
    """Each tensor a run of steps makes, as its last step leaves it."""
    return {s.dst.name: s.dst for s in steps}


def _part(plan: Plan, name: str, section: Section, spec: Spec, following: Spec | None,
          following_backward: tuple[Step, ...], riding: tuple[str, ...] = (),
          tied: tuple[tuple[str, TensorRef], ...] = ()) -> Plan:
    """``section`` of ``plan`` (section ``name``'s steps, or one block's of them) as a plan of its own spec:
    the tensors it makes its activations, those it reads from the part before its inputs; its outputs'
    cotangents the gradients the part after it hands back (``following``, the spec of that part, whose
    backward is ``following_backward``; and those of the values ``riding`` to the last stage, made there),
    its inputs' gradients those it makes (and a ``tied`` param's
    contribution to its gradient, the one this section makes)."""
    if name == "after":  # a param's value the plan moved before the block: the last stage moves it again
        section = replace(section, forward=carried_moves(plan) + section.forward)
    made = _made(section.forward)
    names = _names(spec.statements) | set(made)
    read = {r.name for s in spec.statements for r in leaves(s.expr)}
    outputs = {s.result.name for s in spec.statements if s.result.name not in read}
    # a tensor only moved here (the block's input gathered from its D_Y layout) comes from the part before all
    # the same: an input of this part, not an activation it makes
    computed = {s.dst.name for s in section.forward if s.src is None or s.src.name != s.dst.name}
    tensors = tuple(replace(i, role="input" if i.role == "activation" and i.name not in computed else i.role,
                            is_output=i.name in outputs) for i in plan.tensors if i.name in names)
    entering = {i.name for i in tensors if i.role in ("input", "param")}
    cotangents = [c for c in plan.cotangents if plan.primal(c.name) in outputs]
    if following is not None:  # the gradient of what this section hands on, made by the next one's backward
        after = _made(following_backward)
        for out in sorted(outputs & (_names(following.statements) | set(riding))):
            if plan.grad_name(out) not in after:
                raise ShardcError(f"the plan takes no gradient of {out}, the block's input, since nothing before "
                                  "the block has one; a pipeline's layers need it (each feeds the one before)",
                                  plan.spec.span_of("layers"), fix="make a tensor before the block a param")
            cotangents.append(after[plan.grad_name(out)])
    # each input's gradient this section makes: a param's as the plan hands it out, the section
    # before's output's as this section's backward leaves it
    made_back, final = _made(section.backward), {g.name: g for g in plan.grads}
    wanted = [plan.grad_name(i.name) for i in tensors if i.name in entering]
    grads = tuple(final.get(g, made_back[g]) for g in wanted if g in made_back) + tuple(c for _, c in tied)
    names_of = plan.gradient_names + tuple((p, c.name) for p, c in tied)
    reads = {r for s in section.backward for r in (*s.operands, *((s.src,) if s.src else ()))}
    gone = {a.name for a in plan.spec.mesh.axes} - {a.name for a in spec.mesh.axes}  # an end's: the stage axis
    return replace(plan, spec=spec, forward=section.forward, backward=section.backward,
                   recomputed=section.recomputed, optimizer=(), sections=None, choices=(), tensors=tensors,
                   residuals=tuple(r for r in plan.residuals if r.name in made and r in reads),
                   cotangents=tuple(cotangents), grads=grads, gradient_names=names_of,
                   sizes=None if plan.sizes is None else tuple((k, v) for k, v in plan.sizes if k not in gone))


def prefixed(module: Module, prefix: str, keyed: bool = False) -> str:
    """One end's boundary tables and functions, each name prefixed (``PRE_FORWARD_IN``, ``pre_forward_local``);
    ``keyed``: its forward draws dropout masks, so it takes the dropout key (``PRE_KEYED``)."""
    text = ""
    for phase, key in ((module.forward, "FORWARD"), (module.backward, "BACKWARD")):
        named = Phase(f"{prefix.lower()}_{phase.name}", phase.inputs, phase.outputs, phase.body)
        text += template.specs(f"{prefix}_{key}_IN", phase.inputs) + template.specs(f"{prefix}_{key}_OUT",
                                                                                   phase.outputs)
        text += "\n\n" + template.function(named, keyed and phase is module.forward) + "\n\n"
    text += f"{prefix}_COTANGENTS = {module.cotangents!r}\n{prefix}_GRADS = {module.grads!r}\n"
    return text + (f"{prefix}_KEYED = True  # its forward takes the dropout key\n" if keyed else "")


def ends_source(ends: Ends, pre: Module, post: Module, data_dims: dict[str, int], reduce: str = "") -> str:
    """The ends' section of the pipeline module: their functions and tables (``reduce``: their gradients'
    once-a-step reductions, :mod:`shardc.lowering.pipeline_grads`), and the pipeline over the whole model
    (:func:`~shardc.lowering.pipeline_build.model_pipeline` builds it from them)."""
    pre_params = tuple(i.name for i in ends.pre.tensors if i.role == "param")
    post_params = tuple(i.name for i in ends.post.tensors if i.role == "param")
    pre_in = [b.key for b in pre.forward.inputs if b.key not in pre_params]
    post_in = [b.key for b in post.forward.inputs if b.key not in post_params and b.key != _block_output(ends)
               and b.key not in ends.riders]  # a rider comes with the block's output
    # an input without the batch dim (a position table, a bias) is every microbatch's: held whole, not cut
    (pre_data, pre_whole), (post_data, post_whole) = ((tuple(k for k in given if k in data_dims),
                                                       tuple(k for k in given if k not in data_dims))
                                                      for given in (pre_in, post_in))
    text = "\n\n# ---- the block's ends: the statements before it on stage 0, after it on the last " + "-" * 4
    text += ("\n\n" + prefixed(pre, "PRE", uses_dropout(ends.pre.forward)) + "\n"
             + prefixed(post, "POST", uses_dropout(ends.post.forward)) + reduce + "\n")
    text += constants((("PRE_PARAMS", pre_params, "passed stacked over the stages: [STAGES, ...]"),
                       ("POST_PARAMS", post_params, "so too"),
                       ("PRE_DATA", pre_data, "cut into microbatches, stacked over the stages"),
                       ("POST_DATA", post_data, "so too"),
                       ("PRE_WHOLE", pre_whole, "inputs without the batch dim: whole on stage 0, as a param"),
                       ("POST_WHOLE", post_whole, "so too, on the last stage"),
                       ("DATA_DIM", data_dims, "the microbatch dim of each"),
                       ("PRE_RESULT", ends.pre.spec.statements[-1].result.name, "stage 0's output"),
                       ("RIDERS", ends.riders, "made on stage 0, read on the last: each sent with the activation, "
                                               "laid end to end with it, and its gradient with the activation's"),
                       ("LOSS", ends.post.spec.statements[-1].result.name, "the loss (a mean over the tokens)"),
                       ("TIED", {p: c for p, c, _ in ends.tied},
                        "a param (or an input without the batch dim) held by both end stages: its contribution "
                        "made on the last")))
    return text + pipeline_lines("model_pipeline", "model")


def constants(rows: tuple[tuple[str, object, str], ...]) -> str:
    """Module constants, one a line: ``NAME = value  # comment`` (a value's ``repr`` is its literal)."""
    return "".join(f"{name} = {value!r}" + (f"  {template.comment(note)}" if note else "") + "\n"
                   for name, value, note in rows)


def pipeline_lines(builder: str, prefix: str) -> str:
    """The module's pipeline, built by ``builder`` (:mod:`shardc.lowering.pipeline_build`) from the
    module's tables, and its two entry points (``{prefix}_forward``, ``{prefix}_grad``)."""
    return (f"\nPIPELINE = {builder}(globals())  # shardc.lowering.pipeline_build.{builder}: the tables above\n"
            f"{prefix}_forward, {prefix}_grad = PIPELINE.outputs, PIPELINE.gradients\n")


def _block_output(ends: Ends) -> str:
    return boundary_tensor(ends.blocks[-1]).name  # the last block's output: what the statements after read
