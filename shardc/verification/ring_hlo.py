"""The collective-permutes a ring kernel's step makes, as the compiled HLO is searched for them.

A collective matmul (:mod:`shardc.planner.collective_matmul`) sends a block of its gathered operand,
or of its partial result, n - 1 times around its axis (einsums that read one gathered operand send the
same blocks the same way, and XLA keeps one such chain of sends).  A ring attention step
(:mod:`shardc.ops.ring_attention`) is one kernel of the plan, not a collective step: its sends are its
family's :attr:`~shardc.ops.registry.Family.ring` (K and V each ring step but the last, the backward's
dK and dV accumulators n times, a zig-zag reordering's half blocks).  Each send is one
``jax.lax.ppermute`` of one array, so the HLO holds that many collective-permutes of that many elements
over the ring's axes (:func:`shardc.verification.hlo.collectives` reads a permute's axes from its
source-target pairs).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from shardc.ir.plan import Op, Step
from shardc.ops.registry import of_op
from shardc.ring_sends import shared_rings

__all__ = ["RingSends", "ring_sends"]


@dataclass(frozen=True)
class RingSends:
    """``count`` permutes of ``elements`` elements each over ``axes``, made by ``step``."""

    step: Step
    axes: tuple[str, ...]
    elements: int
    count: int


def ring_sends(steps: tuple[Step, ...], sizes: dict[str, int]) -> list[RingSends]:
    """Every ring kernel step's sends, grouped by their elements (K's and V's alike are one group)."""
    found: list[RingSends] = []
    for step, shared in zip(steps, shared_rings(steps), strict=True):
        if step.collective is not None:  # a collective matmul: n - 1 sends of one block over its axis
            if not shared:  # einsums reading one gather send the same blocks: XLA keeps one chain
                found += _collective_matmul_sends(step, sizes)
            continue
        family = of_op(step.fn) if step.op is Op.ELEMENTWISE else None
        ring = family.ring(step, lambda name: sizes[name], 1) if family is not None and family.ring else None
        if ring is None:
            continue
        axes = tuple(a for a in ring.axes if sizes[a] > 1)
        counts = Counter({int(s.elements): 0 for s in ring.sends})
        for s in ring.sends:
            counts[int(s.elements)] += s.count
        found += [RingSends(step, axes, elements, n) for elements, n in sorted(counts.items())]
    return found



def _collective_matmul_sends(step: Step, sizes: dict[str, int]) -> list[RingSends]:
    """A collective matmul's sends: a block of the gathered operand (its source, a device's piece), or
    of the scattered result (its destination), n - 1 times over the axis."""
    c = step.collective
    assert c is not None and c.src is not None
    block = c.src if c.op is Op.ALL_GATHER else c.dst
    elements = math.prod(sizes[d.name] // math.prod(sizes[a] for a in d.axes) for d in block.dims)
    n = math.prod(sizes[a] for a in c.axes)
    return [RingSends(step, c.axes, elements, n - 1)] if n > 1 else []
