"""verify fails lowered modules that are wrong by a little: a norm's statistic off by a constant, the
dropout key ignored, a 10% scale on an activation or a gradient.  Each wrong module is the lowered
module's own source with one line edited, run as verify runs the real one."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import shardc
from shardc.lowering.api import lower
from shardc.lowering.load import load_module
from shardc.verification import verify as verify_module
from shardc.verification.report import POWER
from shardc.verification.scales import input_scales
from shardc.verification.verify import Report, render_report, verify

pytestmark = pytest.mark.slow  # every test here lowers, compiles and runs a module

RMSNORM = "mesh X=4\ndims B=64, D=4096\nY[B, D_X] = rmsnorm(X[B, D_X] over D)\n"
LAYERNORM = "mesh X=4\ndims B=64, D=4096\nY[B, D_X] = layernorm(X[B, D_X] over D)\n"
DROPOUT = "mesh X=2, Y=2\ndims B=8, D=8\nY[B_X, D_Y] = dropout(X[B_X, D_Y], 0.25)\n"
MLP = ("mesh X=2\ndims B=8, D=4, F=6\ndtype bf16\nH[B_X, F] = gelu(In[B_X, D] · W[D, F])\n"
       "Out[B_X, D] = H[B_X, F] · W2[F, D]\n")


def _verify_edited(monkeypatch: pytest.MonkeyPatch, text: str, edit: Callable[[str], str]) -> Report:
    """verify of ``text`` with its lowered module's source passed through ``edit`` (which must change it)."""

    def edited(*args: Any, **kwargs: Any) -> Any:
        lowered = lower(*args, **kwargs)
        source = edit(lowered.source)
        assert source != lowered.source, "the edit matched nothing"
        module = dataclasses.replace(lowered.module, source=source)
        return dataclasses.replace(lowered, module=module, namespace=load_module(source, "edited"), _compiled={})

    monkeypatch.setattr(verify_module, "lower", edited)
    return verify(shardc.parse(text))


def _failed(report: Report) -> set[str]:
    return {r.tensor for r in report.values if not r.ok}


def test_unedited_modules_pass() -> None:
    for text in (RMSNORM, LAYERNORM, DROPOUT, MLP):
        report = verify(shardc.parse(text))
        assert report.ok, render_report(report)


def test_a_norm_statistic_divided_by_4_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """At unit-size inputs the output is 2x off; at inputs shrunk far below sqrt(eps) it is not."""
    report = _verify_edited(monkeypatch, RMSNORM, lambda s: re.sub(r"(= jax\.lax\.psum\(Y_ms\w*, 'X'\))",
                                                                   r"\1 / 4", s))
    assert _failed(report) == {"Y", "dX"}, render_report(report)


def test_a_norm_statistic_without_its_allreduce_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    report = _verify_edited(monkeypatch, RMSNORM, lambda s: re.sub(r"jax\.lax\.psum\((Y_ms\w*), 'X'\)", r"\1", s))
    assert _failed(report) == {"Y", "dX"}, render_report(report)


def test_a_layernorm_with_an_n_minus_1_variance_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    report = _verify_edited(monkeypatch, LAYERNORM, lambda s: re.sub(
        r"(Y_var\w* = .*?) / (X_\w+)\.shape\[1\]", r"\1 / (\2.shape[1] - 1)", s))
    assert {"Y", "dX"} <= _failed(report), render_report(report)


def test_norm_inputs_are_scaled_so_the_statistic_is_far_above_eps() -> None:
    spec = shardc.parse("mesh X=2\ndims B=4, D=8, F=6\nY[B_X, F] = rmsnorm(In[B_X, D] · W[D, F] over F)\n")
    rng = np.random.default_rng(0)
    scales = input_scales(spec, {"In": rng.standard_normal((4, 8)) * 1e-4, "W": rng.standard_normal((8, 6))},
                          set())
    assert scales["In"] == 1.0 and scales["W"] > 1e3  # the norm's argument is brought to unit size


def test_a_lowering_that_ignores_the_dropout_key_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    report = _verify_edited(monkeypatch, DROPOUT, lambda s: s.replace(", dropout_key, (", ", 0, ("))
    assert _failed(report) == {"Y", "dX"}, render_report(report)
    assert {r.phase for r in report.values if not r.ok} <= {"forward key 1", "backward key 1",
                                                             "forward key 1 f32", "backward key 1 f32"}


def test_a_gpt_layer_that_ignores_the_dropout_key_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    text = open("examples/gpt_layer_tp.shard", encoding="utf-8").read()
    report = _verify_edited(monkeypatch, text, lambda s: s.replace(", dropout_key, (", ", 0, ("))
    assert {"Out", "dX", "dW_q"} <= _failed(report), render_report(report)
    assert all("key 1" in r.phase for r in report.values if not r.ok)


@pytest.mark.parametrize(("line", "failed"), [("H = jax.nn.gelu(H_t1)", {"H", "Out"}),
                                              ("dH_t1 = jax.vjp(jax.nn.gelu, H_t1)[1](dH)[0]", {"dW", "dIn"})])
def test_a_ten_percent_scale_on_an_activation_or_a_gradient_fails(monkeypatch: pytest.MonkeyPatch, line: str,
                                                                   failed: set[str]) -> None:
    report = _verify_edited(monkeypatch, MLP, lambda s: s.replace(line, f"{line} * 1.1"))
    assert _failed(report) >= failed, render_report(report)


def test_every_row_would_catch_five_percent_and_says_so() -> None:
    report = verify(shardc.parse(MLP))
    assert report.ok
    text = render_report(report)
    assert "catches" in text
    checked = {(r.phase.removesuffix(" f32"), r.tensor) for r in report.values if r.catches <= POWER}
    assert checked >= {(r.phase.removesuffix(" f32"), r.tensor) for r in report.values if r.max_reference > 0}
    assert all("catches" in row for row in report.to_json()["values"])


def test_inputs_shrunk_to_fit_float16_are_checked_again_at_their_own_scales() -> None:
    """Residual blocks in float16 overflow at the inputs' own scales, so the run shrinks them as a
    whole; there an activation barely curves, so every value is checked again in float32 unshrunk."""
    text = "dtype f16\n" + open("examples/residual_blocks.shard").read()
    report = verify(shardc.parse(text))
    assert report.ok and report.input_scale < 1, render_report(report)
    plain = {(r.phase, r.tensor): r for r in report.values if not r.phase.endswith("f32")}
    again = {(r.phase.removesuffix(" f32"), r.tensor): r for r in report.values if r.phase.endswith("f32")}
    assert set(again) == set(plain)
    grown = [k for k in plain if again[k].max_reference > plain[k].max_reference]
    assert len(grown) == len(plain)
    assert any("checked again in float32 at the inputs' own scales" in n for n in report.notes)
