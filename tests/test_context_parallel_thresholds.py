"""The book-form threshold of attention's all-gather and Ulysses forms: the tokens a device from which the
kernel's compute outlasts the moves of the sequence, in the cost report and in ``--explain``, checked against
values derived by hand under the book's model (matmuls at peak C, a collective's bandwidth term)."""

from __future__ import annotations

import json

import pytest

import shardc
from shardc.costmodel.cost_report import CostReport
from shardc.hardware import get_hardware
from shardc.ir.plan import Plan

V5P = get_hardware("tpu-v5p")
C_OVER_W = V5P.flops / V5P.w_ici  # 2550: the book's C / W_ici


def _spec(heads: str, kv: str, g: int) -> str:
    """One 64K-token sequence over 4 v5p chips of a wrapped axis (the book's model lays an axis of 16 or
    fewer chips on one wrapped ring), not causal, 32 query heads, ``g`` key/value heads."""
    return (f"mesh X=4\ndims B=1, S=65536, T=65536, N=32, G={g}, R={32 // g}, H=128\nhardware tpu-v5p\n"
            f"O[B, S_X, {heads}, H] = attention(Q[B, S_X, {heads}, H], K[B, T_X, {kv}, H], "
            f"V[B, T_X, {kv}, H] over T)\n")


MHA = _spec("N", "N", 32)  # Ulysses takes X onto the 32 heads
GQA = _spec("G, R", "G", 2)  # 2 key/value heads: no Ulysses; the all-gather form beside the ring


def _plan(text: str) -> Plan:
    return shardc.plan(shardc.parse(text), explain=True, model="book")


def _notes(plan: Plan) -> dict[str, str]:
    (choice,) = plan.choices
    return {a.description.split(" (")[-1].rstrip(")"): a.volume for a in choice.alternatives}


def _threshold(note: str) -> float:
    return float(note.split("outlasts its moves from ")[1].split(" tokens")[0].replace(",", ""))


def test_ulysses_threshold_in_the_cost_report_is_c_over_2w() -> None:
    """Ulysses over n devices, c = T/n tokens a device: the forward's four AllToAlls (Q, K, V in, O out) of
    V = 2*B*S*N*H bytes each take V/(4 W) on the wrapped axis, the kernel 4*B*S*T*N*H/(n C); they meet at
    c* = c * (V/W) / (4*B*S*T*N*H/(n C)) = C/(2 W) = 1275 tokens a device; the backward's kernel is 2.5
    times the forward's against four AllToAlls again (dO in; dQ, dK, dV out): C/(5 W) = 510."""
    report = shardc.cost(_plan(MHA), model="book")
    assert isinstance(report, CostReport)
    (fwd,) = [r for r in report.forward.rows if r.context_parallel]
    (bwd,) = [r for r in report.backward.rows if r.context_parallel]
    assert fwd.context_parallel == bwd.context_parallel == "Ulysses"
    assert fwd.hidden_from == pytest.approx(C_OVER_W / 2)
    assert bwd.hidden_from == pytest.approx(C_OVER_W / 5)
    assert fwd.cp_comm_s == pytest.approx(4 * 2 * 65536 * 32 * 128 / (4 * V5P.w_ici))
    assert "context parallel (Ulysses)" in str(report) and "from 1,275 tokens a device" in str(report)
    row = next(r for r in report.to_json()["forward"]["rows"] if r.get("context_parallel"))  # type: ignore[union-attr]
    assert row["hidden_from_tokens"] == pytest.approx(1275)


def test_explain_gives_each_forms_threshold() -> None:
    """``--explain`` weighs forward and backward together: the moves twice (the backward's transposes) against
    the kernel's forward and backward, 3.5 times the forward.  Ulysses: c* = 2 * 4 * (V/(4 W)) * c / (3.5 *
    forward) = C/(3.5 W); all-gather (K and V, 2*B*T*G*H bytes each, gathered in V/W on the wrapped axis of
    4, and dK, dV scattered back): c* = 2 * 2 * (V/W) * c / (3.5 * forward) = (G/N) * C/(1.75 W)."""
    mha, gqa = _notes(_plan(MHA)), _notes(_plan(GQA))
    assert _threshold(mha["AllToAll in and out, as Ulysses"]) == round(C_OVER_W / 3.5)
    assert _threshold(mha["all-gather"]) == round(C_OVER_W / 1.75)
    assert _threshold(gqa["all-gather"]) == round(2 / 32 * C_OVER_W / 1.75)
    assert "a ring step hides its K/V send from" in gqa["ring attention"]


def test_the_all_gather_forms_row_says_its_threshold() -> None:
    """The 4K-token GQA sequence over 16 H100s runs the all-gather form (balanced: the plan holds the sequence in
    zig-zag chunks): K's and V's gathers (the backward's dK, dV scatters) against the kernel, at 256 tokens a
    device; the threshold, in tokens a device, is the form's (its moves and compute both grow with the sequence)."""
    from tests.test_ring_attention import _gqa

    report = shardc.cost(_gqa(4096))
    assert isinstance(report, CostReport)
    for phase in (report.forward, report.backward):
        (k,) = [i for i, r in enumerate(phase.rows) if r.context_parallel]
        moves = [r for r in phase.rows if r.is_collective]
        assert len(moves) == 2 and phase.rows[k].context_parallel == "all-gather, balanced"
        comm = sum(r.comm_s for r in moves)
        assert phase.rows[k].hidden_from == pytest.approx(4096 / 16 * comm / phase.rows[k].compute_s)
        assert phase.rows[k].hidden_from < 1024  # compute-bound at 1024 tokens a device
    row = next(r for r in report.to_json()["backward"]["rows"] if r.get("context_parallel"))  # type: ignore[union-attr]
    assert json.loads(json.dumps(row))["context_comm_s"] == pytest.approx(report.backward.critical_s)
