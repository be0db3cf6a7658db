"""What the planner's candidate plans are searched under and judged by: the weights and the objective.

:func:`shardc.planner.planner.plan` searches a spec once with compute and communication counted alike
(:data:`SUM`), then again under the weights that plan's times call for (:func:`candidate_weights`), and
keeps the candidate of least :func:`objective`; :func:`same_steps` spares planning again a candidate whose
search would make the same steps.
"""

from __future__ import annotations

import math

from shardc.phase_time import PhaseTime
from shardc.planner.graph import Graph
from shardc.sharding.einsum import Solution
from shardc.sharding.layout import CostContext
from shardc.sharding.phase import Phase, Traced
from shardc.timing import PlanTime

__all__ = ["PhaseWeight", "Weights", "SUM", "candidate_weights", "weigh", "same_steps", "objective"]

# How much the search counts a second of compute beside one of communication, per phase
# (forward, backward): their sum first, which bounds a phase's max(compute, comm) within 2x.
# A phase's weight is compute's, or (compute's, the collectives issued ahead's): see candidate_weights.
PhaseWeight = float | tuple[float, float]
Weights = tuple[PhaseWeight, PhaseWeight]
SUM: Weights = (1.0, 1.0)


def candidate_weights(t: PlanTime) -> list[Weights]:
    """The weights the planner searches under after the sum's plan, whose times are ``t``.

    Per phase, compute weighted 0 if that plan left it communication-bound (1 if not), and
    communication alone in both; on the chip's model (:func:`shardc.phase_time.phase_seconds`: the
    collectives issued ahead overlap the phase's compute, the others add to it), also the phase's
    slope there: where its compute hides what is issued ahead, a second of that costs nothing at the
    margin and a second of compute or of an exposed collective costs one.
    """
    bound = (0.0 if t.forward.comm_s > t.forward.busy_s else 1.0,
             0.0 if t.backward.comm_s > t.backward.busy_s else 1.0)
    weights: list[Weights] = [bound, (0.0, 0.0)]
    if not t.forward.book:
        weights.append((_slope(t.forward, bound[0]), _slope(t.backward, bound[1])))
    return [w for w in dict.fromkeys(weights) if w != SUM]


def _slope(phase: PhaseTime, weight: float) -> PhaseWeight:
    """(1, 0) where ``phase``'s compute hides its collectives issued ahead, else ``weight``."""
    return (1.0, 0.0) if phase.ahead_s < phase.busy_s else weight


def weigh(ctx: CostContext, weight: PhaseWeight) -> None:
    """Set the search's weights for one phase (a float: compute's, the collectives' all 1)."""
    ctx.compute_weight, ctx.ahead_weight = (float(weight), 1.0) if isinstance(weight, float | int) else weight


def same_steps(graph: Graph, ctx: CostContext, trace: list[Traced], strategy: str, weights: Weights) -> bool:
    """Whether planning with ``strategy`` and ``weights`` makes the steps the traced plan made.

    A phase's steps follow from its einsums' solutions alone (every other move is a
    reshard, the same under any weights), and each solution from the values the phase
    holds, which the earlier solutions made.  So if every solve the traced plan made
    gives the same moves again, in order, the plans' steps are equal.  A chain's
    layouts are chosen by their own search, so a spec with one is planned again.
    """
    if any(node.chain for node in graph.nodes):
        return False
    if strategy == "rules" and any(node.signs for node in graph.nodes):
        return False  # a sum's local value is searched with sizes, and taken by a rule without
    done: set[object] = set()
    for key, problem, given, solution in trace:
        if key in done:
            continue
        done.add(key)
        name = key[4]  # type: ignore[index]  # the phase, see Phase.key
        weigh(ctx, weights[0 if name == "forward" else 1])
        phase = Phase(name, ctx, {}, strategy == "search", frozenset())  # type: ignore[arg-type]
        again = phase.solve(problem, given)[0]
        if _moves(again) != _moves(solution):
            weigh(ctx, SUM[1])
            return False
    weigh(ctx, SUM[1])
    return True


def _moves(s: Solution) -> tuple[object, ...]:
    """What of a solution becomes steps (its cost, under other weights, may differ)."""
    return (s.operand_moves, s.locals, s.local_result, s.result_moves)


def objective(t: PlanTime) -> tuple[float, float]:
    """What the planner minimises over its candidates: step time then communication, rounded so
    float noise between equal plans does not decide."""
    return (_rounded(t.step_s), _rounded(t.comm_s))


def _rounded(x: float) -> float:
    return 0.0 if x == 0 else round(x, 9 - int(math.floor(math.log10(abs(x)))))
