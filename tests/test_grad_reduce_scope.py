"""`grad_reduce after-backward over dcn`: only the gradient reductions' DCN phase waits for the end of the
backward (PaLM's cross-pod transfer, Chowdhery et al. 2022 section 4), their ICI phase stays overlapped."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardc
from shardc.costmodel.cost_report import CostReport
from shardc.errors import ShardcError
from shardc.hardware import get_hardware
from shardc.timing import plan_time

# Data parallel over 2 pods (DCN) x 4 chips a pod (ICI): the weight's gradient is one AllReduce over P and X,
# run hierarchically: over X on ICI, then the 1/4 each chip is left with over P on DCN.
SPEC = """\
mesh P=2 over dcn, X=4
dims B=4096, D=1024, F=4096
hardware tpu-v4p
{line}
In[B_PX, D] · W[D, F] -> Out[B_PX, F]
"""
SCOPED = "grad_reduce after-backward over dcn"
PIPELINE = Path(__file__).parents[1] / "examples" / "pipeline_llama.shard"


@pytest.fixture(scope="module")
def costs() -> dict[str, CostReport]:
    """The spec's cost with no grad_reduce line, `overlapped`, and the scope."""
    lines = {"none": "", "overlapped": "grad_reduce overlapped", "scoped": SCOPED}
    return {k: shardc.cost(shardc.plan(shardc.parse(SPEC.format(line=v)))) for k, v in lines.items()}


def test_the_scope_round_trips() -> None:
    spec = shardc.parse(SPEC.format(line=SCOPED))
    assert spec.grad_reduce == "after-backward over dcn"
    assert SCOPED in str(spec).splitlines() and shardc.parse(str(spec)) == spec


@pytest.mark.parametrize("line", ["grad_reduce overlapped over dcn", "grad_reduce after-backward over X"])
def test_a_scope_other_than_after_backward_over_dcn_is_refused_at_its_words(line: str) -> None:
    with pytest.raises(ShardcError, match="only `over dcn`") as caught:
        shardc.parse(SPEC.format(line=line), "s.shard")
    span = caught.value.span
    assert span is not None and (span.line, span.column) == (4, 13)
    assert "grad_reduce after-backward over dcn" in str(caught.value)


def test_the_exposed_cross_pod_part_is_the_dcn_phase_of_the_gradient_allreduce(costs: dict[str, CostReport]) -> None:
    """By hand: V = D*F*2 bytes; the AllReduce's DCN phase moves 2V / |X| a chip at W_dcn, 671 us on v4; it
    leaves the ahead (overlapped) collectives for the critical ones, the ICI phase staying ahead."""
    hw = get_hardware("tpu-v4p")
    dcn_s = 2 * (1024 * 4096 * 2) / 4 / hw.w_dcn
    scoped, free = costs["scoped"].backward, costs["overlapped"].backward
    assert dcn_s == pytest.approx(671.1e-6, rel=1e-3)
    assert scoped.grad_reduce_dcn_s == pytest.approx(dcn_s, rel=1e-12)
    assert scoped.critical_s == pytest.approx(free.critical_s + dcn_s, rel=1e-12)
    assert scoped.ahead_s == pytest.approx(free.ahead_s - dcn_s, rel=1e-12) and scoped.ahead_s > 0
    assert scoped.comm_s == pytest.approx(free.comm_s, rel=1e-12)  # one collective time, split, not a second
    # the backward: dW's einsum, then the AllReduce's ICI phase (dIn's einsum beside it), then its DCN phase,
    # counted once (not also as a reduction at the phase's end)
    ici_s = free.comm_s - dcn_s
    assert scoped.step_s == pytest.approx(scoped.compute_s / 2 + ici_s + dcn_s, rel=1e-9)
    report = costs["scoped"].to_json()
    assert report["backward"]["grad_reduce_dcn_s"] == pytest.approx(dcn_s, rel=1e-12)
    assert report["hardware"]["grad_reduce"] == "after-backward over dcn"
    assert "the gradient reductions' DCN phase, after the backward" in costs["scoped"].render()


def test_the_flag_takes_the_scope_and_refuses_another() -> None:
    chip = get_hardware("tpu-v4p")
    assert chip.configured(grad_reduce="after-backward over dcn").reduces_dcn_after_backward
    assert not chip.configured(grad_reduce="after-backward").reduces_dcn_after_backward
    with pytest.raises(ShardcError, match="--grad-reduce"):
        chip.configured(grad_reduce="after-backward over ici")


def test_a_mesh_without_dcn_axes_says_nothing_waits() -> None:
    text = SPEC.format(line=SCOPED).replace("P=2 over dcn", "P=2")
    report = shardc.cost(shardc.plan(shardc.parse(text)))
    assert report.backward.grad_reduce_dcn_s == 0.0
    assert any("no `over dcn` axis" in note for note in report.notes)


def test_without_the_scope_nothing_changes(costs: dict[str, CostReport]) -> None:
    none, overlapped = costs["none"].to_json(), costs["overlapped"].to_json()
    assert "grad_reduce_dcn_s" not in none["backward"] and none["step"] == overlapped["step"]
    assert costs["none"].backward.grad_reduce_dcn_s == 0.0


def test_a_pipelines_scoped_reductions_show_their_dcn_phase_whole() -> None:
    """A pipeline whose data axis spans pods: under the scope its once-a-step reductions add their DCN phase
    whole, the rest hidden under the last microbatch's backward (where, overlapped, v5p hides them whole: a
    collective there holds no cores); plan_time (the planner's objective) and the pipeline's cost agree."""
    text = PIPELINE.read_text().replace("mesh P=4 pipeline, X=8, Y=4", "mesh P=4 pipeline, X=8 over dcn, Y=4")
    planned = shardc.plan(shardc.parse(text.replace("hardware tpu-v5p", f"hardware tpu-v5p\n{SCOPED}")))
    took, pipe = plan_time(planned), shardc.cost(planned).pipeline
    assert pipe is not None and 0 < took.reduce.deferred_s <= took.reduce.seconds  # X's reductions: all DCN
    assert took.reduce_exposed_s == pytest.approx(took.reduce.deferred_s, rel=1e-12)
    assert pipe.grad_reduce_exposed_s == pytest.approx(took.reduce_exposed_s, rel=1e-9)
