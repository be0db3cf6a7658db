"""Attention's all-gather form balanced in zig-zag chunks (:mod:`shardc.ops.balanced_gather`), LLaMA 3's context
parallelism: weighed where the plan holds the sequence in that order, costed at half of each device's S x T
share forward and backward, lowered with the causal mask on the chunks' true positions, and verified."""

from __future__ import annotations

from dataclasses import replace

import pytest

import shardc
from shardc.costmodel.cost_report import CostReport
from shardc.ir.localops import Attention
from shardc.ir.plan import Op, Plan, Step
from shardc.lowering.api import module_source
from shardc.ops.attention import ATTENTION
from shardc.planner.plan_text import render_explain
from shardc.planner.zigzag_order import holds, order_axes, sequence_order

SIZES = {"B": 1, "S": 16384, "T": 16384, "G": 8, "R": 16, "H": 128, "X": 16}
GQA = ("mesh X=16\ndims B=1, S=16384, T=16384, G=8, R=16, H=128\nhardware h100\n"
       "O[B, S_X, G, R, H] = attention(Q[B, S_X, G, R, H], K[B, T_X, G, H], V[B, T_X, G, H] over T, causal)\n")
DROPOUT = "D[B, S_X, G, R, H] = dropout(O[B, S_X, G, R, H], 0.1)\n"


def _plan(text: str = GQA) -> Plan:
    return shardc.plan(shardc.parse(text), explain=True)


def _kernels(plan: Plan) -> list[Step]:
    """The steps that run an attention kernel, forward and backward."""
    return [s for s in plan.forward + plan.backward if isinstance(s.fn, Attention) and s.fn.kernel]


def _contiguous(step: Step) -> Step:
    assert isinstance(step.fn, Attention)
    return replace(step, fn=replace(step.fn, zigzag=False, held=False))


def _cost(plan: Plan) -> CostReport:
    report = shardc.cost(plan)
    assert isinstance(report, CostReport)
    return report


def test_the_held_plan_gathers_k_and_v_with_its_queries_in_zigzag_chunks() -> None:
    """16K tokens of GQA over 16 H100s: the plan holds the sequence in 2 x 16 chunks, gathers K and V along T
    (no ring), and marks its kernels zig-zag over the queries' axis."""
    plan = _plan()
    kernels = _kernels(plan)
    assert holds(plan) and len(kernels) == 2
    assert all(isinstance(s.fn, Attention) and s.fn.zigzag and s.fn.held and not s.fn.ring for s in kernels)
    assert {order_axes(s) for s in kernels} == {("X",)}
    assert sequence_order(plan, {"X": 16}) == (frozenset({"S", "T"}), 32)
    gathered = [(s.op, s.tensor) for s in plan.forward if s.is_collective]
    assert gathered == [(Op.ALL_GATHER, "K"), (Op.ALL_GATHER, "V")]
    assert [s.op for s in plan.backward if s.is_collective] == [Op.REDUCE_SCATTER] * 2
    assert str(kernels[0].fn) == "attention_out(over T,causal(S,T),zigzag,held)"


def test_its_flops_are_half_of_each_devices_share_forward_and_backward() -> None:
    """Each device's two chunks see 2n chunks of keys in all, half its S x T share, where contiguous blocks leave
    the last device 31/32 of it: the kernel's FLOPs are 16/31 of the contiguous form's, forward (Q·K and P·V)
    and backward (the scores again and four more matmuls)."""
    assert ATTENTION.flops is not None
    b, s, t, g, r, h, n = (SIZES[i] for i in "BSTGRHX")
    whole = 4 * b * s * t * g * r * h  # the forward's two matmuls over the whole S x T
    forward, backward = _kernels(_plan())
    for step, factor in ((forward, 1.0), (backward, 2.5)):
        balanced = ATTENTION.flops(step, SIZES.__getitem__)[0]
        contiguous = ATTENTION.flops(_contiguous(step), SIZES.__getitem__)[0]
        assert balanced == factor * whole / n / 2
        assert contiguous == factor * whole / n * (2 * n - 1) / (2 * n)


def test_the_cost_report_charges_the_balanced_kernel_and_names_its_form() -> None:
    """The kernel's time in the cost report is the contiguous kernel's times 16/31 (one rate: the same keys a
    call), its moves the all-gather form's, and its row says the form."""
    plan = _plan()
    contiguous = replace(plan, forward=tuple(_contiguous(s) if isinstance(s.fn, Attention) else s
                                             for s in plan.forward))
    rows = [r for r in _cost(plan).forward.rows if r.context_parallel]
    flat = [r for r in _cost(contiguous).forward.rows if r.context_parallel]
    assert len(rows) == len(flat) == 1
    assert rows[0].context_parallel == "all-gather, balanced" and flat[0].context_parallel == "all-gather"
    assert rows[0].compute_s == pytest.approx(flat[0].compute_s * 16 / 31, rel=1e-12)
    assert rows[0].cp_comm_s == flat[0].cp_comm_s > 0


def test_explain_shows_the_form_balanced_only_where_the_plan_holds_the_order() -> None:
    """--explain lists the balanced all-gather beside the contiguous one, the ring's two and its price the
    least; a dropout drawing its mask by position keeps the sequence in its own order, and the form is not
    offered (it would reorder its queries at each call)."""
    plan = _plan()
    text = render_explain(plan)
    assert "S over X in 2x16 zig-zag chunks, K and V gathered along T (all-gather, balanced)" in text
    (choice,) = plan.choices
    times = {a.description: a.time or 0.0 for a in choice.alternatives}
    (chosen,) = [a for a in choice.alternatives if a.chosen]
    assert chosen.description.endswith("(all-gather, balanced)") and chosen.time == min(times.values())
    dropped = _plan(GQA + DROPOUT)
    assert not holds(dropped) and "all-gather, balanced" not in render_explain(dropped)
    assert all(isinstance(s.fn, Attention) and not s.fn.zigzag for s in _kernels(dropped))


def test_the_lowered_kernel_masks_by_the_chunks_true_positions() -> None:
    source, _ = module_source(_plan())
    assert "CHUNKS = 32" in source
    calls = [line for line in source.splitlines() if "attention(" in line or "attention_grads(" in line]
    assert calls and all("zigzag=(" in line and "ring_attention" not in line for line in calls)


@pytest.mark.slow
def test_a_held_balanced_all_gather_verifies_its_values_gradients_and_collectives() -> None:
    """4 devices, 8 chunks of 4 tokens: the step takes its arrays in zig-zag order, the kernel masks by the true
    positions (a contiguous mask on them fails the values), and the HLO gathers K and V and reduce-scatters dK
    and dV as the plan says."""
    from shardc.verification.verify import verify

    plan = _plan(GQA.replace("X=16", "X=4").replace("16384", "4096").replace("G=8", "G=2").replace("R=16", "R=2"))
    assert holds(plan) and all(isinstance(s.fn, Attention) and not s.fn.ring for s in _kernels(plan))
    report = verify(plan, sizes={"B": 1, "S": 32, "T": 32, "G": 2, "R": 2, "H": 8})
    assert report.ok, [r for r in (*report.values, *report.collectives) if not r.ok]
    assert {r.tensor for r in report.values} == {"O", "dQ", "dK", "dV"}
    assert sorted(r.hlo_op for r in report.collectives) == ["all-gather"] * 2 + ["reduce-scatter"] * 2
