"""The routing family: ``route(Gate[G, S, E], S, C, k over E)``, top-k routing with capacity.

Each token picks its k largest gates along the expert index E, and takes the next
free slot (along the new capacity index C) of each expert it picked, tokens in
order of S within every other index (a group, in GShard's terms: Lepikhin et al.
2020); a token past an expert's capacity is dropped there (GShard; Switch, Fedus
et al. 2021).  So a device needs E and S whole: the top-k runs along E, the slot
of a token is a cumulative count along S.  The forward's candidates are those of a
reduction (:func:`shardc.sharding.rowwise.candidates`) with E and S gathered, costed
by the same objective (``route_by_choice``, the slots taken choice by choice as GShard's top-2
and flaxformer's masked router take them, is planned alike); every other index keeps its sharding, and C comes out
replicated, then moves to the declared sharding.  The step is one local map whose
``fn`` says what lowering needs (:class:`shardc.ir.localops.Route`).  The mask is 0/1,
so it has no backward (no gradient reaches the gates through it, as none reaches
token ids).  Its step's JAX line calls the module's ``route_topk`` helper and its
whole-array meaning is :func:`shardc.ops.route_code.route_forward`.  The capacity is the
length of the capacity index C, from the sizes: the module writes it as a share of the token
count it runs at (C/S of the gates' S, rounded up), so at the sizes it was lowered for it is C,
and at any other sizes it keeps the capacity factor rather than a constant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from shardc.errors import ShardcError
from shardc.ir.localops import Route
from shardc.ir.plan import Op, Step
from shardc.ir.spec import Call, Expr, TensorRef
from shardc.ops.registry import Arrays, Capacity, Family, Namer, Reference, Site, register
from shardc.ops.route_code import capacity_code, route_code, route_forward
from shardc.sharding.layout import Value, add_cost
from shardc.sharding.rowwise import Layouts, by_index, candidates, choose, in_order, record
from shardc.sharding.search import reshard

if TYPE_CHECKING:
    from shardc.ops.registry import Node
    from shardc.sharding.phase import Phase

__all__ = ["ROUTING", "emit", "check_route_step"]

Array = Any


def _argument(call: Call, indices: tuple[str, ...]) -> tuple[str, ...]:
    """The gates: the mask's indices less the capacity index."""
    return tuple(i for i in indices if i != call.names[1])


def route_op(call: Call) -> Route:
    """The route step's local operation for ``call``."""
    assert call.over is not None
    order, slots = call.names
    return Route(order, call.over, slots, int(call.numbers[0]), call.func == "route_by_choice")


def _option(phase: Phase, node: Node, local: Value, target: Value | None, whole: tuple[str, ...]) -> Layouts | None:
    (arg,) = node.operands
    idx = phase.indices[arg]
    axes = by_index(idx, local.layout)
    if local.unreduced or any(axes[i] for i in whole) or not any(s.reaches(local) for s in phase.held[arg]):
        return None
    cost, moves_in = reshard(phase.ctx, arg, idx, phase.held[arg], local)
    result = in_order(node.indices, axes)  # the capacity index replicated
    want = target if target is not None else result
    if not result.reaches(want):
        return None
    moved, moves_out = reshard(phase.ctx, node.result, node.indices, (result,), want)
    return Layouts(local, (), add_cost(cost, moved), moves_in, moves_out, result, want)


def plan_route(phase: Phase, node: Node, declared: dict[str, TensorRef], target: Value | None,
               label: str) -> None:
    """Plan a route node: gates with E and S whole, one local map, then the mask to its sharding."""
    assert node.call is not None and node.call.over is not None
    (arg,) = node.operands
    order, experts = node.call.names[0], node.call.over
    head = label.split(" = ")[0]
    if target is not None and target.unreduced:
        raise ShardcError(f"{node.result} is a routing mask, which is not a partial sum", node.statement.span,
                          fix="drop the {U_...} suffix: route needs reduced gates")
    whole = (order, experts)
    options = [o for v in candidates(phase, arg, whole, node.indices, target, False)
               if (o := _option(phase, node, v, target, whole)) is not None]
    if not options:
        raise ShardcError(f"no sharding of {arg} makes {head}", node.statement.span,
                          fix=f"route needs {order} and {experts} whole on a device: leave them unsharded "
                              f"in {head}, or shard another index")
    best, shown = choose(options, 0)
    record(phase, f"{head} = {route_op(node.call)}({phase.text(arg, phase.held[arg][0])})", best, shown, 0,
           phase.indices[arg], experts)
    phase.moves(arg, best.moves_in)
    phase.emit(Step(Op.ELEMENTWISE, node.result, phase.ref(node.result, best.result),
                    operands=(phase.ref(arg, best.local),), fn=route_op(node.call)), best.result)
    phase.moves(node.result, best.moves_out)
    declared.setdefault(node.result, phase.ref(node.result, best.final))


def check_route_step(step: Step) -> list[str]:
    """Why a local route step is invalid: E and S whole, C replicated, other indices sharded as the gates."""
    assert isinstance(step.fn, Route)
    order, experts, slots = step.fn.order, step.fn.experts, step.fn.slots
    (gates,) = step.operands
    axes = {d.name: d.axes for d in gates.dims}
    problems = [f"route {step.dst}: {gates.name} shards {i}, which route needs whole" for i in (order, experts)
                if axes.get(i)]
    for d in step.dst.dims:
        if d.axes != axes.get(d.name, ()) or (d.name == slots and d.axes):
            problems.append(f"route {step.dst}: {d.name} is not sharded as in {gates.name} (C: replicated)")
    return problems + ([f"route {step.dst}: its gates are partial sums"] if gates.unreduced else [])


def emit(step: Step, var: Namer, sizes: dict[str, int] | None) -> str:
    """One call of ``route_topk``, its capacity C/S of the tokens it is given."""
    assert isinstance(step.fn, Route)
    (gates,) = step.operands
    tokens = f"{var(gates)}.shape[{gates.indices.index(step.fn.order)}]"
    return route_code(step, var, capacity_code(tokens, step.fn.order, step.fn.slots, sizes))


def _forward(site: Site, xs: Arrays, xp: Any) -> Array:
    """The routing mask of whole gates (:func:`shardc.ops.route_code.route_forward`)."""
    (gates,), call, labels = xs, site.func, site.labels[0]
    assert call.over is not None
    (order, slots), experts, k = call.names, call.over, int(call.numbers[0])
    if slots not in site.shape:
        raise ShardcError(f"route's capacity index {slots} has no size", fix=f"give {slots} a size in dims")
    return route_forward(gates, labels.index(order), labels.index(experts), site.shape[slots], k, xp,
                         by_choice=call.func == "route_by_choice")


def _magnitude(site: Site, xs: Arrays, mags: Arrays, y: Array) -> Array:
    """Exact 0/1 values: no rounding behind them."""
    return np.abs(y)


def capacity(call: Call) -> Capacity:
    """``route(Gate, S, C, k over E)`` and ``dispatch``/``combine``'s like arguments: C slots of S tokens."""
    tokens, slots = call.names
    return Capacity(tokens, slots, call.over or "", int(call.numbers[0]))


def _arguments(call: Call, keep: tuple[str, ...]) -> tuple[tuple[Expr, tuple[str, ...]], ...]:
    """The gates, towards the result's indices but the capacity index C, which the route makes."""
    _, slots = call.names
    return ((call.arg, tuple(i for i in keep if i != slots)),)


def _indices(call: Call, operands: tuple[tuple[str, ...], ...]) -> tuple[str, ...]:
    """The gates' indices, then the capacity index C (the mask's slots)."""
    (gates,) = operands
    return (*gates, call.names[1])


ROUTING = register(Family(name="routing", calls=frozenset({"route", "route_by_choice"}), ops=(Route,), plan=plan_route,
                          backward=None, emit=emit,
                          reference=Reference(_forward, None, _magnitude, arguments=_arguments, indices=_indices),
                          argument=_argument,
                          chooses=True, capacity=capacity, fusible=False))
