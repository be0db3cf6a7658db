"""Pipelined verify fails what unpipelined verify fails: a dropout key ignored (two keys are run), a
loose bound (rechecked in float32 against the unsharded program), and it draws each input at its own
scale.  Each wrong module is the lowered pipeline's own source with one line edited."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import shardc
from shardc.lowering import reference as numpy_reference
from shardc.lowering.load import load_module
from shardc.lowering.pipeline_lowering import PipelineLowered, lower_pipeline
from shardc.spec.stages import stage_spec
from shardc.verification import pipeline_verify
from shardc.verification.report import POWER, Report, render_report

pytestmark = pytest.mark.slow  # every test lowers a pipeline, and all but one compile it

DROPOUT = """\
mesh P=2 pipeline, X=2
dims B=16, D=8, F=16
layers 4
microbatches 4
param W_in, W_out
H[B_X, F] = dropout(gelu(In[B_X, D] · W_in[D, F]), 0.5)
Out[B_X, D] = In[B_X, D] + H[B_X, F] · W_out[F, D]
"""
RESIDUAL = DROPOUT.replace("dropout(gelu(In[B_X, D] · W_in[D, F]), 0.5)", "gelu(In[B_X, D] · W_in[D, F])")
FORWARD_DOC = '    """The forward on one device: local blocks in, local blocks out."""\n'


Edit = Callable[[str, PipelineLowered], str]


def _verify_edited(monkeypatch: pytest.MonkeyPatch, text: str, edit: Edit | None = None) -> Report:
    """verify of ``text`` with its lowered module's source passed through ``edit`` (which must change it)."""

    def edited(plan: Any, *args: Any, **kwargs: Any) -> PipelineLowered:
        lowered = lower_pipeline(plan, *args, load=False, **kwargs)
        source = edit(lowered.source, lowered) if edit else lowered.source
        assert edit is None or source != lowered.source, "the edit matched nothing"
        lowered.source, lowered.namespace = source, load_module(source, "edited")
        return lowered

    monkeypatch.setattr(pipeline_verify, "lower_pipeline", edited)
    return pipeline_verify.verify_pipeline(shardc.plan(shardc.parse(text)))


def _failed(report: Report) -> set[tuple[str, str]]:
    return {(r.phase, r.tensor) for r in report.values if not r.ok}


def test_a_pipelined_lowering_that_ignores_the_dropout_key_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer l's key is key * layers + l: taken modulo the layers, every key draws key 0's masks."""

    def ignore_key(source: str, lowered: PipelineLowered) -> str:
        layers = lowered.pipeline.layers
        return source.replace(FORWARD_DOC, FORWARD_DOC + f"    dropout_key = (dropout_key[0] % {layers}, "
                                                         "dropout_key[1])\n", 1)

    right = _verify_edited(monkeypatch, DROPOUT)
    assert right.ok and {r.phase for r in right.values} == {"forward", "backward", "forward key 1", "backward key 1"}
    wrong = _verify_edited(monkeypatch, DROPOUT, ignore_key)
    assert _failed(wrong) == {("forward key 1", "Out"), ("backward key 1", "dIn"), ("backward key 1", "dW_in"),
                              ("backward key 1", "dW_out")}, render_report(wrong)


def test_a_loose_bound_is_rechecked_in_float32_and_catches_two_percent(monkeypatch: pytest.MonkeyPatch) -> None:
    """With bounds loosened to pass 10% of a value every row is weak: the float32 recheck against the
    unsharded program passes the right module and fails one whose block output is 2% off."""
    monkeypatch.setattr(pipeline_verify, "rounding_bound", lambda lowered: 0.1)
    right = _verify_edited(monkeypatch, RESIDUAL)
    checked = [r for r in right.values if r.phase.endswith(" f32")]
    assert right.ok and {r.tensor for r in checked} == {"Out", "dIn", "dW_in", "dW_out"}, render_report(right)
    assert all(r.catches <= POWER for r in checked) and any("checked again in float32" in n for n in right.notes)
    two_percent = "Out = In + 1.02 * Out_t1"
    wrong = _verify_edited(monkeypatch, RESIDUAL, lambda s, _: s.replace("Out = In + Out_t1 ", two_percent))
    assert not wrong.ok and all(r.ok for r in wrong.values if not r.phase.endswith(" f32")), render_report(wrong)
    assert {r.tensor for r in wrong.values if not r.ok} >= {"Out", "dW_out"}, render_report(wrong)


def test_every_row_says_what_it_catches() -> None:
    report = pipeline_verify.verify_pipeline(shardc.plan(shardc.parse(DROPOUT)))
    assert report.ok and all(r.catches <= POWER for r in report.values)
    assert all("catches" in row for row in report.to_json()["values"])
    assert "catches" in render_report(report)
    assert {k: v for k, v in report.input_scales.items() if v != 1.0}  # each input's own scale, reported


def test_each_layer_draws_its_params_where_its_ops_matter() -> None:
    """In every layer the gelu's argument has unit RMS and the residual branch half the RMS of the
    stream it joins, though the stream grows layer by layer."""
    plan = shardc.plan(shardc.parse(RESIDUAL))
    lowered = lower_pipeline(plan, *pipeline_verify.run_sizes(plan, 8))
    inputs = pipeline_verify.draw_inputs(lowered, 0, 0)
    block = stage_spec(plan.spec)
    x = inputs["In"]
    rms = []
    for layer in range(lowered.pipeline.layers):
        values = numpy_reference.forward(block, {"In": x, **{p: inputs[p][layer] for p in ("W_in", "W_out")}})
        branch = values["Out"] - x
        rms.append([float(np.sqrt(np.mean(v ** 2))) for v in (np.einsum("bd,df->bf", x, inputs["W_in"][layer]),
                                                              branch, x)])
        x = values["Out"]
    for argument, branch_rms, stream in rms:
        assert argument == pytest.approx(1.0, rel=0.1) and branch_rms == pytest.approx(stream / 2, rel=0.1), rms
    assert rms[-1][2] > 1.2 * rms[0][2]  # the stream grew: a fixed scale could not have held both



def test_the_float64_bound_grows_with_the_layers_and_the_sums() -> None:
    """The rounding allowance counts the terms of every sum on the chain, once a layer."""
    plan = shardc.plan(shardc.parse(RESIDUAL))
    sizes, layers, micro = pipeline_verify.run_sizes(plan, 8)
    shallow = pipeline_verify.rounding_bound(lower_pipeline(plan, sizes, layers, micro, load=False))
    deep = pipeline_verify.rounding_bound(lower_pipeline(plan, sizes, 2 * layers, micro, load=False))
    wide = pipeline_verify.rounding_bound(lower_pipeline(plan, {**sizes, "F": 4 * sizes["F"]}, layers, micro,
                                                         load=False))
    assert deep == pytest.approx(2 * shallow, rel=1e-9, abs=0) and wide > 1.25 * shallow
    assert shallow < 1e-11  # far below any error a wrong plan makes


def test_a_hundredth_of_a_percent_off_in_one_layer_still_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound follows the computation, but stays far below a real mistake: a block output 1e-4 off
    fails in float64, not merely in the float32 recheck."""
    off = "Out = In + 1.0001 * Out_t1"
    wrong = _verify_edited(monkeypatch, RESIDUAL, lambda s, _: s.replace("Out = In + Out_t1 ", off))
    failed = {r.tensor for r in wrong.values if not r.ok and not r.phase.endswith(" f32")}
    assert failed >= {"Out", "dW_out"}, render_report(wrong)
