"""Sizes at which every route drops tokens, so that verify checks its capacity.

``route(Gate[G, S, E], S, C, k over E)`` gives each expert C slots a group; a token past
them is dropped (GShard, Lepikhin et al. 2020).  At the sizes verify picks otherwise, the S
tokens of a group make S * k / E choices an expert on average, often fewer than C: no token
is dropped, and a module that does not drop (that wraps tokens past the capacity into the
first slots, say) computes the same values.  So the capacity is cut to a few slots and the
token index S made long enough for as many choices an expert on average as it has slots
(about half the experts of each group overflow): a multiple of its size, which keeps every
sharding of it even; indices a rename ties to S grow with it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from shardc.ir.plan import Plan
from shardc.ir.spec import Spec, TensorRef
from shardc.ops.dispatch import DISPATCH
from shardc.ops.registry import of_call
from shardc.ops.route import ROUTING
from shardc.spec.walk import calls, renamed_indices

__all__ = ["overflowing", "shards", "tied"]

_LOAD = 1  # the average choices an expert, in capacities: about half the experts of a group overflow
_MAX_MASK = 1 << 20  # elements of a route's mask grown so: more would not run small


def overflowing(plan: Plan, sizes: dict[str, int], fixed: Iterable[str] = ()) -> tuple[dict[str, int], list[str]]:
    """``sizes`` with each route's token index grown until its experts overflow their capacity, and a
    note for each route it could not grow within :data:`_MAX_MASK` elements of its mask.

    A capacity not in ``fixed`` (a given module's code ties it to the token count) is first cut to the
    fewest slots its shardings allow, 2 at least, so that the token index grows least; a token index in
    ``fixed`` keeps its size (the module's capacity is its share of it), and gets a note if its experts
    do not overflow."""
    out, notes, spec = dict(sizes), [], plan.spec
    for call in (c for s in spec.statements for c in calls(s.expr) if of_call(c.func) in (ROUTING, DISPATCH)):
        if len(call.names) != 2 or call.over is None or not call.numbers or not isinstance(call.arg, TensorRef):
            continue
        (order, slots), experts, k = call.names, call.over, int(call.numbers[0])
        dims = call.arg.indices
        if any(n not in out for n in (order, slots, experts, *dims)) or k < 1:
            continue
        if slots not in fixed:
            out[slots] = _fewest_slots(plan, out, slots)
        need = math.ceil(_LOAD * out[slots] * out[experts] / k)
        if out[order] >= need:
            continue
        if order in fixed:
            notes.append(f"route over {order}: the module's capacity {slots}={out[slots]} is its share of "
                         f"{order}={out[order]} tokens, which its experts do not fill: tokens past the capacity "
                         "are not checked")
            continue
        size = out[order] * math.ceil(need / out[order])
        mask = math.prod(out[d] for d in dims if d != order) * size * out[slots]
        if mask > _MAX_MASK:
            notes.append(f"route over {order}: its experts do not fill their capacity {slots}={out[slots]} at "
                         f"{order}={out[order]} (filling it needs {order}={size}, too large to run): tokens past "
                         "the capacity are not checked")
            continue
        for name in tied(spec, order):
            if name in out:
                out[name] = size
    return out, notes


def _fewest_slots(plan: Plan, sizes: dict[str, int], slots: str) -> int:
    """The least capacity of 2 slots or more that every sharding of ``slots`` divides."""
    blocks = shards(plan, sizes, slots)
    return min(blocks * math.ceil(2 / blocks), sizes[slots])


def shards(plan: Plan, sizes: dict[str, int], index: str) -> int:
    """How many blocks the plan's steps cut ``index`` into, at ``sizes``' mesh (the lcm of its shardings)."""
    found = 1
    for step in plan.forward + plan.backward:
        for ref in (step.dst, *step.operands, *([step.src] if step.src else [])):
            for d in ref.dims:
                if d.name == index:
                    found = math.lcm(found, math.prod(sizes.get(a, 1) for a in d.axes))
    return found


def tied(spec: Spec, index: str) -> set[str]:
    """``index`` and every index a chain of renames gives its size."""
    tied, pairs = {index}, renamed_indices(spec)
    grown = True
    while grown:
        grown = False
        for new, old in pairs:
            if (new in tied) != (old in tied):
                tied |= {new, old}
                grown = True
    return tied
