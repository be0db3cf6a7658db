"""Where a pipelined program keeps each microbatch's residuals from its forward to its backward.

With one ``layers`` block every stage keeps the same values a microbatch, so the ring is a buffer of
each value with a leading dim of the ring's slots (:class:`TreeRing`,
:mod:`shardc.lowering.pipeline_slots`).  With several blocks a stage's microbatch keeps its own
layers' residuals: a dense stage's are smaller than an MoE stage's, and the first stage keeps more
microbatches than the last (1F1B: stages - s of them).  A ring of each device's most microbatches
times the largest layers would hold the first stage's count of the last stages' layers; here
(:class:`FlatRing`) each dtype's residuals lie in one flat buffer, a device's ring slot i taking from
``start[device, i]`` as many elements as the largest chunk whose microbatches that slot holds there,
each layer of it at its own offset and length, so the buffer is as long as the fullest device's slots of
its own layers (SPMD: one length on every device), as a stage on a real cluster (Megatron-LM, DeepSpeed)
keeps its own layers' only.  A slot as long as the device's largest chunk (a stride) held under
DualPipe, ZBV and DualPipeV, whose devices each hold a dense and a wide chunk, every microbatch as the
wide one's: 5 slots of 2 wide layers under DualPipe in the 3 + 5 run (360 kB), where device 1 keeps 3 of
its dense-and-wide stage and 2 of its wide one (312 kB)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardc.lowering.pipeline_bodies import Packed, Placed, Union

__all__ = ["FlatRing", "TreeRing"]


@dataclass(frozen=True)
class TreeRing:
    """A buffer of each kept value, its leading dim the ring's ``count`` slots."""

    shapes: Any
    count: int

    def empty(self) -> Any:
        return jax.tree.map(lambda a: jnp.zeros((self.count,) + a.shape, a.dtype), self.shapes)

    def write(self, bufs: Any, values: Any, stage: Any, chunk: Any, virtual: Any, slot: Any, live: Any) -> Any:
        return jax.tree.map(lambda buf, r: jnp.where(live, buf.at[slot].set(r), buf), bufs, values)

    def read(self, bufs: Any, stage: Any, chunk: Any, slot: Any) -> Any:
        return jax.tree.map(lambda buf: buf[slot], bufs)


@dataclass(frozen=True)
class FlatRing:
    """Each dtype's kept values in one flat buffer (``dtypes``, ``total``: each buffer's length): layer k of
    a microbatch of chunk c in device s's ring slot i at ``start[s, i] + offset[s, c, k]``, ``length[u, k]``
    long on virtual stage u (the block it runs there), read and written as slot k's :class:`Union`."""

    unions: tuple[Union, ...]
    dtypes: tuple[str, ...]
    offset: np.ndarray  # [device, chunk, slot, dtype]
    start: np.ndarray  # [device, ring slot, dtype]
    length: np.ndarray  # [virtual stage, slot, dtype]
    total: tuple[int, ...]

    @staticmethod
    def of(unions: Sequence[Union], which: Sequence[Sequence[int]], virtual: np.ndarray,
           table: Sequence[Sequence[int]], held: Sequence[Sequence[int]] = ()) -> FlatRing:
        """The ring of each slot's ``unions``, virtual stage u's slot k running block ``which[u][k]``, chunk
        c of device s virtual stage ``virtual[c, s]``, device s's entries (chunk x M + microbatch) in ring
        slots ``table[s]``, ``held[s]`` those it holds (every entry where not given)."""
        dtypes = tuple(sorted({d for un in unions for d, _ in un.sizes}))
        length = np.array([[[un.size(which[u][k], d) for d in dtypes] for k, un in enumerate(unions)]
                           for u in range(len(which))], dtype=np.int64).reshape(len(which), len(unions), len(dtypes))
        chunks, devices = virtual.shape
        mine = length[virtual.T]  # [device, chunk, slot, dtype]
        offset = np.cumsum(mine, axis=2) - mine
        whole = mine.sum(axis=2)  # [device, chunk, dtype]: a microbatch of the chunk
        micro = len(table[0]) // chunks
        entries = [list(held[s]) if held else list(range(len(table[s]))) for s in range(devices)]
        size = np.zeros((devices, max(max(row) for row in table) + 1, len(dtypes)), np.int64)
        for s in range(devices):  # each ring slot as long as the largest chunk it holds on the device
            for e in entries[s]:
                size[s, table[s][e]] = np.maximum(size[s, table[s][e]], whole[s, e // micro])
        start = np.cumsum(size, axis=1) - size
        widest = np.array([[dict(un.sizes).get(d, 0) for d in dtypes] for un in unions])  # [slot, dtype]
        ends = [start[s, table[s][e]] + offset[s, e // micro] + widest for s in range(devices) for e in entries[s]]
        total = np.max(ends, axis=(0, 1)) if ends else np.zeros(len(dtypes), np.int64)
        return FlatRing(tuple(unions), dtypes, offset, start, length, tuple(int(n) for n in total))

    def empty(self) -> tuple[Any, ...]:
        return tuple(jnp.zeros((n,), d) for n, d in zip(self.total, self.dtypes, strict=True))

    def _at(self, stage: Any, chunk: Any, slot: Any, k: int) -> Any:
        """Each dtype's offset of slot k of ring slot ``slot`` of the device's chunk."""
        return jnp.asarray(self.start)[stage, slot] + jnp.asarray(self.offset)[stage, chunk, k]

    def write(self, bufs: tuple[Any, ...], values: list[Packed], stage: Any, chunk: Any, virtual: Any, slot: Any,
              live: Any) -> tuple[Any, ...]:
        """``bufs`` with each layer's ``values`` written at ring slot ``slot`` where ``live``: its block's
        length of them (the union's tail, another block's room, left as it was)."""
        out = list(bufs)
        for k, packed in enumerate(values):
            at, own = self._at(stage, chunk, slot, k), jnp.asarray(self.length)[virtual, k]
            for (d, n), value in zip(packed.union.sizes, packed.buffers, strict=True):
                i = self.dtypes.index(d)
                old = jax.lax.dynamic_slice(out[i], (at[i],), (n,))
                new = jnp.where(live & (jnp.arange(n) < own[i]), value, old)
                out[i] = jax.lax.dynamic_update_slice(out[i], new, (at[i],))
        return tuple(out)

    def read(self, bufs: tuple[Any, ...], stage: Any, chunk: Any, slot: Any) -> list[Placed]:
        """Where each layer's values lie at ring slot ``slot`` of the device's chunk: a backward reads its
        block's values out of them (its own length, not the union's)."""
        out = []
        for k, union in enumerate(self.unions):
            at = self._at(stage, chunk, slot, k)
            out.append(Placed(dict(zip(self.dtypes, bufs, strict=True)),
                              {d: at[i] for i, d in enumerate(self.dtypes)}, union))
        return out
