"""How the framework runs the program: `fusion none` (one kernel an op) and `grad_reduce after-backward`
(gradient reductions once the backward is done), as spec lines, flags and hardware-file keys; and the SMs
NCCL takes from the compute an overlapped collective runs under."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import shardc
from shardc.accountings import update_bytes
from shardc.chip_choice import chip_for, load_hardware_file
from shardc.errors import ShardcError
from shardc.hardware import PRESETS, get_hardware
from shardc.phase_time import phase_seconds
from tests.test_cli import shardc_cli

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

MLP = ("mesh X=4, Y=2\ndims B=4096, D=1024, F=4096\nhardware h100\n"
       "Tmp[B_X, F_Y] = gelu(In[B_X, D] · W_in[D, F_Y])\nOut[B_X, D] = Tmp[B_X, F_Y] · W_out[F_Y, D]\n")
# data parallel over 64 GPUs (8 nodes of 8): the gradients all-reduced, nothing else communicated
DP = ("mesh X=64\ndims B=1048576, D=2048, E=2048\nhardware h100\ntopology 8x8\n"
      "H1[B_X, E] = H0[B_X, D] · W0[D, E]\nH2[B_X, D] = H1[B_X, E] · W1[E, D]\n")


run = shardc_cli  # each command in-process: what it prints is the point, not a fresh interpreter


def _with(text: str, line: str) -> str:
    """``text`` with a header ``line`` after its mesh line."""
    head, rest = text.split("\n", 1)
    return f"{head}\n{line}\n{rest}"


def test_the_lines_parse_print_back_and_reject_unknown_words() -> None:
    spec = shardc.parse(_with(_with(MLP, "fusion none"), "grad_reduce after-backward"))
    assert (spec.fusion, spec.grad_reduce) == ("none", "after-backward")
    assert shardc.parse(str(spec)) == spec
    assert (shardc.parse(MLP).fusion, shardc.parse(MLP).grad_reduce) == (None, None)
    with pytest.raises(ShardcError, match="unknown fusion `eager`"):
        shardc.parse(_with(MLP, "fusion eager"))
    with pytest.raises(ShardcError, match="unknown grad_reduce"):
        shardc.parse(_with(MLP, "grad_reduce late"))


def test_without_fusion_a_map_after_a_matmul_reads_its_input_back() -> None:
    tmp = 4096 // 4 * 4096 // 2 * 2  # Tmp[B_X, F_Y] a device, bf16
    fused = shardc.cost(shardc.plan(shardc.parse(MLP)))
    eager = shardc.cost(shardc.plan(shardc.parse(_with(MLP, "fusion none"))))
    (gelu_fused,) = [r for r in fused.forward.rows if r.text.startswith("gelu")]
    (gelu_eager,) = [r for r in eager.forward.rows if r.text.startswith("gelu")]
    assert gelu_fused.memory_bytes == tmp  # the matmul's epilogue: writes Tmp only
    assert gelu_eager.memory_bytes == 2 * tmp  # its own kernel: reads the matmul's result, writes Tmp
    assert eager.step.memory_s > fused.step.memory_s and eager.step.compute_s == fused.step.compute_s
    assert eager.hardware.fusion == "none" and "fusion none" in " ".join(eager.notes)
    book = shardc.cost(shardc.plan(shardc.parse(_with(MLP, "fusion none")), model="book"))
    assert book.step.memory_s == 0  # the book's model has no memory-bound time, fused or not


def test_without_fusion_the_update_runs_as_pytorch_adamws_passes() -> None:
    # adam10 (bf16 param and gradient, fp32 m and v): lerp m 10, mul v 8, addcmul v 10, sqrt 8, div 8, add 8,
    # addcdiv of the param 12 bytes an element; one fused kernel reads param, grad, m, v and writes param, m, v: 22
    assert (update_bytes("adam10", True), update_bytes("adam10", False)) == (22, 64)
    # a master copy (mixed18: fp32 master, m, v; fp32 gradient): the passes update the master, then copy it
    assert update_bytes("mixed18", False) == 14 * 4 + 2 * 4 + 2 * 4 + (4 + 2)
    fused = shardc.cost(shardc.plan(shardc.parse(MLP)))
    eager = shardc.cost(shardc.plan(shardc.parse(_with(MLP, "fusion none"))))
    assert eager.step.update_s == pytest.approx(fused.step.update_s * 64 / 22, rel=1e-12) and fused.step.update_s > 0
    statement = shardc.cost(shardc.plan(shardc.parse(_with(MLP, "fusion statement"))))
    assert statement.step.update_s == fused.step.update_s  # a hand-fused Adam kernel (apex's, Megatron-LM's)


def test_without_fusion_a_map_after_a_map_reads_its_input_back() -> None:
    text = "mesh X=8\ndims B=65536, D=4096\nhardware h100\nY[B_X, D] = tanh(gelu(X[B_X, D]))\n"
    piece = 65536 // 8 * 4096 * 2
    rows = {r.text.split("(")[0]: r.memory_bytes for r in shardc.cost(shardc.plan(shardc.parse(text))).forward.rows}
    eager = {r.text.split("(")[0]: r.memory_bytes
             for r in shardc.cost(shardc.plan(shardc.parse(_with(text, "fusion none")))).forward.rows}
    # XLA: gelu reads X and writes its result (tanh's backward keeps it); tanh, fused into it, reads nothing back
    assert rows == {"gelu": 2 * piece, "tanh": piece}
    assert eager == {"gelu": 2 * piece, "tanh": 2 * piece}  # its own kernel: tanh reads gelu's result back


def test_after_the_backward_the_gradient_reductions_are_exposed() -> None:
    over = shardc.cost(shardc.plan(shardc.parse(DP)))
    after = shardc.cost(shardc.plan(shardc.parse(_with(DP, "grad_reduce after-backward"))))
    reductions = over.backward.ahead_s
    assert reductions > 0 and over.backward.critical_s == 0
    busy = over.backward.compute_s + over.backward.memory_s
    share = over.hardware.overlap_share
    assert reductions < busy  # overlapped, they hide under the backward's compute (which NCCL's SMs slow)
    assert over.backward.step_s == pytest.approx(busy + share * reductions)
    assert (after.backward.ahead_s, after.backward.critical_s) == (0, pytest.approx(reductions))
    assert after.backward.step_s == pytest.approx(busy + reductions)
    assert after.step.exposed_comm_s == pytest.approx(over.step.exposed_comm_s + (1 - share) * reductions)
    book = shardc.cost(shardc.plan(shardc.parse(_with(DP, "grad_reduce after-backward")), model="book"))
    assert book.backward.critical_s == 0  # the book's model overlaps every collective


def test_a_pipeline_reduces_its_gradients_after_the_flush() -> None:
    text = (EXAMPLES / "pipeline_llama.shard").read_text()
    over = shardc.cost(shardc.plan(shardc.parse(text), hardware="h100")).pipeline
    after = shardc.cost(shardc.plan(shardc.parse(_with(text, "grad_reduce after-backward")), hardware="h100")).pipeline
    assert over is not None and after is not None
    assert after.grad_reduce_s == pytest.approx(over.grad_reduce_s) and over.grad_reduce_s > 0
    assert over.grad_reduce_exposed_s < over.grad_reduce_s  # the last microbatch's backward hides some
    assert after.grad_reduce_exposed_s == pytest.approx(after.grad_reduce_s)
    assert after.step_s - over.step_s == pytest.approx(after.grad_reduce_s - over.grad_reduce_exposed_s)


def test_a_flag_or_a_chip_given_beats_the_spec_line(tmp_path: Path) -> None:
    spec = shardc.parse(_with(DP, "grad_reduce after-backward"))
    assert chip_for(spec).grad_reduce == "after-backward"
    overlapped = chip_for(spec, get_hardware("h100").configured(grad_reduce="overlapped"))
    assert overlapped.grad_reduce == "overlapped" and not overlapped.reduces_after_backward
    want = shardc.cost(shardc.plan(spec, hardware=overlapped)).step.step_s
    assert want == pytest.approx(shardc.cost(shardc.plan(shardc.parse(DP))).step.step_s)
    path = tmp_path / "dp.shard"
    path.write_text(str(spec), encoding="utf-8")
    out = run("cost", str(path), "--json", "--grad-reduce", "overlapped", "--fusion", "none")
    spec_line = run("cost", str(path), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert (data["hardware"]["grad_reduce"], data["hardware"]["fusion"]) == ("overlapped", "none")
    assert json.loads(spec_line.stdout)["hardware"]["grad_reduce"] == "after-backward"
    assert run("cost", str(EXAMPLES / "tp.shard"), "--fusion", "eager").returncode == 2
    with pytest.raises(ShardcError, match="--grad-reduce"):
        get_hardware("h100").configured(grad_reduce="late")


def test_a_hardware_file_may_name_how_its_framework_runs(tmp_path: Path) -> None:
    chip = tmp_path / "chip.toml"
    chip.write_text('flops = 1e15\nici_bandwidth = 1e11\nhbm_bytes = 8e10\ndcn_bandwidth = 1e10\n'
                    'fusion = "none"\ngrad_reduce = "after-backward"\n', encoding="utf-8")
    hw = load_hardware_file(str(chip))
    assert not hw.fuses and hw.reduces_after_backward
    chip.write_text('flops = 1e15\nici_bandwidth = 1e11\nhbm_bytes = 8e10\ndcn_bandwidth = 1e10\nfusion = "eager"\n',
                    encoding="utf-8")
    with pytest.raises(ShardcError, match="fusion must be one of"):
        load_hardware_file(str(chip))


# --- NCCL's SMs under an overlapped collective -------------------------------------------------------------

def test_an_overlapped_collective_slows_the_compute_by_the_sms_it_holds() -> None:
    # 10 s of compute under 4 s of collectives holding a quarter of the cores: 1 s more, then 0.5 s critical
    assert phase_seconds(10.0, 4.0, 0.5, book=False, share=0.25) == pytest.approx(11.5)
    # compute done within the collectives at 3/4 speed (2 s of work in 8/3 s < 4 s): the collectives set it
    assert phase_seconds(2.0, 4.0, 0.5, book=False, share=0.25) == pytest.approx(4.5)
    assert phase_seconds(10.0, 4.0, 0.5, book=False) == pytest.approx(10.5)  # nothing held: the max
    assert phase_seconds(10.0, 4.0, 0.5, book=True, share=0.25) == pytest.approx(10.0)  # the book's model


def test_the_gpus_say_the_sms_nccl_holds_and_tpus_none() -> None:
    assert get_hardware("h100").overlap_share == pytest.approx(24 / 132)
    assert get_hardware("a100").overlap_share == pytest.approx(24 / 108)
    assert get_hardware("h100").configured("book").overlap_share == 0
    assert all(PRESETS[name].overlap_share == 0 for name in PRESETS if name.startswith("tpu"))


def test_a_phase_of_overlapped_gathers_takes_the_compute_they_slow(tmp_path: Path) -> None:
    report = shardc.cost(shardc.plan(shardc.parse(DP)))
    for phase in (report.forward, report.backward):
        busy = phase.compute_s + phase.memory_s
        assert phase.step_s == pytest.approx(max(busy + 24 / 132 * phase.ahead_s, phase.ahead_s) + phase.critical_s)
    chip = tmp_path / "chip.toml"
    base = 'flops = 1e15\nici_bandwidth = 1e11\nhbm_bytes = 8e10\ndcn_bandwidth = 1e10\n'
    chip.write_text(base + "sms = 100\ncollective_sms = 20\n", encoding="utf-8")
    assert load_hardware_file(str(chip)).overlap_share == pytest.approx(0.2)
    chip.write_text(base + "sms = 100.5\n", encoding="utf-8")
    with pytest.raises(ShardcError, match="sms must be a whole number"):
        load_hardware_file(str(chip))


# --- the fused attention kernel the framework runs ---------------------------------------------------------

ATTENTION = ("mesh X=8\ndims B=8, S=4096, T=4096, N=16, H=128\nhardware h100\n"
             "C[B_X, S, N, H] = attention(Q[B_X, S, N, H], K[B_X, T, N, H], V[B_X, T, N, H] over T, causal)\n")


def _kernel_row(text: str) -> tuple[float, float]:
    """(FLOPs, seconds) of the forward's attention kernel."""
    rows = shardc.cost(shardc.plan(shardc.parse(text))).forward.rows
    (row,) = [r for r in rows if r.flops and r.text.startswith("attention")]
    return row.flops, row.compute_s


def test_an_attention_kernel_line_runs_that_kernel_at_its_measured_rate() -> None:
    spec = shardc.parse(_with(ATTENTION, "attention_kernel flash2"))
    assert spec.attention_kernel == "flash2" and shardc.parse(str(spec)) == spec
    flops, best = _kernel_row(ATTENTION)
    same, flash2 = _kernel_row(_with(ATTENTION, "attention_kernel flash2"))
    # 4096 keys a call: FlashAttention-3's causal forward 579 TFLOP/s (its paper), FlashAttention-2's 314.06
    # (PyTorch's SDPA flash backend, causal, as cudnn-frontend's benchmark measured it)
    assert same == flops and best == pytest.approx(flops / 579e12) and flash2 == pytest.approx(flops / 314.06e12)
    assert _kernel_row(_with(ATTENTION, "attention_kernel flash3"))[1] == pytest.approx(best)
    with pytest.raises(ShardcError, match="unknown attention_kernel"):
        shardc.parse(_with(ATTENTION, "attention_kernel triton"))


def test_an_attention_kernel_on_a_spec_without_the_fused_call_says_it_changes_nothing() -> None:
    # a held-out run (GPT-NeoX-20B writes its scores out, as its Megatron kernels do) given --attention-kernel flash2
    # was told "fused attention at the rates measured of it", and its step did not move
    unfused = ("mesh X=8\ndims B=8, S=1024, T=1024, N=16, H=128\nhardware h100\nattention_kernel flash2\n"
               "Sc[B_X, N, S, T] = Q[B_X, S, N, H] · K[B_X, T, N, H]\n"
               "Pr[B_X, N, S, T] = softmax(causal(Sc[B_X, N, S, T], S, T) over T)\n"
               "C[B_X, S, N, H] = Pr[B_X, N, S, T] · V[B_X, T, N, H]\n")
    notes = shardc.cost(shardc.plan(shardc.parse(unfused))).notes
    assert any(n.startswith("attention_kernel flash2: changes nothing here") for n in notes)
    fused = shardc.cost(shardc.plan(shardc.parse(_with(ATTENTION, "attention_kernel flash2")))).notes
    assert any(n.startswith("attention_kernel flash2: fused attention at the rates") for n in fused)


def test_a_kernel_without_measured_rates_on_the_chip_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ShardcError, match="no measured rates of attention kernel 'flash3' on a100") as err:
        shardc.plan(shardc.parse(_with(ATTENTION, "attention_kernel flash3")), hardware="a100")
    assert err.value.span is not None and err.value.span.line == 2  # the spec's line (a flag chose the chip)
    assert get_hardware("a100").with_attention("flash2") == get_hardware("a100").configured(attention_kernel="flash2")
    chip = tmp_path / "chip.toml"
    chip.write_text('flops = 1e15\nici_bandwidth = 1e11\nhbm_bytes = 8e10\ndcn_bandwidth = 1e10\n'
                    'attention_kernel = "flash2"\n', encoding="utf-8")
    with pytest.raises(ShardcError, match="rates, not its name"):
        load_hardware_file(str(chip))


def test_the_attention_kernel_flag_beats_the_line(tmp_path: Path) -> None:
    path = tmp_path / "attention.shard"
    path.write_text(_with(ATTENTION, "attention_kernel flash2"), encoding="utf-8")
    flag = run("cost", str(path), "--json", "--attention-kernel", "flash3")
    line = run("cost", str(path), "--json")
    assert flag.returncode == 0, flag.stderr
    fast, slow = (json.loads(out.stdout) for out in (flag, line))
    assert (fast["hardware"]["attention_kernel"], slow["hardware"]["attention_kernel"]) == ("flash3", "flash2")
    assert fast["step"]["step_s"] < slow["step"]["step_s"]


def test_without_fusion_a_norm_is_pytorchs_one_kernel_each_way() -> None:
    """PyTorch eager runs a layer norm as one ATen kernel (``native_layer_norm``), an RMSNorm as one
    (``_fused_rms_norm``): it reads X once and writes Y and its row statistics (float32: a layer norm's mean
    and rstd, an RMSNorm's rstd); its backward kernel reads dY, X and the saved statistics and writes dX,
    making neither the statistics nor Y again.  The old pricing ran each of its steps as a kernel: a
    layernorm's 4 pieces forward and 10 back, an rmsnorm's 3 and 7."""
    piece = 8192 // 8 * 512 * 2  # H, Y, dY or dH on a device, bf16
    norm = ("row_mean", "row_meandev", "layernorm_apply", "row_meansq", "rmsnorm_apply", "row_meandot", "layernorm_vjp",
            "rmsnorm_vjp")
    for func, steps, stats in (("layernorm", (3, 6), 2), ("rmsnorm", (2, 4), 1)):
        text = ("mesh X=8\ndims B=8192, D=512, E=256, F=256\nhardware h100\nfusion none\nparam W_in, W_out\n"
                f"H[B_X, D] = In[B_X, E] · W_in[E, D]\nY[B_X, D] = {func}(H[B_X, D] over D)\n"
                "Out[B_X, F] = Y[B_X, D] · W_out[D, F]\n")
        report = shardc.cost(shardc.plan(shardc.parse(text)))
        forward, backward = ([r.memory_bytes for r in rows if r.text.startswith(norm)]
                             for rows in (report.forward.rows, report.backward.rows))
        assert (len(forward), len(backward)) == steps
        saved = stats * 8192 // 8 * 4  # a float32 a row each, written forward, read back
        assert (sum(forward), sum(backward)) == (2 * piece + saved, 3 * piece + saved)
