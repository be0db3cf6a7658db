"""The parts of a pipelined module's program: a part's forward and backward tables (:class:`Part`), and
what runs before and after the block (:class:`Ends`): for a block alone (:class:`BlockEnds`) stage 0
reads the microbatches and the last stage keeps the outputs and reads their cotangents; for a
``layers L { ... }`` block in a whole model (:class:`ModelEnds`, Megatron-LM's placement) stage 0 runs
the statements before the block and the last stage those after it, ending in the loss.
:class:`shardc.lowering.pipeline_runtime.Pipeline` runs them over a schedule's tick table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

if TYPE_CHECKING:  # annotations only: the pipeline runs these parts
    from shardc.lowering.pipeline_runtime import Pipeline

__all__ = ["Part", "Ends", "BlockEnds", "ModelEnds", "forward_only", "Arrays", "Table", "Phase"]

Arrays = dict[str, Any]
Table = tuple[tuple[int, ...], ...]
Phase = tuple[Callable[..., tuple[Any, ...]], dict[str, P], dict[str, P]]  # a function, its in and out tables


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
    # the backward in two for the zero-bubble schedules (shardc.lowering.pipeline_split), each a function
    # and its in and out tables: B (the input's gradient, and what W reads of it), W (the weights')
    input_backward: Phase | None = None
    weight_backward: Phase | None = None

    @property
    def backward_reads(self) -> frozenset[str]:
        """The forward's values its backward reads (B's and W's where it is split), and the outputs whose
        zero cotangent takes their shape: what a pipeline keeps of a microbatch's forward, as autograd
        saves only what the backward reads (PyTorch's ``save_for_backward``).  The rest is not kept: a
        layer's output is the next layer's input, kept there once; a sum's branch no backward reads.  What W
        reads of B's values (B's outputs: a value B recomputes, a cotangent) B hands it
        (:meth:`backward_weight`), so the forward's copy of it is not kept: DeepSeek-V3's run kept its
        recomputed norms and SwiGLU products twice, 7072 of a MoE layer's 24808 kept elements."""
        tables = [self.backward_in] + [p[1] for p in (self.input_backward,) if p is not None]
        handed = self.input_backward[2] if self.input_backward is not None else {}
        weight = [n for n in self.weight_backward[1] if n not in handed] if self.weight_backward is not None else []
        zeros = {o for o in self.cotangents.values() if o != self.result}
        return frozenset(n for t in tables for n in t) | frozenset(weight) | zeros

    def final(self, name: str) -> str:
        """The name of input ``name``'s gradient once :meth:`finish` has run."""
        return (self.final_grads or {}).get(self.grads[name], self.grads[name])

    def forward(self, pool: Arrays, key: Any = None) -> tuple[Any, tuple[Arrays, Arrays]]:
        """The result, and the residuals the backward reads."""
        args = [pool[k] for k in self.forward_in] + [key] * self.keyed
        saved = dict(zip(self.forward_out, self.forward_local(*args), strict=True))
        return saved[self.result], (pool, saved)

    def _values(self, residuals: tuple[Arrays, Arrays], d_out: Any, more: Arrays | None = None) -> Arrays:
        """What a backward reads: the forward's inputs and saved values, the result's cotangent, and the other
        outputs' (``more``, keyed by output: a value fed beside the block's input; zeros where not given)."""
        pool, saved = residuals
        given = more or {}

        def of(o: str) -> Any:  # the result may be given too: a value riding to the last stage, read there
            parts = [v for v in (d_out if o == self.result else None, given.get(o)) if v is not None]
            return sum(parts[1:], parts[0]) if parts else jnp.zeros_like(saved[o])
        return {**pool, **saved, **{n: of(o) for n, o in self.cotangents.items()}}

    def backward(self, residuals: tuple[Arrays, Arrays], d_out: Any, more: Arrays | None = None) -> Arrays:
        """Each input's gradient (keyed by the input) for the result's cotangent ``d_out`` (and other outputs'
        ``more``); a dropout's keep-mask is a saved forward value, so no key is needed."""
        got = _call(self.backward_local, self.backward_in, self.backward_out, self._values(residuals, d_out, more))
        return {k: got[g] for k, g in self.grads.items()}

    def backward_input(self, residuals: tuple[Arrays, Arrays], d_out: Any, name: str) -> tuple[Any, Arrays]:
        """B: input ``name``'s gradient, and what W reads of B's values (keyed as W reads them)."""
        grads, handed = self.backward_inputs(residuals, d_out, (name,))
        return grads[name], handed

    def backward_inputs(self, residuals: tuple[Arrays, Arrays], d_out: Any,
                        names: tuple[str, ...]) -> tuple[Arrays, Arrays]:
        """B: the gradients of inputs ``names`` (keyed by input), and what W reads of B's values."""
        assert self.input_backward is not None and self.weight_backward is not None
        got = _call(*self.input_backward, self._values(residuals, d_out))
        return {n: got[self.grads[n]] for n in names}, {k: got[k] for k in self.weight_backward[1] if k in got}

    def backward_weight(self, residuals: tuple[Arrays, Arrays], handed: Arrays) -> Arrays:
        """W: every other input's gradient (keyed by the input), from the forward's saved values and what B
        handed on (:meth:`backward_input`); nothing else of the backward."""
        assert self.weight_backward is not None
        pool, saved = residuals
        got = _call(*self.weight_backward, {**pool, **saved, **handed})
        return {k: got[g] for k, g in self.grads.items() if g in got}

    def finish(self, grads: Arrays, incoming: Arrays | None = None) -> Arrays:
        """Each input's gradient (keyed by the input) from what :meth:`backward` returned summed over the
        microbatches: the once-a-step reductions run on the sums, where the part has them (``incoming``:
        the other end's sums of a tied param's contribution, keyed by its name)."""
        if self.reduce_local is None or self.reduce_in is None or self.reduce_out is None:
            return grads
        by_grad = {self.grads[k]: v for k, v in grads.items()} | dict(incoming or {})
        got = dict(zip(self.reduce_out, self.reduce_local(*[by_grad[k] for k in self.reduce_in]), strict=True))
        return {k: got.get(self.final(k), v) for k, v in grads.items()}


def _call(fn: Callable[..., tuple[Any, ...]], ins: dict[str, P], outs: dict[str, P], values: Arrays) -> Arrays:
    """A phase function on the values its in table names, its results keyed by its out table."""
    return dict(zip(outs, fn(*[values[k] for k in ins]), strict=True))


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

    # stage 0's block input for microbatch j, and the values made beside it that the first layer reads (FED)
    def first(self, args: Arrays, j: Any) -> tuple[Any, Arrays]: ...

    # ``slots``: the counts of the rings of what the ends keep for their W (pipeline_slots.Rings' post and pre)
    def start(self, args: Arrays, x: Any, slots: tuple[int, int]) -> Any: ...

    # ``slot``: microbatch j's slot of the post ring on this device (last), of the pre ring (first_back);
    # ``riding``: the values made before the block that ride to the last stage (RIDERS); returns the block
    # output's gradient, the riders', and the accumulator
    def last(self, args: Arrays, y: Any, j: Any, done: Any, acc: Any, backward: bool,
             slot: Any, riding: Arrays) -> tuple[Any, Arrays, Any]: ...

    # ``beside``: the first layer's gradients of the values fed beside the block input (keyed by value)
    def first_back(self, args: Arrays, dx: Any, j: Any, done: Any, acc: Any, slot: Any, beside: Arrays) -> Any: ...

    # the zero-bubble schedules' W tick of microbatch j: the weight gradients of the ends, where ``first``
    # (the first virtual stage's W) or ``last`` (the last's) runs there; ``slots``: j's slots of the two rings
    def weight(self, args: Arrays, j: Any, first: Any, last: Any, acc: Any, slots: tuple[Any, Any]) -> Any: ...

    def results(self, acc: Any) -> Any: ...  # what the program returns of the accumulator (``result_specs``)

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
    last_stage: int = -1  # the stage that keeps the outputs: the last virtual stage's (stage 0 in a V)
    # DualPipe's: the two devices that each read the input and keep outputs, of one direction each
    both: tuple[int, ...] = ()

    def inputs(self) -> tuple[str, ...]:
        return (self.block_input,)

    def stages_of(self, name: str) -> tuple[int, ...]:
        return self.both or (0,)

    def specs(self) -> tuple[P, ...]:
        return (P(None, *self.input_spec),)

    def cotangent_spec(self) -> P:
        return P(None, *self.output_spec)

    def result_specs(self, axis: str) -> Any:
        return (P(axis, None, *self.output_spec), P(axis, None, *self.input_spec))

    def first(self, args: Arrays, j: Any) -> tuple[Any, Arrays]:
        return args[self.block_input][j], {}

    def start(self, args: Arrays, x: Any, slots: tuple[int, int]) -> Any:
        zeros = jnp.zeros_like(args[self.block_input])
        return zeros, zeros

    def last(self, args: Arrays, y: Any, j: Any, done: Any, acc: Any, backward: bool,
             slot: Any, riding: Arrays) -> tuple[Any, Arrays, Any]:
        outs, dxs = acc
        return args["cotangent"][j], {}, (jnp.where(done, outs.at[j].set(y), outs), dxs)

    def first_back(self, args: Arrays, dx: Any, j: Any, done: Any, acc: Any, slot: Any, beside: Arrays) -> Any:
        outs, dxs = acc
        return outs, jnp.where(done, dxs.at[j].set(dx), dxs)

    def weight(self, args: Arrays, j: Any, first: Any, last: Any, acc: Any, slots: tuple[Any, Any]) -> Any:
        return acc  # a block alone's ends have no weights

    def results(self, acc: Any) -> Any:
        return acc

    def cotangent(self, pipe: Pipeline, inputs: Arrays, cotangent: Arrays | None) -> Any:
        if cotangent is None:  # the output is laid out as the input: zeros of its microbatches
            return jnp.zeros_like(pipe.split(inputs[self.block_input], pipe.dims[self.block_input]))
        given = pipe.order(self.output_cotangent, cotangent[self.output_cotangent])
        return pipe.split(given, pipe.dims[self.block_output])

    def outputs(self, pipe: Pipeline, acc: Any) -> Arrays:
        outs = _gathered(acc[0], self.both or (self.last_stage,))  # the last stage's (each direction's last)
        return {self.block_output: pipe.order(self.block_output, pipe.join(outs, pipe.dims[self.block_output]), True)}

    def gradients(self, pipe: Pipeline, acc: Any) -> Arrays:
        grad = pipe.join(_gathered(acc[1], self.both or (0,)), pipe.dims[self.block_input])
        return {self.input_grad: pipe.order(self.input_grad, grad, True)}

    def finish(self, acc: Any) -> Any:
        return acc


@dataclass(frozen=True)
class ModelEnds:
    """A block in a whole model: ``pre`` on stage 0 makes the block's input from the data inputs
    ``pre_data`` and its params; ``post`` on the last stage reads the block's output, ``post_data`` and
    its params and makes the loss.  Their params arrive stacked over the stages, only the first
    (last) stage's copy non-zero, so their gradients need no reduction over the stage axis.  The
    cotangent is each microbatch's loss's; the accumulator the losses and the ends' gradients.

    A ``tied`` param (read by both; or an input without the batch dim, a position table) has a copy on both
    end stages and two accumulated contributions, the last stage's keyed ``name@last``; once a step the two
    stages swap their sums (a collective-permute each way over ``axis``: an AllReduce over the two, as
    Megatron-LM's embedding group runs it) and both finish the same gradient."""

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
    last_stage: int = -1  # the stage that runs ``post``: the last virtual stage's (stage 0 in a V)
    # DualPipe's two devices that each run both parts (each direction enters at one, leaves at the other)
    both: tuple[int, ...] = ()
    # the zero-bubble schedules: the ends' weight gradients at their W ticks (shardc.lowering.pipeline_split),
    # ``post`` cut into B and W; what W reads kept a microbatch until then (the accumulator's third part)
    split: bool = False
    # the inputs without the batch dim each end reads (a position table, a bias): the same for every
    # microbatch, so held whole by the stage that runs the end, as its params are (one in both: by both)
    pre_whole: tuple[str, ...] = ()
    post_whole: tuple[str, ...] = ()
    # the values ``pre`` makes beside its result that the block's first layer reads (E beside X0: FED), and
    # those ``post`` reads, which ride with the activation to the last stage (RIDERS)
    fed: tuple[str, ...] = ()
    riders: tuple[str, ...] = ()

    def inputs(self) -> tuple[str, ...]:
        """Each argument once: one both ends read (a tied param, a position table) is passed once, on both."""
        return tuple(dict.fromkeys(self.pre_data + self.post_data + self.pre_whole + self.post_whole
                                   + self.pre_params + self.post_params))

    def summed(self, post: bool) -> tuple[str, ...]:
        """The inputs of one end (after the block: ``post``) whose gradients it sums over the microbatches: its
        params, and its whole inputs that get a gradient (a position table not declared ``const``)."""
        part, params, whole = (self.post, self.post_params, self.post_whole) if post else (
            self.pre, self.pre_params, self.pre_whole)
        return params + tuple(k for k in whole if k in part.grads)

    def _first(self, name: str) -> bool:
        """Whether stage 0's end (before the block) reads input ``name``."""
        return name in self.pre_data + self.pre_whole + self.pre_params

    def stages_of(self, name: str) -> tuple[int, ...]:
        if self.both:
            return self.both
        last = name in self.post_data + self.post_whole + self.post_params
        return ((0,) if self._first(name) else ()) + ((self.last_stage,) if last else ())

    def _spec(self, name: str) -> P:
        return (self.pre if self._first(name) else self.post).forward_in[name]

    def _key(self, name: str) -> str:
        """The accumulator's key of a post param's gradient: a tied one's own, beside stage 0's."""
        return f"{name}@last" if name in self.tied else name

    def _keys(self) -> dict[str, str]:
        """Each accumulated gradient's key and the param it is of."""
        return {k: k for k in self.summed(False)} | {self._key(k): k for k in self.summed(True)}

    def specs(self) -> tuple[P, ...]:
        data = self.pre_data + self.post_data  # cut into microbatches: [M, ...]
        return tuple(P(None, *self._spec(k)) if k in data else self._spec(k) for k in self.inputs())

    def cotangent_spec(self) -> P:
        return P()

    def result_specs(self, axis: str) -> Any:
        return P(axis, None), {key: P(axis, *self._spec(k)) for key, k in self._keys().items()}

    @staticmethod
    def _drawn(args: Arrays, j: Any) -> tuple[Any, Any]:
        """The dropout key of the ends on microbatch j: the step's key itself (``args["key"]``, as the
        unpipelined reference draws the statements around the blocks under it; a layer draws under
        :func:`shardc.spec.functions.layer_key`, its own salts apart) and j, whose slice of the whole
        batch's mask the microbatch draws (``keep_mask``'s ``MICROBATCH``)."""
        return args["key"], jnp.asarray(j, jnp.int32)

    def _pre_pool(self, args: Arrays, j: Any) -> Arrays:
        return {k: args[k][j] if k in self.pre_data else args[k] for k in self.pre.forward_in}

    def _post_pool(self, args: Arrays, y: Any, j: Any, riding: Arrays) -> Arrays:
        return {k: y if k == self.block_output else riding[k] if k in riding else args[k][j] if k in self.post_data
                else args[k] for k in self.post.forward_in}

    def first(self, args: Arrays, j: Any) -> tuple[Any, Arrays]:
        x, (_, saved) = self.pre.forward(self._pre_pool(args, j), self._drawn(args, j))
        return x, {n: saved[n] for n in dict.fromkeys(self.fed + self.riders)}

    def start(self, args: Arrays, x: Any, slots: tuple[int, int]) -> Any:
        """No losses yet, and zeros of each end param's gradient as its backward hands it on (a partial
        sum, where its reduction runs once a step); split, what the ends' W reads in rings of ``slots``:
        post's from its B (at the last virtual stage's F) to its W, the block input's gradient from the first
        virtual stage's B to its W, each microbatch at its slot (:class:`~shardc.lowering.pipeline_slots.Rings`'
        post and pre: a slot for each one in flight on the ends' devices, as a framework keeps the loss's W
        inputs, not one for each of the M: ZB-H1's 3 + 5 run kept 8 logits' cotangents, 128 kB)."""
        losses = jnp.zeros((args[self.inputs()[0]].shape[0],), x.dtype)
        pre = jax.eval_shape(lambda d: self.pre.backward(self.pre.forward(self._pre_pool(args, 0),
                                                                          self._drawn(args, 0))[1], d), x)
        made = jax.eval_shape(self.first, args, 0)[1]  # the values fed beside x, those riding with it
        post = jax.eval_shape(lambda y, r: self.post.backward(self.post.forward(self._post_pool(args, y, 0, r),
                                                                                self._drawn(args, 0))[1],
                                                              args["cotangent"]), x, made)
        shapes = {k: pre[k] for k in self.summed(False)} | {self._key(k): post[k] for k in self.summed(True)}
        dends = {k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.items()}
        if not self.split:
            return losses, dends
        kept = jax.eval_shape(lambda y, r: self._post_input_backward(args, y, 0, r)[3], x, made)
        kept = jax.tree.map(lambda a: jnp.zeros((slots[0], *a.shape), a.dtype), kept)
        ring = {n: jnp.zeros((slots[1], *a.shape), a.dtype) for n, a in {"dx": x, **made}.items()}
        return losses, dends, {"dx": ring, "post": kept}

    def _post_input_backward(self, args: Arrays, y: Any, j: Any, riding: Arrays) -> tuple[Any, Any, Arrays, Arrays]:
        """The loss, the block output's gradient (post's B), the riders', and what post's W reads that this
        microbatch made (the forward's saved values, B's handed ones; the params W reads are the arguments)."""
        loss, (pool, saved) = self.post.forward(self._post_pool(args, y, j, riding), self._drawn(args, j))
        got, handed = self.post.backward_inputs((pool, saved), args["cotangent"], (self.block_output, *self.riders))
        assert self.post.weight_backward is not None
        values = {**pool, **saved, **handed}
        kept = {k: values[k] for k in self.post.weight_backward[1] if k not in self.post_params}
        return loss, got.pop(self.block_output), got, kept

    def _add(self, dends: Arrays, got: Arrays, post: bool, done: Any) -> Arrays:
        """The ends' gradient sums with ``got`` (keyed by param) of the params before the block (after it,
        ``post``) added, where ``done``."""
        keys = {self._key(k) if post else k: k for k in self.summed(post)}  # a tied param's last copy: @last
        return {k: jnp.where(done, g + got[keys[k]], g) if k in keys else g for k, g in dends.items()}

    def last(self, args: Arrays, y: Any, j: Any, done: Any, acc: Any, backward: bool,
             slot: Any, riding: Arrays) -> tuple[Any, Arrays, Any]:
        losses, dends, *kept = acc
        if backward and self.split:  # B now; W at the last virtual stage's W tick of microbatch j
            loss, dy, d_riding, made = self._post_input_backward(args, y, j, riding)
            post = jax.tree.map(lambda buf, v: jnp.where(done, buf.at[slot].set(v), buf), kept[0]["post"], made)
            kept = [{**kept[0], "post": post}]
        else:
            loss, residuals = self.post.forward(self._post_pool(args, y, j, riding), self._drawn(args, j))
            dy, d_riding = jnp.zeros_like(y), {n: jnp.zeros_like(v) for n, v in riding.items()}
            if backward:
                got = self.post.backward(residuals, args["cotangent"])
                dends, dy = self._add(dends, got, True, done), got[self.block_output]
                d_riding = {n: got[n] for n in riding}
        losses = jnp.where(done, losses.at[j].set(loss), losses)
        return dy, d_riding, (losses, dends, *kept)

    def first_back(self, args: Arrays, dx: Any, j: Any, done: Any, acc: Any, slot: Any, beside: Arrays) -> Any:
        losses, dends, *kept = acc
        if self.split:  # no B: nothing waits for the gradient of the inputs before the block; all is W
            given = {"dx": dx, **beside}
            rings = {n: jnp.where(done, buf.at[slot].set(given[n]), buf) for n, buf in kept[0]["dx"].items()}
            return losses, dends, {**kept[0], "dx": rings}
        return losses, self._pre_backward(args, dx, j, done, dends, beside)

    def _pre_backward(self, args: Arrays, dx: Any, j: Any, done: Any, dends: Arrays, beside: Arrays) -> Arrays:
        """The backward before the block on microbatch j (its forward runs again for its residuals: a
        cheap lookup), from the block input's gradient ``dx`` and the first layer's of the values fed beside
        it (``beside``), added to the ends' gradient sums where ``done``."""
        got = self.pre.backward(self.pre.forward(self._pre_pool(args, j), self._drawn(args, j))[1], dx, beside)
        return self._add(dends, got, False, done)

    def weight(self, args: Arrays, j: Any, first: Any, last: Any, acc: Any, slots: tuple[Any, Any]) -> Any:
        """W of the ends: before the block its whole backward (from the block input's gradient B kept),
        after it post's W (from what its B kept), each where its virtual stage's W runs."""
        if not self.split:
            return acc
        losses, dends, kept = acc
        given = {n: buf[slots[1]] for n, buf in kept["dx"].items()}
        dends = self._pre_backward(args, given.pop("dx"), j, first, dends, given)
        params = {k: args[k] for k in self.post.forward_in if k in self.post_params}
        got = self.post.backward_weight((params, {}), jax.tree.map(lambda buf: buf[slots[0]], kept["post"]))
        return losses, self._add(dends, got, True, last), kept

    def results(self, acc: Any) -> Any:
        return acc[:2]  # the losses and the ends' gradients; not what the W ticks kept

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
        return {self.post.result: jnp.mean(_gathered(acc[0], self.both or (self.last_stage,)))}

    def finish(self, acc: Any) -> Any:
        losses, dends = acc[:2]
        if self.both:  # DualPipe: the two end devices swap their sums, each then holds every microbatch's
            first, last = self.both
            dends = {k: g + jax.lax.ppermute(g, self.axis, [(first, last), (last, first)]) for k, g in dends.items()}
        pre = {k: dends[k] for k in self.summed(False)}
        incoming = {}
        for k in self.tied:  # the two ends swap their sums: each then holds both contributions
            if self.both:  # both ends on each of the two devices: both contributions are there
                incoming[self.post.grads[k]] = dends[self._key(k)]
                continue
            pre[k] = self._swap(pre[k], 0, self.last_stage % self.stages)
            incoming[self.post.grads[k]] = self._swap(dends[self._key(k)], self.last_stage % self.stages, 0)
        got = self.pre.finish(pre, incoming)
        got |= self.post.finish({k: dends[k] for k in self.summed(True) if k not in self.tied})
        return losses, got | {self._key(k): got[k] for k in self.tied}

    def _swap(self, x: Any, source: int, target: int) -> Any:
        """``x`` (non-zero on stage ``source`` only) on ``source`` and ``target`` both (no send where the two
        ends are on one stage, as in a V)."""
        return x if source == target else x + jax.lax.ppermute(x, self.axis, [(source, target)])

    def gradients(self, pipe: Pipeline, acc: Any) -> Arrays:
        """Each gradient, from the stage that holds it (a tied param's from stage 0; the last stage holds
        the same)."""
        dends = acc[1]
        got = {self.pre.final(k): dends[k][0] for k in self.summed(False)}
        return got | {self.post.grads[k]: dends[k][self.last_stage] for k in self.summed(True) if k not in self.tied}


def _gathered(stacked: Any, stages: tuple[int, ...]) -> Any:
    """The sum over ``stages`` of a result stacked over the stages, each stage's zeros where another
    made it (DualPipe's two end devices each keep one direction's microbatches)."""
    return sum(stacked[s] for s in stages[1:]) + stacked[stages[0]]
