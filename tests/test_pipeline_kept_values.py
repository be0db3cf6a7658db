"""What a zero-bubble pipelined program keeps of a microbatch's forward, and how the memory check counts it:
the values W takes from B are not kept again, and every float is counted at the run's element."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import shardc
from shardc.costmodel.memory import residual_values
from shardc.device_pieces import local_elements
from shardc.lowering.pipeline_lowering import PipelineLowered, lower_pipeline
from shardc.pipeline.boundary import microbatch_dim
from shardc.verification.pipeline_memory import stage_memory_check
from shardc.verification.pipeline_verify import verify_pipeline

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pipeline_llama.shard"
# B needs the recomputed Gt (dU = dA * Gt) and W the recomputed A (dW_down reads it, A = Gt * U): B recomputes
# Gt and hands it to W; U is cached in FP8
TEXT = EXAMPLE.read_text().replace("schedule 1f1b", "schedule zb-h1\nrecompute Gt, A\ndtype f8 U")


@pytest.fixture(scope="module")
def lowered() -> PipelineLowered:
    plan = shardc.plan(shardc.parse(TEXT))
    return lower_pipeline(plan, sizes={"P": 2, "X": 2, "Y": 2, "B": 16}, layers=4, microbatches=4)


def test_w_takes_what_b_recomputes_from_b_and_the_ring_keeps_no_second_copy(lowered: PipelineLowered) -> None:
    """W reads Gt from B's hand-off; the forward's Gt is not kept for it (the ring kept both: DeepSeek-V3's
    run held its recomputed norms and SwiGLU products twice, 2 MB of its 6.7 MB of residuals)."""
    part = lowered.namespace.PIPELINE.block
    assert part.input_backward is not None and part.weight_backward is not None
    assert "Gt" in part.input_backward[2] and "Gt" in part.weight_backward[1]
    kept = part.backward_reads - set(lowered.namespace.PIPELINE.params)
    assert "Gt" not in kept and "A" not in kept
    # what shardc cost counts a layer keeps, and Kx (L1 renamed, one slot of the ring: _once) and the
    # result's cotangent name (a zero cotangent's shape)
    assert kept - {"Kx", "dOut"} == {r.name for r in residual_values(lowered.plan)}


def _check(plan: Any, lowered: PipelineLowered) -> Any:
    stats = SimpleNamespace(argument_size_in_bytes=1.0, output_size_in_bytes=1.0, temp_size_in_bytes=1.0,
                            alias_size_in_bytes=0.0)
    return stage_memory_check(plan, lowered, stats, 8)


def test_the_check_counts_an_f8_residual_at_the_runs_float(lowered: PipelineLowered) -> None:
    """The run stores every float at its element (an f8 value rounded to FP8 and back): the check counts
    the activations the stage holds at 8 bytes an element, U's too, as though no `dtype f8` line were
    written (it counted U at 1 byte scaled by 8 / 2, half what the ring holds)."""
    plan = lowered.plan
    check = dict(_check(plan, lowered).shardc_parts)
    plain = replace(plan, element_bytes=(), dtypes=())
    assert dict(_check(plain, lowered).shardc_parts)["activations"] == check["activations"]
    # hand-summed: the microbatches held times the layers a stage runs times a layer's kept elements
    micro = {**lowered.sizes, microbatch_dim(plan): lowered.batch // lowered.pipeline.microbatches}
    layer = sum(float(local_elements(r, micro)) for r in residual_values(plan))
    held = _check(plan, lowered).held
    assert check["activations"] == held * 2 * layer * 8


@pytest.mark.slow
def test_b_and_w_verify_with_the_recomputed_value_handed_on() -> None:
    """The spec under ZB-H1 run and checked against the reference: W's dW_down from B's Gt is right."""
    report = verify_pipeline(shardc.plan(shardc.parse(TEXT)), devices=8)
    assert report.ok, [r for r in report.values + report.collectives if not r.ok]
