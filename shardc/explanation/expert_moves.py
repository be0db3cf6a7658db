"""An MoE layer's index-based routing read as the language's ``dispatch`` and ``combine``.

MegaBlocks (Gale et al. 2023) and DeepSeek-V3's expert parallelism hold the routing of a top-k
router as indices, not a one-hot mask: each token's row is scattered into its slot of each of its k
experts (``jnp.zeros((G, E, C, D)).at[g, experts, slots].set(rows, mode="drop")``), and the
experts' outputs gathered back at the same indices, weighted by the gates and summed over the k
choices (``out.at[g, experts, slots].get(mode="fill")``).  The scatter's result is the language's
``dispatch(Gate[G, S, E], X[G, S, D], S, C, k over E)`` and the weighted sum of the gathered rows
``combine(Gate[G, S, E], Ex[G, E, C, D], S, C, k over E)``, where their meanings are those.

A *move* is a scatter or gather reading the router's indices (the routing region of
:mod:`shardc.explanation.routing`) and one other array (through its views: a broadcast over the
choices, a transpose), with what follows it reading its result and the routing alone (the gates'
weighting, the sum over the choices).  Its result is compared, as the routing's mask is, with the
language's meaning (:func:`shardc.ops.dispatch_code.whole_forward`) on gates with no ties and
random rows; a move that is neither is an error naming it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardc.explanation.dim_classes import unwritable
from shardc.explanation.routing import Region, arrays, constants_of, draw, experts_and_k, run
from shardc.explanation.sources import shape_text
from shardc.ops.dispatch_code import whole_forward

__all__ = ["Move", "moves", "read_move"]

_MOVERS = frozenset({"scatter", "scatter-add", "scatter_add", "gather"})
_VIEWS = frozenset({"broadcast_in_dim", "reshape", "transpose", "convert_element_type", "squeeze", "copy"})
_LIMIT = 1 << 24  # the most elements of a move's result evaluated to check its meaning


@dataclass
class Move:
    """A scatter or gather of ``rows`` by the routing ``region``'s indices, its result ``result``, made
    by the equations ``eqns`` (the move and what follows it, up to the one making ``result``)."""

    region: Region
    rows: Any
    eqns: list[Any]
    result: Any


def _root(var: Any, made: dict[Any, Any], constants: set[Any]) -> Any:
    """The array ``var`` is a view of (through broadcasts, reshapes, transposes, casts)."""
    eqn = made.get(var)
    while eqn is not None and eqn.primitive.name in _VIEWS:
        ins = [v for v in arrays(eqn) if v not in constants]
        if len(ins) != 1:
            break
        var, eqn = ins[0], made.get(ins[0])
    return var


def moves(region: Region, eqns: list[Any], outvars: list[Any]) -> list[Move]:
    """The index-based dispatches and combines reading ``region``'s indices; the region's results are
    then what else reads it, and the walk leaves the moves' equations out."""
    constants = constants_of(eqns)
    routed = {v for e in region.eqns if id(e) in region.members for v in e.outvars} | {region.gates}
    made = {v: e for e in eqns for v in e.outvars}
    found: list[Move] = []
    for k, eqn in enumerate(eqns):
        ins = arrays(eqn)
        if eqn.primitive.name not in _MOVERS or not any(v in routed for v in ins):
            continue
        roots = {_root(v, made, constants) for v in ins if v not in routed and v not in constants}
        if len(roots) != 1:
            continue
        body, held = [eqn], set(eqn.outvars)
        for later in eqns[k + 1:]:
            reads = arrays(later)
            if any(v in held for v in reads) and all(v in held or v in routed or v in constants for v in reads):
                body.append(later)
                held.update(later.outvars)
        inside = {id(e) for e in body}
        outside = {v for e in eqns if id(e) not in inside for v in arrays(e)} | set(outvars)
        results = [(e, v) for e in body for v in e.outvars if v in outside]
        if len(results) == 1:
            last, result = results[0]
            cut = next(i for i, e in enumerate(body) if e is last)
            found.append(Move(region, roots.pop(), body[:cut + 1], result))
    region.moved |= {id(e) for m in found for e in m.eqns}
    region.pinned |= {v for m in found for e in m.eqns for v in arrays(e) if v in routed}
    region.settle()
    return found


def _cone(move: Move, eqns: list[Any]) -> list[Any]:
    """The equations making the move's result from the gates and its rows (and constants)."""
    made = {v: e for e in eqns for v in e.outvars}
    wanted: set[int] = set()
    stack = [move.result]
    while stack:
        eqn = made.get(stack.pop())
        if eqn is None or id(eqn) in wanted:
            continue
        wanted.add(id(eqn))
        stack += [v for v in arrays(eqn) if v is not move.region.gates and v is not move.rows]
    return [e for e in eqns if id(e) in wanted]


@dataclass(frozen=True)
class Reading:
    """The move as the language's ``part`` (dispatch or combine): the gates' token and expert axes, k,
    C, the rows' axes and the result's in the canonical orders of :func:`whole_forward`."""

    part: str
    order: int
    experts: int
    k: int
    capacity: int
    rows: tuple[int, ...]
    result: tuple[int, ...]


def match_move(move: Move, eqns: list[Any]) -> Reading:
    """The move's meaning as ``dispatch`` or ``combine``, or an error saying it is neither."""
    experts, k = experts_and_k(move.region.seed)
    if math.prod(move.result.aval.shape) > _LIMIT:
        raise unwritable(f"its result {shape_text(move.result)} has more than {_LIMIT} elements, more than explain "
                         "evaluates to check that it is the language's `dispatch` or `combine`; explain the program "
                         "at smaller sizes")
    gates = [draw(move.region.gates, s) for s in (0, 1)]
    rows = [np.random.default_rng(s + 2).standard_normal(move.rows.aval.shape).astype(move.rows.aval.dtype)
            for s in (0, 1)]
    cone = _cone(move, eqns)
    values = [run(cone, [move.region.gates, move.rows], [move.result], [g, r])[0] for g, r in zip(gates, rows,
                                                                                                  strict=True)]
    rank = len(gates[0].shape)
    for part, order in itertools.product(("dispatch", "combine"), [o for o in range(rank) if o != experts]):
        found = _search(part, order, experts, k, gates, rows, values)
        if found is not None:
            return Reading(part, order, experts, k, *found)
    raise unwritable(f"the `{move.eqns[0].primitive.name}` of {shape_text(move.rows)} by the router's indices "
                     f"(its result {shape_text(move.result)}) is neither the language's `dispatch` (each token's "
                     "row in the next free slot of each of its k experts, tokens in order) nor its `combine` (each "
                     "token's k slot rows, weighted by its gates, summed)",
                     fix="write the layer's routing with `route`, `dispatch` and `combine` in a .shard spec")


def _search(part: str, order: int, experts: int, k: int, gates: list[np.ndarray], rows: list[np.ndarray],
            values: list[np.ndarray]) -> tuple[int, tuple[int, ...], tuple[int, ...]] | None:
    """(C, the rows' axes, the result's) in :func:`whole_forward`'s orders where it gives every draw's value."""
    lead = [gates[0].shape[a] for a in range(gates[0].ndim) if a not in (order, experts)]
    canon = [np.moveaxis(g.astype(np.float64), (order, experts), (-2, -1)) for g in gates]
    head = [*lead, gates[0].shape[experts if part == "combine" else order]]
    for row_axes in itertools.permutations(range(rows[0].ndim)):
        shape = [rows[0].shape[a] for a in row_axes]
        if shape[:len(head)] != head or len(shape) < len(head) + (part == "combine"):
            continue
        moved = [np.transpose(r.astype(np.float64), row_axes) for r in rows]
        wants: dict[int, list[np.ndarray]] = {}
        for out_axes in itertools.permutations(range(values[0].ndim)):
            if part == "combine":
                capacity = shape[len(head)]
            elif len(out_axes) > len(head) + 1:
                capacity = int(values[0].shape[out_axes[len(head)]])
            else:
                continue
            if capacity not in wants:
                wants[capacity] = [whole_forward(part, g, r, k, capacity, np) for g, r in zip(canon, moved,
                                                                                             strict=True)]
            have = [np.transpose(v, out_axes) for v in values]
            if all(w.shape == h.shape and np.allclose(h, w, rtol=1e-5, atol=1e-6)
                   for w, h in zip(wants[capacity], have, strict=True)):
                return capacity, row_axes, out_axes
    return None


def read_move(reader: Any, move: Move, eqns: list[Any], line: str) -> None:
    """``In = dispatch(Gate, X, S, C, k over E)`` or ``Y = combine(Gate, Ex, S, C, k over E)``: each dim of
    the rows and the result joined with the one it is in the language's order."""
    found = match_move(move, eqns)
    ids = reader.dims_of(move.region.gates)
    batch = [ids[a] for a in range(len(ids)) if a not in (found.order, found.experts)]
    rows, out = reader.dims_of(move.rows), reader.dims_of(move.result)
    order, experts = ids[found.order], ids[found.experts]
    if found.part == "dispatch":
        slots = out[found.result[len(batch) + 1]]
        features = [rows[a] for a in found.rows[len(batch) + 1:]]
        row_roles, out_roles = [*batch, order, *features], [*batch, experts, slots, *features]
    else:
        slots = rows[found.rows[len(batch) + 1]]
        features = [rows[a] for a in found.rows[len(batch) + 2:]]
        row_roles, out_roles = [*batch, experts, slots, *features], [*batch, order, *features]
    for axis, role in zip(found.rows, row_roles, strict=True):
        reader.join(rows[axis], role)
    for axis, role in zip(found.result, out_roles, strict=True):
        reader.join(out[axis], role)
    for d, letter in ((order, "S"), (experts, "E"), (slots, "C")):
        reader.hints.setdefault(d, letter)
    reader.make(move.result, found.part, (reader.tensor(move.region.gates), reader.tensor(move.rows)),
                over=experts, names=(order, slots), number=found.k, line=line)
