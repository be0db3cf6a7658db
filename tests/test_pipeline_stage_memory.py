"""A pipelined stage's memory: the activations in flight, a tick's working set, the gradient sums."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import shardc
from shardc.costmodel.phase_memory import phase_memory
from shardc.ir.plan import Plan
from shardc.ir.spec import Schedule

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _plan(name: str, schedule: str | None = None) -> Plan:
    plan = shardc.plan(shardc.parse((EXAMPLES / f"{name}.shard").read_text()))
    if schedule is None:
        return plan
    return replace(plan, spec=replace(plan.spec, schedule=Schedule(schedule)))


def test_a_stage_counts_its_working_set_and_gradient_sums() -> None:
    report = shardc.cost(_plan("llama3_405b"))
    assert report.pipeline is not None
    first = report.pipeline.stages[0]
    assert first.working_bytes > 0
    assert first.memory_bytes == (first.state_bytes + first.activation_bytes + first.gathered_bytes
                                  + first.working_bytes + first.accumulator_bytes)
    # zero 2 over X: each block gradient is reduce-scattered once a step from the unsharded sums, twice
    # the shard the stage keeps (X = 64 holds 1/64 of each)
    assert first.accumulator_bytes > first.working_bytes
    assert report.pipeline.to_json()["per_stage"][0]["working_bytes"] == first.working_bytes


def test_the_working_set_is_a_microbatch_through_the_sections_a_stage_runs() -> None:
    plan = _plan("pipeline_llama2_13b")
    report = shardc.cost(plan)
    assert report.pipeline is not None
    pipe = report.pipeline
    sizes = dict(report.sizes) | {pipe.dim: pipe.microbatch_size}
    middle, last = pipe.stages[1], pipe.stages[-1]
    block = max(p.temporaries for p in phase_memory(plan, sizes, section="block"))
    after = max(p.temporaries for p in phase_memory(plan, sizes, section="after"))
    assert middle.sections == ("block",) and middle.working_bytes == block
    assert "after" in last.sections and last.working_bytes == max(block, after)
    assert pipe.stages[0].sections == ("block", "before")  # the embedding runs on the first stage


def test_an_all_reduce_sums_in_place_and_gpipe_holds_every_microbatch() -> None:
    report = shardc.cost(_plan("yi_34b"))
    assert report.pipeline is not None
    assert all(s.accumulator_bytes == 0 for s in report.pipeline.stages)  # zero 1: no ReduceScatter
    gpipe = shardc.cost(_plan("yi_34b", "gpipe"))
    assert gpipe.pipeline is not None
    assert gpipe.pipeline.stages[0].held == gpipe.pipeline.pipeline.microbatches
