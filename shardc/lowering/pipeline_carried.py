"""Values made before a pipelined block that are read past stage 0's first layer, in a pipelined program.

What a stage hands the next each tick (:class:`Carried`): the block's activation, and the values riding with
it to the last stage (:func:`shardc.pipeline.boundary.riders`: made before the block, read after it).  And
the values the block reads beside its input (:func:`shardc.pipeline.boundary.fed_beside`: ``E`` beside
``X0``, both fed by the layer's output): the model's first layer reads those made before the block, each
later layer its input (:func:`fed_values`), whose gradient is then theirs added to its own (:func:`input_grad`).

A rider is made on stage 0 with the block's input and read by the statements after the block on the last
stage; every stage between hands it on unchanged, laid end to end with the activation in one flat array, so a
hop is one send of both (the ``p2p_bytes`` the cost charges: :func:`shardc.pipeline.boundary.carried_refs`),
and the gradients come back the same way, the rider's from the last stage's backward to stage 0's.  With no
rider the array is the activation itself, as it always was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

__all__ = ["Carried", "fed_values", "input_grad"]

Arrays = dict[str, Any]


@dataclass(frozen=True)
class Carried:
    """The activation's shape and type, and each rider's name and shape (in the activation's type)."""

    shape: tuple[int, ...]
    dtype: Any
    riders: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @staticmethod
    def of(x: Any, values: Arrays, names: tuple[str, ...]) -> Carried:
        """The carry of activation ``x`` (an array or its shape) with the riders ``names`` of ``values``."""
        return Carried(tuple(x.shape), x.dtype, tuple((n, tuple(values[n].shape)) for n in names))

    @property
    def sent(self) -> tuple[int, ...]:
        """The shape of what is sent: the activation's, or with riders one flat array of every element."""
        if not self.riders:
            return self.shape
        return (math.prod(self.shape) + sum(math.prod(s) for _, s in self.riders),)

    def pack(self, x: Any, values: Arrays) -> Any:
        """``x`` and the riders of ``values`` as one array to send."""
        if not self.riders:
            return x
        return jnp.concatenate([x.ravel(), *(values[n].astype(self.dtype).ravel() for n, _ in self.riders)])

    def unpack(self, sent: Any) -> tuple[Any, Arrays]:
        """The activation and each rider (by name) of an array :meth:`pack` made."""
        if not self.riders:
            return sent, {}
        at = math.prod(self.shape)
        x, values = sent[:at].reshape(self.shape), {}
        for name, shape in self.riders:
            values[name] = sent[at:at + math.prod(shape)].reshape(shape)
            at += math.prod(shape)
        return x, values


def fed_values(fed: tuple[str, ...], k: int, given: Any, beside: Arrays | None, start: Any) -> Arrays:
    """The values ``fed`` beside slot k's layer's input ``given`` (none for a later block's): the input itself,
    but in the model's first layer (slot 0 of the virtual stage that ``start``s) those made before the block
    (``beside``)."""
    return {n: jnp.where(start, beside[n], given) if k == 0 and beside else given for n in fed}


def input_grad(got: Arrays, name: str, fed: tuple[str, ...], first_block: bool, k: int,
               start: Any) -> tuple[Any, Arrays]:
    """Slot k's layer's gradient of its input ``name``, from its inputs' (``got``): the input's, plus those of
    the values ``fed`` beside it (in the first block), which past the model's first layer are the input; and at
    slot 0 the first layer's of those values, which the ends take (zeros where it is not the first layer, or a
    later block's: every branch of a slot returns one structure)."""
    dx, mine = got[name], fed if first_block else ()
    for n in mine:
        dx = dx + (jnp.where(start, jnp.zeros_like(got[n]), got[n]) if k == 0 else got[n])
    return dx, {n: got[n] if n in mine else jnp.zeros_like(dx) for n in fed} if k == 0 else {}
