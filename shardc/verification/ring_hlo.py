"""The collective-permutes a ring kernel's step makes, as the compiled HLO is searched for them.

A ring attention step (:mod:`shardc.ops.ring_attention`) is one kernel of the plan, not a collective
step: its sends are its family's :attr:`~shardc.ops.registry.Family.ring` (K and V each ring step but the
last, the backward's dK and dV accumulators n times, a zig-zag reordering's half blocks), each one
``jax.lax.ppermute`` of one array, so the HLO holds that many collective-permutes of that many elements
over the ring's axes (:func:`shardc.verification.hlo.collectives` reads a permute's axes from its
source-target pairs).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from shardc.ir.plan import Op, Step
from shardc.ops.registry import of_op

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
    for step in steps:
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

