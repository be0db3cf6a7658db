"""The chip's compute model: presets, matmul efficiency, fp8, memory-bound steps and fusion, overlap and
buckets, MFU against HFU, and the book's model that keeps the book's figures."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import shardc
from shardc.collectives import Op
from shardc.errors import ShardcError
from shardc.hardware import BUCKET_BYTES, PRESETS, Hardware, get_hardware
from shardc.ir.localops import Row
from shardc.timing import plan_time
from tests.test_cli import shardc_cli

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
BOOK = Path(__file__).resolve().parent / "book_model" / "figures.json"

MLP = ("mesh X=4, Y=2\ndims B=4096, D=1024, F=4096\n"
       "Tmp[B_X, F_Y] = gelu(In[B_X, D] · W_in[D, F_Y])\nOut[B_X, D] = Tmp[B_X, F_Y] · W_out[F_Y, D]\n")
MATMUL = "mesh X=8\ndims B={b}, D={d}, F={f}\nOut[B_X, F] = In[B_X, D] · W[D, F]\n"
NORM = "mesh X=8\ndims B=65536, D=4096\nY[B_X, D] = rmsnorm(X[B_X, D] over D)\n"


def run_script(path: str) -> str:
    done = subprocess.run([sys.executable, path], capture_output=True, text=True, check=True, cwd=ROOT, timeout=120)
    return done.stdout


run = shardc_cli  # each command in-process: what it prints is the point, not a fresh interpreter


# --- presets ----------------------------------------------------------------------------------------------

def test_tpu_dcn_is_the_pods_data_centre_network_a_chip() -> None:
    # Cloud TPU: v5e 6.4 Tbps a 256-chip pod, v6e 25.6 Tbps: 3.125e9 and 1.25e10 bytes/s a chip
    assert get_hardware("tpu-v5e").dcn_bandwidth == 6.4e12 / 8 / 256
    assert get_hardware("tpu-v6e").dcn_bandwidth == 25.6e12 / 8 / 256
    assert get_hardware("tpu-v5p").dcn_bandwidth == 6.25e9  # the book's


@pytest.mark.parametrize(("name", "flops", "f8", "link", "hbm", "hbm_bw", "dcn"), [
    ("a100", 3.12e14, 3.12e14, 3e11, 80e9, 2.039e12, 2.5e10),
    ("h800", 9.89e14, 1.979e15, 2e11, 80e9, 3.35e12, 5e10),
    ("b200", 2.25e15, 4.5e15, 9e11, 180e9, 7.7e12, 5e10),
    ("h100", 9.89e14, 1.979e15, 4.5e11, 80e9, 3.35e12, 5e10),
    ("tpu-v5p", 4.59e14, 4.59e14, 9e10, 96e9, 2.8e12, 6.25e9),
])
def test_new_gpus_have_their_data_sheet_figures(name: str, flops: float, f8: float, link: float, hbm: float,
                                                hbm_bw: float, dcn: float) -> None:
    hw = get_hardware(name)
    assert (hw.flops, hw.peak("f8"), hw.ici_bandwidth, hw.hbm_bytes, hw.hbm_bandwidth, hw.dcn_bandwidth) == \
        (flops, f8, link, hbm, hbm_bw, dcn)


def test_hardware_json_lists_every_field_of_every_preset() -> None:
    out = run("hardware", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert set(data) == set(PRESETS) and {"a100", "h800", "b200"} <= set(data)
    fields = {f.name for f in dataclasses.fields(Hardware)}
    for name, row in data.items():
        assert fields <= set(row), name
        assert row["dcn_bandwidth"] == PRESETS[name].dcn_bandwidth


def test_a_hardware_file_gives_its_own_matmul_curve(tmp_path: Path) -> None:
    from shardc.chip_choice import load_hardware_file

    chip = tmp_path / "chip.toml"
    base = 'flops = 1e15\nici_bandwidth = 1e11\nhbm_bytes = 8e10\ndcn_bandwidth = 5e10\nflops_f8 = 2e15\n'
    chip.write_text(base + "matmul_efficiency = [[1e9, 0.2], [1e12, 0.8]]\n", encoding="utf-8")
    hw = load_hardware_file(str(chip))
    assert hw.matmul_efficiency == ((1e9, 0.2), (1e12, 0.8)) and hw.peak("f8") == 2e15
    assert hw.efficiency(1e9) == 0.2 and hw.efficiency(1e15) == 0.8
    for bad in ("[[1e12, 0.8], [1e9, 0.2]]", "[[1e9, 1.5]]", "[1e9]", "[[1e9, -0.1]]", "3"):
        chip.write_text(base + f"matmul_efficiency = {bad}\n", encoding="utf-8")
        with pytest.raises(ShardcError, match="matmul_efficiency"):
            load_hardware_file(str(chip))


def test_scaled_keeps_every_other_field() -> None:
    hw = get_hardware("h100")
    fast = hw.scaled(bandwidth=2.0, flops=3.0)
    assert (fast.ici_bandwidth, fast.dcn_bandwidth, fast.flops, fast.flops_f8) == \
        (2 * hw.ici_bandwidth, 2 * hw.dcn_bandwidth, 3 * hw.flops, 3 * hw.flops_f8)  # type: ignore[operator]
    assert (fast.matmul_efficiency, fast.ici_domain, fast.hbm_bandwidth) == \
        (hw.matmul_efficiency, hw.ici_domain, hw.hbm_bandwidth)


# --- matmuls at the rate the chip reaches ------------------------------------------------------------------

def test_a_small_matmul_runs_at_lower_efficiency_than_a_large_one() -> None:
    hw = get_hardware("h100")
    assert hw.efficiency(2 * 256 * 512 * 256) < 0.02 < 0.75 < hw.efficiency(2 * 4096**3)
    # through the cost: the FLOPs a second of a small spec's einsum are well below a large one's
    small = shardc.cost(shardc.plan(shardc.parse(MATMUL.format(b=2048, d=256, f=256)), hardware="h100"))
    large = shardc.cost(shardc.plan(shardc.parse(MATMUL.format(b=65536, d=8192, f=8192)), hardware="h100"))
    rate = [r.compute_flops / r.compute_s for r in (small.step, large.step)]
    assert rate[0] < 0.2 * rate[1] and rate[1] < hw.flops


def test_an_a100_large_matmul_runs_at_the_mean_of_its_two_measurements() -> None:
    """ml-engineering's MAMF table (267.9 TFLOPS, the best shape of a search) and cuBLAS on 8192^3 random-normal
    inputs (257 TFLOPS, the clock lowered to hold the power limit): 84.2% of 312 TFLOPS."""
    a100 = get_hardware("a100")
    assert a100.efficiency(2 * 8192**3) == pytest.approx((267.9e12 + 257e12) / 2 / 3.12e14)
    assert a100.efficiency(1e9) == a100.efficiency(1e14)  # one class: flat at both ends


def test_the_compute_benchmark_weighs_the_curve_against_wave_quantization() -> None:
    """benchmarks/compute_fidelity.py: the curve in FLOPs predicts the held-out published matmuls better than
    the same curve with whole waves of tiles over the SMs, the shape effect a training step's thin matmuls
    would need."""
    done = run_script("benchmarks/compute_fidelity.py")
    lines = [line for line in done.splitlines() if "mean |ratio - 1|" in line]
    assert len(lines) == 2, done
    plain, waves = (float(line.split("mean |ratio - 1| ")[1].split("%")[0]) for line in lines)
    assert plain < 12 < 20 < waves


def test_the_curve_holds_its_ends_and_interpolates_in_log_flops() -> None:
    hw = get_hardware("h100")
    (x0, y0), (x1, y1) = hw.matmul_efficiency[:2]
    assert hw.efficiency(x0 / 10) == y0 and hw.efficiency(1e20) == hw.matmul_efficiency[-1][1]
    assert hw.efficiency(math.sqrt(x0 * x1)) == pytest.approx((y0 + y1) / 2)
    assert all(0 < y <= 1 for _, y in hw.matmul_efficiency)
    assert dataclasses.replace(hw, book=True).efficiency(x0) == 1.0


def test_an_fp8_spec_is_faster_than_bf16_on_h100_and_alike_on_a_tpu() -> None:
    text = MATMUL.format(b=65536, d=8192, f=8192) + "hardware {chip}\n"
    h100 = get_hardware("h100")
    # large matmuls: each dtype's curve at its last point, over its own peak
    hopper = h100.peak("f8") * h100.matmul_efficiency_f8[-1][1] / (h100.flops * h100.matmul_efficiency[-1][1])
    for chip, ratio in (("h100", hopper), ("tpu-v5p", 1.0)):
        bf16 = shardc.cost(shardc.plan(shardc.parse(text.format(chip=chip))))
        f8 = shardc.cost(shardc.plan(shardc.parse(text.format(chip=chip) + "dtype f8\n")))
        rates = [r.step.compute_flops / r.step.compute_s for r in (bf16, f8)]  # (the plans may differ a little)
        assert rates[1] == pytest.approx(ratio * rates[0], rel=0.02)
        if ratio > 1:
            assert f8.step.step_s < bf16.step.step_s
    assert 1.2 < hopper < 1.6  # fp8 kernels reach less of their doubled peak than bf16 ones of theirs


def test_hopper_fp8_matmuls_reach_deepgemms_measured_share_of_their_peak() -> None:
    """DeepGEMM's H800 table: its ten training-size rows (M=4096, and the grouped GEMMs) average 1,110
    TFLOPS, 56% of 1,979; its M=64 rows 272 TFLOPS, 14%."""
    for name in ("h100", "h200", "h800"):
        hw = get_hardware(name)
        assert hw.efficiency(1e13, "f8") == pytest.approx(11102e12 / 10 / 1.979e15)
        assert hw.efficiency(1e9, "f8") == pytest.approx(1632e12 / 6 / 1.979e15)
        assert hw.efficiency(1e13, "f8") < 0.6 < 0.8 < hw.efficiency(1e13)
        assert hw.matmul_seconds(1e13, "f8") == pytest.approx(1e13 / (1.979e15 * hw.efficiency(1e13, "f8")))
    b200 = get_hardware("b200")  # no fp8 measurement: the bf16 fractions over the fp8 peak
    assert b200.efficiency(1e13, "f8") == b200.efficiency(1e13)
    assert dataclasses.replace(get_hardware("h800"), book=True).efficiency(1e13, "f8") == 1.0


def test_a_hardware_file_gives_its_own_fp8_curve(tmp_path: Path) -> None:
    from shardc.chip_choice import load_hardware_file

    chip = tmp_path / "chip.toml"
    base = 'flops = 1e15\nici_bandwidth = 1e11\nhbm_bytes = 8e10\ndcn_bandwidth = 5e10\nflops_f8 = 2e15\n'
    chip.write_text(base + "matmul_efficiency = [[1e12, 0.8]]\nmatmul_efficiency_f8 = [[1e9, 0.1], [1e12, 0.6]]\n",
                    encoding="utf-8")
    hw = load_hardware_file(str(chip))
    assert (hw.efficiency(1e12, "f8"), hw.efficiency(1e12)) == (0.6, 0.8)
    chip.write_text(base + "matmul_efficiency_f8 = [[1e9, 1.5]]\n", encoding="utf-8")
    with pytest.raises(ShardcError, match="matmul_efficiency_f8"):
        load_hardware_file(str(chip))


# --- memory-bound steps and fusion ------------------------------------------------------------------------

def test_a_norm_costs_its_bytes_over_hbm_bandwidth() -> None:
    report = shardc.cost(shardc.plan(shardc.parse(NORM), hardware="h100"))
    hw = report.hardware
    rows = {r.text.split("(")[0]: r for r in report.forward.rows if not r.is_collective}
    piece = 65536 // 8 * 4096 * 2  # X[B_X, D] a device, bf16
    # the statistic reads X, and its row only the next step reads (fused, not written); the apply reads X
    # (not made by the step before) but not the statistic (made by it), and writes Y (the output)
    assert rows[str(Row.ROW_MEANSQ)].memory_bytes == piece
    assert rows[str(Row.RMSNORM_APPLY)].memory_bytes == piece + piece
    for r in rows.values():
        assert r.memory_s == pytest.approx(r.memory_bytes / (hw.hbm_bandwidth * hw.hbm_efficiency))
        assert r.compute_s == 0
    assert report.forward.memory_s == pytest.approx(sum(r.memory_s for r in rows.values()))
    assert report.forward.step_s >= report.forward.memory_s > 0


def test_a_map_after_a_matmul_is_fused_into_it() -> None:
    report = shardc.cost(shardc.plan(shardc.parse(MLP), hardware="h100"))
    (gelu,) = [r for r in report.forward.rows if r.text.startswith("gelu")]
    tmp = 4096 // 4 * 4096 // 2 * 2  # Tmp[B_X, F_Y] a device, bf16
    assert gelu.memory_bytes == tmp  # reads the matmul's result in its epilogue, writes Tmp (kept)


def test_the_book_model_has_no_memory_bound_time_and_matmuls_at_peak() -> None:
    report = shardc.cost(shardc.plan(shardc.parse(NORM), hardware="h100"), model="book")
    assert report.step.memory_s == 0 and report.step.update_s == 0
    mlp = shardc.cost(shardc.plan(shardc.parse(MLP), hardware="h100", model="book"))
    assert mlp.step.compute_s == pytest.approx(mlp.step.compute_flops / mlp.hardware.flops)


def test_the_update_reads_and_writes_the_training_state() -> None:
    p = shardc.plan(shardc.parse(MLP), hardware="h100")
    report = shardc.cost(p)
    params = (1024 * 4096 / 2) * 2  # W_in[D, F_Y] and W_out[F_Y, D] a device
    hw = report.hardware  # adam10, at the share of the HBM bandwidth an elementwise pass reaches
    assert report.step.update_s == pytest.approx(params * 22 / (hw.hbm_bandwidth * hw.hbm_efficiency))
    assert plan_time(p).update_s == pytest.approx(report.step.update_s)


# --- overlap as the lowered program runs ------------------------------------------------------------------

def test_a_critical_allreduce_is_exposed_and_ahead_gathers_overlap() -> None:
    spec = shardc.parse((EXAMPLES / "tp.shard").read_text(), "tp.shard")
    report = shardc.cost(shardc.plan(spec, collective_matmul=False))  # collectives whole, none run as a ring
    for phase in (report.forward, report.backward):
        assert phase.critical_s > 0
        busy = phase.compute_s + phase.memory_s
        assert phase.step_s == pytest.approx(max(busy, phase.ahead_s) + phase.critical_s)
    assert report.step.exposed_comm_s >= report.step.critical_s > 0
    book = shardc.cost(shardc.plan(spec, model="book"))
    assert book.forward.step_s == pytest.approx(max(book.forward.compute_s, book.forward.comm_s))


def test_gradient_reductions_pay_latency_once_a_bucket() -> None:
    # data parallel over many small weights: 16 reductions of 8 KB, latency-bound one by one
    text = "mesh X=64\ndims B=65536, D=64, E=64\n" + "".join(
        f"H{k + 1}[B_X, E] = H{k}[B_X, D] · W{k}[D, E]\n" if k % 2 == 0 else
        f"H{k + 1}[B_X, D] = H{k}[B_X, E] · W{k}[E, D]\n" for k in range(16))
    p = shardc.plan(shardc.parse(text), hardware="h100")
    grads = [r for r in shardc.cost(p).backward.rows if r.is_collective and r.ahead]
    assert len(grads) == 16 and all(r.latency_s > r.bandwidth_s for r in grads)
    one = shardc.cost(p)  # 25 MiB: one bucket
    each = shardc.cost(p, bucket_mb=64 * 64 * 2 / 2**20)  # a bucket a tensor
    # on a GPU a collective's latency adds to its transfer (NCCL's model): one latency for the bucket
    assert all(r.serial for r in grads)
    assert one.backward.ahead_s == pytest.approx(grads[0].latency_s + sum(r.bandwidth_s for r in grads))
    assert each.backward.ahead_s == pytest.approx(sum(r.comm_s for r in grads))
    assert one.hardware.bucket_bytes == BUCKET_BYTES == 25 * 2**20
    with pytest.raises(ShardcError, match="bucket-mb"):
        shardc.cost(p, bucket_mb=0)


# --- MFU, HFU, tokens -------------------------------------------------------------------------------------

def test_mfu_excludes_recompute_and_hfu_counts_it() -> None:
    spec = shardc.parse(MLP)
    none = shardc.cost(shardc.plan(spec, hardware="h100"), mfu=0.5)
    full = shardc.cost(shardc.plan(spec, hardware="h100", recompute="full"), mfu=0.5)
    assert full.step.model_flops == none.step.model_flops  # PaLM: recomputed FLOPs are not model FLOPs
    assert full.step.step_at_mfu_s == none.step.step_at_mfu_s
    assert full.step.hardware_flops > none.step.hardware_flops == none.step.model_flops
    assert full.step.hfu > full.step.mfu and none.step.hfu == pytest.approx(none.step.mfu)
    peak = full.step.devices * full.hardware.flops * full.step.step_s
    assert full.step.mfu == pytest.approx(full.step.model_flops / peak)


def test_cost_json_has_the_step_and_pipeline_figures() -> None:
    out = run("cost", str(EXAMPLES / "llama2_13b.shard"), "--json")
    assert out.returncode == 0, out.stderr
    step = json.loads(out.stdout)["step"]
    for key in ("step_s", "exposed_comm_s", "mfu", "hfu", "model_flops", "tokens_per_s_per_chip"):
        assert isinstance(step[key], float) and step[key] > 0, key
    assert step["tokens_per_s_per_chip"] == pytest.approx(4096 * 732 / step["step_s"] / 4096)  # B*S, 4096 chips
    out = run("cost", str(EXAMPLES / "pipeline_llama.shard"), "--json")
    data = json.loads(out.stdout)
    pipe = data["pipeline"]
    assert pipe["step_s"] > 0 and 0 < pipe["mfu"] < 1
    # the whole model's FLOPs over every chip and the simulated step: the block's layers on every stage
    flops = data["step"]["model_flops"] / pipe["layers"][0] * sum(pipe["layers"])  # no ends outside the block
    peak = data["hardware"]["C"]  # a bf16 spec
    assert pipe["mfu"] == pytest.approx(flops / (data["devices"] * pipe["stages"] * peak * pipe["step_s"]))
    text = run("cost", str(EXAMPLES / "llama2_13b.shard")).stdout
    assert "exposed communication" in text and "HFU" in text and "tokens/s a chip" in text


def test_plan_and_layouts_take_the_model_and_bucket_flags() -> None:
    path = str(EXAMPLES / "tp.shard")
    for model in ("book", "chip"):
        plan = run("plan", path, "--model", model, "--bucket-mb", "4")
        spec = shardc.parse((EXAMPLES / "tp.shard").read_text(), path)
        want = shardc.cost(shardc.plan(spec, model=model, bucket_mb=4)).step.step_s
        assert plan.returncode == 0, plan.stderr
        assert f"{want * 1e3:.3g} ms" in plan.stdout.splitlines()[1]
        layouts = run("layouts", path, "--chips", "16", "--model", model, "--json")
        assert layouts.returncode == 0, layouts.stderr
    assert run("cost", path, "--bucket-mb", "0").returncode == 2


def test_the_command_line_model_flag_is_the_python_one() -> None:
    out = run("cost", str(EXAMPLES / "fsdp_tp.shard"), "--json", "--model", "book")
    spec = shardc.parse((EXAMPLES / "fsdp_tp.shard").read_text(), str(EXAMPLES / "fsdp_tp.shard"))
    report = shardc.cost(shardc.plan(spec, model="book"))
    assert json.loads(out.stdout)["step"]["step_s"] == report.step.step_s
    assert json.loads(out.stdout)["hardware"]["model"] == "book"
    with pytest.raises(ShardcError, match="cost model"):
        shardc.cost(shardc.plan(spec), model="roofline")


# --- the book's model keeps the book's figures -------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(json.loads(BOOK.read_text())))
def test_the_book_model_reproduces_the_figures_before_the_chip_model(name: str) -> None:
    """Every example's figures as `shardc cost` gave them before the chip's rates were modelled (the book's
    model throughout), reproduced to the last digit under `model="book"`; a pipeline's step as since its
    weight gradients are reduced once a step, not once a microbatch (`pipeline_step_s`)."""
    want = json.loads(BOOK.read_text())[name]
    path = EXAMPLES / f"{name}.shard"
    report = shardc.cost(shardc.plan(shardc.parse(path.read_text(), str(path)), model="book"), mfu=0.4)
    for phase in (report.forward, report.backward, report.step):
        for key, value in want[phase.name].items():
            assert getattr(phase, key) == pytest.approx(value, rel=1e-12, abs=1e-300), (phase.name, key)
    assert [t.sentence for t in report.thresholds] == want["thresholds"]
    if "pipeline_step_s" in want:
        assert report.pipeline is not None and report.pipeline.step_s == pytest.approx(want["pipeline_step_s"])


def test_a_collective_step_kind_is_never_memory_bound() -> None:
    report = shardc.cost(shardc.plan(shardc.parse(MLP), hardware="h100"))
    for r in report.forward.rows + report.backward.rows:
        assert not (r.is_collective and r.memory_bytes)
        assert r.op is not Op.EINSUM or r.compute_s > 0 or r.memory_bytes > 0


def test_a_matmul_takes_the_larger_of_its_flops_and_its_bytes() -> None:
    """The roofline of one matmul: attention's scores (a head dim of 64 contracted, S x T written) take
    their bytes over HBM, more than their FLOPs at the matmul rate; a large square matmul its FLOPs."""
    hw = get_hardware("h100")
    scores = "mesh X=1\ndims B=8, N=16, S=4096, T=4096, H=64\nSc[B, N, S, T] = Q[B, N, S, H] · K[B, N, T, H]\n"
    report = shardc.cost(shardc.plan(shardc.parse(scores), hardware="h100"))
    (row,) = [r for r in report.forward.rows if r.op is Op.EINSUM]
    nbytes = 2 * (2 * 8 * 16 * 4096 * 64 + 8 * 16 * 4096 * 4096)  # Q, K read; Sc written; bf16
    flops = 2 * 8 * 16 * 4096 * 4096 * 64
    assert row.compute_s == pytest.approx(flops / (hw.flops * hw.efficiency(flops)))
    assert hw.matmul_hbm_efficiency is not None  # a matmul bound by its bytes moves them at its share
    assert row.compute_s + row.memory_s == pytest.approx(nbytes / (hw.hbm_bandwidth * hw.matmul_hbm_efficiency))
    assert nbytes / hw.hbm_bandwidth > row.compute_s > 0
    large = shardc.cost(shardc.plan(shardc.parse(MATMUL.format(b=65536, d=8192, f=8192)), hardware="h100"))
    assert all(r.memory_s == 0 for r in large.forward.rows if r.op is Op.EINSUM)
