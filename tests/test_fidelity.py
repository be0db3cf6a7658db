"""The published training runs of ``benchmarks/runs/``: each spec is the paper's model, and costs."""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

import shardc
from shardc.ir.plan import Plan
from shardc.ir.spec import Spec
from shardc.spec.walk import leaves

ROOT = Path(__file__).resolve().parent.parent
RUNS = (ROOT / "benchmarks" / "runs", ROOT / "examples")  # the runs small enough to verify are examples

# parameter counts the papers give: Touvron et al. 2023 (LLaMA-2 70B: 68.98e9 as counted by its
# released weights' shapes), Chowdhery et al. 2022 Table 1 (540.35e9), Dubey et al. 2024 (405e9),
# Brown et al. 2020 Table 2.1 (175.0e9), DeepSeek-AI 2024 (arXiv 2412.19437) section 4.2 (671e9) and its
# released checkpoint's 685e9 with the multi-token-prediction module, less that module's copies of the
# embedding and the output head (V x D each), which training shares with the main model (section 3.2.3)
PARAMS = {"llama2_70b_maxtext": 68.98e9, "palm_540b": 540.35e9, "llama3_405b": 405e9, "gpt3_175b_megatron": 175.0e9,
          "deepseek_v3": 685e9 - 2 * 129280 * 7168,
          # MosaicML's MPT benchmark table (llm-foundry, scripts/train/benchmarking/README.md), its NumParams column:
          # the learned positional embedding grows with the sequence length (the 64K row's)
          "mpt_7b_h100": 6658859008, "mpt_13b_h100": 12853954560, "mpt_30b_h100": 29975214080,
          "mpt_70b_h100": 64862437376, "mpt_7b_64k_h100": 6918905856, "mpt_7b_a100": 6658859008,
          "mpt_30b_a100": 29975214080, "mpt_70b_a100": 64862437376, "mpt_1b_h100": 1315950592,
          "mpt_13b_32k_a100": 13011240960,
          # Narayanan et al. 2021, equation 2 (Table 1 rounds it): 12 l h^2 (1 + 13/12h + (V + s)/12lh)
          "megatron_1_7b": 1.65223e9, "megatron_7_5b": 7.46778e9, "megatron_18_4b": 18.4497e9,
          # Smith et al. 2022 (MT-NLG, 530e9), Le Scao et al. 2022 (BLOOM, 176,247M), Zhang et al. 2022 Table 1 (OPT,
          # 175e9), Touvron et al. 2023 Table 2 (LLaMA 65.2e9)
          "mtnlg_530b": 530e9, "bloom_176b": 176.247e9, "opt_175b": 175e9, "llama_65b": 65.2e9,
          # NVIDIA 2024, Table 1 (9.4e9 embedding + 331.6e9 others); Mixtral's released config.json, 46,702,792,704
          "nemotron4_340b": 9.4e9 + 331.6e9, "mixtral_8x7b_h100": 46702792704,
          # Narayanan et al. 2021, equation 2, the pipelined rows of Table 1; Falcon-180B's released checkpoint as the
          # Hugging Face hub counts it (179.523e9, its layernorms' 4.8e6 among them)
          "megatron_145_6b": 145.622e9, "megatron_310_1b": 310.131e9, "megatron_1t": 1008.04e9,
          "falcon_180b": 179.523e9,
          # MegaScale's 175B, GPT-3's shape (Brown et al. 2020, Table 2.1)
          "megascale_175b": 175.0e9,
          # Rae et al. 2021, Table 1 (280B): 80 layers of D=16384, Transformer-XL's W_r among them
          "gopher_280b": 280e9,
          # Llama 3.1 8B's, 70B's and 405B's released config.json (8,030,261,248, 70,553,706,496, 405,853,388,800) less
          # their RMSNorm scales
          "torchtitan_llama3_8b": 8030261248 - 65 * 4096,
          "torchtitan_llama3_8b_cp": 8030261248 - 65 * 4096, "torchtitan_llama3_70b": 70553706496 - 161 * 8192,
          "torchtitan_llama3_405b": 405853388800 - 253 * 16384,
          # MaxText's base.yml decoder at global_parameter_scale=32 (MaxText/configs/v5e/32b.sh): 2VD + L(4D^2 + 3DF)
          "maxtext_32b_v5e": 2 * 32000 * 8192 + 32 * (4 * 8192**2 + 3 * 8192 * 28672),
          # GPT-NeoX-20B's released checkpoint (20,554,567,680), less its biases and layernorms (3,526,656);
          # StarCoderBase counted from its released config.json's shapes (GPTBigCode: 15,517,456,384) less the same
          "gpt_neox_20b": 20554567680 - 44 * (4 * 6144 + 24576 + 6144) - 44 * 4 * 6144 - 2 * 6144,
          "starcoder_15b": 15517456384 - 40 * (48 * 128 + 2 * 128 + 2 * 6144 + 24576) - 40 * 4 * 6144 - 2 * 6144,
          # DeepSeek LLM 67B counted from its released config.json's shapes (67,425,001,472) less its RMSNorm scales
          "deepseek_llm_67b": 67425001472 - 95 * 2 * 8192 - 8192}


def _spec(name: str) -> Spec:
    path = next(folder / f"{name}.shard" for folder in RUNS if (folder / f"{name}.shard").exists())
    return shardc.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _params(spec: Spec) -> float:
    """Every param's elements, a `layers` block's once a layer of its block (each param counted once)."""
    sizes = dict(spec.dims)
    counts = [n if isinstance(n, int) else sizes.get(n, 1) for n in spec.layer_counts()]  # each block's
    seen: dict[str, float] = {}
    for k, statement in enumerate(spec.statements):
        block = spec.block_of(k)
        for ref in leaves(statement.expr):
            if spec.params is not None and ref.name in spec.params and ref.name not in seen:
                count = math.prod(sizes[d.name] for d in ref.dims)
                seen[ref.name] = count * (counts[block] if spec.block is not None and block is not None else 1)
    return math.fsum(seen.values())


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_each_run_is_its_papers_model(name: str) -> None:
    assert _params(_spec(name)) == pytest.approx(PARAMS[name], rel=0.005)


def _benchmark() -> ModuleType:
    path = ROOT / "benchmarks" / "fidelity.py"
    found = importlib.util.spec_from_file_location("fidelity_benchmark", path)
    assert found is not None and found.loader is not None
    module = importlib.util.module_from_spec(found)
    sys.modules[found.name] = module  # its dataclasses look their module up there
    found.loader.exec_module(module)
    return module


@pytest.mark.slow  # every run planned and costed, at the recompute policy it ran with
def test_the_fidelity_benchmark_costs_and_prints_every_run(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str],
                                                           shared_plan: Callable[..., Plan]) -> None:
    fidelity = _benchmark()
    # each run's plan the process's shared one (conftest): the same spec file planned the same way, which other
    # files' tests of DeepSeek-V3 and LLaMA 3 405B 128K plan too
    monkeypatch.setattr(shardc, "plan", lambda spec, recompute: shared_plan(spec.filename, recompute))
    table = fidelity.rows()
    assert {r["run"] for r in table} == {run.name for run in fidelity.PUBLISHED}
    assert all(r["predicted_step_s"] > 0 and 0 < r["predicted_mfu"] <= 1 and r["measured_step_s"] > 0 for r in table)
    monkeypatch.setattr(fidelity, "rows", lambda: table)  # printed as `python benchmarks/fidelity.py` prints it
    monkeypatch.setattr(sys, "argv", ["fidelity.py"])
    assert fidelity.main() == 0
    out = capsys.readouterr().out
    assert all(run in out for run in ("LLaMA-2 70B", "PaLM 540B", "LLaMA 3 405B", "GPT-3 175B",
                                      "DeepSeek-V3 671B", "MPT-7B 2K", "MPT-70B 2K, 64 A100", "GPT 18.4B",
                                      "MT-NLG 530B", "BLOOM 176B", "Llama 3.1 70B, torchtitan",
                                      "Llama 3.1 8B, torchtitan"))


def test_deepseek_v3_plans_and_costs_with_its_routing_held_as_indices(deepseek_v3_plan: Plan) -> None:
    """DeepSeek-V3's 256 experts, top-8: the dispatch moves tokens by index (no [B, S, E, C] mask kept)
    and its FLOPs are the experts' matmuls (`benchmarks/plan_speed.py` times its plan and cost)."""
    plan = deepseek_v3_plan  # planned at recompute="selective" (conftest)
    report = shardc.cost(plan)
    assert not any({"S", "E", "C"} <= set(r.indices) for r in plan.residuals)
    assert report.pipeline is not None and report.pipeline.step_s > 0
