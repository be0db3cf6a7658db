"""The expert-parallel helpers a lowered module calls: index-based dispatch and combine, the routing of
:func:`shardc.lowering.runtime.route_topk` held as indices (GShard, Lepikhin et al. 2020; Switch, Fedus et
al. 2021; DeepSeek-V3's node-limited routing), and their gradients.

Gates come as [*batch, S, E], tokens as [*batch, S, *features], expert rows as [*batch, E, C, *features];
each helper flattens the batch and the features.  A lowered module imports them from
:mod:`shardc.lowering.runtime`, which holds them with the other helpers
(:func:`shardc.lowering.template.runtime_names`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["expert_dispatch", "expert_combine", "expert_dispatch_vjp", "expert_combine_vjp", "expert_gate_vjp"]

Array = Any


def _node_limited(g: Array, k: int, limit: int, groups: int) -> Array:
    """Gates [N, S, E] with the experts outside each token's ``limit`` best of ``groups`` groups at -inf: a
    group's score the sum of its k / limit largest gates (DeepSeek-V3's node-limited routing)."""
    per = g.shape[-1] // groups
    grouped = g.reshape(*g.shape[:-1], groups, per)
    score = jnp.sum(jax.lax.top_k(grouped, max(1, k // limit))[0], axis=-1)
    _, best = jax.lax.top_k(score, limit)
    keep = jnp.any(best[..., None] == jnp.arange(groups), axis=-2)
    return jnp.where(jnp.repeat(keep, per, axis=-1), g, -jnp.inf)


def _routing(gates: Array, k: int, capacity: int, limit: int = 0, groups: int = 0) -> tuple[Array, Array, Array,
                                                                                             Array]:
    """(flat gates [N, S, E], experts [N, S, k], slots [N, S, k] (``capacity`` where dropped), batch rows
    [N, 1, 1]) of ``gates``: each token's k largest gates (ties: the lower expert; with a ``limit``, among
    its best groups' experts only), its slot at each the count of earlier tokens that chose that expert."""
    g = gates.reshape(-1, *gates.shape[-2:])
    _, top = jax.lax.top_k(_node_limited(g, k, limit, groups) if limit else g, k)
    chosen = jnp.sum(jax.nn.one_hot(top, g.shape[-1], dtype=jnp.int32), axis=-2)
    before = jnp.cumsum(chosen, axis=-2) - chosen
    slot = jnp.minimum(jnp.take_along_axis(before, top, axis=-1), capacity)
    return g, top, slot, jnp.arange(g.shape[0])[:, None, None]


def _rows(x: Array, lead: int, inner: int) -> Array:
    """``x`` as [N, *its ``inner`` routing dims, features]: batch and features each flattened."""
    return x.reshape(-1, *x.shape[lead:lead + inner], math.prod(x.shape[lead + inner:]))


def _padded(rows: Array) -> Array:
    """Expert rows [N, E, C, F] with a zero slot C appended, where dropped choices read and write."""
    return jnp.pad(rows, ((0, 0), (0, 0), (0, 1), (0, 0)))


def expert_dispatch(gates: Array, x: Array, k: int, capacity: int, limit: int = 0,
                    groups: int = 0, each: bool = False) -> Array:
    """Each token's row of ``x`` written into its slot of each of its k experts: [*batch, E, C, *features]
    (an empty slot 0; a token past an expert's capacity is dropped there); ``each``: ``x`` is
    [*batch, S, E, *features] and a slot gets the row of its own expert."""
    lead, inner = gates.ndim - 2, 2 if each else 1
    _, top, slot, n = _routing(gates, k, capacity, limit, groups)
    xs = _rows(x, lead, inner)
    rows = (jnp.take_along_axis(xs, top[..., None], axis=2) if each
            else jnp.broadcast_to(xs[:, :, None], (*top.shape, xs.shape[-1])))
    out = jnp.zeros((xs.shape[0], gates.shape[-1], capacity + 1, xs.shape[-1]), x.dtype)
    out = out.at[n, top, slot].set(rows)
    return out[:, :, :capacity].reshape(*gates.shape[:-2], gates.shape[-1], capacity, *x.shape[lead + inner:])


def expert_combine(gates: Array, rows: Array, k: int, capacity: int, limit: int = 0,
                   groups: int = 0) -> Array:
    """Each token's k expert rows (its slots) weighted by its gates and summed: [*batch, S, *features]."""
    lead = gates.ndim - 2
    g, top, slot, n = _routing(gates, k, capacity, limit, groups)
    picked = _padded(_rows(rows, lead, 2))[n, top, slot]
    y = jnp.sum(jnp.take_along_axis(g, top, axis=-1)[..., None] * picked, axis=-2)
    return y.reshape(*gates.shape[:-1], *rows.shape[lead + 2:])


def expert_dispatch_vjp(gates: Array, d_rows: Array, k: int, capacity: int, limit: int = 0,
                        groups: int = 0, each: bool = False) -> Array:
    """The tokens' gradient of :func:`expert_dispatch`: each token's k slot rows of ``d_rows`` summed
    (``each``: each at its expert, [*batch, S, E, *features], 0 at the experts not chosen)."""
    lead = gates.ndim - 2
    _, top, slot, n = _routing(gates, k, capacity, limit, groups)
    picked = _padded(_rows(d_rows, lead, 2))[n, top, slot]
    if each:
        picked = jnp.sum(jax.nn.one_hot(top, gates.shape[-1], dtype=d_rows.dtype)[..., None] * picked[..., None, :],
                         axis=-3)
        return picked.reshape(*gates.shape, *d_rows.shape[lead + 2:])
    return jnp.sum(picked, axis=-2).reshape(*gates.shape[:-1], *d_rows.shape[lead + 2:])


def expert_combine_vjp(gates: Array, d_out: Array, k: int, capacity: int, limit: int = 0,
                       groups: int = 0) -> Array:
    """The expert rows' gradient of :func:`expert_combine`: each token's gate-weighted ``d_out`` row added
    into its slot of each of its experts."""
    lead = gates.ndim - 2
    g, top, slot, n = _routing(gates, k, capacity, limit, groups)
    ds = _rows(d_out, lead, 1)
    rows = jnp.take_along_axis(g, top, axis=-1)[..., None] * ds[:, :, None]
    out = jnp.zeros((ds.shape[0], g.shape[-1], capacity + 1, ds.shape[-1]), d_out.dtype).at[n, top, slot].add(rows)
    return out[:, :, :capacity].reshape(*gates.shape[:-2], g.shape[-1], capacity, *d_out.shape[lead + 1:])


def expert_gate_vjp(gates: Array, d_out: Array, rows: Array, k: int, capacity: int, limit: int = 0,
                    groups: int = 0) -> Array:
    """The gates' gradient of :func:`expert_combine`: at each chosen expert, ``d_out``'s row dotted with
    that expert's row of the token (0 where the token was dropped); 0 at the experts not chosen."""
    lead = gates.ndim - 2
    g, top, slot, n = _routing(gates, k, capacity, limit, groups)
    picked = _padded(_rows(rows, lead, 2))[n, top, slot]
    dots = jnp.sum(picked * _rows(d_out, lead, 1)[:, :, None], axis=-1)
    grad = jnp.sum(jax.nn.one_hot(top, g.shape[-1], dtype=gates.dtype) * dots[..., None], axis=-2)
    return grad.reshape(gates.shape)
