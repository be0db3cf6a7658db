"""Sliding-window attention, ``causal(Sc, S, T, window W)`` and ``attention(Q, K, V over T, causal, window W)``:
parsed, checked, meant (query s sees keys s - W < t <= s), costed and verified."""

from __future__ import annotations

import doctest
from dataclasses import replace

import numpy as np
import pytest

import shardc
from shardc.chip_model import interpolate
from shardc.costmodel.cost_report import CostReport
from shardc.costmodel.symbolic import cost_formulas
from shardc.errors import ShardcError
from shardc.hardware import PRESETS
from shardc.ir.localops import Attention, Causal, CausalVjp
from shardc.lowering import run_windows
from shardc.lowering.sizes import devices_to_check, small_sizes
from shardc.ops import attention_share
from shardc.ops.attention_reference import attention_forward
from shardc.ops.masks import in_window
from shardc.spec.attention_call import roles
from shardc.spec.walk import calls

HEAD = "mesh X=2, Y=2\ndims B=4, S=16, T=16, N=4, H=16\ndtype f32\n"
FUSED = ("O[B_X, S, N_Y, H] = attention(Q[B_X, S, N_Y, H], K[B_X, T, N_Y, H], V[B_X, T, N_Y, H] "
         "over T, causal{flag})\n")
MASK = "M[B_X, N_Y, S, T] = causal(Sc[B_X, N_Y, S, T], S, T{flag})\n"


def _cost(text: str) -> CostReport:
    report = shardc.cost(shardc.plan(shardc.parse(text)))
    assert isinstance(report, CostReport)
    return report


@pytest.mark.parametrize("line", [FUSED, MASK])
def test_a_window_parses_and_prints_back_as_written(line: str) -> None:
    spec = shardc.parse(HEAD + line.format(flag=", window 4"))
    call = spec.statements[0].expr
    assert call.window == 4 and "window 4" in str(spec.statements[0])
    again = shardc.parse(HEAD + str(spec.statements[0]) + "\n")
    assert again.statements == spec.statements
    assert shardc.parse(HEAD + line.format(flag="")).statements[0].expr.window is None


@pytest.mark.parametrize("line, flag, message", [
    (FUSED, ", window 0", "size must be positive"),
    (FUSED, ", window 2.5", "not a whole number"),
    (MASK, ", window 3, window 4", "two windows"),
    (FUSED.replace(", causal", ""), ", window 4", "without `causal`"),
    ("Y[B, S] = gelu(Z[B, S]{flag})\n", ", window 4", "`gelu` takes no window"),
    (MASK, ", window 4, 0.5", "tensors first, then index names, numbers, a window"),
])
def test_a_bad_window_is_an_error_with_its_span(line: str, flag: str, message: str) -> None:
    with pytest.raises(ShardcError, match=message) as err:
        shardc.parse(HEAD + line.format(flag=flag))
    assert err.value.span is not None and err.value.span.line == 4


def test_the_window_keeps_the_w_keys_up_to_the_query() -> None:
    """s - W < t <= s: W keys, the query's own among them; none after it."""
    keep = in_window(np.arange(6)[:, None], np.arange(6)[None, :], 3)
    assert keep.sum(axis=1).tolist() == [1, 2, 3, 3, 3, 3]
    assert keep[5].tolist() == [False, False, False, True, True, True]
    assert (in_window(np.arange(6)[:, None], np.arange(6)[None, :], 6) == np.tri(6, dtype=bool)).all()


def test_the_fused_reference_is_the_softmax_of_the_scores_masked_to_the_window() -> None:
    """Against a direct loop: row s averages V over its keys max(0, s - W + 1) .. s by softmax weight; a window
    of T or more is the causal mask alone."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(1, 8, 1, 4)) for _ in range(3))
    r = roles(("B", "S", "N", "H"), ("B", "T", "N", "H"), ("B", "T", "N", "H"), "T")
    out = attention_forward(r, True, q, k, v, np, window=3)
    for s in range(8):
        keys = range(max(0, s - 2), s + 1)
        w = np.exp([q[0, s, 0] @ k[0, t, 0] / 2 for t in keys])
        assert np.allclose(out[0, s, 0], sum(p * v[0, t, 0] for p, t in zip(w / w.sum(), keys, strict=True)))
    assert np.allclose(attention_forward(r, True, q, k, v, np, window=8), attention_forward(r, True, q, k, v, np))


def test_the_share_module_examples() -> None:
    assert doctest.testmod(attention_share).failed == 0


def test_the_run_window_examples() -> None:
    """W < N keeps its share of the keys within 1 .. n - 1; W >= N, or N undeclared, stays as written."""
    assert doctest.testmod(run_windows).failed == 0


def test_gemma2_verify_runs_a_window_that_masks_and_lowers_what_the_reference_runs() -> None:
    """At verify's sizes (T = 4 of 8192) the local layers' window 4096 runs as 2: its mask keeps fewer keys
    than the causal mask alone, so a lowered mask that left out the window (or kept 4096) would fail verify's
    Pl; the steps' window and the spec's call (the reference's) are the same 2, the global layers' none."""
    with open("examples/gemma2_27b.shard") as f:
        plan = shardc.plan(shardc.parse(f.read()))
    sizes = small_sizes(plan, devices_to_check(plan, 8))
    run = run_windows.windows_at(plan, sizes)
    w, t = 2, sizes["T"]
    assert t == 4 and run_windows.window_notes(plan, sizes) == [
        "window 4096 over T run as window 2 of its 4 keys (the window's share of the keys, as the sequence shrank)"]
    masks = [s.fn for s in run.forward + run.backward if isinstance(s.fn, Causal | CausalVjp)]
    assert sorted(str(m.window) for m in masks) == ["2", "2", "None", "None"]
    assert [c.window for s in run.spec.statements for c in calls(s.expr) if c.func == "causal"] == [w, None]
    positions = np.arange(t)
    windowed, causal = in_window(positions[:, None], positions[None, :], w), np.tri(t, dtype=bool)
    assert (windowed != causal).sum() == 3  # rows 2 and 3 lose keys 0, and 0 and 1
    assert (in_window(positions[:, None], positions[None, :], 4096) == causal).all()
    assert run_windows.windows_at(plan, plan.spec.sizes) is plan  # at the spec's own sizes, as written


def test_a_windowed_kernel_runs_at_the_rate_measured_at_the_windows_length() -> None:
    """H100, T = 16384 whole on the device, W = 1024: each query sees at most 1024 keys, so the kernel runs at
    FlashAttention-3's rate at 1024 (423 TFLOP/s forward), not at 16384's (616); without the window, at 16384."""
    head = "mesh X=8\ndims B=8, S=16384, T=16384, G=8, R=4, H=128\nhardware h100\n"
    line = ("O[B_X, S, G, R, H] = attention(Q[B_X, S, G, R, H], K[B_X, T, G, H], V[B_X, T, G, H] over T, "
            "causal{flag})\n")
    hw = PRESETS["h100"]
    for flag, keys in ((", window 1024", 1024), ("", 16384)):
        report = shardc.cost(shardc.plan(shardc.parse(head + line.format(flag=flag))), hardware="h100")
        assert isinstance(report, CostReport)
        for rows, points in ((report.forward.rows, hw.attention_forward), (report.backward.rows,
                                                                            hw.attention_backward)):
            (row,) = [r for r in rows if "attention_" in r.text and r.flops]
            assert row.compute_s == pytest.approx(row.flops / (hw.peak("bf16") * interpolate(points, keys)))


def test_fused_windowed_flops_are_the_band_of_the_window_by_hand() -> None:
    """S = T = 16, W = 4: rows 0..3 see 1/2, 3/2, 5/2, 7/2 keys by area (s, as the causal half counts S^2 / 2), the
    other 12 rows 4 each: 8 + 48 = 56 of the 256 scores, so the chip runs 56/256 of the whole Q·K and P·V (each
    4·B·S·T·N·H / 2 over the 4 devices); model FLOPs count the whole S x T, as for causal."""
    report = _cost(HEAD + FUSED.format(flag=", window 4"))
    whole = 4 * 4 * 16 * 16 * 4 * 16
    assert report.forward.compute_flops == whole / 4 * 56 / 256
    assert report.backward.compute_flops == 2.5 * whole / 4 * 56 / 256
    assert report.forward.model_flops == whole and report.backward.model_flops == 2 * whole


def test_a_window_of_t_or_more_costs_and_plans_as_the_causal_mask() -> None:
    causal = shardc.plan(shardc.parse(HEAD + FUSED.format(flag="")))
    for w in (16, 40):
        plan = shardc.plan(shardc.parse(HEAD + FUSED.format(flag=f", window {w}")))
        assert [s.fn for s in plan.forward] == [s.fn for s in causal.forward] and plan.notes == causal.notes
        assert _cost(HEAD + FUSED.format(flag=f", window {w}")).forward == _cost(HEAD + FUSED.format(flag="")).forward


@pytest.mark.parametrize("window, share", [(8, 1 / 8), (56, 27 / 32)])
def test_the_sharded_sequences_busiest_device_runs_its_rows_band(window: int, share: float) -> None:
    """S = 64 over 4 devices, the last device's rows 48..63 of 64 keys (the causal all-gather form's last device
    runs 7/8): W = 8, all past W, 8 keys each: 1/8; W = 56, rows 48..55 see s keys (416 by area), 56..63 56
    each (448): 864 / 1024 = 27/32.  The contiguous blocks, as no ring is offered."""
    text = ("mesh X=4\ndims B=4, S=64, T=64, G=2, R=2, H=16\ndtype f32\nO[B, S_X, G, R, H] = attention(Q[B, S_X, G, "
            f"R, H], K[B, T_X, G, H], V[B, T_X, G, H] over T, causal, window {window})\n")
    plan = shardc.plan(shardc.parse(text))
    kernel = plan.forward[[isinstance(s.fn, Attention) for s in plan.forward].index(True)]
    assert isinstance(kernel.fn, Attention) and kernel.fn.window == window and not kernel.fn.ring
    assert [n for n in plan.notes if "ring attention is not a candidate" in n] == [
        f"O = attention(... window {window}) with S sharded: ring attention is not a candidate (a ring passes every "
        f"key block to every device, where each device's queries need only the keys of the {window} positions up "
        "to its block: a halo exchange, not planned); the all-gather and Ulysses forms were weighed"]
    assert _cost(text).forward.compute_flops == 4 * 4 * 64 * 64 * 4 * 16 / 4 * share


def test_the_formula_without_sizes_is_the_band_for_long_sequences() -> None:
    """S whole: 4·B·S·T·N·H (2 S W - W^2) / 2 S^2 over the devices; S sharded: the busiest device past W, W / S."""
    whole = ("mesh X=2, Y=2\nO[B_X, S, N_Y, H] = attention(Q[B_X, S, N_Y, H], K[B_X, T, N_Y, H], V[B_X, T, N_Y, H] "
             "over T, causal, window 4096)\n")
    text = str(cost_formulas(shardc.plan(shardc.parse(whole))))
    assert "compute 16384*B*H*N*T/(X*Y) - 33554432*B*H*N*T/(S*X*Y) FLOPs a device" in text
    sharded = whole.replace("B_X, S, N_Y", "B_Y, S_X, N").replace("B_X, T, N_Y", "B_Y, T_X, N")
    assert "compute 16384*B*H*N*T/(X*Y) FLOPs a device" in str(cost_formulas(shardc.plan(shardc.parse(sharded))))


def test_the_unfused_mask_costs_what_the_causal_mask_costs() -> None:
    """XLA computes every score of a masked softmax: the window skips no work there."""
    head = HEAD + "Sc[B_X, N_Y, S, T] = Q[B_X, S, N_Y, H] · K[B_X, T, N_Y, H]\n"
    plain, windowed = (_cost(head + MASK.format(flag=f)) for f in ("", ", window 4"))
    for a, b in ((windowed.forward, plain.forward), (windowed.backward, plain.backward)):
        assert [(r.flops, r.memory_bytes, r.compute_s, r.memory_s) for r in a.rows] == \
            [(r.flops, r.memory_bytes, r.compute_s, r.memory_s) for r in b.rows]
    assert windowed.step.compute_s == plain.step.compute_s
    step = shardc.plan(shardc.parse(head + MASK.format(flag=", window 4"))).forward[-1]
    assert step.fn == Causal("S", "T", 4)


def test_a_mistral_7b_layer_runs_three_eighths_of_its_scores() -> None:
    """Mistral 7B (Jiang et al. 2023, table 1): 32 query heads in 8 groups of 4, head dim 128, window 4096;
    at 8192 tokens the band is 8192 x 4096 - 4096^2 / 2 of 8192^2 scores: 3/8."""
    text = ("mesh X=8\ndims B=8, S=8192, T=8192, G=8, R=4, H=128\nO[B_X, S, G, R, H] = attention(Q[B_X, S, G, R, "
            "H], K[B_X, T, G, H], V[B_X, T, G, H] over T, causal, window 4096)\n")
    report = _cost(text)
    whole = 4 * 8 * 8192 * 8192 * 32 * 128
    assert report.forward.compute_flops == whole / 8 * 3 / 8 and report.forward.model_flops == whole


@pytest.mark.slow
def test_a_windowed_spec_verifies_against_the_reference_values_and_hlo() -> None:
    """The fused kernel with S sharded (its blocks' positions offset) and the unfused mask, both W = 5 of 32
    keys: the lowered values and gradients match the reference."""
    from shardc.verification.verify import verify

    text = ("mesh X=2, Y=2\ndims B=2, S=32, T=32, N=2, H=8\ndtype f32\n"
            "O[B_Y, S_X, N, H] = attention(Q[B_Y, S_X, N, H], K[B_Y, T_X, N, H], V[B_Y, T_X, N, H] over T, causal, "
            "window 5)\nSc[B_Y, N, S_X, T] = O[B_Y, S_X, N, H] · K[B_Y, T_X, N, H]\n"
            "P[B_Y, N, S_X, T] = softmax(causal(Sc[B_Y, N, S_X, T], S, T, window 5) over T)\n"
            "Out[B_Y, S_X, N, H] = P[B_Y, N, S_X, T] · V[B_Y, T_X, N, H]\n")
    report = verify(shardc.parse(text))
    assert report.ok, [r for r in (*report.values, *report.collectives) if not r.ok]
    assert {"O", "P", "Out", "dQ", "dK", "dV"} <= {r.tensor for r in report.values}


@pytest.mark.slow
def test_verify_shrinks_the_window_with_the_keys_and_fails_a_lowering_that_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """T = 4096, W = 1024, run at T = 16: verify runs window 4 (noted) and passes; lowered with the window as
    written (4096 >= 16 keys: the causal mask alone) against the reference's 4, the masked values fail.  A
    module given to verify (lowered at the spec's sizes) keeps its window, and the report says it is untested."""
    from shardc.verification import verify as verify_module

    text = ("mesh X=2\ndims B=2, S=4096, T=4096, N=2, H=8\ndtype f32\n"
            "Sc[B, N, S_X, T] = Q[B, S_X, N, H] · K[B, T_X, N, H]\n"
            "P[B, N, S_X, T] = softmax(causal(Sc[B, N, S_X, T], S, T, window 1024) over T)\n")
    sizes = {"B": 2, "S": 16, "T": 16, "N": 2, "H": 8}
    report = verify_module.verify(shardc.parse(text), sizes=sizes)
    assert report.ok and any("window 1024 over T run as window 4 of its 16 keys" in n for n in report.notes)
    kept = verify_module.windows_at
    monkeypatch.setattr(verify_module, "windows_at", lambda plan, at: replace(
        kept(plan, at), forward=plan.forward, backward=plan.backward))
    wrong = verify_module.verify(shardc.parse(text), sizes=sizes)
    assert not wrong.ok and {r.tensor for r in wrong.values if not r.ok} >= {"P"}
    monkeypatch.setattr(verify_module, "windows_at", kept)
    given = verify_module.verify(shardc.parse(text), sizes=sizes, module=shardc.lower(shardc.parse(text)).module.source)
    assert given.ok and any("window 1024 over T is the given module's, as lowered: at the run's 16 keys it masks "
                            "nothing" in n for n in given.notes)  # its code's window, not the shrunk one


@pytest.mark.slow
def test_a_pipelined_verify_shrinks_the_window_in_its_stages_and_its_reference() -> None:
    """The pipelined path lowers its own program: T = 4096 runs at 5, window 1024 as 1 (noted), in the stages'
    steps and the reference alike, else the masked values (Y and every gradient) would differ."""
    from shardc.verification.verify import verify

    text = ("mesh P=2 pipeline, X=2\ndims B=8, S=4096, T=4096, D=8, N=2, H=4\nlayers 2\nmicrobatches 2\ndtype f32\n"
            "param W_q, W_k, W_o\nQ[B_X, S, N, H] = X[B_X, S, D] · W_q[D, N, H]\nKx[B_X, T, D] = X[B_X, S, D]\n"
            "K[B_X, T, N, H] = Kx[B_X, T, D] · W_k[D, N, H]\nSc[B_X, N, S, T] = Q[B_X, S, N, H] · K[B_X, T, N, H]\n"
            "Pr[B_X, N, S, T] = softmax(causal(Sc[B_X, N, S, T], S, T, window 1024) over T)\n"
            "C[B_X, S, N, H] = Pr[B_X, N, S, T] · K[B_X, T, N, H]\n"
            "Y[B_X, S, D] = X[B_X, S, D] + C[B_X, S, N, H] · W_o[N, H, D]\n")
    report = verify(shardc.parse(text))
    assert report.ok, [r for r in report.values if not r.ok]
    assert any("window 1024 over T run as window 1 of its 5 keys" in n for n in report.notes)
