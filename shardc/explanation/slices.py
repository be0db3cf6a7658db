"""An array's elements moved along one dim: slices put back together along the dim they cut, a flip
(maps of the array, local where that dim is whole on a device), a sort (the language's ``sort``).

A rotary position embedding (Su et al. 2021, as GPT-NeoX and LLaMA implementations write it) rotates
the halves of the head dim, ``rotate_half(x) = concatenate([-x2, x1])`` with ``x1, x2`` the halves of
``x``'s last dim, then adds ``x * cos + rotate_half(x) * sin``.  ``rotate_half(x)`` has x's dims and,
with the head dim whole on each device, x's sharding: no data crosses devices, as for an elementwise
map, so the parts are a run of maps of x, and the whole run, where it is that rotation, the language's
``rotary`` (:mod:`shardc.explanation.rotary_runs`).  Its parts alone (a half of a dim, a strided slice,
a cache grown by a concatenation) have dims of sizes the program's other tensors do not have, and no
form in the language: each is an error naming the op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardc.explanation.constants import record
from shardc.explanation.dim_classes import unwritable
from shardc.explanation.fused import split_projection

__all__ = ["Piece", "concatenate", "cut", "reverse", "sort"]


@dataclass(frozen=True)
class Piece:
    """``[start, stop)`` of the dim ``axis`` of an array of the dims ``ids`` (a view of ``source``)."""

    source: Any
    ids: tuple[int, ...]
    axis: int
    start: int
    stop: int


def _bounds(eqn: Any) -> list[tuple[int, int, int]]:
    """Each result's (axis, start, stop) of a ``slice`` (one dim narrowed, unit strides) or a ``split``."""
    shape = eqn.invars[0].aval.shape
    if eqn.primitive.name == "split":
        axis, starts = eqn.params["axis"], [0]
        for size in eqn.params["sizes"]:
            starts.append(starts[-1] + int(size))
        return [(axis, a, b) for a, b in zip(starts, starts[1:], strict=False)]
    if any(s not in (None, 1) for s in eqn.params["strides"] or ()):
        raise unwritable("a strided slice picks every k-th element of a dim, which no op of the spec language "
                         "does (a dim's elements a device holds are one block; a rotary embedding's interleaved "
                         "pairs, x[..., ::2] and x[..., 1::2] as RoFormer's and GPT-J's code pair them, are not "
                         "the language's `rotary`, which rotates the halves as LLaMA's rotate_half does)",
                         fix="pass the strided slice to the program as an argument (an input of its size in the "
                             "spec); rotate the halves of the head dim (its weights' columns permuted, the same "
                             "model); or write the .shard spec")
    narrowed = [k for k, (a, b, n) in enumerate(zip(eqn.params["start_indices"], eqn.params["limit_indices"], shape,
                                                    strict=True)) if (a, b) != (0, n)]
    if len(narrowed) != 1:
        raise unwritable("a slice of several dims at once has no form in the spec language")
    k = narrowed[0]
    return [(k, int(eqn.params["start_indices"][k]), int(eqn.params["limit_indices"][k]))]


def cut(reader: Any, eqn: Any, line: str) -> None:
    """A ``slice``/``split`` of an array: each result a part of it (``reader.pieces``), read as a map of
    the array (a region, as an elementwise run) until a concatenation puts the parts back together.; a
    contraction's product split along a dim of its weight is a contraction a part (a fused QKV's)."""
    if split_projection(reader, eqn, line):
        return
    var = reader.base(eqn.invars[0])
    ops = reader.region[var][1] if var in reader.region else frozenset()
    source, ids = reader.source(var), tuple(reader.dims_of(eqn.invars[0]))
    for out, (axis, start, stop) in zip(eqn.outvars, _bounds(eqn), strict=True):
        for k, (d, e) in enumerate(zip(ids, reader.dims_of(out), strict=True)):
            if k != axis:
                reader.join(d, e)
        reader.pieces[out] = Piece(source, ids, axis, start, stop)
        reader.region[out] = (source, ops | {eqn.primitive.name}, line)
    record(reader, eqn, eqn.primitive.name, [var])


def concatenate(reader: Any, eqn: Any, line: str) -> None:
    """Parts of one array along one dim, each once, in any order (``concatenate([-x2, x1])``): a map of the
    array where that dim is whole on a device; any other concatenation is an error."""
    axis, out = eqn.params["dimension"], eqn.outvars[0]
    ins = [reader.base(v) for v in eqn.invars]
    parts = [reader.pieces.get(v) for v in ins]
    first = parts[0]
    if first is None or any(p is None or (p.source, p.ids, p.axis) != (first.source, first.ids, axis) for p in parts):
        raise unwritable("a concatenation grows a dim (a cache's length, a stack of arrays), which no op of the "
                         "spec language does; only the parts of one array put back together (rotary "
                         "embedding's rotate-half) are read, as a map of the array",
                         fix="concatenate the inputs before the program: two products with one array, x @ w1 and "
                             "x @ w2, side by side are one contraction with the weights concatenated; a cache "
                             "grown by a step is the spec of one step at the grown length")
    spans = sorted((p.start, p.stop) for p in parts if p is not None)
    if [a for a, _ in spans] != [0, *(b for _, b in spans[:-1])] or spans[-1][1] != reader.size[first.ids[axis]]:
        raise unwritable("a concatenation of parts of an array that are not each of its elements once")
    sharded = [axes for atom, axes in reader.layout(first.source) if atom in reader.atoms(first.ids[axis]) and axes]
    if sharded:
        raise unwritable(f"a concatenation of parts of a dim sharded over {', '.join(sharded[0])} moves its elements "
                         "between devices, which a map of the spec language does not")
    for d, e in zip(first.ids, reader.dims_of(out), strict=True):
        reader.join(d, e)
    ops = frozenset().union(*(reader.region[v][1] for v in ins if v in reader.region))
    # the parts in their order put each element back in place: the array itself, nothing moved
    in_place = [p.start for p in parts if p is not None] == [a for a, _ in spans]
    reader.region[out] = (first.source, ops - {"slice", "split"} if in_place else ops | {"concatenate"}, line)
    if not in_place:  # the parts in place are the array: no step of a run
        record(reader, eqn, "concatenate", ins)


def sort(reader: Any, eqn: Any, line: str) -> None:
    """``jnp.sort(x, axis)``: ``sort(X over I)``, the language's (I gathered where it is sharded)."""
    if len(eqn.invars) != 1:
        raise unwritable("a sort that carries other arrays along (an argsort, a sort by keys) makes "
                         "positions along a dim, which the language has no tensor for")
    source, out = eqn.invars[0], eqn.outvars[0]
    for d, e in zip(reader.dims_of(source), reader.dims_of(out), strict=True):
        reader.join(d, e)
    over = reader.dims_of(source)[eqn.params["dimension"]]
    reader.make(out, "norm", (reader.tensor(source),), fn="sort", over=over, line=line)


def reverse(reader: Any, eqn: Any, line: str) -> None:
    """``jnp.flip``: a map of the array where the reversed dims are whole on a device.  Right after a
    sort along the same dim (``jnp.sort(x, descending=True)``) it is that sort's order: the language's
    ``sort``, ascending, which moves what a descending one does."""
    source, out = eqn.invars[0], eqn.outvars[0]
    flipped = {reader.find(reader.dims_of(source)[k]) for k in eqn.params["dimensions"]}
    made = next((s for s in reader.statements if s.result is reader.base(source) and s.fn == "sort"), None)
    if made is not None and flipped == {reader.find(made.over)}:
        reader.view(out, source, list(range(len(out.aval.shape))))
        return
    atoms = {a for d in flipped for a in reader.atoms(d)}
    sharded = [axes for atom, axes in reader.layout(reader.source(source)) if axes and atom in atoms]
    if sharded:
        raise unwritable(f"a reversal of a dim sharded over {', '.join(sharded[0])} moves its elements between "
                         "devices, which a map of the spec language does not")
    ops = reader.region.get(reader.base(source), (None, frozenset(), ""))[1]
    reader.region_of(out, [source], frozenset(ops | {"rev"}), line)
