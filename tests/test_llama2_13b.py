"""examples/llama2_13b.shard, the whole model, against the book's exercise (ch. 5): 13.0e9 params,
and on 4096 TPU v5p chips with 3M tokens: pure data parallelism does not fit, pure FSDP is
communication-bound (732 tokens a chip < 850), FSDP over X=1024 with tensor parallelism over Y=4 is
compute-bound at about 0.3 s a step at 40% MFU."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

import shardc
from shardc.costmodel.cost_report import CostReport
from shardc.hardware import get_hardware
from shardc.spec.overrides import apply_overrides

TEXT = (Path(__file__).resolve().parents[1] / "examples" / "llama2_13b.shard").read_text(encoding="utf-8")


def _report(text: str, **sizes: int) -> CostReport:
    spec = shardc.parse(text)
    book = replace(get_hardware("tpu-v5p"), book=True)  # the book's assumptions: its verdicts
    return shardc.cost(shardc.plan(apply_overrides(spec, sizes) if sizes else spec, hardware=book), mfu=0.4)


def test_params_are_13e9_within_1_percent() -> None:
    report = _report(TEXT)
    assert report.memory is not None
    assert report.memory.params_total == pytest.approx(13.0e9, rel=0.01)
    assert report.memory.params_total == 3 * 40 * 5120 * 13824 + 4 * 5120 * 40 * 128 * 40 + 2 * 32000 * 5120


def test_fsdp_with_tensor_parallelism_is_compute_bound_near_0_3_s() -> None:
    step = _report(TEXT).step
    assert step.bound == "compute"
    assert step.step_at_mfu_s == pytest.approx(0.3, rel=0.1)


def test_pure_fsdp_over_4096_chips_is_communication_bound() -> None:
    step = _report(TEXT, X=4096, Y=1).step
    assert step.bound == "communication" and step.comm_s > step.compute_s


def test_pure_data_parallelism_does_not_fit() -> None:
    replicated = re.sub(r"(W_\w+\[[^\]]*\])", lambda m: m.group(1).replace("_X", ""), TEXT)
    memory = _report(replicated, X=4096, Y=1).memory
    assert memory is not None and not memory.fits
    assert memory.param_bytes + memory.optimizer_bytes == pytest.approx(130e9, rel=0.01)  # (2 + 4 + 4) bytes a param
