"""A pipelined module's program, as ordinary Python: any schedule's tick table, the block, its ends.

The SPMD pipeline of JAX's ``shard_map`` documentation: one ``shard_map`` over every
mesh axis, each device holding its stage's layers (params stacked on a leading layer
dim sharded over the stage axis; under an uneven split, the cost's, every stage runs as
many slots as the fullest holds, and a slot past its own layers holds zeros and hands
its input on).  A schedule is a tick table: at tick t stage s runs the forward of
microbatch ``forward[t][s]`` and the backward of ``backward[t][s]`` (-1: none), as the
simulated order places them, a unit of it a tick (a DualPipe F&B pair's F and B in one)
(:mod:`shardc.pipeline.ticks`).  :class:`Pipeline` runs any table the same way: a
``fori_loop`` over the ticks (one compiled body), in which every device runs its stage
forward and backward masked by the table (SPMD: one program for all), keeps each
microbatch's residuals until its backward (in a ring of the microbatches the table keeps in flight:
:mod:`shardc.lowering.pipeline_slots`), and sends with ``jax.lax.ppermute`` its
activation down and its cotangent up (the receiver keeps what the table says was
really sent; where the chunks sit and which sends reach them:
:mod:`shardc.lowering.pipeline_routes`).  Under the zero-bubble schedules (ZB-H1, ZBV,
DualPipeV, DualPipe) a third table, ``weight_ticks``, places the weight gradients: the backward tick
then runs the input's gradient only (B) and keeps what the weights' gradient (W) reads of it
until W's tick (:mod:`shardc.lowering.pipeline_split`).  Each layer's forward and backward
are the stage plan's own, so the
collectives on the other axes are the planned ones in both directions; a weight
gradient's reduction runs once, after the loop, on the sum of the microbatches' partial
gradients (:meth:`Part.finish`, :mod:`shardc.lowering.pipeline_grads`).  With several ``layers``
blocks each slot runs its layer's block, a device holds its own layers' params in flat buffers
(:mod:`shardc.lowering.pipeline_params`), and a slot's ring keeps one block's residuals at a time, in
buffers as long as the larger's (:mod:`shardc.lowering.pipeline_bodies`).

What comes before the block and after it is an :class:`Ends`: for a block alone
(:class:`BlockEnds`) stage 0 reads the microbatches and the last stage keeps the
outputs and reads their cotangents; for a ``layers L { ... }`` block in a whole model
(:class:`ModelEnds`, Megatron-LM's placement) stage 0 runs the statements before the
block and the last stage those after it, ending in the loss, whose backward runs at
once (the loss's cotangent over M: the batch's loss is the microbatches' mean).  A lowered module
builds its pipeline from its globals (:mod:`shardc.lowering.pipeline_build`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardc.lowering.pipeline_bodies import Body, BodyTables, body_tables, switch, unpacked
from shardc.lowering.pipeline_carried import Carried, fed_values, input_grad
from shardc.lowering.pipeline_keep import FlatRing, TreeRing
from shardc.lowering.pipeline_params import Flat, Slots, Stacked
from shardc.lowering.pipeline_parts import Arrays, Ends, Part, Table, forward_only
from shardc.lowering.pipeline_routes import Placement
from shardc.lowering.pipeline_slots import Rings, rings
from shardc.lowering.pipeline_slots import paired as pairs
from shardc.lowering.runtime import make_mesh
from shardc.lowering.runtime_ring import zigzag_order
from shardc.spec.functions import layer_key
from shardc.spec.stages import split_layers

__all__ = ["Pipeline"]

@dataclass
class Pipeline:
    """The block's ``layers`` layers over the stages of ``axis`` of the mesh ``mesh_axes``, ``ends``
    around it, in the order of the tick tables ``forward_ticks`` and ``backward_ticks``.

    ``params``: the (first) block's, each passed stacked [its layers, ...]; ``dims``: the microbatch dim of
    each data input of the whole batch (and of the block's output, keyed so).  ``chunks``: the
    model chunks a device holds (V of Megatron-LM's interleaved schedule, 2 in a ``v_shape``, else 1),
    each a virtual stage, a run of layers (:class:`~shardc.lowering.pipeline_routes.Placement`: chunk x
    stages + stage, or in a V stage and 2 stages - 1 - stage); a tick table's entry is chunk x M +
    microbatch."""

    mesh_axes: dict[str, int]
    axis: str
    layers: int
    microbatches: int
    forward_ticks: Table
    backward_ticks: Table
    block: Part
    block_input: str
    params: tuple[str, ...]
    ends: Ends
    dims: dict[str, int]
    chunks: int = 1
    stage_layers: tuple[int, ...] | None = None  # the layers each stage holds, where not the even split
    # the zero-bubble schedules' W ticks: at tick t stage s runs the weight gradient of weight_ticks[t][s]
    # (B_TABLE's then the input's gradient only); None: each backward whole, at its B tick
    weight_ticks: Table | None = None
    v_shape: bool = False  # the chunks in a V (ZBV, DualPipeV: shardc.lowering.pipeline_routes), else interleaved
    two_way: bool = False  # DualPipe's two directions on the V's places, each chunk a whole stage held twice
    # the arrays entering or leaving the pipeline whose sequence axes it holds in zig-zag order (name -> axes
    # of the whole array; shardc.planner.zigzag_order), and their chunk count: permuted once as they enter
    # stage 0 or the last stage, so every stage's sends carry that order, and put back as they leave
    zigzag: dict[str, tuple[int, ...]] = field(default_factory=dict)
    zigzag_chunks: int = 0
    # several `layers` blocks: each later block's body (its part, input and params), and every block's layers
    # (the first's the block above); a slot runs its layer's block's body (shardc.lowering.pipeline_bodies)
    more: tuple[Body, ...] = ()
    block_layers: tuple[int, ...] | None = None
    # values made before the block that its layers read beside the input (E beside X0), fed by the layer's
    # output as the input is: the model's first layer reads stage 0's (the ends' ``first``), a later one its
    # input, so nothing more is sent (shardc.pipeline.boundary.fed_beside)
    fed: tuple[str, ...] = ()
    # values made before the block that the statements after it read: each rides with the activation every
    # stage hands on, and its gradient back with the activation's (shardc.lowering.pipeline_carried)
    riders: tuple[str, ...] = ()
    _programs: dict[bool, Any] = field(default_factory=dict, repr=False)

    @property
    def stages(self) -> int:
        return self.mesh_axes[self.axis]

    @property
    def placement(self) -> Placement:
        """Which virtual stage each device's chunks are, and the sends between them."""
        return Placement(self.stages, self.chunks, self.v_shape, self.two_way)

    @functools.cached_property
    def rings(self) -> Rings:
        """The buffers' rings: a slot for each value the tick tables keep in flight at once, not one a
        microbatch (:mod:`shardc.lowering.pipeline_slots`)."""
        return rings(self.placement, self.microbatches, self.forward_ticks, self.backward_ticks, self.weight_ticks)

    @property
    def held(self) -> tuple[int, ...]:
        """The layers each virtual stage holds, as the cost splits them (the spec's ``stage_layers``, else
        :func:`split_layers`; DualPipe's virtual stages each a model stage's)."""
        place, given = self.placement, self.stage_layers
        split = given if given is not None else split_layers(self.layers, place.model_stages)
        return tuple(split[place.model(u)] for u in range(place.virtual_stages)) if place.two_way else split

    @property
    def slots(self) -> int:
        """The layers every virtual stage runs (SPMD: one program): the most any holds.  Under an uneven
        split a slot past a stage's own layers holds zeros and hands its input on unchanged."""
        return max(self.held)

    @property
    def bodies(self) -> tuple[Body, ...]:
        """Every block's layer body, in the model's order."""
        counts = self.block_layers or (self.layers,)
        return (Body(self.block, self.block_input, self.params, counts[0]), *self.more)

    @functools.cached_property
    def tables(self) -> BodyTables:
        """Which body each virtual stage's slot runs, and where its params lie."""
        return body_tables(self._firsts(), self.held, [b.layers for b in self.bodies])

    @functools.cached_property
    def holding(self) -> Stacked | Flat:
        """Where a device holds its layers' params and their gradient sums (:mod:`shardc.lowering.pipeline_params`):
        each param stacked over the stages' slots with one block, each device's own in flat buffers with several."""
        slots = Slots(self.bodies, self.tables, self.held, tuple(self._firsts()), self.placement, self.axis,
                      tuple(self.mesh_axes.items()))
        return Flat(slots) if len(self.bodies) > 1 else Stacked(slots, tuple(self.slot_layers()))

    def _firsts(self) -> list[int]:
        """Each virtual stage's first layer (DualPipe's: its model stage's)."""
        place = self.placement
        return [sum(self.held[:place.model(v)]) for v in range(len(self.held))]

    def slot_layers(self) -> list[int]:
        """Each device's slots in order (its chunks in turn), the layer each holds (the layer count for an
        empty one): the order of a one-block pipeline's params' leading dim, sharded over the stages."""
        place, firsts = self.placement, self._firsts()
        order = [place.virtual(c, s) for s in range(self.stages) for c in range(self.chunks)]
        return [firsts[u] + k if k < self.held[u] else self.layers for u in order for k in range(self.slots)]

    @functools.cached_property
    def shared(self) -> dict[str, P]:
        """The inputs a layer reads beside its input and params (an ALiBi bias, a position table: no batch
        dim, :func:`shardc.pipeline.boundary.check_lowerable`), each the same for every microbatch and
        layer: every stage holds it whole, laid out over the other axes as the block's forward reads it
        (as Megatron-DeepSpeed's stages each build BLOOM's ALiBi tensor), passed after the params."""
        return {k: b.part.forward_in[k] for b in self.bodies for k in b.part.forward_in
                if k != b.input and k not in b.params and k not in self.fed}

    def _layer(self, params: tuple[Any, ...], b: int, chunk: Any, virtual: Any, k: int) -> Arrays:
        """What slot k's layer reads beside its input: its params (``params``: the holding's, then the
        :attr:`shared` inputs) and the shared inputs."""
        own = len(params) - len(self.shared)
        return dict(zip(self.shared, params[own:], strict=True)) | self.holding.layer(params[:own], b, chunk,
                                                                                      virtual, k)

    def layer_key(self, key: Any, virtual: Any, k: int, j: Any) -> tuple[Any, Any]:
        """The dropout key of layer k of virtual stage ``virtual`` on microbatch j: (the key its layer
        number draws under in the unpipelined stack, :func:`shardc.spec.functions.layer_key`; j)."""
        number = jnp.asarray(self._firsts())[virtual] + k
        return layer_key(key, number, self.layers, jnp), jnp.asarray(j, jnp.int32)

    def _stage_fwd(self, x: Any, params: tuple[Any, ...], key: Any, virtual: Any, chunk: Any,
                   j: Any, beside: Arrays | None = None, start: Any = False) -> tuple[Any, list[Any]]:
        """The stage's layers forward on ``x``: the output, and each layer's saved values but its params
        (the backward reads those from the params, once a layer, not a copy a microbatch), keyed by block.
        ``beside``: the values fed beside the input that the model's first layer reads, where ``start``."""
        kept, held = [], jnp.asarray(self.held)[virtual]
        for k in range(self.slots):
            def run(b: int, k: int = k) -> Callable[[Any], Any]:
                def go(given: Any) -> Any:
                    body = self.bodies[b]
                    pool = {body.input: given, **fed_values(self.fed if b == 0 else (), k, given, beside, start),
                            **self._layer(params, b, chunk, virtual, k)}
                    y, (used, saved) = body.part.forward(pool, self.layer_key(key, virtual, k, j))
                    reads = body.part.backward_reads
                    mine = {n: v for n, v in used.items() if n in reads and n not in body.params
                            and n not in self.shared}  # a shared input: read from the arguments again
                    return y, {b: (mine,
                                   _once({n: v for n, v in saved.items() if n in reads}))}
                return go
            y, mine = switch(self.tables, k, virtual, run, x, pack=len(self.bodies) > 1)
            x = y if k < min(self.held) else jnp.where(k < held, y, x)  # an empty slot hands x on
            kept.append(mine)
        return x, kept

    def _saved(self, kept: list[Any], params: tuple[Any, ...], chunk: Any, virtual: Any) -> list[Callable[[int], Any]]:
        """Each slot's residuals as its backward reads them, for the block b it runs (read inside b's branch,
        out of the slot's union where several blocks can run there): the saved values and the layer's params."""
        def of(k: int, b: int) -> Any:
            used, saved = unpacked(kept[k], b)
            return ({**used, **self._layer(params, b, chunk, virtual, k)},
                    {n: v for names, v in saved.items() for n in names})
        return [functools.partial(of, k) for k in range(len(kept))]

    def _grads_of(self, b: int, got: Arrays) -> Arrays:
        return {p: got[p] for p in self.bodies[b].params}

    def _stage_bwd(self, kept: list[Any], g: Any, virtual: Any, start: Any = False) -> tuple[Any, list[Any], Arrays]:
        """The stage's layers backward, last to first: the input's gradient, each slot's params' gradients
        (keyed by block), and the model's first layer's of the values fed beside its input, where ``start``."""
        grads: list[Any] = [{}] * len(kept)
        held = jnp.asarray(self.held)[virtual]
        beside: Arrays = {}
        for k in reversed(range(len(kept))):
            def run(b: int, k: int = k) -> Callable[[Any], Any]:
                def go(d_out: Any) -> Any:
                    got = self.bodies[b].part.backward(kept[k](b), d_out)
                    dx = input_grad(got, self.bodies[b].input, self.fed, b == 0, k, start)
                    return dx, {b: self._grads_of(b, got)}
                return go
            (dx, beside), grads[k] = switch(self.tables, k, virtual, run, g, pack=len(self.bodies) > 1)
            g = dx if k < min(self.held) else jnp.where(k < held, dx, g)
        return g, grads, beside

    def _stage_input_bwd(self, kept: list[Any], g: Any, virtual: Any,
                         start: Any = False) -> tuple[Any, list[Any], Arrays]:
        """B of the stage's layers, last to first: the input's gradient, what each layer's W reads, and the
        model's first layer's gradients of the values fed beside its input, where ``start``."""
        handed: list[Any] = [{}] * len(kept)
        held = jnp.asarray(self.held)[virtual]
        beside: Arrays = {}
        for k in reversed(range(len(kept))):
            def run(b: int, k: int = k) -> Callable[[Any], Any]:
                def go(d_out: Any) -> Any:
                    body = self.bodies[b]
                    names = (body.input, *(self.fed if b == 0 else ()))
                    got, made = body.part.backward_inputs(kept[k](b), d_out, names)
                    return input_grad(got, self.bodies[b].input, self.fed, b == 0, k, start), {b: made}
                return go
            (dx, beside), handed[k] = switch(self.tables, k, virtual, run, g, pack=len(self.bodies) > 1)
            g = dx if k < min(self.held) else jnp.where(k < held, dx, g)
        return g, handed, beside

    def _stage_weight_bwd(self, kept: list[Any], handed: list[Any], virtual: Any) -> list[Any]:
        """W of the stage's layers: their params' gradients from the saved values and what B handed on."""
        out = []
        for k in range(len(kept)):
            def run(b: int, k: int = k) -> Callable[[Any], Any]:
                def go(_: Any) -> Any:
                    made = self.bodies[b].part.backward_weight(kept[k](b), unpacked(handed[k], b))
                    return 0.0, {b: self._grads_of(b, made)}
                return go
            out.append(switch(self.tables, k, virtual, run, 0.0, pack=len(self.bodies) > 1)[1])
        return out

    def _local(self, backward: bool, key: Any, cotangent: Any, *args: Any) -> tuple[Any, ...]:
        """The schedule on one device: the ends' accumulator (results and their gradients) and, with
        ``backward``, the block params' gradients, from this stage's blocks of the arguments."""
        stage = jax.lax.axis_index(self.axis)
        names = self.ends.inputs()
        pool = {k: x[0] for k, x in zip(names, args, strict=False)} | {"cotangent": cotangent[0], "key": key}
        params = args[len(names):]
        table = self.forward_ticks if backward else forward_only(self.forward_ticks)
        ftab, btab = jnp.asarray(table), jnp.asarray(self.backward_ticks)
        m = self.microbatches
        x, made = jax.eval_shape(self.ends.first, pool, 0)
        sends = Carried.of(x, made, self.riders)  # what a stage sends: the activation, the riders with it
        shapes = jax.eval_shape(self._stage_fwd, x, params, key, stage, 0, 0)[1]
        # each buffer a ring of the values in flight at once, a chunk x M + microbatch entry at its slot
        rings = self.rings
        ks, hs, xs, gs, ps, qs = (jnp.asarray(r.table)[stage] for r in (rings.kept, rings.handed, rings.acts,
                                                                          rings.cots, rings.post, rings.pre))
        keep = self._keep(shapes)
        kept = keep.empty()
        acts, cots = (jnp.zeros((r.count,) + sends.sent, x.dtype) for r in (rings.acts, rings.cots))
        split = backward and self.weight_ticks is not None
        wtab = jnp.asarray(self.weight_ticks if self.weight_ticks is not None else ())
        first = self._saved(keep.read(kept, stage, 0, 0), params, 0, stage)  # a slot's values, their shapes
        handed = _buffers(jax.eval_shape(lambda g: self._stage_input_bwd(first, g, stage), x)[1],
                          rings.handed.count) if split else ()  # B's values W reads
        place = self.placement
        virtual = place.table()  # [chunk, stage]
        # a tick where a device runs an F and a B (DualPipe's pairs): its B and W read the buffers as the tick
        # found them, so nothing of its F comes before them and a GPU may overlap the two; elsewhere they read
        # what F left (the same values: a slot F writes in a tick is never one they read there)
        paired = backward and pairs(table, self.backward_ticks)

        def write(kept: Any, cots: Any, res: Any, c: Any, u: Any, e: Any, live: Any, end: Any, cot: Any) -> Any:
            """F's residuals and its end's cotangent, each at its entry's slot."""
            return keep.write(kept, res, stage, c, u, ks[e], live), jnp.where(end, cots.at[gs[e]].set(cot), cots)

        def tick(t: Any, carry: Any) -> Any:
            kept, handed, acts, cots, acc, dparams, pending = carry
            if paired:  # the last tick's F's writes first, B's reads after them (XLA updates the rings in place)
                kept, cots = write(kept, cots, *pending)
            ef = ftab[t, stage]
            e = jnp.maximum(ef, 0)
            c, j = e // m, e % m
            u = virtual[c, stage]
            start = place.starts(u)  # the first virtual stage reads the ends' input
            given, beside = self.ends.first(pool, j)  # and the values fed beside it, which the first layer reads
            got, riding = sends.unpack(acts[xs[e]])
            riding = {n: jnp.where(start, beside[n], v) for n, v in riding.items()}  # made here, or received
            y, res = self._stage_fwd(jnp.where(start, given, got), params, key, u, c, j, beside, start)
            end = (ef >= 0) & place.ends(u)  # the last virtual stage hands on to the ends
            cot, d_riding, acc = self.ends.last(pool, y, j, end, acc, backward, ps[e], riding)
            cot = sends.pack(cot, d_riding)
            # paired, F's writes wait for the next tick (none reads them before): B reading the rings F had
            # written kept the old and the new, XLA copying a whole ring a tick (DeepSeek-V3's run: 11.9 MB)
            if paired:
                pending = (res, c, u, e, ef >= 0, end, cot)
            else:
                kept, cots = write(kept, cots, res, c, u, e, ef >= 0, end, cot)
            # Every tick sends (SPMD: one program); a receiver keeps what the table says was sent.
            acts = place.hand_on(self.axis, acts, sends.pack(y, riding), ftab[t], stage, m, 1, xs)
            if not backward:
                return kept, handed, acts, cots, acc, dparams, pending
            eb = btab[t, stage]
            e = jnp.maximum(eb, 0)
            c, j = e // m, e % m
            u = virtual[c, stage]
            mine = self._saved(keep.read(kept, stage, c, ks[e]), params, c, u)
            g, d_riding = sends.unpack(cots[gs[e]])
            if split:  # B now, W at its own tick (of this or an earlier microbatch's B, or after its B in this one)
                dx, made, beside = self._stage_input_bwd(mine, g, u, place.starts(u))
                handed = jax.tree.map(lambda buf, h: jnp.where(eb >= 0, buf.at[hs[e]].set(h), buf), handed, made)
            else:
                dx, dw, beside = self._stage_bwd(mine, g, u, place.starts(u))
                dparams = self.holding.accumulate(dparams, dw, eb >= 0, c, u)
            beside = {n: beside.get(n, 0) + d_riding.get(n, 0) for n in {**beside, **d_riding}}  # fed, and riding
            acc = self.ends.first_back(pool, dx, j, (eb >= 0) & place.starts(u), acc, qs[e],
                                       beside)  # before W, which reads it
            if split:
                ew = wtab[t, stage]
                w = jnp.maximum(ew, 0)
                uw = virtual[w // m, stage]  # the ends' W where this W's virtual stage runs them
                dw = self._stage_weight_bwd(self._saved(keep.read(kept, stage, w // m, ks[w]), params, w // m,
                                                             uw), jax.tree.map(lambda buf: buf[hs[w]], handed), uw)
                dparams = self.holding.accumulate(dparams, dw, ew >= 0, w // m, uw)
                acc = self.ends.weight(pool, w % m, (ew >= 0) & place.starts(uw), (ew >= 0) & place.ends(uw), acc,
                                       (ps[w], qs[w]))
            cots = place.hand_on(self.axis, cots, sends.pack(dx, d_riding), btab[t], stage, m, -1, gs)
            return kept, handed, acts, cots, acc, dparams, pending

        # each layer's params' gradients as its backward hands them on: partial sums where they reduce once a step
        grads = jax.eval_shape(lambda d: self._stage_bwd(first, d, stage), x)[1]
        none = jnp.zeros((), ftab.dtype)  # paired, the writes of an F before the first: none
        pending = (jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes), none, virtual[0, stage], none,
                   *jnp.zeros(2, bool), jnp.zeros(sends.sent, x.dtype)) if paired else ()
        init = (kept, handed, acts, cots, self.ends.start(pool, x, (rings.post.count, rings.pre.count)),
                self.holding.zeros(grads), pending)
        acc, dparams = jax.lax.fori_loop(0, len(table), tick, init)[4:6]
        if backward:  # the microbatches' sums reduced, once a step (DualPipe's two copies' summed first)
            acc, dparams = self.ends.finish(acc), self.holding.finish(dparams)
        acc = jax.tree.map(lambda a: a[None], self.ends.results(acc))
        return (acc, dparams) if backward else (acc,)

    def _keep(self, shapes: Any) -> TreeRing | FlatRing:
        """Where the residuals of the microbatches in flight lie (:mod:`shardc.lowering.pipeline_keep`):
        ``shapes`` a microbatch's, each device's own layers' where several blocks differ."""
        if len(self.bodies) == 1:
            return TreeRing(shapes, self.rings.kept.count)
        place = self.placement
        virtual = np.array([[place.virtual(c, s) for s in range(self.stages)] for c in range(self.chunks)])
        kept = self.rings.kept
        return FlatRing.of([p.union for p in shapes], self.tables.which, virtual, kept.table, kept.held)

    def specs(self) -> tuple[tuple[P, ...], tuple[Any, tuple[P, ...]]]:
        """The program's in_specs (the key, the cotangent, the ends' inputs, the block's params), and
        its outputs' (the ends' accumulator, the params' gradients), the stage axis leading."""
        a = self.axis
        params = self.holding.specs()
        ins = (P(), P(a, *self.ends.cotangent_spec()), *[P(a, *s) for s in self.ends.specs()], *params,
               *self.shared.values())  # a shared input: whole on every stage (no stage axis)
        return ins, (self.ends.result_specs(a), params)

    def program(self, backward: bool = True) -> tuple[jax.sharding.Mesh, Any]:
        """The mesh and the jitted schedule ``(key, cotangent, *inputs, *params)``: with ``backward``
        the whole tick table, returning the ends' accumulator and the params' gradients; else its
        forward ticks only, returning the accumulator."""
        if backward not in self._programs:
            mesh = make_mesh(self.mesh_axes)
            ins, outs = self.specs()
            step = jax.shard_map(functools.partial(self._local, backward), mesh=mesh, in_specs=ins,
                                 out_specs=outs if backward else outs[:1], check_vma=False)
            self._programs[backward] = (mesh, jax.jit(step))
        return self._programs[backward]

    def order(self, name: str, x: Any, back: bool = False) -> Any:
        """``x`` (array ``name``, whole) with its sequence axes in the zig-zag order the pipeline holds, or,
        ``back``, in their own order again; as it is where the pipeline holds none."""
        return zigzag_order(x, self.zigzag.get(name, ()), self.zigzag_chunks, back)

    def split(self, x: Any, dim: int) -> Any:
        """The batch cut into microbatches along ``dim``: [M, ...] (in host memory, as :meth:`arguments`
        places it)."""
        return np.stack(np.split(np.asarray(x), self.microbatches, axis=dim))

    def join(self, xs: Any, dim: int) -> Any:
        """Microbatches [M, ...] back into the batch along ``dim``."""
        return jnp.concatenate(list(xs), axis=dim)

    def _on(self, x: Any, where: tuple[int, ...]) -> Any:
        """``x`` stacked over the stages, on the stages ``where`` only (zeros elsewhere), in host memory."""
        x = np.asarray(x)
        stacked = np.zeros((self.stages,) + x.shape, x.dtype)
        stacked[list(where)] = x
        return stacked

    def arguments(self, inputs: Arrays, cotangent: Any, key: Any = 0) -> list[Any]:
        """The program's arguments, placed: the dropout key, the cotangent on the last stage, each data
        input cut into microbatches and each end param on the stage that reads it, the block's params."""
        mesh = self.program()[0]
        args = [np.asarray(key, np.uint32), self._on(cotangent, self.placement.end_stages)]
        for k in self.ends.inputs():
            x = self.split(self.order(k, inputs[k]), self.dims[k]) if k in self.dims else inputs[k]
            args.append(self._on(x, self.ends.stages_of(k)))
        args += [*self.holding.host(inputs), *(np.asarray(inputs[k]) for k in self.shared)]
        # built and placed from host memory: jax cuts a host array into its pieces without compiling a
        # program for each (as it would to move a device array, or to build one op by op)
        return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, self.specs()[0], strict=True)]

    def outputs(self, inputs: Arrays, key: Any = 0) -> Arrays:
        """The ends' results (the block's output, or the loss) as global arrays, from the inputs (each
        block param stacked [layers, ...]); ``key`` draws the dropout masks (layer l's under
        key * layers + l).  Runs the table's forward ticks only."""
        _, step = self.program(backward=False)
        (acc,) = step(*self.arguments(inputs, self.ends.cotangent(self, inputs, None), key))
        return dict(self.ends.outputs(self, acc))

    def gradients(self, inputs: Arrays, cotangent: Arrays, key: Any = 0) -> Arrays:
        """Every gradient (keyed by gradient name; the block params' stacked [layers, ...]) from the
        cotangent of the ends' result (keyed by its gradient name), under dropout ``key``."""
        return self.run(inputs, cotangent, key)[1]

    def run(self, inputs: Arrays, cotangent: Arrays, key: Any = 0) -> tuple[Arrays, Arrays]:
        """The whole tick table once: the ends' results and every gradient."""
        _, step = self.program()
        return self.read(*step(*self.arguments(inputs, self.ends.cotangent(self, inputs, cotangent), key)))

    def read(self, acc: Any, dparams: tuple[Any, ...]) -> tuple[Arrays, Arrays]:
        """The program's outputs as global arrays keyed by name: the ends' results, every gradient."""
        grads = dict(self.ends.gradients(self, acc)) | dict(self.holding.gradients(dparams))
        return dict(self.ends.outputs(self, acc)), grads


def _once(saved: Arrays) -> dict[tuple[str, ...], Any]:
    """The saved values keyed by the names each goes by, so that a value saved under two names (a rename:
    ``Kx = L1``) takes one slot of the ring, not two (the lowered pipeline kept both, 240 B a layer and
    microbatch more than ``shardc cost`` counts in ``pipeline_llama``'s run)."""
    names: dict[int, tuple[str, ...]] = {}
    for n, v in saved.items():
        names[id(v)] = names.get(id(v), ()) + (n,)
    return {names[id(v)]: v for v in saved.values()}


def _buffers(shapes: Any, n: int) -> Any:
    """Zeros of ``n`` of each of ``shapes`` (a tree of shapes): a ring of ``n`` slots."""
    return jax.tree.map(lambda a: jnp.zeros((n,) + a.shape, a.dtype), shapes)
