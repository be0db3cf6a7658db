"""DualPipe lowered as itself: two whole stages a device (s and P-1-s), microbatches fed from both ends in
its tick table's order, the two copies of each stage summing their gradients once a step; verified
against the unsharded reference, and its mutants fail."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

import shardc
from shardc.lowering import pipeline_lowering, pipeline_routes
from shardc.lowering.pipeline_lowering import lower_pipeline, tick_tables
from shardc.pipeline.dualpipe import device_layers
from shardc.pipeline.ticks import TickTable
from shardc.spec.stages import pipeline_of
from shardc.verification.pipeline_verify import verify_pipeline
from tests.test_pipeline_split import V_SPEC
from tests.test_plan_sections import MODEL

BLOCK = V_SPEC.replace("schedule 1f1b", "schedule dualpipe")
WHOLE = MODEL.replace("microbatches 2", "microbatches 4\nschedule dualpipe")


@pytest.mark.parametrize("split", ["", "\nstage_layers 3, 2, 2, 1"])
def test_each_device_holds_its_two_stages_layers_as_the_cost_counts_them(split: str) -> None:
    """Device d's slots hold the layers of stage d (chunk 0) and of stage P-1-d (chunk 1), each layer on
    two devices: the layers the cost's memory counts a device (``device_layers``: twice the params)."""
    plan = shardc.plan(shardc.parse(BLOCK.replace("layers 32", "layers 8") + split))
    pipe = pipeline_of(plan.spec)
    assert pipe is not None
    program = lower_pipeline(plan, sizes={"X": 1, "Y": 1}, microbatches=8).namespace.PIPELINE
    slots, held = program.slot_layers(), program.chunks * program.slots
    per_device = [[layer for layer in slots[d * held:(d + 1) * held] if layer < 8] for d in range(4)]
    assert [len(layers) for layers in per_device] == list(device_layers(pipe))
    firsts = [sum(pipe.stage_layers[:s]) for s in range(4)]
    for d, layers in enumerate(per_device):
        mine = [range(firsts[s], firsts[s] + pipe.stage_layers[s]) for s in (d, 3 - d)]
        assert layers == [layer for run in mine for layer in run]
    assert sorted(layer for layers in per_device for layer in layers) == sorted(2 * list(range(8)))


@pytest.mark.slow
def test_dualpipe_verifies_as_itself() -> None:
    """A block alone over 4 stages (8 devices: P=4, X=2), two layers a stage: DualPipe's tick table, both
    directions' activations and cotangents each way (4 permutes a tick), and after the loop each param's
    two copies' sums swapped between stages s and P-1-s."""
    report = verify_pipeline(shardc.plan(shardc.parse(BLOCK, "dualpipe")), devices=8)
    assert report.ok, [r for r in report.values + report.collectives if not r.ok]
    assert report.mesh == {"P": 4, "X": 2, "Y": 1} and report.sizes["layers"] == 8
    copies = [r for r in report.collectives if "two copies' sums swapped" in r.step]
    assert sorted(r.step.split()[4] for r in copies) == sorted(f"dW_{n}" for n in ("q", "k", "v", "o", "gate",
                                                                                    "up", "down"))
    assert all(r.ok and r.hlo_op == "collective-permute x 1" for r in copies)
    loop = next(r for r in report.collectives if r.kind == "Loop")
    ticks = len(tick_tables("dualpipe", 4, 8)[0])
    assert loop.ok and loop.hlo_op == f"while x [{ticks}]" and ticks != len(tick_tables("dualpipev", 4, 8)[0])
    assert ticks == 16  # an F&B pair a tick: the compiled loop's trip count (its ops one a tick took 26)
    sends = [r for r in report.collectives if "a tick:" in r.step]
    assert len(sends) == 4 and all(r.ok and r.hlo_op == "collective-permute x 1" for r in sends)


def _one_way(*args: Any) -> TickTable:
    """DualPipe's tick table with the second direction's microbatches (chunks P and up) left out."""
    ticks = _RUN_TICKS(*args)
    return replace(ticks, rows=tuple(tuple(tuple(op for op in group if op[2] < ticks.stages) for group in row)
                                     for row in ticks.rows))


_RUN_TICKS = pipeline_lowering.run_ticks


@pytest.mark.slow
def test_a_whole_model_verifies_and_its_mutants_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Embedding, block and loss under DualPipe over P=2: both end devices run the embedding and the loss
    (one direction each) and swap their sums of the ends' gradients.  Fed one way only, placed as a V
    (the way down turning into the way back), or with the two copies' gradients not summed, verify fails."""
    plan = shardc.plan(shardc.parse(WHOLE))
    report = verify_pipeline(plan)
    assert report.ok, [r for r in report.values + report.collectives if not r.ok]
    copies = {r.step.split()[4] for r in report.collectives if "two copies' sums swapped" in r.step and r.ok}
    assert copies == {"dW1", "dW2", "dW_emb", "dW_out"}
    mutants = (("run_ticks", _one_way, {"Loss", "dW1", "dW2", "dW_emb", "dW_out"}),
               ("TWO_WAY_LOWERED", (), None),
               ("sum_copies", lambda self, axis, grads, slots: grads, {"dW1", "dW2"}))
    for name, mutant, wrong in mutants:
        with monkeypatch.context() as patch:
            patch.setattr(pipeline_routes.Placement if name == "sum_copies" else pipeline_lowering, name, mutant)
            bad = verify_pipeline(plan)
        failed = {r.tensor for r in bad.values if not r.ok}
        assert not bad.ok and failed and (wrong is None or failed == wrong), (name, failed)
