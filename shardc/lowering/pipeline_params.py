"""Where a pipelined program holds its layers' params, their gradient sums and the gradients it returns.

With one ``layers`` block every virtual stage's slot k runs the same layer, so each param is passed
stacked [stages x chunks x slots, ...], sharded over the stage axis: a device holds the rows of its own
chunks' slots (:class:`Stacked`, the SPMD pipeline of JAX's ``shard_map`` documentation), its gradient
sums likewise.  With several blocks (DeepSeek-V3's 3 dense layers, then 58 MoE layers) a slot runs
the block of its layer, and which block differs between stages: a stack of each block's params over
the slots any stage runs it at put both blocks' on every device (the 3 + 5 run over 4 stages of 2
layers: 4 layers' params and gradient sums on each, where a stage holds 2).  There (:class:`Flat`) a
device's own layers' params lie in one flat buffer a dtype, each param as this device's shard of it
over the other mesh axes: chunk c's slot k at the device's own offset, laid out as slot k's
:class:`~shardc.lowering.pipeline_bodies.Union` lays out the block it runs there, the buffer as long as
the fullest device's (SPMD: one length on every device), as Megatron-LM, DeepSpeed and torchtitan
build a stage of its own layers only.  The gradient sums and the gradients the program returns lie so
too, each slot as long as its own block's (the offsets: a
:class:`~shardc.lowering.pipeline_keep.FlatRing` of one entry a chunk).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from shardc.lowering.pipeline_bodies import Body, BodyTables, Packed, Union, switch
from shardc.lowering.pipeline_parts import Arrays
from shardc.lowering.pipeline_routes import Placement
from shardc.pipeline.block_split import block_bounds

__all__ = ["Flat", "Held", "Stacked"]


@dataclass(frozen=True)
class Slots:
    """What a holding reads of its pipeline: the blocks, which block each virtual stage's slot runs, the
    layers each virtual stage holds from its first, where the chunks sit, and the mesh."""

    bodies: tuple[Body, ...]
    tables: BodyTables
    held: tuple[int, ...]
    firsts: tuple[int, ...]
    placement: Placement
    axis: str
    mesh: tuple[tuple[str, int], ...]

    def layer(self, virtual: int, k: int) -> tuple[int, int] | None:
        """The block of virtual stage ``virtual``'s slot k and its layer in that block; None past its layers."""
        if k >= self.held[virtual]:
            return None
        b = self.tables.which[virtual][k]
        return b, self.firsts[virtual] + k - block_bounds([body.layers for body in self.bodies])[b][0]

    def live(self, virtual: Any, k: int) -> Any:
        """Whether slot k of ``virtual`` (traced) holds a layer: its writes of an empty one are masked."""
        return k < jnp.asarray(self.held)[virtual]


@dataclass(frozen=True)
class Stacked:
    """One block's params, each stacked [stages x chunks x slots, ...] over the stage axis."""

    slots: Slots
    slot_layers: tuple[int, ...]  # each device's slots in order, the layer each holds (the count: none)

    @property
    def body(self) -> Body:
        return self.slots.bodies[0]

    def specs(self) -> tuple[P, ...]:
        return tuple(P(self.slots.axis, *self.body.part.forward_in[p]) for p in self.body.params)

    def host(self, inputs: Arrays) -> list[Any]:
        """Each param stacked [its layers, ...] as the stages' slots hold it, zeros in an empty slot."""
        out = []
        for p in self.body.params:
            w = np.asarray(inputs[p])
            out.append(np.concatenate([w, np.zeros((1, *w.shape[1:]), w.dtype)])[np.asarray(self.slot_layers)])
        return out

    def layer(self, params: tuple[Any, ...], b: int, chunk: Any, virtual: Any, k: int) -> Arrays:
        """The params of slot k of the device's chunk (its rows are chunk x slots + k)."""
        at = chunk * self.slots.tables.slots[0] + k
        return {p: w[at] for p, w in zip(self.body.params, params, strict=True)}

    def zeros(self, grads: list[Any]) -> tuple[Any, ...]:
        """The gradient sums, each [chunks x slots, ...] of what a slot's backward hands on (``grads``)."""
        n = self.slots.placement.chunks * self.slots.tables.slots[0]
        return tuple(jnp.zeros((n, *grads[0][0][p].shape), grads[0][0][p].dtype) for p in self.body.params)

    def accumulate(self, total: tuple[Any, ...], grads: list[Any], ran: Any, chunk: Any,
                   virtual: Any) -> tuple[Any, ...]:
        """The sums with each slot's ``grads`` added at its row, where a backward ``ran`` there."""
        out = list(total)
        for k, mine in enumerate(grads):
            live, at = ran & self.slots.live(virtual, k), chunk * self.slots.tables.slots[0] + k
            out = [t.at[at].add(jnp.where(live, mine[0][p], 0)) for t, p in zip(out, self.body.params, strict=True)]
        return tuple(out)

    def finish(self, total: tuple[Any, ...]) -> tuple[Any, ...]:
        """Each slot's params' gradients from their sums (DualPipe's two copies' summed first)."""
        mine = self.slots.placement.sum_copies(self.slots.axis, total, self.slots.tables.slots[0])
        layers = [self.body.part.finish({p: d[k] for p, d in zip(self.body.params, mine, strict=True)})
                  for k in range(mine[0].shape[0])]
        return tuple(jnp.stack([g[p] for g in layers]) for p in self.body.params)

    def gradients(self, out: tuple[Any, ...]) -> Arrays:
        """Each param's gradient stacked [its layers, ...] (a layer's first slot: DualPipe's copies agree)."""
        first: dict[int, int] = {}
        for k, layer in enumerate(self.slot_layers):
            first.setdefault(layer, k)
        real = np.asarray([first[layer] for layer in range(self.body.layers)])
        return {self.body.part.grads[p]: g[real] for p, g in zip(self.body.params, out, strict=True)}


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class Held:
    """A device's own layers' values in one flat buffer a dtype (``buffers``, each [length], or [1, ...,
    length] over the mesh outside the program), slot k laid out as ``unions[k]`` (static)."""

    buffers: tuple[Any, ...]
    unions: tuple[Union, ...]

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Union, ...]]:
        return self.buffers, self.unions

    @classmethod
    def tree_unflatten(cls, unions: tuple[Union, ...], buffers: Any) -> Held:
        return cls(tuple(buffers), unions)


@dataclass(frozen=True)
class Chunked:
    """Where each slot of a device's chunks lies in its flat buffers: chunk c's slot k at ``c x length[d] +
    start[k][d]`` in the buffer of dtype d, each slot as long as its union (the larger block that runs
    there), the same on every device."""

    dtypes: tuple[str, ...]
    start: tuple[dict[str, int], ...]
    length: dict[str, int]

    @staticmethod
    def of(unions: Sequence[Union]) -> Chunked:
        dtypes = tuple(sorted({d for union in unions for d, _ in union.sizes}))
        at, start = dict.fromkeys(dtypes, 0), []
        for union in unions:
            start.append(dict(at))
            for d, n in union.sizes:
                at[d] += n
        return Chunked(dtypes, tuple(start), at)

    def at(self, chunk: Any, k: int) -> dict[str, Any]:
        return {d: chunk * self.length[d] + self.start[k][d] for d in self.dtypes}


@dataclass(frozen=True)
class Flat:
    """Several blocks' params, each device's own layers' in one flat buffer a dtype (the module doc)."""

    slots: Slots

    @functools.cached_property
    def virtual(self) -> np.ndarray:
        """Virtual stage by [chunk, device]."""
        place = self.slots.placement
        return np.array([[place.virtual(c, s) for s in range(place.stages)] for c in range(place.chunks)])

    def specs(self) -> tuple[P, ...]:
        return (P(*(n for n, _ in self.slots.mesh)),)

    def elements(self, per_layer: Sequence[int]) -> int:
        """The length of a buffer of a device's layers of one dtype, a layer of block b ``per_layer[b]``
        elements long."""
        return self.slots.placement.chunks * sum(max(per_layer[b] for b in possible)
                                                 for possible in self.slots.tables.possible)

    def _chunk(self, chunk: Any) -> Any:
        return 0 if self.slots.placement.chunks == 1 else chunk  # static where a device holds one chunk

    def _local(self, shape: Sequence[int], spec: P) -> tuple[int, ...]:
        """A param's shape on a device."""
        sizes = dict(self.slots.mesh)
        return tuple(n // math.prod(sizes[a] for a in cut) for n, cut in zip(shape, _cuts(spec, len(shape)),
                                                                           strict=True))

    def _piece(self, shape: Sequence[int], spec: P, device: tuple[int, ...]) -> tuple[slice, ...]:
        """Device ``device``'s (its place on the mesh) block of a param of ``shape`` laid out as ``spec``."""
        names, sizes = [n for n, _ in self.slots.mesh], dict(self.slots.mesh)
        out = []
        for n, cut in zip(self._local(shape, spec), _cuts(spec, len(shape)), strict=True):
            j = 0
            for a in cut:  # several axes on a dim: the first the major (as a NamedSharding cuts it)
                j = j * sizes[a] + device[names.index(a)]
            out.append(slice(j * n, (j + 1) * n))
        return tuple(out)

    def _places(self) -> Any:
        """Each device (its place on the mesh), chunk and slot holding a layer: (device, chunk, slot, block,
        its layer of the block)."""
        slots = self.slots
        stage_dim = [n for n, _ in slots.mesh].index(slots.axis)
        for device in np.ndindex(*(n for _, n in slots.mesh)):
            for c, u in enumerate(self.virtual[:, device[stage_dim]]):
                for k in range(len(slots.tables.possible)):
                    got = slots.layer(int(u), k)
                    if got is not None:
                        yield device, c, k, *got

    def host(self, inputs: Arrays) -> list[Any]:
        """Every device's own layers' params (each its shard) packed in its buffers, zeros in an empty slot."""
        bodies = self.slots.bodies
        unions = tuple(Union.of({b: {p: jax.ShapeDtypeStruct(self._local(inputs[p].shape[1:], bodies[b].part
                                                                         .forward_in[p]), inputs[p].dtype)
                                     for p in bodies[b].params} for b in possible})
                       for possible in self.slots.tables.possible)
        lay = Chunked.of(unions)
        mesh = tuple(n for _, n in self.slots.mesh)
        bufs = {d: np.zeros((*mesh, self.slots.placement.chunks * lay.length[d]), d) for d in lay.dtypes}
        for device, c, k, b, layer in self._places():
            at = lay.at(c, k)
            pieces = {p: np.asarray(inputs[p][layer][self._piece(inputs[p].shape[1:], bodies[b].part.forward_in[p],
                                                                 device)]) for p in bodies[b].params}
            for d in lay.dtypes:  # in the union's order: the params by name, each dtype's end to end
                mine = [pieces[p].ravel() for p in sorted(pieces) if pieces[p].dtype.name == d]
                if mine:
                    flat = np.concatenate(mine)
                    bufs[d][device][at[d]:at[d] + flat.size] = flat
        return [Held(tuple(bufs[d] for d in lay.dtypes), unions)]

    def layer(self, params: tuple[Any, ...], b: int, chunk: Any, virtual: Any, k: int) -> Arrays:
        """Block b's params of slot k of the device's chunk, read out of its buffers (b's own length)."""
        held = params[0]
        lay = Chunked.of(held.unions)
        bufs = {d: x.reshape(-1) for d, x in zip(lay.dtypes, held.buffers, strict=True)}
        return held.unions[k].unpack(b, bufs, lay.at(self._chunk(chunk), k))

    def zeros(self, grads: list[Packed]) -> Held:
        """The gradient sums, slot k laid out as ``grads[k]`` (what a slot's backward hands on) is."""
        unions = tuple(g.union for g in grads)
        lay = Chunked.of(unions)
        n = self.slots.placement.chunks
        return Held(tuple(jnp.zeros((n * lay.length[d],), d) for d in lay.dtypes), unions)

    def accumulate(self, total: Held, grads: list[Packed], ran: Any, chunk: Any, virtual: Any) -> Held:
        """The sums with each slot's ``grads`` added at its place, where a backward ``ran`` there."""
        lay = Chunked.of(total.unions)
        out = dict(zip(lay.dtypes, total.buffers, strict=True))
        for k, packed in enumerate(grads):
            live, at = ran & self.slots.live(virtual, k), lay.at(self._chunk(chunk), k)
            for (d, n), value in zip(packed.union.sizes, packed.buffers, strict=True):
                old = jax.lax.dynamic_slice(out[d], (at[d],), (n,))
                out[d] = jax.lax.dynamic_update_slice(out[d], old + jnp.where(live, value, 0), (at[d],))
        return Held(tuple(out[d] for d in lay.dtypes), total.unions)

    def finish(self, total: Held) -> tuple[Held]:
        """Each slot's params' gradients from their sums, its block's reductions run on them (DualPipe's two
        copies' sums added first: device s and stages - 1 - s swap their buffers, each adding the other's
        chunk 1 to its chunk 0 and its chunk 0 to its chunk 1, the same model stages), laid out as the params."""
        slots, stage = self.slots, jax.lax.axis_index(self.slots.axis)
        lay = Chunked.of(total.unions)
        sums = dict(zip(lay.dtypes, total.buffers, strict=True))
        if slots.placement.two_way:
            pairs = [(s, slots.placement.stages - 1 - s) for s in range(slots.placement.stages)]
            got = jax.lax.ppermute(sums, slots.axis, pairs)
            sums = {d: x + jnp.roll(got[d], lay.length[d]) for d, x in sums.items()}
        made = []
        for c in range(slots.placement.chunks):
            u = jnp.asarray(self.virtual)[c, stage]
            for k, union in enumerate(total.unions):
                mine = lay.at(c, k)

                def run(b: int, union: Union = union, at: dict[str, int] = mine) -> Any:
                    return lambda _: (0.0, {b: slots.bodies[b].part.finish(union.unpack(b, sums, at))})
                made.append(switch(slots.tables, k, u, run, 0.0, pack=True)[1])
        unions = tuple(g.union for g in made[:len(total.unions)])
        dtypes, ones = Chunked.of(unions).dtypes, (1,) * len(slots.mesh)
        grads = [jnp.concatenate([x for g in made for (e, _), x in zip(g.union.sizes, g.buffers, strict=True)
                                  if e == d]) for d in dtypes]
        return (Held(tuple(g.reshape(ones + g.shape) for g in grads), unions),)

    def gradients(self, out: tuple[Any, ...]) -> Arrays:
        """Each param's gradient stacked [its layers, ...], each device's shard of each of its layers put
        in place (DualPipe's two copies hold one sum)."""
        held, bodies, sizes = out[0], self.slots.bodies, dict(self.slots.mesh)
        lay = Chunked.of(held.unions)
        bufs = {d: np.asarray(x) for d, x in zip(lay.dtypes, held.buffers, strict=True)}
        grads: dict[str, Any] = {}
        for device, c, k, b, layer in self._places():
            union, at = held.unions[k], lay.at(c, k)
            for p, (shape, d) in zip(sorted(bodies[b].params), union.leaves[union.blocks.index(b)], strict=True):
                spec, n = bodies[b].part.forward_in[p], math.prod(shape)
                whole = tuple(n * math.prod(sizes[a] for a in cut)
                              for n, cut in zip(shape, _cuts(spec, len(shape)), strict=True))
                g = grads.setdefault(bodies[b].part.grads[p], np.zeros((bodies[b].layers, *whole), d))
                g[layer][self._piece(whole, spec, device)] = bufs[d][device][at[d]:at[d] + n].reshape(shape)
                at = {**at, d: at[d] + n}
        return grads


def _cuts(spec: P, ndim: int) -> tuple[tuple[str, ...], ...]:
    """The mesh axes that cut each of the ``ndim`` dims of an array laid out as ``spec``."""
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e)
                 for e in (*spec, *[None] * (ndim - len(spec))))
