"""Ulysses under a plan holding the sequence in zig-zag order: its AllToAll gathers whole sequences in the held
order, so its causal mask compares their true positions (:mod:`shardc.planner.zigzag_order`).  A spec with two
causal attentions over one sequence, one whose kernel balances best as the held all-gather form (GQA's few
key heads) and one whose heads take the axis (Ulysses), holds the order for both."""

from __future__ import annotations

from dataclasses import replace

import pytest

import shardc
from shardc.ir.localops import Attention
from shardc.ir.plan import Op, Plan, Step
from shardc.lowering.api import module_source
from shardc.planner.zigzag_order import holds, order_axes, sequence_order

TWO = ("mesh X=4\ndims B=1, S=4096, T=4096, G=2, R=2, H=128, N=8\nhardware h100\n"
       "O[B, S_X, G, R, H] = attention(Q[B, S_X, G, R, H], K[B, T_X, G, H], V[B, T_X, G, H] over T, causal)\n"
       "P[B, S_X, N, H] = attention(Q2[B, S_X, N, H], K2[B, T_X, N, H], V2[B, T_X, N, H] over T, causal)\n")
DROPOUT = "D[B, S_X, N, H] = dropout(P[B, S_X, N, H], 0.1)\n"


def _plan(text: str = TWO) -> Plan:
    return shardc.plan(shardc.parse(text))


def _kernels(plan: Plan, tensor: str) -> list[Step]:
    return [s for s in plan.forward + plan.backward
            if isinstance(s.fn, Attention) and s.fn.kernel and s.tensor in (tensor, "d" + tensor)]


def test_a_ulysses_kernel_keeps_the_held_order_and_masks_by_it() -> None:
    plan = _plan()
    assert holds(plan) and sequence_order(plan, {"X": 4}) == (frozenset({"S", "T"}), 8)
    ulysses = _kernels(plan, "P")
    assert ulysses and all(isinstance(s.fn, Attention) and s.fn.held and s.fn.order == ("X",) for s in ulysses)
    assert {order_axes(s) for s in _kernels(plan, "O") + ulysses} == {("X",)}
    moved = [s.tensor for s in plan.forward if s.op is Op.ALL_TO_ALL]
    assert moved == ["Q2", "K2", "V2", "P"]  # Ulysses: whole sequences in, heads out
    assert str(ulysses[0].fn) == "attention_out(over T,causal(S,T),zigzag(X),held)"
    source, _ = module_source(plan)
    calls = [line for line in source.splitlines() if "attention(Q2" in line or "attention_grads(Q2" in line]
    assert calls and all("zigzag=('X',)" in line for line in calls)


def test_holding_the_order_is_faster_than_the_plan_that_cannot() -> None:
    """A dropout mask drawn by position after Ulysses keeps the plan from holding the order: the all-gather
    attention then runs unbalanced, its last device's causal share (2n - 1) / 2n, not a half."""
    held, unheld = _plan(), _plan(TWO + DROPOUT)
    assert holds(held) and not holds(unheld)
    assert all(isinstance(s.fn, Attention) and not s.fn.order for s in _kernels(unheld, "P"))

    def kernel_s(plan: Plan, tensors: tuple[str, ...]) -> float:
        report = shardc.cost(plan)
        return sum(r.compute_s for phase in (report.forward, report.backward) for r in phase.rows
                   if r.tensor in tensors and r.op is Op.ELEMENTWISE)

    assert kernel_s(held, ("O", "dQ")) < kernel_s(unheld, ("O", "dQ"))  # balanced against unbalanced
    assert kernel_s(held, ("P", "dQ2")) == pytest.approx(kernel_s(unheld, ("P", "dQ2")))  # Ulysses: whole sequences


@pytest.mark.slow
def test_ulysses_in_the_held_order_verifies_and_a_contiguous_mask_does_not() -> None:
    """4 devices, 8 chunks of 4 tokens: values, gradients and the HLO's AllToAlls as planned; the same kernel
    masking the held places as if contiguous fails the values."""
    from shardc.verification.verify import verify

    sizes = {"B": 1, "S": 32, "T": 32, "G": 2, "R": 2, "H": 8, "N": 4}
    plan = _plan()
    report = verify(plan, sizes=sizes)
    assert report.ok, [r for r in (*report.values, *report.collectives) if not r.ok]
    assert sorted(r.hlo_op for r in report.collectives).count("all-to-all") == 8  # 4 forward, 4 backward

    def contiguous(steps: tuple[Step, ...]) -> tuple[Step, ...]:
        return tuple(replace(s, fn=replace(s.fn, order=(), zigzag=False)) if isinstance(s.fn, Attention)
                     and s.fn.order else s for s in steps)

    wrong = replace(plan, forward=contiguous(plan.forward), backward=contiguous(plan.backward))
    assert not verify(wrong, sizes=sizes).ok
