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
