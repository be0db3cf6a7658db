"""A fused projection split in parts, as transformer code writes its QKV: ``qkv = x @ w_qkv`` then
``q, k, v = jnp.split(qkv, 3, -1)`` (nanoGPT's ``c_attn``, flax and MaxText's fused kernel
``[D, 3, N, H]``, Megatron's interleaved ``[D, N * 3 * H]`` reshaped before the split), read as one
contraction a part, with the weight's parts.

The language has no op that takes a part of a dim, but a contraction's product split along a dim of its
weight is the contraction with the weight's parts: ``split(x · W[D, 3F]) = x · W[:, :F], x · W[:, F:2F],
...``, the same values.  Where that dim of the weight is whole on each device (the weight sharded along
another dim, or not at all), each device holds each part's block as it holds the whole's, so the spec
of three weights ``w_qkv_q[D, F]``, ``w_qkv_k``, ``w_qkv_v`` has the program's bytes on each device
and its collectives (a gather of the whole weight is the three parts' gathers, by size).  Where the
split dim is sharded, a device's block of the whole straddles the parts (blocks of 3F/n columns, parts
of F), so XLA moves them between devices, which no spec of the language writes: an error naming the
weight and what to do.
"""

from __future__ import annotations

from typing import Any

from shardc.explanation.dim_classes import unwritable
from shardc.explanation.spec_text import Made

__all__ = ["split_projection"]

_PARTS = {3: "qkv"}  # the suffixes of a weight's parts, where the count has names


def _weight(reader: Any, operands: tuple[Any, ...], dim: int) -> tuple[int, int] | None:
    """(the operand's side, the position of ``dim`` in it) where an input of the program (no statement
    makes it, no scan stacks it) holds ``dim`` as a dim of its own (not a part of one)."""
    stacked = {*reader.layer_inputs[0], *reader.layer_inputs[1]}
    for side, operand in enumerate(operands):
        if operand in reader.made or operand in stacked:
            continue
        # a dim of its own, or one of the parts a reshape made of one (Megatron's interleaved [N, 3, H])
        where = [k for k, d in enumerate(reader.dims_of(operand)) if reader.find(dim) in reader.atoms(d)]
        if len(where) == 1 and len(reader.atoms(dim)) == 1:
            return side, where[0]
    return None


def split_projection(reader: Any, eqn: Any, line: str) -> bool:
    """Read a ``split`` of a contraction's product into equal parts, along a dim of its weight, as one
    contraction a part; False where it is not one (the split is then read as parts of the array)."""
    array, sizes, axis = reader.base(eqn.invars[0]), eqn.params.get("sizes", ()), eqn.params.get("axis", -1)
    made = next((s for s in reversed(reader.statements) if s.result is array), None)
    # in three or more: a split in two may be a rotary embedding's halves, put back together (slices.py)
    if eqn.primitive.name != "split" or len(sizes) < 3 or len(set(sizes)) != 1 or made is None \
            or made.kind != "dot" or array in reader.used:
        return False
    dims = reader.dims_of(eqn.invars[0])
    found = _weight(reader, made.operands, dims[axis])
    if found is None:
        return False
    side, where = found
    weight = made.operands[side]
    sharded = [axes for atom, axes in reader.layout(weight) if atom == reader.find(dims[axis]) and axes]
    if sharded:
        raise unwritable(f"a fused projection's weight {reader.names[weight]} is split in {len(sizes)} along a dim "
                         f"sharded over {', '.join(sharded[0])}: a device's block of it straddles the parts, which "
                         "XLA moves between devices, and the spec language has no op that takes a part of a dim",
                         fix="shard the fused weight along another dim (its heads: lay it out [D, 3, N, H] with N "
                             "sharded, as MaxText's fused kernel), or pass the parts' weights as arrays of their own")
    _unmake(reader, made)
    reader.unreadable[array] = (f"a fused projection's product (of {reader.names[weight]}) is read whole beside "
                                "its parts, which the spec writes as a contraction a part",
                                "read only its parts (q, k, v), or pass the parts' weights as arrays of their own")
    names = [f"{reader.names[weight]}_{_PARTS[len(sizes)][k] if len(sizes) in _PARTS else k}"
             for k in range(len(sizes))]
    reader.notes.append(f"{', '.join(names)} are {reader.names[weight]}'s parts along its dim of "
                        f"{reader.size[dims[axis]]}, split at {line or 'its split'}: one contraction a part")
    for k, out in enumerate(eqn.outvars):
        for position, (d, e) in enumerate(zip(dims, reader.dims_of(out), strict=True)):
            if position != axis:
                reader.join(d, e)
        operands = list(made.operands)
        operands[side] = _part(reader, weight, where, dims[axis], reader.dims_of(out)[axis], names[k])
        reader.make(out, "dot", tuple(operands), line=made.line)
    return True


def _unmake(reader: Any, made: Any) -> None:
    """Take back the statement ``made`` (the whole product, which no statement reads)."""
    reader.statements.remove(made)
    reader.made.discard(made.result)
    name = reader.names.pop(made.result)
    if name == f"Y{reader.counts.get('Y', 0)}":
        reader.counts["Y"] -= 1


def _part(reader: Any, weight: Any, where: int, split: int, dim: int, name: str) -> Made:
    """The weight's part along its dim at ``where`` (or that dim's part ``split``), now ``dim``, its
    sharding along the others; a parameter where the weight is one."""
    part = Made()
    dims = reader.dims_of(weight)
    whole = [dim if reader.find(a) == reader.find(split) else a for a in reader.atoms(dims[where])]
    reader.dims[part] = [*dims[:where], *whole, *dims[where + 1:]]
    reader.names[part] = name
    reader.fused_parts[name] = reader.names[weight]
    reader.axes[part] = {**dict(reader.layout(weight)), dim: ()}
    given = reader.step.inputs.get(weight)
    if given is not None and given in reader.step.params:
        reader.step.params.append(part)
    else:
        reader.step.inputs[part] = part
    return part
