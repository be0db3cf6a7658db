"""A ``jax.lax.scan`` of a layer over stacked weights read as a ``layers N { ... }`` block of the spec."""

from __future__ import annotations

import math
from typing import Any

from jax.extend import core as jex

from shardc.explanation.contractions import apart
from shardc.explanation.dim_classes import unwritable
from shardc.explanation.sources import source_line
from shardc.explanation.spec_text import Made
from shardc.explanation.training import carried

__all__ = ["read_scan"]


def read_scan(reader: Any, eqn: Any) -> None:
    """``jax.lax.scan`` of a layer over stacked weights: the body once, as a ``layers N { ... }``
    block (its carry the block's input and output), each stacked weight one layer's (the leading
    dim left out), read as far as the carry needs it (a training step's residuals are not).  Each
    scan is a block of its own, in the program's order."""
    body, length = reader.walked.once(eqn.params["jaxpr"].jaxpr), int(eqn.params["length"])
    consts, carry = eqn.params["num_consts"], eqn.params["num_carry"]
    for k, (outer, inner) in enumerate(zip(eqn.invars, body.invars, strict=True)):
        if isinstance(outer, jex.Literal) or not outer.aval.shape:
            continue
        reader.step.enter(outer, inner)
        if k < consts + carry:
            reader.view(inner, outer, list(range(len(outer.aval.shape))))
            if k < consts:
                reader.layer_inputs[1].append(reader.base(outer))
            continue
        reader.layer_inputs[0].append(reader.base(outer))
        if reader.axes.get(reader.base(outer), {}).get(reader.dims_of(outer)[0], ()):
            _layer_sharded(reader, outer, length)
        reader.stacked.add(reader.dims_of(outer)[0])
        reader.dims[inner], reader.alias[inner] = reader.dims_of(outer)[1:], outer
    start = len(reader.statements)
    reader.walk(body, carried(body, carry), carry)
    line = source_line(eqn) or reader.caller
    outs = [_close_carry(reader, inner_in, inner_out, line)
            for inner_in, inner_out in zip(body.invars[consts:consts + carry], body.outvars[:carry], strict=True)]
    reader.blocks.append((start, len(reader.statements), length))
    for k, (outer, inner) in enumerate(zip(eqn.outvars, [*outs, *body.outvars[carry:]], strict=True)):
        if k >= carry:
            reader.stacked_outputs.add(outer)
        elif not isinstance(inner, jex.Literal) and outer.aval.shape:
            reader.view(outer, inner, list(range(len(outer.aval.shape))))


def _close_carry(reader: Any, inner_in: Any, inner_out: Any, line: str) -> Any:
    """A layer's carry out is the next layer's carry in: made inside the block (an elementwise run
    that ends the layer, ``tanh(h @ w)``, is written where it is read, which would be after the block)
    and of the carry in's dims and layout, so the block's output feeds its input.  Where the dims are
    held apart (``h @ w``, ``w[S, T]`` square: T is not S in the weight) or the layout differs, the
    output is copied into the carry's (the language's rename or reshard, ``C[B, S] = H[B, T_X]``), as
    the loop hands it on.  The carry out is returned."""
    if isinstance(inner_out, jex.Literal) or not inner_out.aval.shape or isinstance(inner_in, jex.Literal):
        return inner_out
    tensor, source = reader.tensor(inner_out), reader.tensor(inner_in)
    ins, outs = reader.dims_of(inner_in), reader.dims_of(inner_out)
    if not any(apart(reader, d, e) for d, e in zip(ins, outs, strict=True)):
        for d, e in zip(ins, outs, strict=True):
            reader.join(d, e)
        if reader.layout(tensor) == reader.layout(source):
            reader.carries.add(tensor)
            return inner_out
    carry = Made()
    reader.dims[carry] = list(ins)
    reader.make(carry, "copy", (tensor,), line=line)
    reader.axes[carry] = dict(reader.layout(source))
    reader.carries.add(carry)
    return carry


def _layer_sharded(reader: Any, stacked: Any, length: int) -> None:
    """Stacked weights sharded along the layers (``W[L_X, D, F]``: each device holds L/X whole layers,
    and XLA gathers each layer's slice as the loop reads it) written as the language's nearest
    equivalent: each layer's weights sharded over those axes along a dim they divide (FSDP), the
    same bytes a device and one AllGather of a layer's weights a layer, with a note saying so."""
    axes = reader.axes[reader.base(stacked)]
    layer, *rest = reader.dims_of(stacked)
    moved = axes[layer]
    devices = math.prod(reader.mesh[a] for a in moved)
    held = [d for d in rest if not axes.get(d, ())] + [d for d in rest if axes.get(d, ())]
    fits = [d for d in held if reader.size[d] % (devices * math.prod(reader.mesh[a] for a in axes.get(d, ()))) == 0]
    if not fits:
        raise unwritable(f"a scan over stacked weights sharded along the layers over {', '.join(moved)}, whose "
                         "layers' dims those axes divide none of (the language shards each layer's weights)")
    axes[layer], axes[fits[0]] = (), (*moved, *axes.get(fits[0], ()))
    name = reader.names.get(reader.base(stacked), "a stacked weight")
    reader.notes.append(f"{name}: its {length} layers sharded over {', '.join(moved)} in the program, each "
                      "layer's weights here (FSDP): the same bytes a device and gathered (XLA may gather the "
                      "whole stack before its loop, here a layer at a time)")
