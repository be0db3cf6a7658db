"""A pipelined spec: its stage axis, the split of the repeated block's layers, the stage's own spec.

The block repeated ``layers L`` times is cut into P stages (P the size of the axis
marked ``pipeline``) of L/P consecutive layers (the statements before a ``layers L
{ ... }`` block run on the first stage, those after it on the last, as Megatron-LM
places them); an uneven split puts the extra layers on the first stages, and is
stated.  A spec with several ``layers`` blocks is cut the same way over its layers in
order, every layer of the first block, then the next block's (DeepSeek-V3's 3 dense layers
then its 58 MoE layers, 61 in all): a stage may hold layers of two blocks
(:mod:`shardc.pipeline.block_split` says which).  Inside a stage the plan uses the other
axes only: :func:`stage_spec` is the spec with the stage axis removed, which the planner
plans as it would any spec.
``interleaved V`` and ``zbv`` cut each stage into V (zbv: 2) chunks of layers: chunk c
of the model sits on device c mod P (interleaved) or on device c, then back, for
c >= P (zbv's V shape).  ``dualpipe`` (DeepSeek-V3's) keeps the P stages whole and puts
two on each device, stage d and stage P-1-d (microbatches enter from both ends).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from shardc.errors import ShardcError
from shardc.ir.spec import Add, Contract, Mesh, Schedule, Spec, Statement, TensorRef
from shardc.spec.walk import block_feeds, leaves

__all__ = ["check_dualpipe", "Pipeline", "pipeline_of", "check_pipeline", "stage_spec", "pipeline_note", "layer_count",
           "block_layers", "split_layers", "splits", "DEFAULT_SCHEDULE"]

DEFAULT_SCHEDULE = Schedule("1f1b")


@dataclass(frozen=True)
class Pipeline:
    """The pipeline of a spec: P stages, M microbatches, a schedule, the layers of each stage."""

    axis: str
    stages: int
    microbatches: int
    schedule: Schedule
    layers: int  # every block's layers, in all
    microbatches_given: bool = True
    split: tuple[int, ...] | None = None  # `stage_layers`: the layers of each stage, where given
    blocks: tuple[int, ...] = ()  # each `layers` block's count, in order, where the spec has several

    @property
    def chunks(self) -> int:
        """Layer chunks a device holds: V for interleaved, 2 for zbv, dualpipev and dualpipe (two whole stages),
        else 1."""
        two = {"zbv", "dualpipe", "dualpipev"}
        return self.schedule.virtual if self.schedule.name == "interleaved" else 2 if self.schedule.name in two else 1

    @property
    def cuts(self) -> int:
        """Runs of layers a stage is cut into: its chunks, except DualPipe's, which are whole stages."""
        return 1 if self.schedule.name == "dualpipe" else self.chunks

    @property
    def stage_layers(self) -> tuple[int, ...]:
        """Layers on each stage: the spec's ``stage_layers``, else :func:`split_layers`'s."""
        return self.split if self.split is not None else split_layers(self.layers, self.stages)

    @property
    def even(self) -> bool:
        return len(set(self.stage_layers)) == 1

    def split_text(self) -> str:
        counts = self.stage_layers
        layers = f"{self.layers} layers" + (f" ({' + '.join(map(str, self.blocks))}, the blocks' in order)"
                                             if self.blocks else "")
        if self.even:
            return f"{layers} over {self.stages} stages: {counts[0]} a stage"
        how = "as `stage_layers` splits them" if self.split is not None else "unevenly"
        return (f"{layers} over {self.stages} stages, {how}: "
                + ", ".join(str(c) for c in counts) + " (the slowest stage sets the pace)")


def check_dualpipe(schedule: str, stages: int, microbatches: int) -> None:
    """DualPipe's own conditions, which the deepseek-ai/DualPipe repository asserts: an even number of
    devices (device d pairs with p-1-d), an even number of microbatches (half enter at each end), at least
    2p; DualPipeV's: at least 2p microbatches."""
    p, m = stages, microbatches
    if schedule == "dualpipev":
        if m < 2 * p:
            raise ShardcError(f"dualpipev needs at least twice the stages' microbatches, not {m} over {p} stages",
                              fix=f"use microbatches {2 * p}")
        return
    if p % 2 or m % 2 or m < 2 * p:
        raise ShardcError(f"dualpipe needs an even number of stages and an even number of microbatches of at "
                          f"least twice the stages, not {p} stages and {m} microbatches",
                          fix=f"use microbatches {max(2 * p, m + m % 2)}" if p % 2 == 0 else
                          "use an even pipeline axis (DualPipe pairs device d with device p-1-d)")


def split_layers(layers: int, stages: int) -> tuple[int, ...]:
    """Layers on each of ``stages`` stages: the first ``layers % stages`` stages hold one more."""
    base, extra = divmod(layers, stages)
    return tuple(base + (s < extra) for s in range(stages))


def splits(held: object, stages: int, layers: int) -> bool:
    """Whether ``held`` (a ``stage_layers`` split) gives each of ``stages`` stages one layer or more,
    ``layers`` in all."""
    return (isinstance(held, tuple) and len(held) == stages and all(type(n) is int and n >= 1 for n in held)
            and sum(held) == layers)


def layer_count(spec: Spec, sizes: Mapping[str, int] | None = None) -> int:
    """The spec's layer count, every ``layers`` block's in all (1 without a ``layers`` line); a count
    that names a dim takes its size from ``sizes``, else from the spec's dims."""
    return sum(block_layers(spec, sizes))


def block_layers(spec: Spec, sizes: Mapping[str, int] | None = None) -> tuple[int, ...]:
    """Each ``layers`` block's count, in order (:meth:`Spec.layer_counts`), dims at ``sizes`` (else the spec's)."""
    known = spec.sizes if sizes is None else sizes
    return tuple(n if isinstance(n, int) else known[n] for n in spec.layer_counts())


def pipeline_of(spec: Spec, sizes: Mapping[str, int] | None = None) -> Pipeline | None:
    """The spec's pipeline, or None when no mesh axis is marked ``pipeline``; a ``layers`` count that
    names a dim is taken at ``sizes`` (else at the spec's dims)."""
    axis = spec.mesh.pipeline_axis
    if axis is None:
        return None
    given = spec.microbatches is not None
    micro = spec.microbatches if spec.microbatches is not None else axis.size  # default: one a stage
    blocks = block_layers(spec, sizes)
    return Pipeline(axis.name, axis.size, micro, spec.schedule or DEFAULT_SCHEDULE, sum(blocks), given,
                    spec.stage_layers, blocks if len(blocks) > 1 else ())


def pipeline_note(spec: Spec) -> list[str]:
    """The header line ``shardc plan`` adds for a pipelined spec (none otherwise)."""
    pipe = pipeline_of(spec)
    if pipe is None:
        return []
    given = "" if pipe.microbatches_given else " (default)"
    what = ("for one layer of the block, the steps marked once on the first stage (before the block) or the "
            "last (after it)" if spec.block is not None else "for one layer")
    return [f"# pipeline over {pipe.axis}: {pipe.split_text()}; {pipe.microbatches} microbatches{given}, "
            f"schedule {pipe.schedule}; below is one stage's plan, {what} (nothing is sharded over "
            f"{pipe.axis}); `shardc cost` gives the pipeline's step time"]


def stage_spec(spec: Spec) -> Spec:
    """The spec one stage runs: the mesh without the stage axis, no pipeline lines."""
    axes = tuple(a for a in spec.mesh.axes if not a.pipeline)
    return replace(spec, mesh=Mesh(axes), microbatches=None, schedule=None, stage_layers=None)


def check_pipeline(spec: Spec) -> None:
    """Raise if the pipeline lines are inconsistent (called by ``validate``)."""
    marked = [a for a in spec.mesh.axes if a.pipeline]
    if len(marked) > 1:
        raise ShardcError(f"mesh axes {marked[0].name} and {marked[1].name} are both marked pipeline",
                          marked[1].span, fix="mark one axis `pipeline`: its devices hold the stages")
    if not marked:
        for key, given in (("microbatches", spec.microbatches is not None), ("schedule", spec.schedule is not None),
                           ("stage_layers", spec.stage_layers is not None)):
            if given:
                raise ShardcError(f"`{key}` needs a pipeline axis", spec.span_of(key),
                                  fix="mark the stage axis of the mesh, e.g. `mesh P=4 pipeline, X=8`")
        return
    axis = marked[0]
    for statement in spec.statements:
        for ref in _refs(statement):
            if axis.name in {a for d in ref.dims for a in d.axes} | set(ref.unreduced):
                raise ShardcError(f"{ref.name} is sharded over {axis.name}, the pipeline axis", ref.span,
                                  fix=f"inside a stage tensors are sharded over the other axes; the "
                                  f"{axis.name} axis holds different layers, not slices of a tensor")
    pipe = pipeline_of(spec)
    if pipe is None:  # a pipeline axis of size 1: pipelining switched off, its lines have nothing to check
        return
    if pipe.schedule.name == "interleaved" and pipe.microbatches % pipe.stages:
        raise ShardcError(f"interleaved needs microbatches a multiple of the {pipe.stages} stages, "
                          f"not {pipe.microbatches}", spec.span_of("microbatches"),
                          fix=f"use microbatches {pipe.stages * max(1, pipe.microbatches // pipe.stages)} "
                          "(Megatron-LM's interleaved order)")
    if pipe.schedule.name in ("dualpipe", "dualpipev"):
        try:
            check_dualpipe(pipe.schedule.name, pipe.stages, pipe.microbatches)
        except ShardcError as err:
            raise ShardcError(err.message, spec.span_of("microbatches") or axis.span, fix=err.fix) from None
    _check_split(spec, pipe)
    _check_chunks(spec, pipe)
    _check_between(spec, axis.name)
    _check_reads_across(spec)
    needed = pipe.stages * pipe.cuts
    if pipe.layers < needed:
        stages = f"{pipe.stages} stages" + (f" of {pipe.cuts} chunks" if pipe.cuts > 1 else "")
        raise ShardcError(f"{pipe.layers} layer(s) cannot fill {stages}", spec.span_of("layers") or axis.span,
                          fix=f"a `layers` line of at least {needed}, or a smaller pipeline axis")


def _check_split(spec: Spec, pipe: Pipeline) -> None:
    """``stage_layers``: a count for each stage, each one or more, that sum to the layers (one chunk a
    device: interleaved and zbv place their chunks themselves; DualPipe's two a device are whole stages)."""
    split = spec.stage_layers
    if split is None:
        return
    where = spec.span_of("stage_layers")
    if pipe.cuts > 1:
        raise ShardcError(f"`stage_layers` splits one run of layers a stage; schedule {pipe.schedule} holds "
                          f"{pipe.chunks} chunks a device", where, fix="drop `stage_layers`, or use gpipe or 1f1b")
    if not splits(split, pipe.stages, pipe.layers):
        raise ShardcError(f"`stage_layers` gives {len(split)} count(s) summing to {sum(split)}: {pipe.axis} has "
                          f"{pipe.stages} stages and the spec {pipe.layers} layers", where,
                          fix=f"give {pipe.stages} counts of 1 or more that sum to {pipe.layers}")


def _check_chunks(spec: Spec, pipe: Pipeline) -> None:
    """Several blocks under a schedule that cuts a stage into chunks: each chunk a run of whole layers, so
    that each chunk's layers of each block are whole (one block's chunks may share a stage's layers)."""
    if not pipe.blocks or pipe.cuts == 1 or not any(n % pipe.cuts for n in pipe.stage_layers):
        return
    raise ShardcError(f"schedule {pipe.schedule} cuts each stage into {pipe.cuts} chunks of layers, and with several "
                      f"`layers` blocks each chunk holds whole layers: {pipe.layers} layers over {pipe.stages} "
                      f"stages give " + ", ".join(map(str, pipe.stage_layers)), spec.span_of("layers:1"),
                      fix=f"use layers a multiple of {pipe.stages * pipe.cuts} in all, or schedule 1f1b")


def _check_between(spec: Spec, axis: str) -> None:
    """Several blocks under a pipeline: each block follows the one before it.  A statement between two
    blocks would run once a microbatch on whichever stage the layer cut falls, a section neither end's (the
    ends run on the first and last stages) that the plan's cut into before, block and after
    (:class:`shardc.ir.plan.Sections`) has no place for."""
    blocks = spec.blocks()
    for (_, end, _), (first, _, layers) in zip(blocks, blocks[1:], strict=False):
        if end == first:
            continue
        statement = spec.statements[end]
        raise ShardcError(f"{statement.result.name} is computed between two `layers` blocks of a spec pipelined "
                          f"over {axis}: the stages run the statements before the first block (the first stage), "
                          f"the blocks' layers, and those after the last block (the last stage), nothing between",
                          statement.span or statement.result.span,
                          fix=f"move it into a block: the last statement of the block before it or the first "
                          f"of the `layers {layers}` block after it (run then in each of that block's layers), or "
                          f"drop the `pipeline` mark from {axis} to run it once between the blocks")


def _check_reads_across(spec: Spec) -> None:
    """What a stage receives of a block's layers is the output its last layer hands on (the one that
    feeds the next layer, :func:`shardc.spec.walk.block_feeds`), and only the stage that runs next holds it:
    the next block's first layer, or after the last block the statements there (the last stage).  A read of
    any other value of a block past it has no stage that holds it (the plan's cut into before, block and after
    has no place for its gradient)."""
    blocks = spec.blocks()
    for j, (lo, hi, layers) in enumerate(blocks):
        made = {s.result.name for s in spec.statements[lo:hi]}
        fed = {out.name for _, out in block_feeds(spec, spec.statements[lo:hi]) if out is not None}
        if not fed:  # a block with no activation input (every layer alike) hands nothing on
            continue
        last = j == len(blocks) - 1
        reader = range(hi, len(spec.statements) if last else blocks[j + 1][1])
        for k in range(hi, len(spec.statements)):
            for ref in (r for r in leaves(spec.statements[k].expr) if r.name in made):
                if ref.name in fed and k in reader:
                    continue
                held = ("a value inside the block, not the output its layers hand on (" + ", ".join(sorted(fed))
                        + ")") if ref.name not in fed else "its output, which the stages hand on to the next block only"
                raise ShardcError(f"{ref.name} is read past the `layers {layers}` block that makes it, {held}: "
                                  "under a pipeline only the stage holding the block's last layer has it", ref.span,
                                  fix="read the block's output there, make the value a result of the statements "
                                  "after the block, or drop the `pipeline` mark from the mesh axis")


def _refs(statement: Statement) -> list[TensorRef]:
    out, todo = [statement.result], [statement.expr]
    while todo:
        expr = todo.pop()
        if isinstance(expr, TensorRef):
            out.append(expr)
        elif isinstance(expr, Contract):
            todo.extend(expr.operands)
        elif isinstance(expr, Add):
            todo.extend(expr.terms)
        else:
            todo.extend(expr.args)
    return out
