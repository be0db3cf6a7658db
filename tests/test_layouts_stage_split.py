"""`shardc layouts` on a spec whose `stage_layers` splits its own pipeline (BLOOM's 5, 6 x 10, 5 on 12
stages): another pipeline depth splits the layers evenly, rather than being refused or crashing."""

from __future__ import annotations

import shardc
from shardc.hardware import get_hardware
from shardc.ir.spec import Spec
from shardc.layouts import Options
from shardc.layouts.rank import pairs, prepare
from shardc.layouts.templates import Candidate, recost

SPEC = """mesh P=2 pipeline, X=2
dims B=8, S=16, D=32, F=64
microbatches 4
stage_layers 1, 3
hardware a100
layers 4

H[B_X, S, F] = gelu(In[B_X, S, D] · W_in[D, F])
Out[B_X, S, D] = H[B_X, S, F] · W_out[F, D]
"""


def test_another_pipeline_depth_drops_the_specs_own_split() -> None:
    spec = shardc.parse(SPEC, "split.shard")
    own, other = prepare(spec, {"P": 2, "X": 2}), prepare(spec, {"P": 4, "X": 1})
    assert isinstance(own, Spec) and own.stage_layers == (1, 3)
    assert isinstance(other, Spec) and other.stage_layers is None  # was: skipped, 4 stages and 2 counts


def test_a_template_planned_with_the_split_is_recosted_at_another_depth_without_it() -> None:
    """The template search re-costs one plan at each candidate's sizes: the plan's split of 2 stages at 4
    stages ran past its counts (IndexError in block_split)."""
    spec = shardc.parse(SPEC, "split.shard")
    template = shardc.plan(spec)
    other = prepare(spec, {"P": 4, "X": 1})
    assert isinstance(other, Spec)
    row = recost(template, Candidate(other, pairs(other)), Options(get_hardware("a100")))
    assert not isinstance(row, str) and row.step_s > 0
