"""The time of one plan step on one chip, re-exported for the cost pass.

The model lives in :mod:`shardc.collectives` (the table of collectives and their
time on a chip) and :mod:`shardc.timing` (per step, and the step time of a plan),
where the planner reads it too.
"""

from shardc.collectives import FACTOR, collective_time, hops, links, split_axes
from shardc.timing import StepCost, cost_step, describe, einsum_flops, local_elements, step_volume

__all__ = ["FACTOR", "links", "hops", "StepCost", "cost_step", "einsum_flops", "split_axes", "local_elements",
           "collective_time", "describe", "step_volume"]
