"""A pipelined module's program, as ordinary Python: any schedule's tick table, the block, its ends.

The SPMD pipeline of JAX's ``shard_map`` documentation: one ``shard_map`` over every
mesh axis, each device holding its stage's L/P layers (params stacked on a leading
layer dim sharded over the stage axis).  A schedule is a tick table: at tick t stage s
runs the forward of microbatch ``forward[t][s]`` and the backward of ``backward[t][s]``
(-1: none), as the schedule's simulation with unit times places them
(:mod:`shardc.pipeline.schedules`).  :class:`Pipeline` runs any table the same way: a
``fori_loop`` over the ticks (one compiled body), in which every device runs its stage
forward and backward masked by the table (SPMD: one program for all), keeps each
microbatch's residuals until its backward, and sends with ``jax.lax.ppermute`` its
activation down and its cotangent up (the receiver keeps what the table says was
really sent).  Each layer's forward and backward are the stage plan's own, so the
collectives on the other axes are the planned ones in both directions; a weight
gradient's reduction runs once, after the loop, on the sum of the microbatches' partial
gradients (:meth:`Part.finish`, :mod:`shardc.lowering.pipeline_grads`).

What comes before the block and after it is an :class:`Ends`: for a block alone
(:class:`BlockEnds`) stage 0 reads the microbatches and the last stage keeps the
outputs and reads their cotangents; for a ``layers L { ... }`` block in a whole model
(:class:`ModelEnds`, Megatron-LM's placement) stage 0 runs the statements before the
block and the last stage those after it, ending in the loss, whose backward runs at
once (the loss's cotangent over M: the batch's loss is the microbatches' mean).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardc.lowering.runtime import make_mesh

__all__ = ["Part", "Ends", "BlockEnds", "ModelEnds", "Pipeline", "forward_only", "block_pipeline", "model_pipeline"]

Arrays = dict[str, Any]
Table = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Part:
    """One planned part on one device: its two phase functions and their boundary tables.

    ``result`` is the value the part hands on (the block's output, the loss); ``grads`` maps
    each input that gets a gradient to its gradient's name."""

    forward_local: Callable[..., tuple[Any, ...]]
    forward_in: dict[str, P]
    forward_out: dict[str, P]
    backward_local: Callable[..., tuple[Any, ...]]
    backward_in: dict[str, P]
    backward_out: dict[str, P]
    cotangents: dict[str, str]
    grads: dict[str, str]
    result: str
    keyed: bool = False
    # the weight gradients' reductions, once a step on the microbatches' summed partial sums (keyed by
    # gradient name; shardc.lowering.pipeline_grads); None: the backward reduces them itself
    reduce_local: Callable[..., tuple[Any, ...]] | None = None
    reduce_in: dict[str, P] | None = None
    reduce_out: dict[str, P] | None = None
    # a partial sum handed on under another name than the gradient it ends as (a tied param's part)
    final_grads: dict[str, str] | None = None

    def final(self, name: str) -> str:
        """The name of input ``name``'s gradient once :meth:`finish` has run."""
        return (self.final_grads or {}).get(self.grads[name], self.grads[name])

    def forward(self, pool: Arrays, key: Any = None) -> tuple[Any, tuple[Arrays, Arrays]]:
        """The result, and the residuals the backward reads."""
        args = [pool[k] for k in self.forward_in] + [key] * self.keyed
        saved = dict(zip(self.forward_out, self.forward_local(*args), strict=True))
        return saved[self.result], (pool, saved)

    def backward(self, residuals: tuple[Arrays, Arrays], d_out: Any) -> Arrays:
        """Each input's gradient (keyed by the input) for the result's cotangent ``d_out``; a dropout's
        keep-mask is a saved forward value, so no key is needed."""
        pool, saved = residuals
        cot = {n: d_out if o == self.result else jnp.zeros_like(saved[o]) for n, o in self.cotangents.items()}
        values = {**pool, **saved, **cot}
        got = dict(zip(self.backward_out, self.backward_local(*[values[k] for k in self.backward_in]), strict=True))
        return {k: got[g] for k, g in self.grads.items()}

    def finish(self, grads: Arrays, incoming: Arrays | None = None) -> Arrays:
        """Each input's gradient (keyed by the input) from what :meth:`backward` returned summed over the
        microbatches: the once-a-step reductions run on the sums, where the part has them (``incoming``:
        the other end's sums of a tied param's contribution, keyed by its name)."""
        if self.reduce_local is None or self.reduce_in is None or self.reduce_out is None:
            return grads
        by_grad = {self.grads[k]: v for k, v in grads.items()} | dict(incoming or {})
        got = dict(zip(self.reduce_out, self.reduce_local(*[by_grad[k] for k in self.reduce_in]), strict=True))
        return {k: got.get(self.final(k), v) for k, v in grads.items()}


def forward_only(table: Table) -> Table:
    """The ticks of ``table`` that run a forward, in order (a program that computes no gradient)."""
    return tuple(row for row in table if any(j >= 0 for j in row))


class Ends(Protocol):
    """What runs before the block on stage 0 and after it on the last stage, each microbatch.

    Its arguments (``inputs``) arrive on the stages that read them (``stages_of``: 0 and/or -1), data
    cut into microbatches [M, ...]; ``cotangent`` is the cotangent of its result, on the last stage.
    Its accumulator (``start``) is its result and the gradients it makes, returned as ``result_specs``
    lays them out, each stacked over the stages."""

    def inputs(self) -> tuple[str, ...]: ...

    def stages_of(self, name: str) -> tuple[int, ...]: ...

    def specs(self) -> tuple[P, ...]: ...  # each input's, without the stage axis

    def cotangent_spec(self) -> P: ...

    def result_specs(self, axis: str) -> Any: ...

    def first(self, args: Arrays, j: Any) -> Any: ...  # stage 0's block input for microbatch j

    def start(self, args: Arrays, x: Any) -> Any: ...

    def last(self, args: Arrays, y: Any, j: Any, done: Any, acc: Any, backward: bool) -> tuple[Any, Any]: ...

    def first_back(self, args: Arrays, dx: Any, j: Any, done: Any, acc: Any) -> Any: ...

    def cotangent(self, pipe: Pipeline, inputs: Arrays, cotangent: Arrays | None) -> Any: ...

    def outputs(self, pipe: Pipeline, acc: Any) -> Arrays: ...

    def gradients(self, pipe: Pipeline, acc: Any) -> Arrays: ...

    def finish(self, acc: Any) -> Any: ...  # the accumulator once the schedule is done: gradients reduced


@dataclass(frozen=True)
class BlockEnds:
    """A block alone: stage 0 reads microbatch j of ``block_input``; the last stage keeps the block's
    output and reads its cotangent ([M, ...]); the accumulator is the outputs and the input's gradients."""

    block_input: str
    block_output: str
    input_spec: P
    output_spec: P
    input_grad: str  # the gradient's name of the block input
    output_cotangent: str  # the cotangent's name of the block output

    def inputs(self) -> tuple[str, ...]:
        return (self.block_input,)

    def stages_of(self, name: str) -> tuple[int, ...]:
        return (0,)

    def specs(self) -> tuple[P, ...]:
        return (P(None, *self.input_spec),)

    def cotangent_spec(self) -> P:
        return P(None, *self.output_spec)

    def result_specs(self, axis: str) -> Any:
        return (P(axis, None, *self.output_spec), P(axis, None, *self.input_spec))

    def first(self, args: Arrays, j: Any) -> Any:
        return args[self.block_input][j]

    def start(self, args: Arrays, x: Any) -> Any:
        zeros = jnp.zeros_like(args[self.block_input])
        return zeros, zeros

    def last(self, args: Arrays, y: Any, j: Any, done: Any, acc: Any, backward: bool) -> tuple[Any, Any]:
        outs, dxs = acc
        return args["cotangent"][j], (jnp.where(done, outs.at[j].set(y), outs), dxs)

    def first_back(self, args: Arrays, dx: Any, j: Any, done: Any, acc: Any) -> Any:
        outs, dxs = acc
        return outs, jnp.where(done, dxs.at[j].set(dx), dxs)

    def cotangent(self, pipe: Pipeline, inputs: Arrays, cotangent: Arrays | None) -> Any:
        if cotangent is None:  # the output is laid out as the input: zeros of its microbatches
            return jnp.zeros_like(pipe.split(inputs[self.block_input], pipe.dims[self.block_input]))
        return pipe.split(cotangent[self.output_cotangent], pipe.dims[self.block_output])

    def outputs(self, pipe: Pipeline, acc: Any) -> Arrays:
        return {self.block_output: pipe.join(acc[0][-1], pipe.dims[self.block_output])}  # the last stage's

    def gradients(self, pipe: Pipeline, acc: Any) -> Arrays:
        return {self.input_grad: pipe.join(acc[1][0], pipe.dims[self.block_input])}  # stage 0's

    def finish(self, acc: Any) -> Any:
        return acc


@dataclass(frozen=True)
class ModelEnds:
    """A block in a whole model: ``pre`` on stage 0 makes the block's input from the data inputs
    ``pre_data`` and its params; ``post`` on the last stage reads the block's output, ``post_data`` and
    its params and makes the loss.  Their params arrive stacked over the stages, only the first
    (last) stage's copy non-zero, so their gradients need no reduction over the stage axis.  The
    cotangent is each microbatch's loss's; the accumulator the losses and the ends' gradients.

    A ``tied`` param (read by both) has a copy on both end stages and two accumulated contributions,
    the last stage's keyed ``name@last``; once a step the two stages swap their sums (a
    collective-permute each way over ``axis``: an AllReduce over the two, as Megatron-LM's embedding
    group runs it) and both finish the same gradient."""

    pre: Part
    post: Part
    pre_data: tuple[str, ...]
    post_data: tuple[str, ...]
    pre_params: tuple[str, ...]
    post_params: tuple[str, ...]
    block_output: str
    tied: tuple[str, ...] = ()
    axis: str = ""
    stages: int = 1

    def inputs(self) -> tuple[str, ...]:
        return self.pre_data + self.post_data + self.pre_params + tuple(p for p in self.post_params
                                                                        if p not in self.tied)

    def stages_of(self, name: str) -> tuple[int, ...]:
        if name in self.tied:
            return (0, -1)
        return (0,) if name in self.pre_data + self.pre_params else (-1,)

    def _spec(self, name: str) -> P:
        return (self.pre if name in self.pre_data + self.pre_params else self.post).forward_in[name]

    def _key(self, name: str) -> str:
        """The accumulator's key of a post param's gradient: a tied one's own, beside stage 0's."""
        return f"{name}@last" if name in self.tied else name

    def _keys(self) -> dict[str, str]:
        """Each accumulated gradient's key and the param it is of."""
        return {k: k for k in self.pre_params} | {self._key(k): k for k in self.post_params}

    def specs(self) -> tuple[P, ...]:
        data = tuple(P(None, *self._spec(k)) for k in self.pre_data + self.post_data)
        return data + tuple(self._spec(k) for k in self.inputs()[len(data):])

    def cotangent_spec(self) -> P:
        return P()

    def result_specs(self, axis: str) -> Any:
        return P(axis, None), {key: P(axis, *self._spec(k)) for key, k in self._keys().items()}

    def _pre_pool(self, args: Arrays, j: Any) -> Arrays:
        return {k: args[k][j] if k in self.pre_data else args[k] for k in self.pre.forward_in}

    def _post_pool(self, args: Arrays, y: Any, j: Any) -> Arrays:
        return {k: y if k == self.block_output else args[k][j] if k in self.post_data else args[k]
                for k in self.post.forward_in}

    def first(self, args: Arrays, j: Any) -> Any:
        return self.pre.forward(self._pre_pool(args, j))[0]

    def start(self, args: Arrays, x: Any) -> Any:
        """No losses yet, and zeros of each end param's gradient as its backward hands it on (a partial
        sum, where its reduction runs once a step)."""
        losses = jnp.zeros((args[self.inputs()[0]].shape[0],), x.dtype)
        pre = jax.eval_shape(lambda d: self.pre.backward(self.pre.forward(self._pre_pool(args, 0))[1], d), x)
        post = jax.eval_shape(lambda y: self.post.backward(self.post.forward(self._post_pool(args, y, 0))[1],
                                                           args["cotangent"]), x)
        shapes = {k: pre[k] for k in self.pre_params} | {self._key(k): post[k] for k in self.post_params}
        return losses, {k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.items()}

    def last(self, args: Arrays, y: Any, j: Any, done: Any, acc: Any, backward: bool) -> tuple[Any, Any]:
        losses, dends = acc
        loss, residuals = self.post.forward(self._post_pool(args, y, j))
        losses = jnp.where(done, losses.at[j].set(loss), losses)
        if not backward:
            return jnp.zeros_like(y), (losses, dends)
        got = self.post.backward(residuals, args["cotangent"])
        keys = {self._key(k): k for k in self.post_params}
        dends = {k: jnp.where(done, g + got[keys[k]], g) if k in keys else g for k, g in dends.items()}
        return got[self.block_output], (losses, dends)

    def first_back(self, args: Arrays, dx: Any, j: Any, done: Any, acc: Any) -> Any:
        losses, dends = acc  # the forward before the block runs again for its residuals (a cheap lookup)
        got = self.pre.backward(self.pre.forward(self._pre_pool(args, j))[1], dx)
        dends = {k: jnp.where(done, g + got[k], g) if k in self.pre_params else g for k, g in dends.items()}
        return losses, dends

    @property
    def result_cotangent(self) -> str:
        """The loss's cotangent's name."""
        (name,) = self.post.cotangents
        return name

    def cotangent(self, pipe: Pipeline, inputs: Arrays, cotangent: Arrays | None) -> Any:
        if cotangent is None:
            return jnp.zeros(())
        return jnp.asarray(cotangent[self.result_cotangent]) / pipe.microbatches  # a microbatch's share

    def outputs(self, pipe: Pipeline, acc: Any) -> Arrays:
        """The batch's loss: the mean of the microbatches' (each a mean over its tokens)."""
        return {self.post.result: jnp.mean(acc[0][-1])}

    def finish(self, acc: Any) -> Any:
        losses, dends = acc
        pre = {k: dends[k] for k in self.pre_params}
        incoming = {}
        for k in self.tied:  # the two ends swap their sums: each then holds both contributions
            pre[k] = self._swap(pre[k], 0, self.stages - 1)
            incoming[self.post.grads[k]] = self._swap(dends[self._key(k)], self.stages - 1, 0)
        got = self.pre.finish(pre, incoming)
        got |= self.post.finish({k: dends[k] for k in self.post_params if k not in self.tied})
        return losses, got | {self._key(k): got[k] for k in self.tied}

    def _swap(self, x: Any, source: int, target: int) -> Any:
        """``x`` (non-zero on stage ``source`` only) on ``source`` and ``target`` both."""
        return x + jax.lax.ppermute(x, self.axis, [(source, target)])

    def gradients(self, pipe: Pipeline, acc: Any) -> Arrays:
        """Each gradient, from the stage that holds it (a tied param's from stage 0; the last stage holds
        the same)."""
        dends = acc[1]
        got = {self.pre.final(k): dends[k][0] for k in self.pre_params}
        return got | {self.post.grads[k]: dends[k][-1] for k in self.post_params if k not in self.tied}


@dataclass
class Pipeline:
    """The block's ``layers`` layers over the stages of ``axis`` of the mesh ``mesh_axes``, ``ends``
    around it, in the order of the tick tables ``forward_ticks`` and ``backward_ticks``.

    ``params``: the block's, each passed stacked [layers, ...]; ``dims``: the microbatch dim of
    each data input of the whole batch (and of the block's output, keyed so)."""

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
    _programs: dict[bool, Any] = field(default_factory=dict, repr=False)

    @property
    def stages(self) -> int:
        return self.mesh_axes[self.axis]

    def layer_key(self, key: Any, stage: Any, k: int, j: Any) -> tuple[Any, Any]:
        """The dropout key of layer k of ``stage`` on microbatch j: (key * layers + its layer number, j),
        the masks layer number l of the unpipelined stack draws under key * layers + l."""
        number = stage * (self.layers // self.stages) + k
        return (jnp.asarray(key, jnp.uint32) * jnp.uint32(self.layers) + jnp.asarray(number, jnp.uint32),
                jnp.asarray(j, jnp.int32))

    def _stage_fwd(self, x: Any, params: tuple[Any, ...], key: Any, stage: Any, j: Any) -> tuple[Any, list[Any]]:
        kept = []
        for k in range(self.layers // self.stages):
            pool = {self.block_input: x, **{p: w[k] for p, w in zip(self.params, params, strict=True)}}
            x, residuals = self.block.forward(pool, self.layer_key(key, stage, k, j))
            kept.append(residuals)
        return x, kept

    def _stage_bwd(self, kept: list[Any], g: Any) -> tuple[Any, tuple[Any, ...]]:
        grads: list[Arrays] = [{}] * len(kept)
        for k in reversed(range(len(kept))):
            grads[k] = self.block.backward(kept[k], g)
            g = grads[k][self.block_input]
        return g, tuple(jnp.stack([d[p] for d in grads]) for p in self.params)

    def _local(self, backward: bool, key: Any, cotangent: Any, *args: Any) -> tuple[Any, ...]:
        """The schedule on one device: the ends' accumulator (results and their gradients) and, with
        ``backward``, the block params' gradients, from this stage's blocks of the arguments."""
        stage = jax.lax.axis_index(self.axis)
        names = self.ends.inputs()
        pool = {k: x[0] for k, x in zip(names, args, strict=False)} | {"cotangent": cotangent[0]}
        params = args[len(names):]
        table = self.forward_ticks if backward else forward_only(self.forward_ticks)
        ftab, btab = jnp.asarray(table), jnp.asarray(self.backward_ticks)
        x = jax.eval_shape(self.ends.first, pool, 0)
        shapes = jax.eval_shape(self._stage_fwd, x, params, key, stage, 0)[1]
        kept = jax.tree.map(lambda a: jnp.zeros((self.microbatches,) + a.shape, a.dtype), shapes)
        zeros = jnp.zeros((self.microbatches,) + x.shape, x.dtype)
        first, last = stage == 0, stage == self.stages - 1
        sends = [(s, s + 1) for s in range(self.stages - 1)]
        back = [(s + 1, s) for s in range(self.stages - 1)]

        def tick(t: Any, carry: Any) -> Any:
            kept, acts, cots, acc, dparams = carry
            jf = ftab[t, stage]
            jf0 = jnp.maximum(jf, 0)
            y, res = self._stage_fwd(jnp.where(first, self.ends.first(pool, jf0), acts[jf0]), params, key, stage, jf0)
            kept = jax.tree.map(lambda buf, r: jnp.where(jf >= 0, buf.at[jf0].set(r), buf), kept, res)
            cot, acc = self.ends.last(pool, y, jf0, (jf >= 0) & last, acc, backward)
            cots = jnp.where((jf >= 0) & last, cots.at[jf0].set(cot), cots)
            # Every tick sends (SPMD: one program); a receiver keeps what the table says was sent.
            got = jax.lax.ppermute(y, self.axis, sends)
            sent = ftab[t, jnp.maximum(stage - 1, 0)]  # the microbatch the stage above ran
            acts = jnp.where((stage > 0) & (sent >= 0), acts.at[jnp.maximum(sent, 0)].set(got), acts)
            if not backward:
                return kept, acts, cots, acc, dparams
            jb = btab[t, stage]
            jb0 = jnp.maximum(jb, 0)
            dx, dw = self._stage_bwd(jax.tree.map(lambda buf: buf[jb0], kept), cots[jb0])
            dparams = tuple(jnp.where(jb >= 0, a + b, a) for a, b in zip(dparams, dw, strict=True))
            acc = self.ends.first_back(pool, dx, jb0, (jb >= 0) & first, acc)
            got = jax.lax.ppermute(dx, self.axis, back)
            sent = btab[t, jnp.minimum(stage + 1, self.stages - 1)]
            cots = jnp.where((stage < self.stages - 1) & (sent >= 0), cots.at[jnp.maximum(sent, 0)].set(got), cots)
            return kept, acts, cots, acc, dparams

        # each layer's params' gradients as its backward hands them on: partial sums where they reduce once a step
        partial = jax.eval_shape(self._stage_bwd, jax.tree.map(lambda buf: buf[0], kept), zeros[0])[1]
        init = (kept, zeros, zeros, self.ends.start(pool, x), tuple(jnp.zeros(d.shape, d.dtype) for d in partial))
        _, _, _, acc, dparams = jax.lax.fori_loop(0, len(table), tick, init)
        if backward:  # the microbatches' sums reduced, once a step
            acc, dparams = self.ends.finish(acc), self._finish(dparams)
        acc = jax.tree.map(lambda a: a[None], acc)
        return (acc, dparams) if backward else (acc,)

    def _finish(self, dparams: tuple[Any, ...]) -> tuple[Any, ...]:
        """Each of the stage's layers' params' gradients from their sums over the microbatches."""
        layers = [self.block.finish({p: d[k] for p, d in zip(self.params, dparams, strict=True)})
                  for k in range(self.layers // self.stages)]
        return tuple(jnp.stack([g[p] for g in layers]) for p in self.params)

    def specs(self) -> tuple[tuple[P, ...], tuple[Any, tuple[P, ...]]]:
        """The program's in_specs (the key, the cotangent, the ends' inputs, the block's params), and
        its outputs' (the ends' accumulator, the params' gradients), the stage axis leading."""
        a = self.axis
        params = tuple(P(a, *self.block.forward_in[p]) for p in self.params)
        ins = (P(), P(a, *self.ends.cotangent_spec()), *[P(a, *s) for s in self.ends.specs()], *params)
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

    def split(self, x: Any, dim: int) -> Any:
        """The batch cut into microbatches along ``dim``: [M, ...]."""
        return jnp.stack(jnp.split(jnp.asarray(x), self.microbatches, axis=dim))

    def join(self, xs: Any, dim: int) -> Any:
        """Microbatches [M, ...] back into the batch along ``dim``."""
        return jnp.concatenate(list(xs), axis=dim)

    def _on(self, x: Any, where: tuple[int, ...]) -> Any:
        """``x`` stacked over the stages, on the stages ``where`` only (zeros elsewhere)."""
        x = jnp.asarray(x)
        return jnp.zeros((self.stages,) + x.shape, x.dtype).at[jnp.asarray(where)].set(x)

    def arguments(self, inputs: Arrays, cotangent: Any, key: Any = 0) -> list[Any]:
        """The program's arguments, placed: the dropout key, the cotangent on the last stage, each data
        input cut into microbatches and each end param on the stage that reads it, the block's params."""
        mesh = self.program()[0]
        args = [jnp.asarray(key, jnp.uint32), self._on(cotangent, (-1,))]
        for k in self.ends.inputs():
            x = self.split(inputs[k], self.dims[k]) if k in self.dims else inputs[k]
            args.append(self._on(x, self.ends.stages_of(k)))
        args += [jnp.asarray(inputs[p]) for p in self.params]
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
        grads = dict(self.ends.gradients(self, acc))
        grads.update({self.block.grads[p]: g for p, g in zip(self.params, dparams, strict=True)})
        return dict(self.ends.outputs(self, acc)), grads


# A lowered pipeline module's globals are its tables; these build its pipeline from them, so the
# module holds data and one call, and the code is here.


def _part(tables: Mapping[str, Any], prefix: str, result: str) -> Part:
    """A part's phase functions and tables as a lowered module names them: ``forward_local``,
    ``FORWARD_IN``, ... for the block, prefixed (``pre_forward_local``, ``PRE_FORWARD_IN``) for an end."""
    fn, table = (prefix.lower() + "_", prefix + "_") if prefix else ("", "")
    return Part(tables[fn + "forward_local"], tables[table + "FORWARD_IN"], tables[table + "FORWARD_OUT"],
                tables[fn + "backward_local"], tables[table + "BACKWARD_IN"], tables[table + "BACKWARD_OUT"],
                tables[table + "COTANGENTS"], tables[table + "GRADS"], result, tables.get(table + "KEYED", False),
                tables.get(fn + "reduce_local"), tables.get(table + "REDUCE_IN"), tables.get(table + "REDUCE_OUT"),
                tables.get(table + "FINAL_GRADS"))


def _pipeline(tables: Mapping[str, Any], ends: Ends) -> Pipeline:
    """The block's layers over the stages in the tick tables' order, ``ends`` around it."""
    block = _part(tables, "", tables["BLOCK_OUTPUT"])
    return Pipeline(tables["PIPE_MESH_AXES"], tables["PIPELINE_AXIS"], tables["LAYERS"], tables["MICROBATCHES"],
                    tables["F_TABLE"], tables["B_TABLE"], block, tables["BLOCK_INPUT"], tables["PARAMS"], ends,
                    tables["DATA_DIM"])


def block_pipeline(tables: Mapping[str, Any]) -> Pipeline:
    """A block alone's pipeline from a lowered module's globals: stage 0 reads the microbatches of
    ``BLOCK_INPUT``, the last stage keeps ``BLOCK_OUTPUT`` and reads its cotangent ``OUTPUT_COTANGENT``."""
    first, out = tables["BLOCK_INPUT"], tables["BLOCK_OUTPUT"]
    ends = BlockEnds(first, out, tables["FORWARD_IN"][first], tables["FORWARD_OUT"][out], tables["GRADS"][first],
                     tables["OUTPUT_COTANGENT"])
    return _pipeline(tables, ends)


def model_pipeline(tables: Mapping[str, Any]) -> Pipeline:
    """A whole model's pipeline from a lowered module's globals: the statements before the block
    (``pre_*``, ``PRE_*``, making ``PRE_RESULT``) on stage 0, those after it (``post_*``, ``POST_*``,
    ending in ``LOSS``) on the last."""
    pre, post = _part(tables, "PRE", tables["PRE_RESULT"]), _part(tables, "POST", tables["LOSS"])
    ends = ModelEnds(pre, post, tables["PRE_DATA"], tables["POST_DATA"], tables["PRE_PARAMS"], tables["POST_PARAMS"],
                     tables["BLOCK_OUTPUT"], tuple(tables.get("TIED", {})), tables["PIPELINE_AXIS"],
                     tables["PIPE_MESH_AXES"][tables["PIPELINE_AXIS"]])
    return _pipeline(tables, ends)
