"""What crosses a stage boundary of a pipelined plan: the activation sent on, and the dim microbatches cut.

Costing (:mod:`shardc.costmodel.pipeline_cost`) and lowering (:mod:`shardc.lowering.pipeline_lowering`)
both ask these of a plan; they are questions about the pipeline's structure, answered once here.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from shardc.errors import ShardcError
from shardc.ir.plan import Op, Plan, Step, TensorInfo, model_dims
from shardc.ir.spec import Spec, Statement, TensorRef
from shardc.spec.walk import block_feeds, leaves

__all__ = ["microbatch_dim", "batch_dim", "boundary_tensor", "boundary_of", "batch_axes", "splits", "send_bytes",
           "check_microbatches", "check_lowerable", "shared_inputs", "fed_beside", "handed_beside", "riders",
           "carried_refs", "check_riders", "rider_sums", "rider_contributions", "gradient_reductions",
           "tied_contributions", "carried_moves"]


def _block_input(spec: Spec, tensors: tuple[TensorInfo, ...]) -> TensorRef | None:
    """What a stage receives: the ``layers`` block's first activation input (the first input without one).

    A block that reads no activation made before it (its layers start from an input, ``X0[B, D]``, or it opens
    the spec and reads the spec's input itself) takes its first input's batch dim all the same; the lowering
    then refuses such a block, saying why (:func:`check_lowerable`)."""
    if spec.block is None:
        return next((i.ref for i in tensors if i.role == "input"), None)
    lo, hi = spec.block
    made = {s.result.name for s in spec.statements[lo:hi]}
    kinds = {i.name: i.role for i in tensors}
    reads = [r for s in spec.statements[lo:hi] for r in leaves(s.expr) if r.name not in made]
    carried = spec.statements[lo - 1].result.name if lo else None  # PRE_RESULT, before any value fed beside it
    return next((r for r in reads if r.name == carried), None) or next(
        (r for role in ("activation", "input") for r in reads if kinds.get(r.name) == role), None)


def microbatch_dim(plan: Plan) -> str:
    """The dim microbatches cut: the first dim of the block's first input that no param has."""
    return batch_dim(plan.spec, plan.tensors)


def batch_dim(spec: Spec, tensors: tuple[TensorInfo, ...]) -> str:
    """:func:`microbatch_dim` of a spec whose tensors (their roles) are ``tensors``, before it is planned."""
    model = model_dims(tensors)
    first = _block_input(spec, tensors)
    for ref in [first] if first is not None else []:
        for dim in ref.dims:
            if dim.name not in model:
                return dim.name
    raise ShardcError("a pipeline needs a batch dim to cut into microbatches; every input dim is a param's",
                      spec.span_of("layers") or (axis.span if (axis := spec.mesh.pipeline_axis) else None),
                      fix="give the block's input a batch dim such as B")


def boundary_tensor(plan: Plan) -> TensorRef:
    """The activation a stage sends the next: the block's last output shaped like its first input (the one that
    feeds it, :func:`shardc.spec.walk.block_feeds`; a result no statement reads before it, a layer's dead end,
    is not sent)."""
    return boundary_of(plan.spec, plan.tensors)


def boundary_of(spec: Spec, tensors: tuple[TensorInfo, ...]) -> TensorRef:
    """:func:`boundary_tensor` of a spec whose tensors (their roles) are ``tensors``, before it is planned."""
    first = _block_input(spec, tensors)
    if spec.block is not None:
        lo, hi = spec.block
        outputs = [s.result for s in spec.statements[lo:hi]]
    else:
        outputs = [i.ref for i in tensors if i.is_output]
    for ref in reversed(outputs):
        if first is not None and sorted(ref.indices) == sorted(first.indices):
            return ref
    if not outputs:
        raise ShardcError("the pipelined block has no output to send to the next stage")
    return outputs[-1]


def batch_axes(spec: Spec, tensors: tuple[TensorInfo, ...]) -> tuple[str, tuple[str, ...]]:
    """The dim microbatches cut and the mesh axes that shard it where a stage sends it on: the data-parallel
    axes, whose devices each cut their own share into the microbatches."""
    dim = batch_dim(spec, tensors)
    return dim, next((d.axes for d in boundary_of(spec, tensors).dims if d.name == dim), ())


def send_bytes(plan: Plan, name: str) -> tuple[int, int]:
    """Bytes an element of the boundary ``name`` takes each way: the activation on in its own type, its
    gradient back in the gradient's (a ``dtype f8`` boundary's in the storage type:
    :func:`shardc.ir.precision.gradient_dtype`)."""
    return plan.nbytes(name), plan.nbytes(dict(plan.gradient_names).get(name, name))


def check_microbatches(plan: Plan, microbatches: int, sizes: dict[str, int]) -> str:
    """The microbatch dim, once its size (when ``sizes`` has one) splits into ``microbatches``.

    ``shardc plan``, ``lower`` and ``verify`` check the spec's own sizes so, as ``cost`` does.
    """
    dim = microbatch_dim(plan)
    if dim in sizes and sizes[dim] % microbatches:
        raise ShardcError(f"{dim}={sizes[dim]} does not split into {microbatches} microbatches",
                          plan.spec.span_of("microbatches"), fix=f"make {dim} a multiple of the microbatches")
    if dim in sizes:
        _check_local_microbatch(plan, dim, microbatches, sizes)
    return dim


def _check_local_microbatch(plan: Plan, dim: str, microbatches: int, sizes: dict[str, int]) -> None:
    """Each device cuts its own share of the batch into the microbatches (Megatron-LM's micro-batch size is a
    data-parallel rank's): a microbatch its devices do not divide would have a device run part of a sequence."""
    _, axes = batch_axes(plan.spec, plan.tensors)
    devices = math.prod(sizes.get(a, plan.spec.mesh.axis(a).size) for a in axes)
    local, each = sizes[dim] // devices, sizes[dim] // microbatches
    if splits(sizes[dim], microbatches, devices):
        return
    fits = [m for m in range(1, local + 1) if local % m == 0]
    raise ShardcError(f"{dim}={sizes[dim]} in {microbatches} microbatches is {each} a microbatch, which its "
                      f"{devices} devices ({', '.join(axes)}) do not divide: a device would run {each / devices:g} "
                      "of one", plan.spec.span_of("microbatches"),
                      fix=f"cut each device's {local} into whole microbatches: microbatches "
                          f"{', '.join(map(str, fits))}, or a larger {dim}")


def splits(batch: int, microbatches: int, devices: int) -> bool:
    """Whether ``batch`` cuts into ``microbatches`` that its data-parallel ``devices`` each run whole: each device
    cuts its own share (a batch its devices do not divide is padded whole, :mod:`shardc.planner.padding`)."""
    return batch % microbatches == 0 and (batch % devices != 0 or (batch // microbatches) % devices == 0)


def shared_inputs(plan: Plan) -> frozenset[str]:
    """The inputs the ``layers`` block reads without the microbatch dim (BLOOM's ALiBi bias [N, T]): the same
    for every microbatch and layer, so every stage holds one copy whole, as a param is held (Megatron-
    DeepSpeed's stages each build BLOOM's ALiBi tensor; the lowered pipeline passes it to every stage)."""
    spec = plan.spec
    if spec.mesh.pipeline_axis is None or spec.block is None:
        return frozenset()
    inputs = {i.name for i in plan.tensors if i.role == "input"}
    lo, hi = spec.block
    batch = microbatch_dim(plan)
    return frozenset(r.name for s in spec.statements[lo:hi] for r in leaves(s.expr)
                     if r.name in inputs and batch not in r.indices)


def check_lowerable(plan: Plan) -> None:
    """Refuse a pipelined plan that reads an input its lowered pipeline has no way to feed.

    A stage receives one activation from the previous stage (the block's input, or with
    `layers` alone the spec's first input) and holds its own params.  The statements before
    the `layers { }` blocks run on the first stage, those after them on the last
    (:class:`shardc.lowering.pipeline_parts.ModelEnds`), which read any input: one with the
    batch dim (token ids, targets, a mask) cut into the microbatches, one without it (a
    position table, an output bias) whole, as that end's params.  In a block, an input
    without the batch dim, the same for every microbatch (BLOOM's ALiBi bias [N, T]), every
    stage holds whole (:attr:`shardc.lowering.pipeline_runtime.Pipeline.shared`); one with it
    would be a different tensor for every microbatch on every stage, which neither the
    lowering nor the reference defines.
    """
    spec = plan.spec
    if spec.mesh.pipeline_axis is None:
        return
    _check_one_carried(spec, spec.mesh.pipeline_axis.name)
    check_riders(plan)
    inputs = [i.name for i in plan.tensors if i.role == "input"]
    blocks = [(lo, hi) for lo, hi, _ in spec.blocks()] or [(0, len(spec.statements))]
    batch = microbatch_dim(plan)
    graded = {g.name for g in plan.grads}
    for k, statement in enumerate(spec.statements):
        if not any(lo <= k < hi for lo, hi in blocks):
            _check_end_data(plan, statement, batch, graded)  # an end's inputs: the end stage's (PRE_DATA, ...)
            continue
        fed = {inputs[0]} if inputs and spec.block is None else set()
        for ref in leaves(statement.expr):
            # in a block, an input without the batch dim is held whole by every stage (shared_inputs)
            whole = spec.block is not None and batch not in ref.indices
            if ref.name in inputs and ref.name not in fed and not whole:
                what = f"an input with the batch dim {batch}" if batch in ref.indices else "an input"
                drop = f", drop its dim {batch} where every sequence shares it" if spec.block else ""
                raise ShardcError(f"the pipelined block reads {ref.name}, {what}; a pipelined stage receives only "
                                  "the previous stage's activation (and, in a `layers { }` block, inputs without "
                                  "the batch dim, held whole)", ref.span,
                                  fix=f"compute {ref.name} from the block's input{drop}, or make {ref.name} a param "
                                      "(declared with `param`)")


def _check_end_data(plan: Plan, statement: Statement, batch: str, graded: set[str]) -> None:
    """An end's input with the batch dim is data cut into the microbatches (token ids, a mask): the pipeline
    returns no gradient of it (each microbatch's would be a slice of it, on the stage that made it)."""
    inputs = {i.name for i in plan.tensors if i.role == "input"}
    for ref in leaves(statement.expr):
        if ref.name in inputs and batch in ref.indices and plan.grad_name(ref.name) in graded:
            raise ShardcError(f"the statements around the pipelined block read {ref.name}, an input with the batch "
                              f"dim {batch} that gets a gradient; the pipeline cuts it into the microbatches as data "
                              "and returns no gradient of it", ref.span,
                              fix=f"declare {ref.name} `const`: data such as a mask or token ids needs no gradient")


class _FirstBlock(NamedTuple):
    """The first ``layers`` block of a spec with statements before it, as its stages read what those make."""

    lo: int  # its first statement
    hi: int  # past its last
    carried: str  # the value made last before it: what stage 0 hands on
    before: frozenset[str]  # every value made before it
    feeds: dict[str, TensorRef | None]  # each activation input with the output feeding it (walk.block_feeds)


def _first_block(spec: Spec) -> _FirstBlock | None:
    """The spec's first ``layers`` block as :class:`_FirstBlock`; None where no statement comes before it."""
    blocks = spec.blocks()
    if not blocks or blocks[0][0] == 0:
        return None
    lo, hi, _ = blocks[0]
    return _FirstBlock(lo, hi, spec.statements[lo - 1].result.name,
                       frozenset(s.result.name for s in spec.statements[:lo]),
                       {ref.name: out for ref, out in block_feeds(spec, spec.statements[lo:hi])})


def fed_beside(spec: Spec) -> tuple[str, ...]:
    """The values made before the first ``layers`` block that it reads beside the one its stages hand on
    (``E`` beside the carried ``X0``) and feeds from the same output (:func:`shardc.spec.walk.block_feeds`):
    past the first layer each is the carried value, so no stage sends it; the first layer, on stage 0,
    reads the one made before the block there (:attr:`shardc.lowering.pipeline_runtime.Pipeline.fed`)."""
    first = _first_block(spec)
    by = None if first is None else first.feeds.get(first.carried)
    if first is None or by is None:
        return ()
    return tuple(n for n, out in first.feeds.items() if n in first.before and n != first.carried and out == by)


def riders(spec: Spec) -> tuple[str, ...]:
    """The values made before the ``layers`` blocks that the statements after them read (an embedding's
    output added to the head's input): made on stage 0 each microbatch and read on the last stage, each rides
    with the activation every stage hands on (one send a hop, the two laid end to end), and its gradient with
    the activation's back (:attr:`shardc.lowering.pipeline_runtime.Pipeline.riders`)."""
    blocks = spec.blocks()
    if not blocks or blocks[0][0] == 0:
        return ()
    lo, hi = blocks[0][0], blocks[-1][1]
    made = [s.result.name for s in spec.statements[:lo]]
    read = {r.name for s in spec.statements[hi:] for r in leaves(s.expr)}
    return tuple(n for n in made if n in read)


def handed_beside(spec: Spec) -> tuple[str, ...]:
    """The values made before the first ``layers`` block that it reads fed by another output than the carried
    value's (``E`` fed by ``G`` where ``X0`` is by ``X1``): a second value each layer hands the next, so each
    hop between stages would send it beside the activation (and its gradient back).  The lowering refuses it
    (:func:`_check_one_carried`); the cost charges its send (:func:`carried_refs`)."""
    first = _first_block(spec)
    by = None if first is None else first.feeds.get(first.carried)
    if first is None or by is None:
        return ()
    return tuple(n for n, out in first.feeds.items()
                 if n in first.before and n != first.carried and out is not None and out != by)


def carried_refs(plan: Plan) -> tuple[TensorRef, ...]:
    """What one send between stages carries, each a microbatch's shard: the activation the stages hand on
    (:func:`boundary_tensor`) and the values riding with it (:func:`riders`), in the boundary's type; the cost
    charges their elements together (``p2p_bytes``), the lowered program sends them as one array.  A value
    the block hands on beside its activation (:func:`handed_beside`, which the lowering refuses) is sent each
    hop too, and charged so."""
    ride = set(riders(plan.spec)) | set(handed_beside(plan.spec))
    return (boundary_tensor(plan), *(i.ref for i in plan.tensors if i.name in ride))


def rider_sums(plan: Plan) -> dict[str, Step]:
    """Each value riding to the last stage that the block reads too, as its input (``X0`` read by the head),
    with the step before the block summing its gradient's two contributions, the head's and the block's
    (``dX0 = dX0_1 + dX0_layer``): the head's comes back from the last stage with the activation's gradient,
    as a rider's does, and stage 0 adds the two where that step does (the statements before the block take
    the sum as their cotangent: :meth:`shardc.lowering.pipeline_parts.Part.backward`)."""
    spec, blocks = plan.spec, plan.spec.blocks()
    if not blocks or blocks[0][0] == 0 or plan.sections is None:
        return {}
    carried = spec.statements[blocks[0][0] - 1].result.name
    head = {s.dst.name for s in plan.section("after").backward}
    inner = {s.dst.name for s in plan.section("block").backward}
    out = {}
    for name in (n for n in riders(spec) if n == carried):
        step = next((s for s in plan.section("before").backward if s.dst.name == plan.grad_name(name)), None)
        if (step is not None and step.op is Op.ELEMENTWISE and len(step.operands) == 2
                and sorted(r.name in head for r in step.operands) == [False, True]
                and all(r.name in head | inner for r in step.operands)):
            out[name] = step
    return out


def rider_contributions(plan: Plan, section: str) -> tuple[tuple[str, TensorRef], ...]:
    """Each of :func:`rider_sums`' values with the contribution to its gradient that ``section`` ("after": the
    head's, which the last stage hands back as that rider's gradient; "block": the block's, its input's
    gradient as the stages hand it back) makes: the sum's operand made there."""
    if plan.sections is None:
        return ()
    made = {s.dst.name for s in plan.section(section).backward}
    return tuple((name, next(r for r in step.operands if r.name in made)) for name, step in rider_sums(plan).items())


def check_riders(plan: Plan) -> None:
    """A value riding to the last stage (:func:`riders`) that the block reads too gets its gradient in two
    contributions, the block's and the head's: the block's input (:func:`rider_sums`) has them handed back
    apart, the head's with the activation's gradient; another (``E`` fed beside the block's input) is refused
    at its read after the block."""
    spec, blocks = plan.spec, plan.spec.blocks()
    if not blocks or blocks[0][0] == 0:
        return
    lo, hi = blocks[0][0], blocks[-1][1]
    inside = {r.name for s in spec.statements[lo:hi] for r in leaves(s.expr)}
    summed = rider_sums(plan)
    for name in (n for n in riders(spec) if n in inside and n not in summed):
        read = next(r for s in spec.statements[hi:] for r in leaves(s.expr) if r.name == name)
        raise ShardcError(f"{name} is made before the pipelined block and read both in it and after it: its "
                          "gradient is two contributions, the block's and the head's, which the lowered stages "
                          "hand back apart only for the block's input", read.span,
                          fix=f"read after the block a value made before it that the block does not read (make "
                              f"{name}'s statement twice, one for the block and one for the head), or compute it "
                              "after the block")


def _check_one_carried(spec: Spec, axis: str) -> None:
    """A ``layers`` block reads one value made before it: the one its stages hand on (into the first block the
    last statement's before it, ``PRE_RESULT``; into a later one the block before's output), and beside it
    those the spec feeds from the same output (:func:`fed_beside`).  A value fed from another output (``E``
    fed by ``G``, where ``X0`` is by ``X1``: :func:`handed_beside`) is a second value each layer hands the
    next: a second value each hop sends, which ``shardc cost`` charges (:func:`carried_refs`) and the lowered
    stages do not make.
    A later block's read of an earlier block's inner value is the spec's own check's
    (:func:`shardc.spec.stages.check_pipeline`)."""
    first = _first_block(spec)
    if first is None:
        return
    before, carried, feeds = first.before, first.carried, first.feeds
    reads = [r for s in spec.statements[first.lo:first.hi] for r in leaves(s.expr)]
    given = next((r for r in reads if r.name in before), None)
    if given is not None and carried not in {r.name for r in reads}:  # stage 0 hands on the value made last
        raise ShardcError(f"the statement just before the pipelined block makes {carried}, which the block does "
                          f"not read: stage 0 hands the block the value made last before it", given.span,
                          fix=f"make {carried} before {given.name}, so that {given.name} is made last before the "
                              "block")
    beside = set(fed_beside(spec))
    for j, (lo, hi, _) in enumerate(spec.blocks()):
        for ref in (r for s in spec.statements[lo:hi] for r in leaves(s.expr)):
            if ref.name in before and (j > 0 or ref.name not in beside | {carried}):
                fed, by = feeds.get(ref.name), feeds.get(carried)
                why = (f"the block feeds it from {fed.name}, {carried} from {by.name}: two values each layer "
                       "hands the next, where a stage sends one" if j == 0 and fed is not None and by is not None
                       else "only the block's input reaches a later block")
                raise ShardcError(f"the pipelined block reads {ref.name}, made before the blocks; {why}", ref.span,
                                  fix=f"write {ref.name} with {carried}'s indices and sharding, so that the "
                                      f"layer's output feeds both (the first layer reads the {ref.name} made "
                                      f"before the block, each later one the layer's output), or compute "
                                      f"{ref.name} inside the block from {carried}, or drop the `pipeline` mark "
                                      f"from {axis}")


def gradient_reductions(plan: Plan) -> frozenset[int]:
    """The backward steps that reduce a param's gradient over the batch (an AllReduce or ReduceScatter of
    it): a sum over the batch, so linear in it.  Under a pipeline Megatron-LM, DeepSpeed and torchtitan
    accumulate each microbatch's partial gradient locally and run these once a step, on the sum."""
    grads = {plan.grad_name(i.name) for i in plan.tensors if i.role == "param"}
    return frozenset(k for k, s in enumerate(plan.backward)
                     if s.tensor in grads and s.op in (Op.ALL_REDUCE, Op.REDUCE_SCATTER))


def tied_contributions(plan: Plan) -> tuple[tuple[str, TensorRef], ...]:
    """Each param read both before and after the ``layers`` block (an embedding tied to the output
    layer), with the contribution to its gradient the backward after the block makes: the value the
    backward before it reads from there, in the step summing the two.  Megatron-LM holds such a param
    on the first and the last stage and sums the two contributions over them once a step.  An input
    without the batch dim read on both ends and given a gradient (a position table not ``const``) is
    held and summed so too: its gradient is the same sum of two contributions, one on each end."""
    spec = plan.spec
    if spec.block is None or plan.sections is None:
        return ()
    lo, hi = spec.block

    def names(lo: int, hi: int) -> set[str]:
        return {r.name for s in spec.statements[lo:hi] for r in leaves(s.expr)}

    graded = {g.name for g in plan.grads}  # a `const` input has no gradient to sum: each end reads it alone
    params = {k for k in _held_on_both(plan) if plan.grad_name(k) in graded}
    made = {s.dst.name: s.dst for s in plan.section("after").backward}
    back = plan.section("before").backward
    out = []
    for param in sorted(names(0, lo) & names(hi, len(spec.statements)) & params):
        found = {r.name for s in back if s.dst.name == plan.grad_name(param) for r in s.operands if r.name in made}
        if len(found) != 1:
            raise ShardcError(f"{param} is read on both ends of the pipelined block, but the plan sums its "
                              "gradient's two contributions in no one step", spec.span_of("layers"),
                              fix="read it once on each side of the block")
        out.append((param, made[found.pop()]))
    return tuple(out)


def carried_moves(plan: Plan) -> tuple[Step, ...]:
    """The moves of a param before the block whose results the statements after it read (a tied
    embedding's gathered table): the plan makes such a value once, but under a pipeline the first
    stage makes it and the last stage reads it, so the last stage runs these moves again."""
    if plan.spec.block is None or plan.sections is None:
        return ()
    after = plan.section("after")
    made: set[TensorRef] = set()
    wanted: set[TensorRef] = set()  # what a step after the block reads before a step there makes it
    for s in after.forward + after.recomputed + after.backward:
        wanted |= {r for r in (*s.operands, *((s.src,) if s.src else ())) if r not in made}
        made.add(s.dst)
    have = {i.ref for i in plan.tensors if i.role == "param"}
    chain: list[tuple[Step, TensorRef]] = []
    for step in plan.section("before").forward:
        if step.src is not None and step.src in have and (step.is_collective or step.op is Op.SLICE):
            chain.append((step, step.src))
            have.add(step.dst)
    needed = {r for r in wanted if r in have}
    out: list[Step] = []
    for step, src in reversed(chain):  # what the wanted values are made from, in order
        if step.dst in needed:
            out.insert(0, step)
            needed.add(src)
    return tuple(out)


def _held_on_both(plan: Plan) -> frozenset[str]:
    """The params and the inputs without the batch dim a pipelined model's two ends may both read: each
    held by the first and the last stage alike (a tied embedding, a position table)."""
    batch = microbatch_dim(plan)
    return frozenset(i.name for i in plan.tensors if i.role == "param" or (
        i.role == "input" and batch not in i.ref.indices))
