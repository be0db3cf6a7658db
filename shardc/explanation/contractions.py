"""A jaxpr's contractions read as the spec's einsums: a ``dot_general``'s contracted and batch dims joined
with its operands', an operand read twice along one dim (self-attention's Q·K and P·V) renamed first, and
the letters of the ``jnp.einsum`` equation that made it kept as the dims' names."""

from __future__ import annotations

import re
from typing import Any

from shardc.explanation.fresh import Made

__all__ = ["read_dot", "apart", "rename"]

_EQUATION = re.compile(r"([a-z]+),([a-z]+)->([a-z]*)")


def read_dot(reader: Any, eqn: Any, line: str) -> None:
    """A ``dot_general``: its contracted and batch dims joined, its result a ``dot`` statement (an operand read
    twice along one dim renamed first)."""
    lhs, rhs = eqn.invars
    out = eqn.outvars[0]
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    left, right, ids = reader.dims_of(lhs), reader.dims_of(rhs), reader.dims_of(out)
    free_l = [i for i in range(len(left)) if i not in lc and i not in lb]
    free_r = [i for i in range(len(right)) if i not in rc and i not in rb]
    operands, views = [reader.tensor(lhs), reader.tensor(rhs)], [left, right]
    pairs = [*zip(lc, rc, strict=True), *zip(lb, rb, strict=True)]
    for side, clashes in enumerate(_clashes(reader, left, right, pairs, free_l, free_r)):
        if clashes:  # one array read twice along one dim (self-attention's Q·K and P·V): a renamed copy
            operands[side], views[side] = rename(reader, operands[side], views[side], clashes, line)
    left, right = views
    for a, b in zip(lc, rc, strict=True):
        reader.join(left[a], right[b])
    order = [(left[a], right[b]) for a, b in zip(lb, rb, strict=True)]
    order += [(left[i], None) for i in free_l] + [(None, right[i]) for i in free_r]
    for position, (a, b) in enumerate(order):
        for d in (a, b):
            if d is not None:
                reader.join(d, ids[position])
    _hint(reader, eqn, (left, right))
    reader.make(out, "dot", (operands[0], operands[1]), line=line)


def _clashes(reader: Any, left: list[int], right: list[int], pairs: list[tuple[int, int]], free_l: list[int],
             free_r: list[int]) -> tuple[set[int], set[int]]:
    """Each operand's dims a contraction cannot join as they are: a right one the left operand keeps
    too (``Q[B, S, H] · K[B, S, H]``: S twice in the result), or one of a joined pair whose join would
    merge two dims a tensor holds apart (``P[B, S, T] · V[B, S, H]`` over T: S is T), renamed on the
    side that does not hold the other's dim already (V's S, not P's T)."""
    kept = {a for i in free_l for a in reader.atoms(left[i])}
    renamed: tuple[set[int], set[int]] = (set(), {right[i] for i in free_r
                                                  if kept & set(reader.atoms(right[i]))})
    tensors = _held(reader) if pairs else []
    for a, b in pairs:
        ra, rb = set(reader.atoms(left[a])), set(reader.atoms(right[b]))
        if ra == rb or not any(ra & held and rb & held for held in tensors):
            continue
        if ra & {e for d in right if d != right[b] for e in reader.atoms(d)}:  # the right operand holds a's dim
            renamed[0].add(left[a])
        else:
            renamed[1].add(right[b])
    return renamed


def apart(reader: Any, d: int, e: int) -> bool:
    """Whether joining ``d`` and ``e`` would merge two named dims a tensor holds apart (a square
    weight's ``w[D, E]`` when ``x @ w`` is added to x)."""
    ra, rb = set(reader.atoms(d)), set(reader.atoms(e))
    return ra != rb and any(ra & held and rb & held for held in _held(reader))


def _held(reader: Any) -> list[set[int]]:
    """The named dims (atoms) each tensor of the spec holds."""
    return [{a for d in reader.dims[var] for a in reader.atoms(d)} for var in reader.names if var in reader.dims]


def rename(reader: Any, tensor: Any, view: list[int], clashes: set[int], line: str) -> tuple[Any, list[int]]:
    """A copy of ``tensor`` whose ``clashes`` dims are new ones of the same size and sharding (the
    language's rename, ``Kx[B, T, D] = L1[B, S, D]``), and the ids of ``view`` (a view of it) in it."""
    fresh = {d: reader.fresh(d) for d in clashes}
    moved = {a: b for d, e in fresh.items() for a, b in zip(reader.atoms(d), reader.atoms(e), strict=True)}
    layout = reader.layout(tensor)
    copy = Made()
    reader.dims[copy] = [moved.get(a, a) for a, _ in layout]
    reader.make(copy, "copy", (tensor,), line=line)
    reader.axes[copy] = {moved.get(a, a): axes for a, axes in layout}
    return copy, [fresh.get(d, d) for d in view]


def _hint(reader: Any, eqn: Any, operands: tuple[list[int], ...]) -> None:
    """The letters of a ``jnp.einsum`` equation, where its terms are this dot_general's operands."""
    found = _EQUATION.findall(str(eqn.source_info.name_stack))
    terms = found[-1][:2] if found else ()
    if len(terms) == 2 and all(len(t) == len(ids) for t, ids in zip(terms, operands, strict=True)):
        for term, ids in zip(terms, operands, strict=True):
            for letter, d in zip(term, ids, strict=True):
                reader.hints.setdefault(d, letter.upper())
