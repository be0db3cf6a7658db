"""Computation beside a collective on a GPU (shardc/overlap.py): one rule, the cores the collective holds
(Hardware.overlap_share) taken from the computation while it runs, wherever the cost overlaps the two."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import shardc
from shardc.hardware import get_hardware
from shardc.overlap import beside, beside_seconds
from shardc.timing import plan_time

EXAMPLE = Path(__file__).parents[1] / "examples" / "pipeline_llama.shard"


@pytest.mark.parametrize(("work", "comm", "share"), [(2.0, 0.5, 0.25), (0.3, 0.6, 0.25), (1.0, 1.0, 0.0),
                                                     (0.9, 1.2, 0.2), (1.0, 0.5, 1.0)])
def test_the_event_form_and_the_closed_form_agree(work: float, comm: float, share: float) -> None:
    """beside (until the first ends, and the work left) then the work left at the whole rate is
    beside_seconds: 2.0 of work beside 0.5 of collective holding a quarter of the cores takes 2.125."""
    first, left = beside(work, comm, share)
    assert max(first + left, comm) == pytest.approx(beside_seconds(work, comm, share))
    assert beside_seconds(2.0, 0.5, 0.25) == pytest.approx(2.125)
    assert beside_seconds(0.3, 0.6, 0.25) == pytest.approx(0.6)  # done on the cores left before the collective


def test_a_pipelines_gradient_reductions_slow_the_backward_they_hide_under() -> None:
    """The reductions run once a step under the last microbatch's backward, which runs beside them on the
    cores they leave: on H100 (NCCL's 24 channels of 132 SMs) the exposed part is that share of them where
    the backward outlasts them; a chip whose collectives hold no cores hides them whole."""
    text = EXAMPLE.read_text().replace("hardware tpu-v5p", "hardware h100")
    h100 = get_hardware("h100")
    got = []
    for hw in (h100, dataclasses.replace(h100, collective_sms=None)):
        report = json.loads(shardc.cost(shardc.plan(shardc.parse(text, str(EXAMPLE)), hardware=hw)).json_text())
        got.append((report["pipeline"]["grad_reduce_s"], report["pipeline"]["grad_reduce_exposed_s"]))
    (reduce_s, exposed_s), (free_reduce_s, free_exposed_s) = got
    assert reduce_s == pytest.approx(free_reduce_s) and reduce_s > 0 and free_exposed_s == 0
    assert exposed_s == pytest.approx(h100.overlap_share * reduce_s)


@pytest.mark.parametrize(("chip", "line"), [("tpu-v5p", ""), ("h100", ""), ("h100", "grad_reduce after-backward")])
def test_the_planner_weighs_a_pipelines_reductions_as_the_cost_hides_them(chip: str, line: str) -> None:
    """plan_time (the planner's objective) and the pipeline's cost time the once-a-step gradient reductions
    by one rule (overlap.reduced_after), where plan_time once added them whole: on TPU v5p (its collectives
    hold no cores) the last microbatch's backward hides them whole, on H100 all but NCCL's share of them;
    issued after the backward, they show whole.  (On H100 the reductions' own time differs by bucket
    latencies: the cost buckets a stage's reductions layer by layer, plan_time across its layers.)"""
    text = EXAMPLE.read_text().replace("hardware tpu-v5p", f"hardware {chip}\n{line}")
    planned = shardc.plan(shardc.parse(text, str(EXAMPLE)))
    took, pipe = plan_time(planned), shardc.cost(planned).pipeline
    assert pipe is not None and pipe.grad_reduce_s > 0
    rel = 1e-9 if chip == "tpu-v5p" else 1e-2
    assert took.reduce.seconds == pytest.approx(pipe.grad_reduce_s, rel=rel)
    assert took.reduce_exposed_s == pytest.approx(pipe.grad_reduce_exposed_s, rel=rel, abs=1e-15)
    share = 1.0 if line else get_hardware(chip).overlap_share
    assert took.reduce_exposed_s == pytest.approx(share * took.reduce.seconds, abs=1e-15)
    assert took.step_s == pytest.approx(took.forward_s + took.backward_s + took.reduce_exposed_s + took.optimizer_s
                                        + took.update_s)
