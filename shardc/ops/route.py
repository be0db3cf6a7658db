"""The routing family: ``route(Gate[G, S, E], S, C, k over E)``, top-k routing with capacity.

:mod:`shardc.ops.route_plans` plans its forward (E and S whole on a device); the mask is
0/1, so it has no backward (no gradient reaches the gates through it, as none reaches
token ids).  Its step's JAX line calls the module's ``route_topk`` helper and its
whole-array meaning is :func:`shardc.ops.route_code.route_forward`.  The capacity is the
length of the capacity index C, from the sizes: the module writes it as a share of the token
count it runs at (C/S of the gates' S, rounded up), so at the sizes it was lowered for it is C,
and at any other sizes it keeps the capacity factor rather than a constant.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardc.errors import ShardcError
from shardc.ir.localops import Route
from shardc.ir.plan import Step
from shardc.ir.spec import Call
from shardc.ops.registry import Arrays, Family, Namer, Reference, Site, register
from shardc.ops.route_code import capacity_code, route_code, route_forward
from shardc.ops.route_plans import plan_route

__all__ = ["ROUTING", "emit"]

Array = Any


def _argument(call: Call, indices: tuple[str, ...]) -> tuple[str, ...]:
    """The gates: the mask's indices less the capacity index."""
    return tuple(i for i in indices if i != call.names[1])


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
    return route_forward(gates, labels.index(order), labels.index(experts), site.shape[slots], k, xp)


def _magnitude(site: Site, xs: Arrays, mags: Arrays, y: Array) -> Array:
    """Exact 0/1 values: no rounding behind them."""
    return np.abs(y)


ROUTING = register(Family(name="routing", calls=frozenset({"route"}), ops=(Route,), plan=plan_route, backward=None,
                          emit=emit, reference=Reference(_forward, None, _magnitude), argument=_argument,
                          fusible=False))
