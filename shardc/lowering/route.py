"""``route`` (top-k routing with capacity), as lowering and the numpy reference see it.

:func:`route_code` writes the planned step (:mod:`shardc.planner.route`: E and S
whole on the device) as one call of the module's ``route_topk`` helper
(:data:`HELPER`: ``jax.lax.top_k`` along E, an exclusive cumulative count along
S), then a transpose to the result's index order.  :func:`route_forward` is the
same meaning written again for whole arrays (a stable argsort for the top k, ties
to the lower expert, as ``jax.lax.top_k`` breaks them), for
:mod:`shardc.lowering.reference`.  Token s takes slot c of expert e when e is
among its k largest gates and c tokens before it (along S) chose e; with c at
or past the capacity (C's length) it is dropped there (GShard, Lepikhin et al.
2020; Switch, Fedus et al. 2021).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardc.planner.ir import Step
from shardc.planner.localops import Route
from shardc.spec.ir import TensorRef

__all__ = ["HELPER", "route_code", "route_forward", "uses_route"]

Array = Any

HELPER = '''

def route_topk(gates, k, capacity, order, experts):
    """Top-k routing with capacity: the 0/1 mask [..., capacity] (a new last dim) of each token's
    slot at each of its k largest gates along ``experts`` (ties: the lower expert), slots counted
    in token order along ``order``; a token past an expert's capacity is dropped there."""
    x = jnp.moveaxis(gates, (order, experts), (-2, -1))
    _, top = jax.lax.top_k(x, k)
    chosen = jnp.sum(jax.nn.one_hot(top, x.shape[-1], dtype=jnp.int32), axis=-2)
    slot = jnp.cumsum(chosen, axis=-2) - chosen  # tokens before this one that chose the expert
    mask = chosen[..., None] * jax.nn.one_hot(slot, capacity, dtype=gates.dtype)  # 0 past the capacity
    return jnp.moveaxis(mask, (-3, -2), (order, experts))
'''


def uses_route(steps: tuple[Step, ...]) -> bool:
    """Whether a plan's steps call ``route_topk``."""
    return any(isinstance(s.fn, Route) for s in steps)


def route_code(step: Step, var: Callable[[TensorRef], str], capacity: str) -> str:
    """One route step as one line of Python; ``capacity`` is C's local length, as code."""
    assert isinstance(step.fn, Route)
    order, experts, slots, k = step.fn.order, step.fn.experts, step.fn.slots, step.fn.k
    (gates,) = step.operands
    made = (*gates.indices, slots)
    code = (f"route_topk({var(gates)}, k={k}, capacity={capacity}, order={gates.indices.index(order)}, "
            f"experts={gates.indices.index(experts)})")
    if made == step.dst.indices:
        return code
    return f"jnp.transpose({code}, {tuple(made.index(i) for i in step.dst.indices)})"


def route_forward(x: Array, order: int, experts: int, capacity: int, k: int, xp: Any) -> Array:
    """The routing mask of whole gates ``x``: ``x``'s dims, then the capacity dim last."""
    y = xp.moveaxis(x, (order, experts), (-2, -1))
    top = xp.argsort(-y, axis=-1, stable=True)[..., :k]  # stable: ties to the lower expert
    chosen = xp.any(top[..., None] == xp.arange(y.shape[-1]), axis=-2)
    slot = xp.cumsum(chosen, axis=-2) - chosen
    hit = chosen[..., None] & (slot[..., None] == xp.arange(capacity))
    return xp.moveaxis(hit.astype(x.dtype), (-3, -2), (order, experts))
