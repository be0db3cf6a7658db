"""The planning pass: spec -> plan of every collective, forward and backward.

>>> import shardc
>>> spec = shardc.parse("mesh X=4\\nOut[B_X, F] = In[B_X, D] · W[D, F]\\n")
>>> p = shardc.plan(spec)
>>> [s.op.value for s in p.backward if s.is_collective]
['all_reduce']
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import replace
from typing import NoReturn

from shardc.arguments import check_gradients
from shardc.chip_choice import chip_for
from shardc.errors import ShardcError, clip
from shardc.hardware import Hardware, check_spans
from shardc.ir.plan import Plan, Sections, Step
from shardc.ir.spec import Spec, TensorRef, parse_topology
from shardc.ops.registry import Node
from shardc.ops.ring_attention import window_ring_notes
from shardc.pipeline.boundary import check_microbatches
from shardc.planner.backward import Backward, plan_backward
from shardc.planner.candidates import SUM, Weights, candidate_weights, objective, same_steps, weigh
from shardc.planner.chain import choose_chain
from shardc.planner.collective_matmul import fuse_collective_matmuls
from shardc.planner.contexts import search_context, shared_context, shared_search, sharing, stage_run_of, tensor_infos
from shardc.planner.fold import fold_redundant, settle_intermediates, share_recomputed
from shardc.planner.graph import Graph, build_graph
from shardc.planner.layer_blocks import enter_block, leave_block, node_blocks
from shardc.planner.memory_fit import MemoryOf, candidate_rank, check_limit, fastest_fitting, remembered
from shardc.planner.padding import padding_notes
from shardc.planner.recompute import attention_region, checkpoints, named_values, policy, recompute_steps
from shardc.planner.zero import plan_optimizer, zero3_spec, zero_axes, zero_params
from shardc.planner.zigzag_order import balances, hold_zigzag, holds, may_hold
from shardc.sharding.layout import CostContext, SearchTooLong, Value
from shardc.sharding.phase import Phase, Traced
from shardc.sharding.unit import (
    bond_note,
    bonded_axes,
    placements,
    restriction_note,
    strip_unit_axes,
    unwritten_axes,
)
from shardc.spec.stages import pipeline_of, stage_spec
from shardc.spec.validate import validate
from shardc.step_cost import StepCost
from shardc.timing import PlanTime, plan_time
from shardc.topology import check_topology

__all__ = ["plan", "plan_candidate", "shared_search", "SAVE_POLICIES"]

SAVE_POLICIES = ("default", "none", "all")
# The search work (states settled, configurations tried, moves built: CostContext.tick) the
# planner may do before it gives up with a clear error.  The search grows with every mesh axis
# of size > 1 (the layouts of a tensor multiply), never with size-1 axes.  A count, not seconds:
# the same spec plans, or stops, on any machine under any load.  The most any example, test spec
# or test of the suite needs is about 80,000 (examples/moe_transformer.shard; six size-2 axes
# written apart, 70,000); eight size-2 axes written apart need more than this and stop, after
# about as long as the 30 s the search once allowed (benchmarks/plan_speed.py).
BUDGET = 300_000
STRATEGIES = ("auto", "search", "rules")


def plan(spec: Spec, save: str = "default", strategy: str = "auto", hardware: str | Hardware | None = None,
         spans: dict[str, int] | None = None, recompute: str = "none", budget: int = BUDGET,
         explain: bool = False, gradients: Mapping[str, str] | None = None,
         topology: str | tuple[int, ...] | None = None, weights: Weights | None = None,
         collective_matmul: bool = True, memory: MemoryOf | None = None,
         memory_limit: float | None = None, memory_floor: MemoryOf | None = None) -> Plan:
    """Plan ``spec``: by least step time on the chip with ``dims``, by the book's rules without.

    The chip is ``hardware`` (a preset name or a :class:`Hardware`), else the spec's
    ``hardware`` line, else tpu-v5p; ``spans`` overrides how many physical ICI axes a
    mesh axis is laid over (:meth:`Hardware.spans`).  The objective is the step time
    ``shardc cost`` reports on that chip (:func:`shardc.timing.plan_time`: compute and
    communication, each phase ``max(compute, comm)``).  That max does not split over
    einsums, so the search minimises per einsum a weighted sum of compute, the collectives
    issued ahead and the exposed ones, under a few weights (:func:`candidate_weights`), and
    the planner returns, of the plans it builds (those
    searches' and the book's rules'), the one of least step time, ties to less
    communication.  ``strategy="rules"`` applies the book's rules even when sizes are
    known (the baseline the search is measured against); ``"search"`` runs the search
    once, compute and communication counted alike (or as ``weights``, (forward, backward), says:
    compute's weight, or compute's and the collectives issued ahead's, as :func:`candidate_weights` gives them).
    ``recompute`` (none, selective, full, dots, dots-except:PARAM,..., +attention: :mod:`shardc.planner.recompute`)
    is what the backward recomputes instead of keeping; those forward steps are part of every candidate's backward time.
    ``budget`` is how much search the planner may do (:data:`BUDGET`) before it stops
    with a :class:`ShardcError`.  ``explain`` keeps, in :attr:`Plan.choices`, the
    alternatives each choice weighed (``shardc plan --explain``); the plan is the same.
    ``gradients`` names tensors' gradients as given (tensor -> name), for a part of a spec
    planned apart that must keep the whole spec's names (:func:`shardc.names.gradient_names`).
    ``topology`` (``4x4x4``, ``48x8``, or a tuple) is the slice or cluster the mesh lies on, over
    the spec's ``topology`` line; without either, the chip's usual one (:mod:`shardc.topology`).
    ``collective_matmul`` (the default) runs an einsum and the critical-path AllGather before it (or
    ReduceScatter after it) as one ring of sends overlapping its block matmuls, where that is faster on the
    chip (:mod:`shardc.planner.collective_matmul`); False keeps every collective whole.
    ``memory`` (a plan's bytes a device as ``shardc cost`` counts them: :func:`shardc.costmodel.fitting.plan_memory`)
    makes the plan the fastest whose memory is at most ``memory_limit`` (the chip's HBM by default), over the
    choices that change what a plan holds (:mod:`shardc.planner.memory_fit`); without it, the fastest.
    ``memory_floor`` (of the fastest plan, bytes that no plan of those choices holds less than) skips that
    search where it passes the limit: none would fit, and the plan is the fastest.
    """
    if save not in SAVE_POLICIES:
        raise ShardcError(f"unknown residual policy {save!r}", fix="use one of: " + ", ".join(SAVE_POLICIES))
    if strategy not in STRATEGIES:
        raise ShardcError(f"unknown strategy {strategy!r}", fix="use one of: " + ", ".join(STRATEGIES))
    policy(recompute)  # its params are checked where the plan is made
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ShardcError(f"budget={clip(repr(budget))}: must be a whole number of search steps >= 1",
                          fix=f"leave it out for the default, {BUDGET:,}")
    check_gradients(gradients)
    validate(spec)  # a Spec built in Python has not met the parser's checks
    spec = _with_topology(spec, topology, hardware)
    if not isinstance(collective_matmul, bool):
        raise TypeError(f"collective_matmul must be True or False, not {type(collective_matmul).__name__}")
    check_limit(memory_limit)
    def fastest(dcn: bool) -> Plan:
        args = (spec, strategy, hardware, spans, recompute, (budget, explain, dcn), gradients or {}, weights or SUM)
        # the plan held in zig-zag order solves the same einsums: both share one search cache
        with shared_search() if not sharing() else nullcontext():
            return fastest_fitting(lambda policy: _planned(policy, *args), fuse_collective_matmuls, save,
                                   collective_matmul, (memory, memory_limit, memory_floor),
                                   lambda p: objective(plan_time(p)))
    try:
        return fastest(False)
    except SearchTooLong as e:
        if not _dcn_bondable(spec):
            _gave_up(e, spec)
    try:  # past the budget: again with DCN axes written together moved as one (bonded_axes)
        return fastest(True)
    except SearchTooLong as e:
        _gave_up(e, spec)


def _dcn_bondable(spec: Spec) -> bool:
    """Whether a search again with DCN axes moved as one (``bonded_axes(dcn=True)``) searches less."""
    stage = stage_spec(spec) if spec.mesh.pipeline_axis is not None else spec
    stripped = strip_unit_axes(stage)
    return bonded_axes(stripped) is None and bonded_axes(stripped, dcn=True) is not None


def _gave_up(e: SearchTooLong, spec: Spec) -> NoReturn:
    """The error of a search past its budget, at the mesh line; an axis no tensor is written over named."""
    free = unwritten_axes(spec)
    raise ShardcError(
        f"planning gave up after {e.work:,} steps of search (layouts and moves explored): the search "
        f"over layouts grows with every mesh axis (this mesh has {e.axes} of size > 1)", spec.span_of("mesh"),
        fix=(f"no tensor is written over {', '.join(free)}, so every dim is tried on it: write it where it goes "
             "(B_XY), or drop it from the mesh; else " if free else "")
        + "merge axes that always shard together into one (mesh X=2, Y=2 used only as B_XY: "
          "one axis XY=4), or drop the dims line to plan by the book's rules") from None


def _planned(save: str, spec: Spec, strategy: str, hardware: str | Hardware | None,
             spans: dict[str, int] | None, recompute: str, search: tuple[int, bool, bool],
             gradients: Mapping[str, str], weights: Weights) -> Plan:
    """The fastest plan under the step-time search (:func:`plan`'s, before memory is weighed and collective
    matmuls fused)."""
    planned = hold_zigzag(_plan_within_budget(spec, save, strategy, hardware, spans, recompute, search, gradients,
                                              weights=weights))
    if may_hold(planned):  # planned again held (no reordering, all-gather balanced); the faster
        again = hold_zigzag(_plan_within_budget(spec, save, strategy, hardware, spans, recompute, search,
                                                gradients, weights=weights, zigzag_held=True))
        held_s, planned_s = objective(plan_time(again)), objective(plan_time(planned))
        # on a tie, held where a kernel balances its load by the order (Ulysses runs as fast without)
        if holds(again) and (held_s < planned_s or held_s == planned_s and balances(again)):
            planned = again
    return planned


def _with_topology(spec: Spec, topology: str | tuple[int, ...] | None, hardware: str | Hardware | None) -> Spec:
    """``spec`` with the topology given here over its own line, checked against its mesh and chip."""
    if topology is not None:
        if not isinstance(topology, str | tuple | list):
            raise TypeError(f"topology must be a str like '4x4x4' or a tuple of ints, not {type(topology).__name__}")
        shape = parse_topology(topology, what="--topology") if isinstance(topology, str) else tuple(topology)
        if not shape or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape):
            raise ShardcError(f"topology {topology!r}: expects whole sizes of 1 or more", fix="write e.g. 4x4x4")
        spec = replace(spec, topology=shape)
    hw = chip_for(spec, hardware)
    if spec.topology is not None and not (hw.book and hw.ici_domain is not None):
        span = spec.span_of("topology") if topology is None else None
        check_topology(spec.topology, spec.mesh, {}, hw, span, flag=topology is not None)
    return spec


def _plan_within_budget(spec: Spec, save: str, strategy: str, hardware: str | Hardware | None,
                        spans: dict[str, int] | None, recompute: str, search: tuple[int, bool, bool],
                        gradients: Mapping[str, str], outer: Spec | None = None,
                        weights: Weights = SUM, zigzag_held: bool = False) -> Plan:
    """``search``: (budget, explain, DCN axes bonded: :func:`plan`'s second search), and ``gradients``, as
    :func:`plan` takes them; ``outer``: the
    pipelined spec whose stage ``spec`` is (its candidates are timed as that pipeline runs them);
    ``zigzag_held``: zig-zag rings priced as a plan holding the sequence in their order runs them."""
    hw = chip_for(spec, hardware)
    check_spans(spec.mesh, spans)
    spec, zero_notes = zero3_spec(spec, build_graph(spec).params)  # ZeRO-3: the params sharded (FSDP)
    if zero_notes:  # the params sharded, planned as any sharded param; the zero line stays for the gathers' type
        planned = _plan_within_budget(spec, save, strategy, hw, spans, recompute, search, gradients, outer, weights,
                                      zigzag_held)
        return replace(planned, spec=spec, notes=zero_notes + planned.notes)
    if spec.mesh.pipeline_axis is not None:  # a stage's plan: the stage axis holds layers, not shards
        stage_spans = {k: v for k, v in (spans or {}).items() if k != spec.mesh.pipeline_axis.name}
        return pipelined(spec, _plan_within_budget(stage_spec(spec), save, strategy, hw, stage_spans or None,
                                                   recompute, search, gradients, spec, weights, zigzag_held))
    stripped = strip_unit_axes(spec)  # size-1 axes are free: the search never sees them
    graph = build_graph(stripped, gradients)
    units = bonded_axes(stripped, dcn=search[2])
    run = stage_run_of(spec, graph, outer, hw)  # a stage: searched at a microbatch's sizes, each step as often as run
    # a stage is searched at the whole batch too: the search solves einsum by einsum, so its objective made true
    # can still lead it to a worse whole plan; the true objective (plan_time) then picks among both's candidates
    ctxs = [shared_context(spec, graph, hw, spans, units, placements(stripped, units), r)  # one for every candidate
            for r in ([run, (spec, 1)] if run[1] > 1 else [run])]
    for ctx in ctxs:
        ctx.budget, ctx.explain = search[:2]  # shared too: the budget counts the work of every candidate
        ctx.zigzag_held = zigzag_held
    if strategy == "auto" and spec.dims:
        return _best_plan(spec, graph, save, tuple(ctxs), recompute, outer)
    return _plan(spec, graph, save, "search" if strategy == "auto" and spec.dims else strategy, ctxs[0], weights,
                 recompute=recompute)


def pipelined(spec: Spec, stage_plan: Plan) -> Plan:
    """One stage's plan, told it runs in ``spec``'s pipeline (its mesh keeps the stage axis)."""
    sizes = stage_plan.sizes
    if sizes is not None:
        sizes = sizes + tuple((a.name, a.size) for a in spec.mesh.axes if a.pipeline)
    planned = replace(stage_plan, spec=spec, sizes=sizes)
    pipe = pipeline_of(spec)
    if pipe is not None and spec.dims:  # the spec's own batch splits into its microbatches, as cost needs
        check_microbatches(planned, pipe.microbatches, dict(spec.dims))
    return planned


def _best_plan(spec: Spec, graph: Graph, save: str, ctxs: tuple[CostContext, ...], recompute: str = "none",
               outer: Spec | None = None) -> Plan:
    """The least step time among the rules' plan and searches under a few weights, in each context.

    A phase takes about max(compute, comm): once a phase is communication-bound only its
    communication counts at the margin, so after the sum's plan each phase is searched
    again under :func:`candidate_weights` (compute weighted 0 if that plan left it
    communication-bound, the collectives issued ahead 0 where compute hides them).  The exact
    step time picks the winner: for a
    pipeline's stage (``outer``), the time of the pipeline's plan, a microbatch at a time.
    """
    memo: dict[tuple[object, ...], StepCost] = {}  # step costs, shared by the candidates

    def timed(p: Plan) -> PlanTime:
        return plan_time(p if outer is None else pipelined(outer, p), ctxs[0].hardware, memo=memo)

    def searched(ctx: CostContext, rules: bool) -> list[tuple[tuple[float, float], Plan]]:
        trace: list[Traced] = []
        first = _plan(spec, graph, save, "search", ctx, SUM, notes=False, trace=trace, recompute=recompute)
        t = timed(first)
        candidates = [(objective(t), first)]
        for strategy, weights in [("search", w) for w in candidate_weights(t)] + [("rules", SUM)] * rules:
            if same_steps(graph, ctx, trace, strategy, weights):
                continue  # the first's steps, so its time: the tie goes to the first anyway
            p = _plan(spec, graph, save, strategy, ctx, weights, notes=False, recompute=recompute)
            candidates.append((objective(timed(p)), p))
        return candidates

    def search() -> list[Plan]:  # the candidates, fastest first (ties: the first); memory may ask for a slower one
        candidates = [c for k, ctx in enumerate(ctxs) for c in searched(ctx, k == 0)]  # the rules' plan once
        return [p for _, p in sorted(candidates, key=lambda c: c[0])]

    ordered = remembered((spec, save, recompute, outer, ctxs[0].zigzag_held, tuple(map(id, ctxs))), search)
    best = ordered[candidate_rank(len(ordered))]
    return replace(best, notes=_notes(spec, best.forward + best.backward + best.optimizer, ctxs[0]))


def plan_candidate(spec: Spec, strategy: str, weights: Weights = SUM,
                   hardware: str | Hardware | None = None) -> Plan:
    """One of the candidates :func:`plan` compares, planned alone, with its own search cache.

    ``strategy`` is ``"search"`` (compute weighted ``weights``, forward then backward, beside
    communication) or ``"rules"`` (the book's rules).  Every reshard is searched over all layouts,
    also on a mesh whose many axes make :func:`plan` restrict them.  :func:`plan` returns the
    candidate of least :func:`objective`; a spec with ZeRO-3 or a pipeline axis is planned through
    a derived spec first, so it is not a candidate itself.
    """
    if strategy not in ("search", "rules"):
        raise ShardcError(f"unknown candidate strategy {strategy!r}", fix="use search or rules")
    if spec.mesh.pipeline_axis is not None or (spec.zero is not None and spec.zero.stage == 3):
        raise ShardcError("a spec with a pipeline axis or ZeRO-3 is planned through a derived spec",
                          fix="use shardc.plan")
    validate(spec)
    stripped = strip_unit_axes(spec)
    graph = build_graph(stripped)
    ctx = search_context(spec, graph, chip_for(spec, hardware), None, bonded_axes(stripped))
    return _plan(spec, graph, "default", strategy, ctx, weights)


def _notes(spec: Spec, steps: tuple[Step, ...], ctx: CostContext) -> tuple[str, ...]:
    """The plan's notes: padded dims, windowed attention without a ring, and the search's restriction on a
    mesh of many axes."""
    padded = padding_notes(spec, steps) if spec.dims else ()
    padded += window_ring_notes(steps)
    if ctx.places is not None:
        return padded + (restriction_note(strip_unit_axes(spec)),)
    bonded = bond_note(ctx.unit_list())
    return padded + ((bonded,) if bonded else ())


def _plan(spec: Spec, graph: Graph, save: str, strategy: str, ctx: CostContext,
          weights: Weights = SUM, notes: bool = True, trace: list[Traced] | None = None,
          recompute: str = "none") -> Plan:
    sized = bool(spec.dims) and strategy == "search"
    declared = dict(graph.declared)
    forward = Phase("forward", ctx, dict(graph.indices), sized, graph.params, trace=trace)
    for name in graph.inputs:
        forward.hold(name, Value.of(declared[name]))
    weigh(ctx, weights[0])
    _plan_forward(forward, graph, declared, spec)
    weigh(ctx, weights[1])
    backward, opt = _backward_and_optimizer(spec, graph, forward, declared, save, sized)
    sizes = None
    if spec.dims:
        sizes = tuple(spec.dims) + tuple((a.name, a.size) for a in spec.mesh.axes)
    # what the forward hands on: the spec's own results and the residuals; an intermediate's layout the planner
    # recorded in `declared` is no result (a sum may read it in another layout, leaving its move unread)
    fwd = fold_redundant(tuple(forward.steps), frozenset(graph.declared.values()) | set(backward.residuals))
    declared = settle_intermediates(fwd, declared, frozenset(graph.declared))
    bwd = fold_redundant(tuple(backward.phase.steps), frozenset(backward.grads))
    again = _recomputed(spec, graph, fwd, backward.residuals, declared, recompute, ctx.hardware.reruns_layers)
    bwd = share_recomputed(again, bwd)
    return Plan(
        spec=spec,
        forward=fwd,
        backward=bwd,
        save=save,
        sizes=sizes,
        tensors=tensor_infos(graph, declared),
        residuals=backward.residuals,
        cotangents=backward.cotangents,
        grads=backward.grads,
        strategy="search" if sized else "rules",
        choices=tuple(forward.choices + backward.phase.choices),
        gradient_names=tuple(graph.grads.items()),
        hardware=ctx.hardware.name,
        chip=ctx.hardware,
        spans=tuple(sorted((ctx.spans or {}).items())),
        topology=ctx.topology,
        notes=_notes(spec, fwd + bwd + opt, ctx) if notes else (),
        optimizer=opt,
        recompute=recompute,
        recomputed=again,
        element_bytes=tuple(graph.element_bytes.items()),
        gathered_bytes=tuple(graph.gathered_bytes.items()),
        dtypes=tuple(graph.dtypes.items()),
        gemms=tuple(graph.gemms.items()),
        sections=Sections.of(fwd, bwd, again),
    )


def _backward_and_optimizer(spec: Spec, graph: Graph, forward: Phase, declared: dict[str, TensorRef], save: str,
                            sized: bool) -> tuple[Backward, tuple[Step, ...]]:
    """The backward after ``forward``, and ZeRO-1/2's optimizer phase over the params' shards
    (:mod:`shardc.planner.zero`)."""
    ctx = forward.ctx
    shards = zero_params(spec, graph.params, declared) if spec.zero is not None and spec.zero.stage < 3 else {}
    stage = spec.zero.stage if spec.zero is not None else 0
    partial = {p: (tuple(a for a in zero_axes(spec) if a not in Value(declared[p].layout).used()), layout)
               for p, layout in shards.items()} if stage == 1 else {}
    backward = plan_backward(graph, forward, declared, save, partial, shards if stage == 2 else {},
                             node_blocks(spec, graph))
    weigh(ctx, SUM[1])
    optimizer = Phase("optimizer", ctx, dict(backward.phase.indices), sized, frozenset())
    made = {g.name: g for g in backward.grads}
    return backward, plan_optimizer(optimizer, shards, declared, {p: made[graph.grads[p]] for p in shards})


def _recomputed(spec: Spec, graph: Graph, fwd: tuple[Step, ...], residuals: tuple[TensorRef, ...],
                declared: dict[str, TensorRef], recompute: str, whole_layers: bool) -> tuple[Step, ...]:
    """The forward steps the backward runs again under ``recompute`` (:mod:`shardc.planner.recompute`)."""
    region = attention_region(graph) if recompute == "selective" else frozenset()
    start = [declared[n] for n in checkpoints(graph.inputs, spec, recompute)]  # under full, each layer's input
    rule = policy(recompute, graph.params)
    return recompute_steps(rule.mode, fwd, residuals, start, region, frozenset(graph.params), rule.rerun,
                           named_values(graph, spec.recompute), whole_layers, rule.keeps_attention, rule.alternate)


def _plan_forward(phase: Phase, graph: Graph, declared: dict[str, TensorRef], spec: Spec) -> None:
    nodes = list(graph.nodes)
    blocks = node_blocks(spec, graph)
    k = 0
    while k < len(nodes):
        node = nodes[k]
        if node.chain and phase.sized and node.result not in declared:
            end = k
            while nodes[end].chain:
                end += 1
            choose_chain(phase, nodes[k:end + 1], declared)
        if blocks and blocks[k] is not None and (k == 0 or blocks[k - 1] != blocks[k]):
            enter_block(phase, nodes[k:], blocks[k:], declared)
        if blocks and k > 0 and blocks[k - 1] is not None and blocks[k] != blocks[k - 1]:
            leave_block(phase, nodes[:k], nodes[k:], declared)
        start = len(phase.steps)
        _plan_node(phase, node, declared)
        if blocks:
            phase.mark_block(start, blocks[k])
        k += 1


def _plan_node(phase: Phase, node: Node, declared: dict[str, TensorRef]) -> None:
    # A pre-activation (the A · B of f(A · B)) takes the layout f's result is declared in:
    # moving it before f costs what moving f's result would, so the einsum search sees the
    # whole statement, f(A · B) = (A · B then f).
    wanted = declared.get(node.result, node.target)
    target = Value.of(wanted) if wanted is not None else None
    label = _label(node, phase, declared)
    node.family.plan(phase, node, declared, target, label)


def _label(node: Node, phase: Phase, declared: dict[str, TensorRef]) -> str:
    parts = []
    for name in node.operands:
        ref = declared.get(name)
        parts.append(str(ref) if ref is not None else f"{name}[{', '.join(phase.indices[name])}]")
    target = declared.get(node.result)
    head = str(target) if target is not None else f"{node.result}[{', '.join(node.indices)}]"
    return f"{head} = {' · '.join(parts)}"
