"""Which layer body each slot of a pipelined program runs, where the spec has several ``layers`` blocks.

The model's layers are every layer of the first block, then the next block's (DeepSeek-V3: 3 dense
layers, then 58 MoE layers), and a stage holds a run of them, so a stage at a boundary between blocks
runs layers of two bodies (:mod:`shardc.pipeline.block_split`).  Every device runs one program (SPMD),
each virtual stage's slot k holding layer ``first + k`` of its run; slot k runs the body of that
layer's block, chosen by ``jax.lax.switch`` on a per-(virtual stage, slot) index where the virtual
stages differ there, called directly where they agree (always, with one block).  A device holds the
params of its own layers only, each slot's as long as the wider layer that can run there
(:mod:`shardc.lowering.pipeline_params`).

What a slot keeps for its backward (the residuals, and what B hands W) is one set of flat buffers, one
a dtype, sized to the largest of the blocks that can run there (:class:`Union`), not a buffer of each
block: a device runs one block at a slot, so its ring holds that block's values, as a stage on a real
cluster (Megatron-LM, DeepSpeed) allocates its own layers' only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from shardc.lowering.pipeline_parts import Part
from shardc.pipeline.block_split import block_bounds

__all__ = ["Body", "BodyTables", "Packed", "Placed", "Union", "body_tables", "own_run", "switch",
           "unpacked"]


@dataclass(frozen=True)
class Body:
    """One ``layers`` block's layer: its part (forward and backward), its input and params, its layers."""

    part: Part
    input: str
    params: tuple[str, ...]
    layers: int


@dataclass(frozen=True)
class BodyTables:
    """Each block's slots a virtual stage holds (``slots[b]``, the most any holds), and for virtual stage u's
    slot k: the block it runs (``which[u][k]``), its position in ``possible[k]`` (``branch[u][k]``);
    ``possible[k]``: the blocks some virtual stage runs at slot k."""

    slots: tuple[int, ...]
    which: tuple[tuple[int, ...], ...]
    branch: tuple[tuple[int, ...], ...]
    possible: tuple[tuple[int, ...], ...]


def _block_of(layer: int, bounds: list[tuple[int, int]]) -> int:
    return next((b for b, (lo, hi) in enumerate(bounds) if lo <= layer < hi), len(bounds) - 1)


def own_run(first: int, held: int, bound: tuple[int, int]) -> tuple[int, int]:
    """A virtual stage's layers of one block: its run [first, first + held) within the block's [lo, hi)."""
    return max(first, bound[0]), min(first + held, bound[1])


def body_tables(firsts: Sequence[int], held: Sequence[int], counts: Sequence[int]) -> BodyTables:
    """The tables of virtual stages whose runs start at ``firsts`` and hold ``held`` layers, the model's
    layers ``counts`` of each block in order.  An empty slot (past a stage's layers) runs the block of its
    stage's last layer at the position after it: its output and gradients are masked away."""
    bounds = block_bounds(counts)
    slots = tuple(max(max(0, hi - lo) for lo, hi in (own_run(f, n, bound) for f, n in zip(firsts, held, strict=True)))
                  for bound in bounds)
    width = max(held)
    which = [tuple(_block_of(first + min(k, n - 1), bounds) for k in range(width))
             for first, n in zip(firsts, held, strict=True)]
    possible = tuple(tuple(sorted({row[k] for row in which})) for k in range(width))
    branch = tuple(tuple(possible[k].index(b) for k, b in enumerate(row)) for row in which)
    return BodyTables(slots, tuple(which), branch, possible)


def switch(tables: BodyTables, k: int, virtual: Any, run: Callable[[int], Callable[..., Any]], *args: Any,
           pack: bool = False) -> Any:
    """``run(b)(*args)`` for the block b that slot k of virtual stage ``virtual`` runs, each ``run(b)``
    returning (a value, {b: its block's values}): called directly where one block can run there, else by
    ``jax.lax.switch`` over those that can (every branch returns one structure): with ``pack`` the
    block's values in the slot's :class:`Union` (what a ring keeps; where only one block can run too),
    else the others' values as zeros."""
    possible = tables.possible[k]
    shapes = {b: jax.eval_shape(run(b), *args)[1][b] for b in possible} if pack else {}
    union = Union.of(shapes) if pack else None
    if len(possible) == 1:
        got = run(possible[0])(*args)
        return (got[0], union.pack(got[1][possible[0]])) if union is not None else got
    shapes = shapes or {b: jax.eval_shape(run(b), *args)[1][b] for b in possible}

    def branch(b: int) -> Callable[..., Any]:
        def go(*xs: Any) -> Any:
            got = run(b)(*xs)
            if union is not None:
                return got[0], union.pack(got[1][b])
            return got[0], {c: got[1][c] if c == b else _zeros(shapes[c]) for c in possible}
        return go
    return jax.lax.switch(jnp.asarray(tables.branch)[virtual, k], [branch(b) for b in possible], *args)


@dataclass(frozen=True)
class Union:
    """The values several blocks keep at a slot, one block's at a time, in one flat buffer a dtype: each
    block's values (``trees[i]``, the leaves ``leaves[i]``: shape and dtype) laid end to end in the buffer
    of their dtype, each buffer (``sizes``: dtype and length) as long as the longest block's."""

    blocks: tuple[int, ...]
    trees: tuple[Any, ...]
    leaves: tuple[tuple[tuple[tuple[int, ...], str], ...], ...]
    sizes: tuple[tuple[str, int], ...]

    @staticmethod
    def of(shapes: dict[int, Any]) -> Union:
        """The union of each block's values of ``shapes`` (block -> a tree of shapes)."""
        leaves = tuple(tuple((tuple(a.shape), jnp.dtype(a.dtype).name) for a in jax.tree.leaves(s))
                       for s in shapes.values())
        need: dict[str, int] = {}
        for mine in leaves:
            for d in {d for _, d in mine}:
                need[d] = max(need.get(d, 0), sum(math.prod(s) for s, e in mine if e == d))
        return Union(tuple(shapes), tuple(jax.tree.structure(s) for s in shapes.values()), leaves,
                     tuple(sorted(need.items())))

    def size(self, b: int, dtype: str) -> int:
        """The elements of block b's values of ``dtype``."""
        return sum(math.prod(s) for s, d in self.leaves[self.blocks.index(b)] if d == dtype)

    def pack(self, values: Any) -> Packed:
        """One block's ``values`` in the buffers (zeros past them)."""
        flat = jax.tree.leaves(values)
        out = []
        for d, n in self.sizes:
            mine = [jnp.ravel(v) for v in flat if jnp.dtype(v.dtype).name == d]
            used = sum(v.size for v in mine)
            out.append(jnp.concatenate([*mine, jnp.zeros((n - used,), d)]) if mine else jnp.zeros((n,), d))
        return Packed(tuple(out), self)

    def unpack(self, b: int, buffers: dict[str, Any], start: dict[str, Any] | None = None) -> Any:
        """Block b's values read back out of ``buffers`` (by dtype), from ``start`` in each (0: the union's
        own buffers; a flat ring's offset, traced, where it keeps the slot: its block's length read only)."""
        i = self.blocks.index(b)
        at = {d: 0 for d, _ in self.sizes}
        out = []
        for shape, d in self.leaves[i]:
            n = math.prod(shape)
            piece = (buffers[d][at[d]:at[d] + n] if start is None
                     else jax.lax.dynamic_slice(buffers[d], (start[d] + at[d],), (n,)))
            out.append(piece.reshape(shape))
            at[d] += n
        return jax.tree.unflatten(self.trees[i], out)


@dataclass(frozen=True)
class Placed:
    """A slot's values where a flat ring keeps them (:class:`shardc.lowering.pipeline_keep.FlatRing`): its
    buffers and the slot's offset in each, by dtype; a backward reads its block's values out of them."""

    buffers: dict[str, Any]
    start: dict[str, Any]
    union: Union


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class Packed:
    """A slot's values as its :class:`Union` lays them out: a pytree of the buffers (the union static)."""

    buffers: tuple[Any, ...]
    union: Union

    def tree_flatten(self) -> tuple[tuple[Any, ...], Union]:
        return self.buffers, self.union

    @classmethod
    def tree_unflatten(cls, union: Union, buffers: Any) -> Packed:
        return cls(tuple(buffers), union)


def unpacked(stored: Any, b: int) -> Any:
    """Block b's values of what a slot keeps: read out of its union where several blocks can run there."""
    if isinstance(stored, Packed):
        return stored.union.unpack(b, {d: x for (d, _), x in zip(stored.union.sizes, stored.buffers, strict=True)})
    return stored.union.unpack(b, stored.buffers, stored.start) if isinstance(stored, Placed) else stored[b]


def _zeros(shapes: Any) -> Any:
    """Zeros of each of ``shapes`` (a tree of shapes)."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
