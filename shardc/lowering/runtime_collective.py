"""Collective matmul on one device's blocks: an einsum with its AllGather or ReduceScatter as a ring.

A lowered module calls these through :func:`shardc.lowering.runtime.allgather_einsum` and
``einsum_reducescatter`` inside ``jax.shard_map`` (the "Collective matmul" example of JAX's shard_map
documentation; Wang et al. 2023).  The ring runs over one mesh axis of n devices, each sending to the
next (``jax.lax.ppermute``), n - 1 sends in all:

- gathered operand: each step multiplies the block of the operand the device holds (its own first,
  then the one before it, ...) while it sends that block on; the other operands are sliced to the block
  along the gathered index, and the block's product lands at its place in the result (an index of the
  result) or is added up (a contracted index);
- reduce-scattered result: each step computes the partial result of one block of the scattered index,
  adds it to the accumulator received from the device before, and sends the sum on; the block a device
  computes at step j is the one that, passed on n - 1 - j times more, reaches its owner.

The axis is the minor-most of the index's axes, so a device's block along the index is its position on
the axis.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from shardc.lowering.runtime_ring import varying_zero

__all__ = ["ring_allgather_einsum", "ring_einsum_reducescatter"]

Array = Any


def _shift(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


def _block(x: Array, letters: str, letter: str, index: Any, size: int) -> Array:
    """Block ``index`` of ``size`` along index ``letter`` of ``x`` (whose indices are ``letters``), or
    ``x`` where it has no such index."""
    if letter not in letters:
        return x
    return jax.lax.dynamic_slice_in_dim(x, index * size, size, letters.index(letter))


def ring_allgather_einsum(subs: str, xs: tuple[Array, ...], k: int, dim: int, axis: str) -> Array:
    """``jnp.einsum(subs, *xs)`` with operand ``k`` gathered along its dim ``dim`` over ``axis`` first,
    the gather run as a ring under the block products."""
    ins, out = subs.split("->")
    names = ins.split(",")
    letter = names[k][dim]
    n, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    held = xs[k]
    size = held.shape[dim]
    result: Array | None = None
    for j in range(n):
        sent = jax.lax.ppermute(held, axis, _shift(n)) if j < n - 1 else held  # issued before the product
        src = (me - j) % n  # the device whose block is held now
        args = [held if i == k else _block(x, names[i], letter, src, size) for i, x in enumerate(xs)]
        part = jnp.einsum(subs, *args)
        if letter not in out:  # contracted: the blocks' products add up
            result = part if result is None else result + part
        else:
            d = out.index(letter)
            if result is None:
                shape = part.shape[:d] + (part.shape[d] * n,) + part.shape[d + 1:]
                result = jnp.zeros(shape, part.dtype) + varying_zero(part.dtype, part)
            result = jax.lax.dynamic_update_slice_in_dim(result, part, src * size, d)
        held = sent
    return result


def ring_einsum_reducescatter(subs: str, xs: tuple[Array, ...], dim: int, axis: str) -> Array:
    """``jnp.einsum(subs, *xs)``, partial over ``axis``, reduce-scattered along the result's dim ``dim``
    over ``axis``, the scatter run as a ring of partial sums under the block products."""
    ins, out = subs.split("->")
    names = ins.split(",")
    letter = out[dim]
    n, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    whole = next(x.shape[name.index(letter)] for x, name in zip(xs, names, strict=True) if letter in name)
    size = whole // n
    acc: Array | None = None
    for j in range(n):
        block = (me - j - 1) % n  # reaches its owner, device ``block``, after the n - 1 - j sends left
        part = jnp.einsum(subs, *(_block(x, name, letter, block, size) for x, name in zip(xs, names, strict=True)))
        acc = part if acc is None else acc + part
        if j < n - 1:
            acc = jax.lax.ppermute(acc, axis, _shift(n))
    return acc
