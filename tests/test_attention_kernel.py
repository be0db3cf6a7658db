"""The fused attention kernel's rate on each chip, and the FLOPs a causal kernel runs (HFU's)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

import shardc
from shardc.chip_choice import load_hardware_file
from shardc.chip_model import interpolate
from shardc.cli.main import main
from shardc.costmodel.cost_report import CostReport
from shardc.costmodel.cost_text import render
from shardc.costmodel.phase_cost import MFU_ATTENTION_CONVENTION
from shardc.errors import ShardcError
from shardc.hardware import KERNELS, PRESETS, Hardware
from shardc.ir.localops import Attention
from shardc.ir.plan import Plan
from shardc.ops.attention_cost import kernel_seconds
from shardc.step_cost import StepCost

H100 = 9.89e14


def _flat(points: tuple[tuple[float, float], ...]) -> list[float]:
    return [x for point in points for x in point]


def test_the_presets_are_the_cited_kernel_measurements() -> None:
    """H100: FlashAttention-3's paper figures (causal forward, backward, head dim 128, TFLOP/s by sequence
    length); A100: FlashAttention-2's causal forward measured at 1K and 4K keys, its backward that times the
    paper's 63/73 (its best backward over its best forward); B200: FlashAttention-4's benchmark in the
    flash-attention repository; TPUs: none (the matmul rate)."""
    lengths = (512, 1024, 2048, 4096, 8192, 16384)
    forward = tuple(zip(lengths, (x * 1e12 / H100 for x in (292, 423, 521, 579, 602, 616)), strict=True))
    backward = tuple(zip(lengths, (x * 1e12 / H100 for x in (316, 424, 501, 542, 559, 561)), strict=True))
    for name in ("h100", "h200", "h800"):
        assert _flat(PRESETS[name].attention_forward) == pytest.approx(_flat(forward))
        assert _flat(PRESETS[name].attention_backward) == pytest.approx(_flat(backward))
    a100 = PRESETS["a100"]
    assert _flat(a100.attention_forward) == pytest.approx([1024, 143.70e12 / 3.12e14, 4096, 156.27e12 / 3.12e14])
    assert _flat(a100.attention_backward) == pytest.approx([1024, 143.70e12 / 3.12e14 * 63 / 73,
                                                            4096, 156.27e12 / 3.12e14 * 63 / 73])
    assert a100.attention_seconds(1e12, 4096, backward=True) > a100.attention_seconds(1e12, 4096, backward=False)
    assert _flat(PRESETS["b200"].attention_forward) == pytest.approx([8192, 1418.1e12 / 2.25e15])
    assert _flat(PRESETS["b200"].attention_backward) == pytest.approx([8192, 1208.6e12 / 2.25e15])
    for name in ("tpu-v4p", "tpu-v5e", "tpu-v5p", "tpu-v6e"):
        assert PRESETS[name].attention_forward == PRESETS[name].attention_backward == ()


def test_hoppers_flashattention2_runs_its_causal_backward_below_its_forward() -> None:
    """cudnn-frontend's measurement of PyTorch's SDPA flash backend, causal, head dim 128: forward 314-345
    TFLOP/s and backward 249-323 from 4K to 64K tokens; below 4K the FlashAttention-3 paper's FlashAttention-2
    bars, its no-mask backward at the causal share measured at 4K (248.76 of 287.36)."""
    forward, backward = KERNELS["h100"]["flash2"]
    assert dict(forward)[65536.0] == pytest.approx(342.65e12 / H100)
    assert dict(backward)[4096.0] == pytest.approx(248.76e12 / H100)
    assert dict(backward)[2048.0] == pytest.approx(291e12 * 248.76 / 287.36 / H100)
    assert all(b < f for (_, f), (_, b) in zip(forward, backward, strict=True))  # at every length measured
    assert KERNELS["h200"]["flash2"] == KERNELS["h800"]["flash2"] == (forward, backward)


def test_attention_seconds_interpolates_in_keys_and_falls_back_to_the_matmul_rate() -> None:
    h100 = PRESETS["h100"]
    flops = 1e12
    assert h100.attention_seconds(flops, 4096, backward=False) == pytest.approx(flops / 579e12)
    assert h100.attention_seconds(flops, 4096, backward=True) == pytest.approx(flops / 542e12)
    assert h100.attention_seconds(flops, 65536, backward=False) == pytest.approx(flops / 616e12)  # flat beyond
    between = interpolate(h100.attention_forward, 3000)
    assert 521e12 / H100 < between < 579e12 / H100
    assert h100.configured("book").attention_seconds(flops, 4096, False) == pytest.approx(flops / H100)
    tpu = PRESETS["tpu-v5p"]
    assert tpu.attention_seconds(flops, 4096, True) == tpu.matmul_seconds(flops)
    assert h100.attention_seconds(0.0, 4096, True) == 0.0


def _causal_text(seq: int) -> str:
    return (f"mesh X=8\ndims B=8, S={seq}, T={seq}, D=1024, N=8, H=128\nhardware h100\nparam W_q, W_o\n"
            "Q[B_X, S, N, H] = L[B_X, S, D] · W_q[D, N, H]\n"
            "C[B_X, S, N, H] = attention(Q[B_X, S, N, H], K[B_X, T, N, H], V[B_X, T, N, H] over T, causal)\n"
            "Y[B_X, S, D] = C[B_X, S, N, H] · W_o[N, H, D]\n")


def _causal(seq: int, hardware: str | Hardware = "h100", recompute: str = "none") -> Plan:
    return shardc.plan(shardc.parse(_causal_text(seq)), hardware=hardware, recompute=recompute)


def _report(plan: Plan, hardware: str | Hardware = "h100") -> CostReport:
    report = shardc.cost(plan, hardware=hardware)
    assert isinstance(report, CostReport)
    return report


def _kernels(rows: tuple[StepCost, ...]) -> list[StepCost]:
    return [r for r in rows if "attention_" in r.text and r.flops]


def test_the_attention_steps_run_at_the_chip_kernel_rate_and_nothing_else_changes() -> None:
    """Forward and backward kernels at FlashAttention-3's figures for their keys (T = 4096); every other
    step's time as on the same chip without attention figures (the matmul rate)."""
    b, s, n, h, x = 8, 4096, 8, 128, 8
    report = _report(_causal(s))
    (fwd,), (bwd,) = _kernels(report.forward.rows), _kernels(report.backward.rows)
    forward_flops = 4 * b * s * s * n * h / x / 2  # causal: the unmasked half
    assert fwd.flops == forward_flops and bwd.flops == 2.5 * forward_flops
    assert fwd.compute_s == pytest.approx(forward_flops / 579e12)
    assert bwd.compute_s == pytest.approx(2.5 * forward_flops / 542e12)
    assert fwd.compute_s > PRESETS["h100"].matmul_seconds(forward_flops)  # below the GEMM rate
    plain = replace(PRESETS["h100"], attention_forward=(), attention_backward=())
    other = _report(_causal(s), plain)
    for mine, theirs in zip(report.step.rows, other.step.rows, strict=True):
        if "attention_" in mine.text and mine.flops:
            assert theirs.compute_s == pytest.approx(PRESETS["h100"].matmul_seconds(mine.flops))
        else:
            assert (mine.compute_s, mine.memory_s, mine.comm_s) == (theirs.compute_s, theirs.memory_s, theirs.comm_s)


def test_the_kernels_own_reads_and_writes_take_time_only_past_its_flops() -> None:
    """Its rate is measured on whole calls, which read Q, K and V and write O: at 4096 keys its bytes take
    less than its FLOPs, so its time is its FLOPs' (it was the two added, its bytes counted twice); at 128
    keys its bytes outlast its FLOPs, and the time is theirs (its roofline)."""
    hw = PRESETS["h100"]
    for s, bound in ((4096, False), (128, True)):
        report = _report(_causal(s))
        for row in _kernels(report.forward.rows) + _kernels(report.backward.rows):
            moved = hw.memory_seconds(row.memory_bytes)
            assert row.memory_bytes > 0 and (moved > row.compute_s) is bound
            assert row.busy_s == pytest.approx(max(row.compute_s, moved), rel=1e-12)


def test_the_planner_and_the_ring_price_the_kernel_with_the_same_function() -> None:
    """A ring kernel's row (X across nodes, where the ring wins): its compute is :func:`kernel_seconds` of its
    step at the ring's block of keys."""
    seq = 131072
    plan = shardc.plan(shardc.parse(
        f"mesh X=16 over dcn\ndims B=1, S={seq}, T={seq}, G=8, R=16, H=128\nhardware h100\nO[B, S_X, G, R, H] = "
        "attention(Q[B, S_X, G, R, H], K[B, T_X, G, H], V[B, T_X, G, H] over T, causal)\n"))
    report = _report(plan)
    sizes = {"X": 16, "B": 1, "S": seq, "T": seq, "G": 8, "R": 16, "H": 128}
    kernels = [s for s in plan.forward + plan.backward if isinstance(s.fn, Attention) and s.fn.kernel]
    rows = _kernels(report.forward.rows) + _kernels(report.backward.rows)
    assert len(kernels) == len(rows) == 2 and all(r.ring_steps == 16 for r in rows)
    for step, row in zip(kernels, rows, strict=True):
        assert row.compute_s == kernel_seconds(step, sizes.__getitem__, PRESETS["h100"], "bf16")
    fwd = rows[0]
    assert fwd.compute_s == pytest.approx(fwd.flops / (H100 * interpolate(PRESETS["h100"].attention_forward,
                                                                           seq / 16)))


def test_not_causal_at_128k_the_all_gather_kernel_call_over_every_key_beats_the_ring() -> None:
    """On 16 H100 and one sequence of 128K tokens, not causal: the all-gather form runs one kernel call over
    all 128K keys (FlashAttention-3's 16K rate, 616 TFLOP/s forward), the ring 16 calls over 8K keys (602):
    2% slower, more than the all-gather's exposed gather of K and V; the ring wins where both run at one rate."""
    text = ("mesh X=16\ndims B=1, S=131072, T=131072, G=8, R=16, H=128\nhardware h100\nO[B, S_X, G, R, H] = "
            "attention(Q[B, S_X, G, R, H], K[B, T_X, G, H], V[B, T_X, G, H] over T)\n")
    flat = replace(PRESETS["h100"], attention_forward=(), attention_backward=())
    for chip, winner in ((PRESETS["h100"], "all-gather"), (flat, "ring attention")):
        (choice,) = shardc.plan(shardc.parse(text), hardware=chip, explain=True).choices
        chosen = next(a.description for a in choice.alternatives if a.chosen)
        assert chosen.endswith(f"({winner})")


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_causal_hardware_flops_are_what_the_chip_runs_and_hfu_stays_below_one(recompute: str) -> None:
    """At 64K tokens a causal kernel's unmasked S x T dominates: model FLOPs count it whole (MFU's convention),
    hardware FLOPs the half the devices run, the backward's recomputed scores and the recomputed forward."""
    b, s, d, n, h = 8, 65536, 1024, 8, 128
    report = _report(_causal(s, recompute=recompute))
    attention = 4 * b * s * s * n * h  # the forward's two matmuls over the whole S x T
    einsums = 2 * (2 * b * s * d * n * h)  # W_q and W_o, forward
    assert report.step.model_flops == pytest.approx(3 * einsums + attention * 3)  # backward: twice the forward
    again = einsums / 2 + attention / 2 if recompute == "full" else 0.0  # the recomputed forward (its W_q, kernel)
    executed = 3 * einsums + attention / 2 * (1 + 2.5) + again
    assert report.step.hardware_flops == pytest.approx(executed)
    assert 0 < report.step.hfu <= 1.0
    if recompute == "none":  # nothing run again: the chip runs less than the model FLOPs count
        assert report.step.hfu < report.step.mfu


def test_hfu_below_mfu_says_why() -> None:
    """A causal kernel runs half the scores the model FLOPs count (PaLM's convention): where that puts HFU
    below MFU the report says so under the MFU line, and the JSON names the convention; where recomputation
    lifts HFU above MFU (short sequences, the projections' FLOPs the most), or nothing is causal, no such line."""
    none, full = _report(_causal(4096)), _report(_causal(256, recompute="full"))
    assert none.step.hfu < none.step.mfu and full.step.hfu > full.step.mfu
    lines = render(none).splitlines()
    step = lines.index("step (forward + backward)")
    at = next(i for i in range(step, len(lines)) if lines[i].lstrip().startswith("MFU "))
    assert lines[at + 1].strip() == none.step.below_mfu and "causal attention whole" in lines[at + 1]
    assert full.step.below_mfu is None and "HFU below MFU" not in "\n".join(render(full).splitlines()[step:])
    flat = shardc.cost(shardc.plan(shardc.parse(_causal_text(4096).replace(", causal)", ")"))))
    assert isinstance(flat, CostReport) and flat.step.below_mfu is None and "HFU below MFU" not in render(flat)
    assert none.to_json()["step"]["mfu_attention_convention"] == MFU_ATTENTION_CONVENTION == "whole"


def test_a_hardware_file_takes_attention_points_and_the_hardware_json_lists_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = "flops = 1e15\nici_bandwidth = 1e11\nhbm_bytes = 8e10\ndcn_bandwidth = 1e10\n"
    chip = tmp_path / "chip.toml"
    chip.write_text(base + "attention_forward = [[1024, 0.4], [16384, 0.6]]\nattention_backward = [[4096, 0.5]]\n",
                    encoding="utf-8")
    hw = load_hardware_file(str(chip))
    assert hw.attention_forward == ((1024, 0.4), (16384, 0.6)) and hw.attention_backward == ((4096, 0.5),)
    assert hw.attention_seconds(1e12, 1024, False) == pytest.approx(1e12 / 0.4e15)
    for bad in ("[[1024, 1.5]]", "[[4096, 0.5], [1024, 0.6]]", "0.5"):
        chip.write_text(base + f"attention_backward = {bad}\n", encoding="utf-8")
        with pytest.raises(ShardcError, match="attention_backward"):
            load_hardware_file(str(chip))
    assert main(["hardware", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["h100"]["attention_backward"][3] == [4096, pytest.approx(542e12 / H100)]
    assert listed["tpu-v5p"]["attention_forward"] == [] and math.isfinite(listed["a100"]["attention_forward"][0][1])


def test_the_kernels_further_results_are_written_inside_its_calls() -> None:
    """The logsumexp, dK and dV are the kernel's own writes, inside the calls its rate is measured on: their
    bytes join the kernel's step, priced against its FLOPs, and take no time of their own (they did: ~2.5 ms
    a step of MPT-7B on H100).  At 4096 keys the FLOPs cover them all; at 128 keys the bytes outlast them."""
    hw = PRESETS["h100"]
    for s, bound in ((4096, False), (128, True)):
        report = _report(_causal(s))
        for rows in (report.forward.rows, report.backward.rows):
            (kernel,) = _kernels(rows)
            further = [r for r in rows if "attention_" in r.text and not r.flops]
            assert len(further) == (1 if rows is report.forward.rows else 2)
            assert all(r.memory_bytes == 0 and r.memory_s == 0 for r in further)
            assert (hw.memory_seconds(kernel.memory_bytes) > kernel.compute_s) is bound
            assert kernel.busy_s == pytest.approx(max(kernel.compute_s, hw.memory_seconds(kernel.memory_bytes)))
    q = 8 // 8 * 128 * 8 * 128 * 2  # Q, K, V, O or dQ at 128 keys on a device, bf16; the logsumexp fp32
    (fwd,) = _kernels(report.forward.rows)
    assert fwd.memory_bytes == 4 * q + 8 // 8 * 128 * 8 * 4  # reads Q, K, V; writes O and the logsumexp
