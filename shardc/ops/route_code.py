"""``route`` (top-k routing with capacity), as lowering and the numpy reference see it (for its
family, :mod:`shardc.ops.route`).

:func:`route_code` writes the planned step (:mod:`shardc.ops.route`: E and S
whole on the device) as one call of
:func:`shardc.lowering.runtime.route_topk` (``jax.lax.top_k`` along E, an
exclusive cumulative count along S), then a transpose to the result's index order.  :func:`route_forward` is the
same meaning written again for whole arrays (a stable argsort for the top k, ties
to the lower expert, as ``jax.lax.top_k`` breaks them), for
:mod:`shardc.lowering.reference`.  Token s takes slot c of expert e when e is
among its k largest gates and c tokens before it (along S) chose e; with c at
or past the capacity (C's length) it is dropped there (GShard, Lepikhin et al.
2020; Switch, Fedus et al. 2021).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from shardc.errors import ShardcError
from shardc.ir.localops import Route
from shardc.ir.plan import Step
from shardc.ir.spec import TensorRef

__all__ = ["route_code", "route_forward", "capacity_code", "node_limited"]

Array = Any

def capacity_code(tokens: str, order: str, slots: str, sizes: dict[str, int] | None) -> str:
    """The capacity as code: ``ceil(tokens * C / S)`` reduced, ``tokens`` the code of the token count
    (S's length, whole on the device) at run time, C and S at the given sizes: C at those sizes, the
    same capacity factor at any others."""
    if not sizes or slots not in sizes or order not in sizes:
        missing = slots if not sizes or slots not in sizes else order
        raise ShardcError(f"the routing index {missing} has no size here", fix=f"give {missing} a size in dims")
    share = math.gcd(sizes[slots], sizes[order])
    return f"-(-{tokens} * {sizes[slots] // share} // {sizes[order] // share})"


def route_code(step: Step, var: Callable[[TensorRef], str], capacity: str) -> str:
    """One route step as one line of Python; ``capacity`` is C's local length, as code."""
    assert isinstance(step.fn, Route)
    order, experts, slots, k = step.fn.order, step.fn.experts, step.fn.slots, step.fn.k
    (gates,) = step.operands
    made = (*gates.indices, slots)
    code = (f"route_topk({var(gates)}, k={k}, capacity={capacity}, order={gates.indices.index(order)}, "
            f"experts={gates.indices.index(experts)}{', by_choice=True' if step.fn.by_choice else ''})")
    if made == step.dst.indices:
        return code
    return f"jnp.transpose({code}, {tuple(made.index(i) for i in step.dst.indices)})"


def node_limited(y: Array, k: int, limit: int, groups: int, xp: Any) -> Array:
    """Gates ``y`` [..., E] with every expert outside each token's ``limit`` best groups at -inf.

    Node-limited routing as DeepSeek-V3 trains ("DeepSeek-V3 Technical Report", arXiv 2412.19437,
    section 2.1.2): the E experts lie in ``groups`` contiguous groups (a node's each), a group's score is
    the sum of its k / ``limit`` largest gates (at least one), and a token's top k are taken from the
    ``limit`` groups of highest score only (ties: the lower group, as ``jax.lax.top_k`` breaks them).
    """
    per = y.shape[-1] // groups
    grouped = xp.reshape(y, (*y.shape[:-1], groups, per))
    score = xp.sum(xp.sort(grouped, axis=-1)[..., per - max(1, k // limit):], axis=-1)
    best = xp.argsort(-score, axis=-1, stable=True)[..., :limit]
    keep = xp.any(best[..., None] == xp.arange(groups), axis=-2)
    return xp.where(xp.repeat(keep, per, axis=-1), y, -xp.inf)


def route_forward(x: Array, order: int, experts: int, capacity: int, k: int, xp: Any,
                  nodes: tuple[int, int] = (0, 0), by_choice: bool = False) -> Array:
    """The routing mask of whole gates ``x``: ``x``'s dims, then the capacity dim last; ``nodes``
    (limit, groups): node-limited (:func:`node_limited`), (0, 0): every expert; ``by_choice``: slots
    taken choice by choice (all tokens' first choices, then their second ones), else token by token."""
    y = xp.moveaxis(x, (order, experts), (-2, -1))
    if nodes[0]:
        y = node_limited(y, k, *nodes, xp)
    top = xp.argsort(-y, axis=-1, stable=True)[..., :k]  # stable: ties to the lower expert
    picks = top[..., None] == xp.arange(y.shape[-1])  # [..., S, k, E]
    chosen = xp.any(picks, axis=-2)
    if by_choice:  # a choice's slot: the same expert's picks before it, choice-major then token order
        ranked = xp.swapaxes(picks, -3, -2).astype(xp.int64)
        flat = xp.reshape(ranked, (*ranked.shape[:-3], -1, ranked.shape[-1]))
        before = xp.reshape(xp.cumsum(flat, axis=-2) - flat, ranked.shape)
        slot = xp.sum(before * ranked, axis=-3)
    else:
        slot = xp.cumsum(chosen, axis=-2) - chosen
    hit = chosen[..., None] & (slot[..., None] == xp.arange(capacity))
    return xp.moveaxis(hit.astype(x.dtype), (-3, -2), (order, experts))
