"""The field's real models as examples: each is its paper's model at its published (or stated) layout."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

import shardc
from shardc.cli.main import main
from shardc.ir.localops import Attention
from shardc.ir.plan import Plan
from shardc.spec.stages import pipeline_of

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# (example, the parameter count its source gives, its chips, the options it is costed under):
# Gemma 2 27B: 1.18e9 embedding + 26.05e9 other parameters (Gemma Team 2024, Table 1), less the
# 0.85e6 norm scales a spec leaves out; Yi-34B: 34.389e9 in its released weights, less 0.87e6
# norm scales; LLaMA 3 405B: 405.853e9 in its released weights, less 4.1e6 norm scales.
MODELS = [("gemma2_27b", 27.2266e9, 6144, ()), ("yi_34b", 34.3880e9, 1024, ("--recompute", "full")),
          ("llama3_405b", 405.8492e9, 8192, ("--recompute", "dots"))]


def _mesh(name: str) -> dict[str, int]:
    path = EXAMPLES / f"{name}.shard"
    spec = shardc.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return {axis.name: axis.size for axis in spec.mesh.axes}


@functools.cache  # the reports are read, never changed: tests of one process share each model's costing
def _cost(name: str, *options: str) -> dict:  # type: ignore[type-arg]
    path = EXAMPLES / f"{name}.shard"
    spec = shardc.parse(path.read_text(encoding="utf-8"), filename=str(path))
    recompute = options[1] if options else "none"
    return shardc.cost(shardc.plan(spec, recompute=recompute)).to_json()


@pytest.mark.parametrize(("name", "params", "chips", "options"), MODELS, ids=[m[0] for m in MODELS])
def test_each_real_model_is_its_papers_model_and_fits(name: str, params: float, chips: int,
                                                       options: tuple[str, ...]) -> None:
    report = _cost(name, *options)
    assert report["memory"]["params_total"] == pytest.approx(params, rel=1e-4)
    assert math.prod(report["sizes"][axis] for axis in _mesh(name)) == chips
    step = report.get("pipeline") or report["step"]
    assert 0 < step["mfu"] <= 1


def test_a_pipelined_models_parameter_count_is_the_whole_models_not_one_stages() -> None:
    # the memory tables of a pipelined spec are one stage's; its parameter count is every stage's
    report = _cost("yi_34b", "--recompute", "full")
    assert report["memory"]["params_total"] > 4 * report["memory"]["params_per_device"]
    assert report["memory"]["params_total"] == pytest.approx(34.3880e9, rel=1e-4)


@pytest.mark.slow  # every layout of a real model searched
@pytest.mark.parametrize(("name", "params", "chips", "options"), MODELS, ids=[m[0] for m in MODELS])
def test_layouts_ranks_the_published_layout_in_its_top_three(name: str, params: float, chips: int,
                                                            options: tuple[str, ...],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = EXAMPLES / f"{name}.shard"
    published = _mesh(name)
    assert main(["layouts", str(path), "--chips", str(chips), "--jobs", "1", "--json", *options]) == 0
    ranked = [row["axes"] for row in json.loads(capsys.readouterr().out)["layouts"] if row["fits"]]
    assert published in ranked[:3], ranked[:3]


def test_a_pipelined_spec_fits_by_its_stages_not_by_the_whole_batch_at_once() -> None:
    """Yi-34B without recompute: a stage's layers with the whole batch at once hold 283 GB, but the 1F1B
    pipeline holds only the microbatches in flight (37 GB on the first stage): it fits, and says so."""
    report = _cost("yi_34b")
    memory = report["memory"]
    stages = report["pipeline"]["per_stage"]
    assert memory["whole_batch_fits"] is False and memory["total_bytes"] > memory["hbm_bytes"]
    assert memory["fits"] is True and max(s["memory_bytes"] for s in stages) < memory["hbm_bytes"]


@pytest.mark.parametrize("path", [EXAMPLES / "llama3_405b.shard", ROOT / "benchmarks" / "runs" / "deepseek_v3.shard"],
                         ids=lambda p: p.stem)
def test_each_pipelined_model_lowers_at_its_own_sizes(path: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """At the spec's own mesh, layers (126 and 58 split unevenly over 16 stages, as the cost splits them)
    and microbatches: the module is written (its run is verify's, at small sizes)."""
    out = tmp_path / "module.py"
    assert main(["lower", str(path), "-o", str(out)]) == 0, capsys.readouterr().err
    spec = shardc.parse(path.read_text(encoding="utf-8"), filename=str(path))
    source = out.read_text(encoding="utf-8")
    compile(source, str(out), "exec")
    pipe = pipeline_of(spec)
    assert pipe is not None  # DeepSeek-V3's 3 dense layers and 58 MoE layers, each block's own functions
    assert f"\nLAYERS = {pipe.layers} " in source and "PIPELINE = model_pipeline(globals())" in source
    assert ("\nBLOCK_LAYERS = (3, 58)" in source) == (pipe.blocks == (3, 58))


def _context_forms(text: str, path: Path,
                   planned: Plan | None = None) -> tuple[Plan, list[Attention], dict[str, float]]:
    """The plan (``--explain``'s, the same as without; ``planned`` where the file's text is planned so already),
    the attention kernels it runs and the time of each context-parallel form it weighed."""
    planned = planned or shardc.plan(shardc.parse(text, filename=str(path)), recompute="dots", explain=True)
    kernels = [s.fn for s in planned.forward if isinstance(s.fn, Attention)]
    (choice,) = [c for c in planned.choices if any("all-gather, balanced" in a.description for a in c.alternatives)]
    return planned, kernels, {a.description.split(" (")[-1].rstrip(")"): a.time or 0.0 for a in choice.alternatives}


def test_llama3_405b_128k_is_the_8k_model_with_its_context_sharded_and_fits(shared_plan: Callable[..., Plan]) -> None:
    """Its 128K stage: the same parameters, the sequence over C, and the fullest stage within 80 GB under
    `--recompute dots`, the least recomputation that fits (`selective` does not).  Of the context-parallel
    forms the planner weighs, with FlashAttention-2 (the example's kernel) the paper's is the cheapest: K and
    V gathered beside queries in zig-zag chunks held across the stages, its kernel called on the whole
    gathered sequence, where the ring's steps call it on a block's keys, at which FlashAttention-2 runs
    slower; under FlashAttention-3, whose rate falls less at shorter calls, the held zig-zag ring wins.  In
    contiguous blocks the last device runs 31/32 of its share."""
    path = EXAMPLES / "llama3_405b_128k.shard"
    text = path.read_text(encoding="utf-8")
    planned, kernels, times = _context_forms(text, path, shared_plan("examples/llama3_405b_128k.shard", "dots", True))
    long = shardc.cost(planned).to_json()
    short = _cost("llama3_405b", "--recompute", "dots")
    assert not _cost("llama3_405b_128k", "--recompute", "selective")["memory"]["fits"]
    assert long["memory"]["params_total"] == short["memory"]["params_total"]
    assert math.prod(_mesh("llama3_405b_128k").values()) == 16384
    assert long["memory"]["fits"]
    assert kernels and all(fn.ring == () and fn.zigzag and fn.held for fn in kernels)
    assert times["all-gather, balanced"] < times["ring attention, balanced"] < 0.6 * times["all-gather"]
    assert "\nattention_kernel flash2\n" in text
    _, kernels, times = _context_forms(text.replace("\nattention_kernel flash2\n", "\n"), path)
    assert kernels and all(fn.ring == ("C",) and fn.zigzag and fn.held for fn in kernels)
    assert times["ring attention, balanced"] < times["all-gather, balanced"] < 0.6 * times["all-gather"]
