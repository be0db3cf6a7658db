"""A pipeline's weight-gradient (W) work is found by the gradient names the plan carries.

The book's ``dW_in`` names the gradient of ``W_in`` only when no tensor of the spec is
called ``dW_in`` (:mod:`shardc.names`); a zero-bubble schedule's B/W split must not
depend on what the activations are called.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import shardc
from tests.test_cli import shardc_cli

HEAD = "mesh P=4 pipeline, X=8, Y=4\nlayers 8\nmicrobatches 8\nschedule {schedule}\n"
BLOCK = """dims B=4096, D=256, F=1024
param W_in, W_out
{t}[B_X, F_Y] = In[B_X, D_Y] · W_in[D_X, F_Y]
Out[B_X, D_Y] = {t}[B_X, F_Y] · W_out[F_Y, D_X]
"""


def _text(activation: str, schedule: str = "zb-h1") -> str:
    return HEAD.format(schedule=schedule) + BLOCK.format(t=activation)


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_an_activation_named_like_a_gradient_leaves_the_split_alone(schedule: str) -> None:
    plain = shardc.cost(shardc.plan(shardc.parse(_text("Tmp", schedule)))).pipeline
    named = shardc.cost(shardc.plan(shardc.parse(_text("dW_in", schedule)))).pipeline
    assert plain is not None and named is not None
    assert named.timing == plain.timing
    assert named.timing.weight > 0  # both weight gradients are W work, not B work
    assert named.step_s == plain.step_s


def test_the_cli_reports_the_same_pipeline_for_either_name(tmp_path: Path) -> None:
    reports = []
    for activation in ("Tmp", "dW_in"):
        path = tmp_path / f"{activation}.shard"
        path.write_text(_text(activation), encoding="utf-8")
        done = shardc_cli("cost", "--json", str(path))
        done.check_returncode()
        out = done.stdout
        reports.append(json.loads(out)["pipeline"])
    plain, named = reports
    assert named["stages"] == plain["stages"]
    assert {k: v for k, v in named.items() if k != "boundary"} == {k: v for k, v in plain.items() if k != "boundary"}
