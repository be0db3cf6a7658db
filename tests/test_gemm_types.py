"""A GEMM's compute type apart from storage: `gemm f8` quantizes every contraction's inputs (forward, Dgrad,
Wgrad) to FP8, `gemm bf16 NAMES` keeps some statements' GEMMs in BF16; the rate, the quantize passes, the
weights' FP8 copies and MFU's peak follow."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

import shardc
from shardc.collectives import Op
from shardc.costmodel.cost_text import render
from shardc.errors import ShardcError
from shardc.ir.spec import DType, Spec
from shardc.quantize import SCALE_BYTES, TILE
from shardc.spec.dtypes import contracts
from shardc.spec.parser import parse
from shardc.step_cost import StepCost
from shardc.testing import specs

MLP = """\
mesh X=2
dims B=8192, D=4096, F=16384
hardware h100
gemm f8
param W1, W2
H[B_X, F] = relu(I[B_X, D] · W1[D, F])
O[B_X, D] = H[B_X, F] · W2[F, D]
Loss[] = cross_entropy(O[B_X, D], Tok[B_X])
"""


def test_a_gemm_line_gives_the_gemms_a_type_and_prints_back() -> None:
    spec = parse(MLP.replace("gemm f8\n", "gemm f8\ngemm bf16 O\n"))
    assert spec.gemm is DType.F8 and spec.gemm_tensors == (("O", DType.BF16),)
    assert (spec.gemm_of("H"), spec.gemm_of("O"), spec.dtype_of("W1")) == (DType.F8, DType.BF16, DType.BF16)
    assert "gemm f8\ngemm bf16 O\n" in str(spec) and parse(str(spec)) == spec
    assert spec.mfu_dtype is DType.F8 and parse(MLP.replace("gemm f8\n", "")).mfu_dtype is DType.BF16


@pytest.mark.parametrize(("line", "message", "column"), [
    ("gemm q8", "unknown dtype `q8`", 6),
    ("gemm bf16 Z", "no statement of the spec computes Z", 11),
    ("gemm bf16 O, H, O", "statement O is given a gemm type twice", 17),
    ("gemm f8 H", "`gemm f8` already", 9),
    ("gemm bf16 A", "contracts no index, so it runs no GEMM", 11),
    ("gemm bf16 W1", "no statement of the spec computes W1", 11),
])
def test_mistakes_in_a_gemm_line_point_at_the_word(line: str, message: str, column: int) -> None:
    text = MLP.replace("gemm f8\n", f"gemm f8\n{line}\n") + "A[B_X, F] = H[B_X, F] · H[B_X, F]\n"
    with pytest.raises(ShardcError, match=message) as err:
        parse(text)
    assert err.value.span is not None and (err.value.span.line, err.value.span.column) == (5, column)


def test_a_second_spec_wide_gemm_line_is_refused() -> None:
    with pytest.raises(ShardcError, match="`gemm` is given twice") as err:
        parse(MLP.replace("gemm f8\n", "gemm f8\ngemm f16\n"))
    assert err.value.span is not None and err.value.span.line == 5


def test_a_product_contracts_nothing_and_a_matmul_does() -> None:
    spec = parse(MLP + "A[B_X, F] = H[B_X, F] · H[B_X, F]\nG[B_X, F] = silu(I[B_X, D] · W1[D, F])\n")
    kinds = {s.result.name: contracts(s.expr, s.result.indices) for s in spec.statements}
    assert kinds == {"H": True, "O": True, "Loss": False, "A": False, "G": True}


@given(specs(), st.data())
def test_gemm_lines_print_back(spec: Spec, data: st.DataObject) -> None:
    gemms = [s.result.name for s in spec.statements if contracts(s.expr, s.result.indices)]
    default = data.draw(st.sampled_from([None, *DType]))
    named = data.draw(st.lists(st.sampled_from(gemms), unique=True, max_size=2)) if gemms else []
    other = [d for d in DType if d is not default]
    declared = tuple((name, data.draw(st.sampled_from(other))) for name in named)
    typed = dataclasses.replace(spec, gemm=default, gemm_tensors=declared)
    assert parse(str(typed)) == typed and str(parse(str(typed))) == str(typed)


def _rows(text: str) -> list[StepCost]:
    report = shardc.cost(shardc.plan(shardc.parse(text)))
    return [r for r in report.forward.rows + report.backward.rows if r.op is Op.EINSUM]


def test_every_gemm_forward_and_backward_runs_at_the_fp8_rate() -> None:
    h100 = shardc.hardware.PRESETS["h100"]
    rows = _rows(MLP)
    assert len(rows) == 6 and all(r.dtype == "f8" for r in rows)  # each marked: not the spec's dtype
    for r in rows:
        assert r.compute_s == pytest.approx(h100.matmul_seconds(r.flops, "f8"), rel=1e-12)
    plain = _rows(MLP.replace("gemm f8\n", ""))
    assert all(r.compute_s == pytest.approx(h100.matmul_seconds(r.flops, "bf16"), rel=1e-12) for r in plain)
    assert all(r.quantize_bytes == 0 for r in plain)
    kept = _rows(MLP.replace("gemm f8\n", "gemm f8\ngemm bf16 O\n"))  # O's forward, Dgrad and Wgrad in bf16
    assert [r.dtype for r in kept] == ["f8", "", "", "", "f8", "f8"]


def test_quantize_passes_are_priced_as_the_rule_says() -> None:
    """Hand-computed: B/X = 4096 rows a device, D = 4096, F = 16384, an FP8 element 1 byte and an FP32
    scale a 1 x 128 tile; the weights are held (quantized once a step, not here)."""
    b, d, f = 4096, 4096, 16384
    q = 1 + SCALE_BYTES / TILE  # bytes an FP8 element with its scale

    def unfused(n: int) -> float:
        return n * 2 + n * q  # read the BF16 operand, write its FP8 copy and scales

    got = [r.quantize_bytes for r in _rows(MLP)]
    assert got == pytest.approx([
        unfused(b * d),  # I · W1: I read from HBM
        b * f * q,  # H · W2: H quantized in relu's kernel, which made it
        unfused(b * f) + b * d * q,  # Wgrad H · dO: both along the tokens; dO fused into ce_vjp
        unfused(b * d),  # Dgrad dO · W2: dO along D, after an AllReduce
        unfused(b * d) + b * f * q,  # Wgrad I · dH_t1 (fused into relu_vjp)
        unfused(b * f),  # Dgrad dH_t1 · W1: along F
    ], rel=1e-12)
    h100 = shardc.hardware.PRESETS["h100"]
    for r in _rows(MLP):
        assert r.memory_s == pytest.approx(h100.memory_seconds(r.quantize_bytes), rel=1e-12)


def test_a_gemm_reading_a_value_stored_in_its_type_quantizes_nothing_for_it() -> None:
    rows = _rows(MLP.replace("gemm f8\n", "gemm f8\ndtype f8 I\n"))
    assert rows[0].quantize_bytes == 0  # I is stored in FP8 already (a cached FP8 activation)


def test_held_weights_are_quantized_once_a_step_and_their_copies_held() -> None:
    plan = shardc.plan(shardc.parse(MLP))
    report = shardc.cost(plan)
    plain = shardc.cost(shardc.plan(shardc.parse(MLP.replace("gemm f8\n", ""))))
    weights = 2 * 4096 * 16384
    copies = weights * (1 + SCALE_BYTES / TILE**2)  # a 128 x 128 block's scale
    assert report.memory.quantized_weight_bytes == pytest.approx(copies, rel=1e-12)
    assert report.memory.param_bytes - plain.memory.param_bytes == pytest.approx(copies, rel=1e-12)
    h100 = shardc.hardware.PRESETS["h100"]
    extra = h100.memory_seconds(weights * 2 + copies)  # read each bf16 weight, write its copy
    assert report.step.update_s - plain.step.update_s == pytest.approx(extra, rel=1e-9)


def test_mfu_is_over_the_gemm_types_peak() -> None:
    report = shardc.cost(shardc.plan(shardc.parse(MLP)))
    h100 = shardc.hardware.PRESETS["h100"]
    mfu = report.step.model_flops / (report.step.devices * h100.peak("f8") * report.step.step_s)
    assert report.step.mfu == pytest.approx(mfu, rel=1e-12) and report.step.dtype == "f8"
    assert "over the f8 peak" in render(report)
    assert report.to_json()["step"]["mfu_peak_dtype"] == "f8"  # type: ignore[index]
    plain = shardc.cost(shardc.plan(shardc.parse(MLP.replace("gemm f8\n", ""))))
    assert plain.to_json()["step"]["mfu_peak_dtype"] == "bf16"  # type: ignore[index]


def test_the_search_prices_a_gemm_at_the_rate_cost_reports() -> None:
    """The planner's search runs each GEMM at its `gemm` type's rate, as cost does (the quantize passes,
    memory-bound beside it, are cost's alone)."""
    p = shardc.plan(shardc.parse(MLP.replace("gemm f8\n", "gemm f8\ngemm bf16 O\n")), explain=True)
    rows = [r for r in shardc.cost(p).forward.rows if r.op is Op.EINSUM]
    chosen = [a for c in p.choices for a in c.alternatives if a.chosen][:len(rows)]
    h100 = shardc.hardware.PRESETS["h100"]
    assert [r.dtype for r in rows] == ["f8", ""]
    for row, alternative in zip(rows, chosen, strict=True):
        alone = row.compute_s + row.memory_s - h100.memory_seconds(row.quantize_bytes)
        assert alternative.time == pytest.approx(alone, rel=1e-9)
