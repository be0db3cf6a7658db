"""The planning pass: spec -> plan of every collective, forward and backward.

>>> import shardc
>>> spec = shardc.parse("mesh X=4\\nOut[B_X, F] = In[B_X, D] · W[D, F]\\n")
>>> p = shardc.plan(spec)
>>> [s.op.value for s in p.backward if s.is_collective]
['all_reduce']
"""

from __future__ import annotations

from shardc.errors import ShardcError
from shardc.pipeline.stages import pipelined, stage_spec
from shardc.planner.backward import plan_backward
from shardc.planner.chain import choose_chain
from shardc.planner.check import comm_time
from shardc.planner.fold import fold_redundant
from shardc.planner.graph import Graph, Node, build_graph
from shardc.planner.ir import Op, Plan, Step, TensorInfo
from shardc.planner.layout import CostContext, Layout, Value
from shardc.planner.phase import Phase
from shardc.spec.ir import Spec, TensorRef
from shardc.spec.validate import validate

__all__ = ["plan", "SAVE_POLICIES"]

SAVE_POLICIES = ("default", "none", "all")
STRATEGIES = ("auto", "search", "rules")


def plan(spec: Spec, save: str = "default", strategy: str = "auto") -> Plan:
    """Plan ``spec``: by least communication time with ``dims``, by the book's rules without.

    ``strategy="rules"`` applies the book's rules even when sizes are known (the
    baseline the search is measured against); ``"search"`` is the default with dims.
    """
    if save not in SAVE_POLICIES:
        raise ShardcError(f"unknown residual policy {save!r}", fix="use one of: " + ", ".join(SAVE_POLICIES))
    if strategy not in STRATEGIES:
        raise ShardcError(f"unknown strategy {strategy!r}", fix="use one of: " + ", ".join(STRATEGIES))
    validate(spec)  # a Spec built in Python has not met the parser's checks
    if spec.mesh.pipeline_axis is not None:  # a stage's plan: the stage axis holds layers, not shards
        return pipelined(spec, plan(stage_spec(spec), save, strategy))
    graph = build_graph(spec)
    if strategy == "auto" and spec.dims:
        # The search is exact per einsum but greedy across them: a gather the rules make
        # early can be reused later for free.  Plan both ways and keep the cheaper whole.
        ctx = _context(spec, graph)  # one search cache for both
        searched = _plan(spec, graph, save, "search", ctx)
        rules = _plan(spec, graph, save, "rules", ctx)
        return rules if comm_time(rules) < comm_time(searched) * (1 - 1e-9) else searched
    return _plan(spec, graph, save, "search" if strategy == "auto" and spec.dims else strategy,
                 _context(spec, graph))


def _context(spec: Spec, graph: Graph) -> CostContext:
    grads = frozenset(graph.grads[p] for p in graph.params)
    return CostContext(spec.mesh, spec.dtype, spec.sizes if spec.dims else None, graph.params | grads)


def _plan(spec: Spec, graph: Graph, save: str, strategy: str, ctx: CostContext) -> Plan:
    sized = bool(spec.dims) and strategy == "search"
    declared = dict(graph.declared)
    forward = Phase("forward", ctx, dict(graph.indices), sized, graph.params)
    for name in graph.inputs:
        forward.hold(name, Value.of(declared[name]))
    _plan_forward(forward, graph, declared)
    backward = plan_backward(graph, forward, declared, save)
    sizes = None
    if spec.dims:
        sizes = tuple(spec.dims) + tuple((a.name, a.size) for a in spec.mesh.axes)
    return Plan(
        spec=spec,
        forward=fold_redundant(tuple(forward.steps), frozenset(declared.values()) | set(backward.residuals)),
        backward=fold_redundant(tuple(backward.phase.steps), frozenset(backward.grads)),
        save=save,
        sizes=sizes,
        tensors=_tensor_infos(graph, declared),
        residuals=backward.residuals,
        cotangents=backward.cotangents,
        grads=backward.grads,
        strategy="search" if sized else "rules",
        choices=tuple(forward.choices + backward.phase.choices),
        gradient_names=tuple(graph.grads.items()),
    )


def _plan_forward(phase: Phase, graph: Graph, declared: dict[str, TensorRef]) -> None:
    nodes = list(graph.nodes)
    k = 0
    while k < len(nodes):
        node = nodes[k]
        if node.chain and phase.sized and node.result not in declared:
            end = k
            while nodes[end].chain:
                end += 1
            choose_chain(phase, nodes[k:end + 1], declared)
        _plan_node(phase, node, declared)
        k += 1


def _plan_node(phase: Phase, node: Node, declared: dict[str, TensorRef]) -> None:
    target = Value.of(declared[node.result]) if node.result in declared else None
    label = _label(node, phase, declared)
    if node.kind == "elementwise":
        _plan_elementwise(phase, node, declared, target)
        return
    final = phase.einsum(node.result, node.operands, target, label, span=node.statement.span)
    if node.result not in declared:  # a chain intermediate: the planner chose its sharding
        declared[node.result] = phase.ref(node.result, final)


def _plan_elementwise(phase: Phase, node: Node, declared: dict[str, TensorRef],
                      target: Value | None) -> None:
    """``f`` keeps the sharding; its input must be reduced, in the result's layout."""
    (arg,) = node.operands
    if target is None:
        target = Value(phase.held[arg][0].layout, ())
    if target.unreduced:
        raise ShardcError(f"{node.result} is an elementwise function of partial sums", node.statement.span,
                          fix="drop the {U_...} suffix: the function needs reduced values")
    want = Value(_permute(phase.indices[arg], node.indices, target), ())
    from shardc.planner.layout import reshard

    _, moves = reshard(phase.ctx, arg, phase.indices[arg], phase.held[arg], want)
    phase.moves(arg, moves)
    phase.emit(Step(Op.ELEMENTWISE, node.result, phase.ref(node.result, target),
                    operands=(phase.ref(arg, want),), fn=node.fn))
    declared.setdefault(node.result, phase.ref(node.result, target))
    declared.setdefault(arg, phase.ref(arg, want))


def _permute(arg_idx: tuple[str, ...], res_idx: tuple[str, ...], target: Value) -> Layout:
    """The target's per-index axes, in the argument's index order."""
    by_index = dict(zip(res_idx, target.layout, strict=True))
    return tuple(by_index[i] for i in arg_idx)


def _label(node: Node, phase: Phase, declared: dict[str, TensorRef]) -> str:
    parts = []
    for name in node.operands:
        ref = declared.get(name)
        parts.append(str(ref) if ref is not None else f"{name}[{', '.join(phase.indices[name])}]")
    target = declared.get(node.result)
    head = str(target) if target is not None else f"{node.result}[{', '.join(node.indices)}]"
    return f"{head} = {' · '.join(parts)}"


def _tensor_infos(graph: Graph, declared: dict[str, TensorRef]) -> tuple[TensorInfo, ...]:
    infos = []
    for name, ref in declared.items():
        role = "param" if name in graph.params else "input" if name in graph.inputs else "activation"
        infos.append(TensorInfo(name, ref, role, name in graph.outputs))
    return tuple(infos)
