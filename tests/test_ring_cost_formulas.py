"""The sends of ring kernels (ring attention, collective matmuls) in the cost formulas and the memory count:
each phase's formulas, evaluated at the sizes, give the numbers of the cost report (the bytes the rings send,
their bandwidth time), and memory counts the buffers their blocks arrive in."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardc
from shardc.costmodel.cost_report import CostReport
from shardc.costmodel.formulas import evaluate, text
from shardc.costmodel.symbolic import cost_formulas
from shardc.ir.plan import Plan
from tests.test_ring_attention import _FLAT_H100, _gqa

CH5 = Path(__file__).resolve().parent / "specs" / "book_ch5_fsdp_tp.shard"


def _cost(plan: Plan) -> CostReport:
    report = shardc.cost(plan)
    assert isinstance(report, CostReport)
    return report


def _ch5(save: str = "default") -> Plan:
    return shardc.plan(shardc.parse(CH5.read_text(), filename=str(CH5)), collective_matmul=True, save=save)


RING = _gqa(131072, causal=False, chip=_FLAT_H100)  # 16 devices, K and V around the ring
ZIGZAG = _gqa(131072, dcn=True)  # causal, across nodes: the ring in zig-zag chunks
PAIR = _gqa(65536, x=2, causal=False, chip=_FLAT_H100)  # a ring of two devices


@pytest.mark.parametrize("plan", [RING, ZIGZAG, PAIR, _ch5(), _ch5("none")],
                         ids=["ring", "zigzag", "ring of two", "collective matmul", "collective matmul, save none"])
def test_the_formulas_evaluate_to_the_numbers_with_the_rings_sends(plan: Plan) -> None:
    report = _cost(plan)
    hw = report.hardware
    values = {k: float(v) for k, v in report.sizes.items()} | {"C": hw.flops, "W_ici": hw.w_ici, "W_dcn": hw.w_dcn}
    sent = [r for r in report.step.rows if r.ring_steps and not r.ring_shared]
    assert sent and all(r.weighted > 0 and r.bandwidth_s > 0 for r in sent)
    for phase in (report.forward, report.backward, report.step):
        f = phase.formula
        assert evaluate(f.comm_bytes, values) == pytest.approx(phase.comm_bytes, rel=1e-12)
        assert evaluate(f.comm_s, values) == pytest.approx(phase.comm_bandwidth_s, rel=1e-12)
    symbolic = cost_formulas(plan)  # the formulas-only report: the same phases
    assert text(symbolic.step.formula.comm_bytes) == text(report.step.formula.comm_bytes)


def test_ring_attentions_sends_by_hand() -> None:
    """16 devices, T/16 keys a device, K and V (bf16) sent 15 times each: 2 * 15 * 2 * B*T*G*H/16 bytes; the
    backward sends them again with dK's and dV's accumulators (float32) 15 times, and those once more home:
    (60 + 120 + 8) * B*T*G*H/16; each send one way over the ring's link."""
    report = _cost(RING)
    assert text(report.forward.formula.comm_bytes) == "15*B*G*H*T/4"
    assert text(report.backward.formula.comm_bytes) == "47*B*G*H*T/4"
    assert report.forward.comm_bytes == 15 * 131072 * 8 * 128 / 4
    (kernel,) = [r for r in report.forward.rows if r.ring_steps]
    # the ring crosses two nodes: each send of K's and V's blocks at InfiniBand's rate, one way
    assert kernel.bandwidth_s == pytest.approx(15 * 2 * (131072 // 16 * 8 * 128 * 2) / report.hardware.w_dcn)


def test_memory_counts_a_rings_blocks_in_flight() -> None:
    """A ring step computes with one block while the next arrives: two blocks' buffers beyond the device's own
    (K and V in the forward; K, V and dK's and dV's float32 accumulators in the backward, the larger), one
    where the ring has two devices."""
    block = 131072 // 16 * 8 * 128  # elements of K's block on a device
    ring = _cost(RING).memory
    assert ring.ring_bytes == 2 * (2 * block * 2 + 2 * block * 4)
    assert ring.total_bytes == pytest.approx(ring.param_bytes + ring.grad_bytes + ring.optimizer_bytes
                                             + ring.residual_bytes + ring.gathered_bytes + ring.ring_bytes)
    assert "in flight" in str(_cost(RING))
    assert _cost(PAIR).memory.ring_bytes == 1 * (2 * 2 + 2 * 4) * (65536 // 2 * 8 * 128)
    assert _cost(_gqa(4096)).memory.ring_bytes == 0  # the all-gather form: no ring


def test_memory_counts_a_collective_matmuls_double_buffer() -> None:
    """The chapter-5 layer with collective matmuls over Y=4: a ring's block of B/X x D/Y (bf16) twice; the
    two rings reading the gathered dOut share one chain of sends, whose 3 received blocks stay alive for the
    second."""
    plan = _ch5()
    sizes = plan.spec.sizes
    block = sizes["B"] // 16 * sizes["D"] // 4 * 2
    assert _cost(plan).memory.ring_bytes == 3 * block
    from shardc.costmodel.memory import ring_buffers

    assert ring_buffers(plan.forward, {**sizes, "X": 16, "Y": 4}, 2) == 2 * block
    assert _cost(shardc.plan(shardc.parse(CH5.read_text()), collective_matmul=False)).memory.ring_bytes == 0
