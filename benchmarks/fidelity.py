"""Published training runs against shardc's cost model: step time and MFU, measured vs predicted.

Each run is a whole-model spec in ``benchmarks/runs/`` (or ``examples/``, where it is small enough
to verify in the tests) written from its paper (embedding, every
layer, loss) at the published layout, batch and recompute policy, on the published chip.  A run
published as a step time is compared on it; one published as FLOP/s a chip (or MFU alone) is
compared on the step time those imply for the model's FLOPs as shardc counts them (6 x params x
tokens for the matmuls, plus attention's, without recomputation), so the step ratio there is the
MFU ratio.

    python benchmarks/fidelity.py [--json]

Targets: each step time within 15% of the measured one, MFU within 5 points.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import shardc  # noqa: E402


@dataclass(frozen=True)
class Run:
    """A published run: its spec, the recompute policy it used, and what its paper measured."""

    name: str
    spec: str  # its path from the repository's root
    recompute: str
    source: str
    step_s: float | None = None  # seconds a step, where published
    flops_per_chip: float | None = None  # model FLOP/s a chip, where published
    mfu: float | None = None
    # microbatches a step accumulates where the spec is one of them (FSDP's gathers and reductions run each one):
    # the step runs the optimizer's update once, so a microbatch's share of it is 1 / accumulated
    accumulated: int = 1
    # the training-state accounting (shardc/accountings.py) the run's framework keeps, where the spec's `optimizer`
    # line does not say it (None: the spec's, else adam10)
    optimizer: str | None = None


PUBLISHED = (
    # MaxText's save_dot_except_mlpwi keeps every projection's output but the MLP's input matmuls', which
    # the backward reruns (with the norms, activations and attention between)
    Run("LLaMA-2 70B, MaxText, 256 v5p", "benchmarks/runs/llama2_70b_maxtext.shard", "dots-except:W_gate,W_up",
        "MaxText docs/tiering.md, benchmarks/maxtext_v5p_model_configs.py", mfu=0.654),
    Run("PaLM 540B, 6144 v4", "benchmarks/runs/palm_540b.shard", "full",
        "Chowdhery et al. 2022, Table 3 and section 4", step_s=17.6, mfu=0.462),
    # the paper names no recomputation policy: dots, every matmul's output kept, is the least that fits
    Run("LLaMA 3 405B 8K, 8192 H100", "examples/llama3_405b.shard", "dots",
        "Dubey et al. 2024, Table 4", flops_per_chip=430e12, mfu=0.43),
    # its 128K stage: context parallel 16 (K and V gathered, queries in zig-zag chunks held across stages), interleaved
    # with an assumed 4 chunks a device; the paper names no recomputation policy: dots is the least that fits
    Run("LLaMA 3 405B 128K, 16384 H100", "examples/llama3_405b_128k.shard", "dots",
        "Dubey et al. 2024, Table 4", flops_per_chip=380e12, mfu=0.38),
    # its 153 TFLOP/s a GPU are equation 3's FLOPs, which count the recomputed forward (as the rows below)
    Run("GPT-3 175B, Megatron-LM, 384 A100", "benchmarks/runs/gpt3_175b_megatron.shard", "full",
        "Narayanan et al. 2021, the 384-GPU PTD-P row beside ZeRO-3, and equation 3",
        step_s=96 * 1536 * 2048 * 96 * 12288**2 * (1 + 2048 / (6 * 12288) + 51200 / (16 * 96 * 12288))
        / (384 * 153e12)),
    # 180K H800 GPU-hours per trillion tokens on 2048 GPUs, a step of 15360 x 4096 tokens: 19.9 s; the
    # report recomputes RMSNorm and MLA's up-projections (the spec's `recompute` line) and keeps no
    # attention scores (selective); DualPipe pairs each forward with another microbatch's backward
    Run("DeepSeek-V3 671B, 2048 H800", "benchmarks/runs/deepseek_v3.shard", "selective",
        "DeepSeek-AI 2024, arXiv 2412.19437, sections 1 and 3.2", step_s=180e3 * 3600 / 2048 * 15360 * 4096 / 1e12),
    # MosaicML's MPT throughput table (mosaicml/llm-foundry): PyTorch FSDP FULL_SHARD on nodes of 8 GPUs, flash
    # attention, activation checkpointing of every block or none.  Each spec is one microbatch of the step
    # (FULL_SHARD gathers and reduce-scatters each one), so its measured time is the step's,
    # GlobalBatchSize(T) / Throughput(T/s), over GradAccum, and its share of the step's one optimizer update is
    # 1 / GradAccum (`accumulated`); the MFU counts attention as MPT does (S x T unmasked), as shardc's model
    # FLOPs do
    Run("MPT-7B 2K, 8 H100", "benchmarks/runs/mpt_7b_h100.shard", "none",
        "llm-foundry scripts/train/benchmarking/README.md, H100 80GB BF16", step_s=98304 / 85144, mfu=0.4644),
    Run("MPT-13B 2K, 64 H100", "benchmarks/runs/mpt_13b_h100.shard", "none",
        "llm-foundry scripts/train/benchmarking/README.md, H100 80GB BF16", step_s=262144 / 307209, mfu=0.3986),
    Run("MPT-30B 2K, 32 H100", "benchmarks/runs/mpt_30b_h100.shard", "full",
        "llm-foundry scripts/train/benchmarking/README.md, H100 80GB BF16",
        step_s=2752512 / 73860 / 3, mfu=0.4392, accumulated=3),
    Run("MPT-70B 2K, 64 H100", "benchmarks/runs/mpt_70b_h100.shard", "full",
        "llm-foundry scripts/train/benchmarking/README.md, H100 80GB BF16",
        step_s=4194304 / 66523 / 4, mfu=0.4257, accumulated=4),
    Run("MPT-7B 64K, 8 H100", "benchmarks/runs/mpt_7b_64k_h100.shard", "full",
        "llm-foundry scripts/train/benchmarking/README.md, H100 80GB BF16",
        step_s=1048576 / 15654 / 2, mfu=0.2859, accumulated=2),
    Run("MPT-7B 2K, 8 A100", "benchmarks/runs/mpt_7b_a100.shard", "none",
        "llm-foundry scripts/train/benchmarking/README.md, A100 80GB",
        step_s=196608 / 37130 / 2, mfu=0.6423, accumulated=2),
    Run("MPT-30B 2K, 8 A100", "benchmarks/runs/mpt_30b_a100.shard", "full",
        "llm-foundry scripts/train/benchmarking/README.md, A100 80GB",
        step_s=1032192 / 7330 / 21, mfu=0.553, accumulated=21),
    Run("MPT-70B 2K, 64 A100", "benchmarks/runs/mpt_70b_a100.shard", "full",
        "llm-foundry scripts/train/benchmarking/README.md, A100 80GB",
        step_s=4194304 / 26274 / 4, mfu=0.5333, accumulated=4),
    Run("MPT-1B 2K, 64 H100", "benchmarks/runs/mpt_1b_h100.shard", "none",
        "llm-foundry scripts/train/benchmarking/README.md, H100 80GB BF16", step_s=2621440 / 2841754, mfu=0.4085),
    Run("MPT-13B 32K, 8 A100", "benchmarks/runs/mpt_13b_32k_a100.shard", "full",
        "llm-foundry scripts/train/benchmarking/README.md, A100 80GB",
        step_s=786432 / 8134 / 3, mfu=0.5169, accumulated=3),
    # Megatron-Turing NLG 530B on 280 DGX A100 nodes (TP 8 x PP 35 x DP 8, DeepSpeed's 1F1B pipeline, every layer
    # checkpointed): the paper's 60.1 s an iteration (its 126 TFLOP/s a GPU are equation 3's FLOPs, the recomputed
    # forward counted, over that time)
    Run("MT-NLG 530B, 2240 A100", "benchmarks/runs/mtnlg_530b.shard", "full",
        "Smith et al. 2022, arXiv 2201.11990, section 2.4", step_s=60.1),
    # BLOOM 176B on Jean Zay (TP 4 x PP 12 x DP 8, ZeRO-1, every layer checkpointed, Omni-Path across nodes): the
    # training log's 104.70 s an iteration at the full batch (its 149.77 TFLOP/s count the recomputed forward)
    Run("BLOOM 176B, 384 A100", "benchmarks/runs/bloom_176b.shard", "full",
        "Le Scao et al. 2022; bigscience train/tr11-176B-ml/README.md, iteration 85376", step_s=104.70),
    # Megatron-LM's weak-scaling table: its TFLOP/s a GPU are equation 3's FLOPs, 96 B s l h^2 (1 + s/6h + V/16lh),
    # which count activation recomputation's extra forward, so the step is those FLOPs over the GPUs' rate (the MFU
    # the step implies for shardc's model FLOPs)
    Run("GPT 1.7B, Megatron-LM, 32 A100", "benchmarks/runs/megatron_1_7b.shard", "full",
        "Narayanan et al. 2021, Table 1 and equation 3",
        step_s=96 * 512 * 2048 * 24 * 2304**2 * (1 + 2048 / (6 * 2304) + 51200 / (16 * 24 * 2304)) / (32 * 137e12)),
    Run("GPT 7.5B, Megatron-LM, 128 A100", "benchmarks/runs/megatron_7_5b.shard", "full",
        "Narayanan et al. 2021, Table 1 and equation 3",
        step_s=96 * 512 * 2048 * 36 * 4096**2 * (1 + 2048 / (6 * 4096) + 51200 / (16 * 36 * 4096)) / (128 * 142e12)),
    Run("GPT 18.4B, Megatron-LM, 256 A100", "benchmarks/runs/megatron_18_4b.shard", "full",
        "Narayanan et al. 2021, Table 1 and equation 3",
        step_s=96 * 1024 * 2048 * 40 * 6144**2 * (1 + 2048 / (6 * 6144) + 51200 / (16 * 40 * 6144)) / (256 * 135e12)),
    # MaxText's 32B (base.yml scaled by global_parameter_scale=32) on one v5e-256, remat full: its 132 TFLOP/s a chip
    # are MaxText's own FLOPs (maxtext_utils.calculate_tflops_training_per_device: 3 x the weights' forward matmuls,
    # 2 x tokens x each weight, plus 3 x attention's 4 x B x S^2 x heads x head dim, causality not discounted), so
    # the step is those FLOPs over that rate
    Run("MaxText 32B, 256 v5e", "benchmarks/runs/maxtext_32b_v5e.shard", "full",
        "MaxText MaxText/configs/v5e/README.md and 32b.sh", mfu=0.6686,
        step_s=3 * (32 * (2 * 4 * 2048 * 8192 * (3 * 28672 + 4 * 8192) + 4 * 4 * 2048**2 * 8192)
                    + 2 * 4 * 2048 * 8192 * 32000) / 132e12),
    # torchtitan's 2D row with async TP (collective matmul, shardc's default): FSDP 32 x TP 8, torch.compile, Float8
    # linears, full activation checkpointing; its tokens/s a GPU over the global batch of 512 x 8192 tokens is the
    # step (no FLOP count involved); the MFU column is over the f8 peak, which the page declines to define
    Run("Llama 3.1 70B, torchtitan, 256 H100", "benchmarks/runs/torchtitan_llama3_70b.shard", "full",
        "Liang et al. 2024, arXiv 2410.06511; torchtitan docs/performance.md, Table 4",
        step_s=512 * 8192 / (876 * 256)),
    # torchtitan's FSDP row on 8 H100s in eager, op-level selective checkpointing (every second matmul of a block
    # rerun, the others' and the attention kernel's output and logsumexp kept); its 5,762 tokens/s a GPU over the
    # global batch of 16 x 8192 tokens is the step; the chip is the 500 W 96 GB Grand Teton part whose peak the
    # page does not know, so its MFU column (33% to 39%) is not compared
    Run("Llama 3.1 8B, torchtitan, 8 H100", "benchmarks/runs/torchtitan_llama3_8b.shard",
        "dots-alternate+attention",
        "Liang et al. 2024, arXiv 2410.06511; torchtitan docs/performance.md, Table 1",
        step_s=16 * 8192 / (5762 * 8)),
)


def predict(run: Run) -> dict[str, Any]:
    """shardc's step time and MFU for ``run`` (the pipeline's where pipelined), and the chip's peak."""
    spec = shardc.parse((ROOT / run.spec).read_text(encoding="utf-8"), filename=run.spec)
    report = shardc.cost(shardc.plan(spec, recompute=run.recompute), optimizer=run.optimizer).to_json()
    step, pipeline = report["step"], report.get("pipeline") or {}
    if pipeline:
        return {"step_s": pipeline["step_s"], "mfu": pipeline["mfu"], "peak": float(report["hardware"]["C"])}
    # one microbatch of ``run.accumulated``: its share of the step's one update
    step_s = step["step_s"] - step["update_s"] * (1 - 1 / run.accumulated)
    return {"step_s": step_s, "mfu": step["mfu"] * step["step_s"] / step_s, "peak": float(report["hardware"]["C"])}


def measured_step(run: Run, predicted: dict[str, Any]) -> float:
    """The published step time, or the one the published FLOP/s a chip or MFU imply for the model's FLOPs
    as shardc counts them (a chip's share: shardc's MFU x its step x the peak)."""
    if run.step_s is not None:
        return run.step_s
    per_chip = predicted["mfu"] * predicted["step_s"] * predicted["peak"]
    if run.flops_per_chip is not None:
        return float(per_chip / run.flops_per_chip)
    assert run.mfu is not None
    return float(per_chip / (run.mfu * predicted["peak"]))


def rows() -> list[dict[str, Any]]:
    out = []
    for run in PUBLISHED:
        got = predict(run)
        want = measured_step(run, got)
        mfu = (run.mfu if run.mfu is not None else run.flops_per_chip / got["peak"] if run.flops_per_chip
               else got["mfu"] * got["step_s"] / want)  # a step time alone: the MFU it implies for shardc's FLOPs
        out.append({"run": run.name, "source": run.source, "measured_step_s": want, "predicted_step_s": got["step_s"],
                    "step_ratio": got["step_s"] / want, "measured_mfu": mfu,
                    "predicted_mfu": got["mfu"], "mfu_points": 100 * (got["mfu"] - mfu)})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    table = rows()
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    print(f"{'run':38} {'measured s':>11} {'predicted s':>12} {'ratio':>6} {'MFU meas.':>10} {'pred.':>6} {'pts':>6}")
    for r in table:
        print(f"{r['run']:38} {r['measured_step_s']:11.3g} {r['predicted_step_s']:12.3g} {r['step_ratio']:6.2f} "
              f"{r['measured_mfu']:10.1%} {r['predicted_mfu']:6.1%} {r['mfu_points']:+6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
