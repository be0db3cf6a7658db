"""The sequence held in zig-zag order across a plan (:mod:`shardc.planner.zigzag_order`): the ring kernels
stop reordering their blocks where no other step looks at positions, the cost drops the reordering's sends,
and the lowered step permutes its arrays as they enter and leave (verified in test_ring_attention.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import shardc
from shardc.costmodel.cost_report import CostReport
from shardc.ir.localops import Attention
from shardc.ir.plan import Plan, Step
from shardc.lowering.api import module_source
from shardc.planner.zigzag_order import hold_zigzag, sequence_order
from tests.test_ring_attention import _gqa

GQA = ("mesh X=16 over dcn\ndims B=1, S=131072, T=131072, G=8, R=16, H=128\nhardware h100\n"
       "O[B, S_X, G, R, H] = attention(Q[B, S_X, G, R, H], K[B, T_X, G, H], V[B, T_X, G, H] over T, causal)\n")


def _kernels(plan: Plan) -> list[Attention]:
    return [s.fn for s in plan.forward + plan.backward if isinstance(s.fn, Attention)]


def _unheld(plan: Plan) -> Plan:
    def off(steps: tuple[Step, ...]) -> tuple[Step, ...]:
        return tuple(replace(s, fn=replace(s.fn, held=False)) if isinstance(s.fn, Attention) else s for s in steps)

    return replace(plan, forward=off(plan.forward), backward=off(plan.backward))


def _cost(plan: Plan) -> CostReport:
    report = shardc.cost(plan)
    assert isinstance(report, CostReport)
    return report


def test_the_128k_gqa_ring_holds_its_zigzag_order_and_its_reordering_leaves_the_step() -> None:
    """128K tokens of GQA over 16 H100s across nodes, causal: the zig-zag ring's reordering (two sends of half
    a block for each of Q, K, V, O and the logsumexp in the forward, and of the backward's nine arrays) was 37 ms
    of exposed communication a step; held across the plan it is gone, and what stays exposed is the ring's."""
    plan = _gqa(131072, dcn=True)
    assert _kernels(plan) and all(fn.ring and fn.zigzag and fn.held for fn in _kernels(plan))
    held, reordered = _cost(plan), _cost(_unheld(plan))
    saved = reordered.step.exposed_comm_s - held.step.exposed_comm_s
    assert saved > 0.030 and held.step.exposed_comm_s < 0.002
    assert held.step.step_s == pytest.approx(reordered.step.step_s - saved)
    assert held.step.compute_s == reordered.step.compute_s
    assert sequence_order(plan, {"X": 16}) == (frozenset({"S", "T"}), 32)
    source, _ = module_source(plan)
    assert "CHUNKS = 32" in source and "held=True" in source


def test_a_step_that_looks_at_positions_keeps_the_kernels_reordering() -> None:
    """A dropout mask is drawn from each element's global position, so the attention output's dropout
    along S keeps the sequence in its own order, and the kernels reorder."""
    dropped = shardc.plan(shardc.parse(GQA + "P[B, S_X, G, R, H] = dropout(O[B, S_X, G, R, H], 0.1)\n"))
    kernels = _kernels(dropped)
    assert kernels and all(fn.zigzag and not fn.held for fn in kernels)
    assert sequence_order(dropped, {"X": 16}) is None
    source, _ = module_source(dropped)
    assert "CHUNKS = 0" in source and "held=True" not in source


def test_the_pass_leaves_a_plan_without_a_zigzag_ring_as_it_is() -> None:
    for plan in (_gqa(4096, causal=False), _gqa(131072, causal=False)):  # all-gather; a ring in its own order
        assert hold_zigzag(plan) is plan and sequence_order(plan, {"X": 16}) is None


def _explained(plan: Plan) -> float:
    (choice,) = plan.choices
    (chosen,) = [a for a in choice.alternatives if a.chosen]
    assert chosen.time is not None and "zig-zag" in chosen.description
    return chosen.time


def _kernels_cost(plan: Plan) -> float:
    """The ring kernels' time in the cost report, forward and backward: their compute and the part of their
    sends that stays exposed (Q, K and V come in the kernel's layout: no other move)."""
    report = _cost(plan)
    return sum(r.compute_s + r.exposed_comm_s for r in report.forward.rows + report.backward.rows if r.ring_steps)


def test_explain_prices_the_chosen_zigzag_ring_as_the_plan_runs_it() -> None:
    """--explain lists each attention form's time; the zig-zag ring's is the one the plan will have: without
    its reordering where the plan holds the sequence in zig-zag order (37 ms less at 128K tokens), with it
    where a step looks at positions, and either equals what the cost report charges the chosen kernels."""
    held = _gqa(131072, dcn=True)
    assert _explained(held) == pytest.approx(_kernels_cost(held), rel=1e-12)
    (choice,) = held.choices
    assert "as the plan holding the sequence in its order runs it" in choice.reason
    dropped = shardc.plan(shardc.parse(GQA + "P[B, S_X, G, R, H] = dropout(O[B, S_X, G, R, H], 0.1)\n"), explain=True)
    assert not any(fn.held for fn in _kernels(dropped))
    assert _explained(dropped) == pytest.approx(_kernels_cost(dropped), rel=1e-12)
    assert _explained(dropped) - _explained(held) > 0.030
    (choice,) = dropped.choices
    assert "held" not in choice.reason
