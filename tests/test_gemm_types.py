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
from shardc.ir.precision import SCALE_BYTES, TILE
from shardc.ir.spec import DType, Spec
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


def test_the_search_prices_a_gemm_and_its_quantize_passes_as_cost_reports() -> None:
    """The planner's search runs each GEMM at its `gemm` type's rate and adds its quantize passes by the one
    rule cost prices them with (the forward's: I read from HBM, H fused into relu's kernel, the weights held;
    the backward's: dO and dH_t1 fused into the vjps that made them or read back after a collective), so
    each GEMM's searched time is the time cost reports for it."""
    p = shardc.plan(shardc.parse(MLP), explain=True)
    rows = [r for r in shardc.cost(p).forward.rows if r.op is Op.EINSUM]
    chosen = [a for c in p.choices for a in c.alternatives if a.chosen][:len(rows)]
    b, d, f = 4096, 4096, 16384
    q = 1 + SCALE_BYTES / TILE
    assert [r.quantize_bytes for r in rows] == pytest.approx([b * d * (2 + q), b * f * q], rel=1e-12)
    for row, alternative in zip(rows, chosen, strict=True):
        assert alternative.time == pytest.approx(row.compute_s + row.memory_s, rel=1e-9)
    # the backward's too: each GEMM with its passes, and the AllReduce after each Wgrad
    spent: dict[str, float] = {}
    for r in shardc.cost(p).backward.rows:
        if r.op in (Op.EINSUM, Op.ALL_REDUCE):
            name = r.text.split(" -> ")[1].split("[")[0]
            spent[name] = spent.get(name, 0.0) + r.compute_s + r.memory_s + r.comm_s
    searched = {c.statement.split("[")[0]: a.time for c in p.choices if c.phase == "backward"
                for a in c.alternatives if a.chosen and " · " in c.statement}
    assert set(searched) == {"dW2", "dH", "dW1", "dI"}
    assert searched == pytest.approx({name: spent[name] for name in searched}, rel=1e-9)


BLIND_SPEC = """\
mesh X=4
dims B=4096, D=8192, F=8192
hardware h100
gemm f8
param W
O[F, B] = W[F, D] · I[D, B]
Loss[] = cross_entropy(O[F, B], Tok[B])
"""


def test_the_quantize_passes_change_the_layout_the_planner_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sharding F or B costs the same FLOPs and moves O alike, but sharded F the GEMM quantizes all of I and
    its quarter of W (not as held) each step; sharded B, its quarter of I and no weight.  A search blind to
    the passes (as it was) takes F, the first in its order, and a slower step."""
    def forward_gemm(p: shardc.Plan) -> str:
        (step,) = [s for s in p.forward if s.op is Op.EINSUM]
        return str(step.dst)

    picked = shardc.plan(shardc.parse(BLIND_SPEC))
    monkeypatch.setattr("shardc.sharding.layout.CostContext.quantize_seconds", lambda self, nbytes: 0.0)
    blind = shardc.plan(shardc.parse(BLIND_SPEC))
    assert (forward_gemm(picked), forward_gemm(blind)) == ("O[F, B_X]", "O[F_X, B]")
    assert shardc.cost(picked).step.step_s < shardc.cost(blind).step.step_s


def test_a_cached_fp8_value_is_transposed_for_its_wgrad() -> None:
    """H cached in FP8 (1 x 128 tiles along F, its last index): the forward's GEMM reads it as it is, the
    Wgrad contracting the tokens dequantizes, transposes and requantizes it (read and write its FP8 values
    and scales), beside quantizing dO (fused into ce_vjp)."""
    b, d, f = 4096, 4096, 16384
    q = 1 + SCALE_BYTES / TILE
    rows = _rows(MLP.replace("gemm f8\n", "gemm f8\ndtype f8 H\n"))
    assert [r.text.split(" -> ")[1].split("[")[0] for r in rows[1:3]] == ["O", "dW2"]
    assert rows[1].quantize_bytes == 0
    assert rows[2].quantize_bytes == pytest.approx(2 * b * f * q + b * d * q, rel=1e-12)


def test_an_fp8_values_gradient_is_of_the_storage_type() -> None:
    """`dtype f8 H` caches H (and its pre-activation) in FP8; their gradients flow back in the spec's BF16
    (DeepSeek-V3, section 3.3.4), so the Dgrad reading dH_t1 quantizes it from BF16."""
    b, f = 4096, 16384
    plan = shardc.plan(shardc.parse(MLP.replace("gemm f8\n", "gemm f8\ndtype f8 H\n")))
    assert dict(plan.dtypes) == {"H": DType.F8, "H_t1": DType.F8}
    assert (plan.nbytes("H"), plan.nbytes("dH"), plan.nbytes("dH_t1")) == (1, 2, 2)
    dgrad = [r for r in _rows(MLP.replace("gemm f8\n", "gemm f8\ndtype f8 H\n")) if "-> dI[" in r.text]
    assert dgrad[0].quantize_bytes == pytest.approx(b * f * (2 + 1 + SCALE_BYTES / TILE), rel=1e-12)
    everything = shardc.plan(shardc.parse(MLP.replace("gemm f8\n", "dtype f8\ngemm f8\n")))
    assert everything.nbytes("dH") == 1  # a spec stored in FP8 keeps its gradients in FP8


def test_a_bf16_gemm_reading_a_value_first_spares_no_fp8_gemm_its_pass() -> None:
    """G's GEMM (`gemm bf16 G`) reads I as stored; H's then quantizes I to FP8 all the same, in cost and in
    the search (a pass is shared only by GEMMs of one type contracting the value alike)."""
    text = MLP.replace("param W1, W2\n", "gemm bf16 G\nparam W0, W1, W2\nG[B_X, F] = I[B_X, D] · W0[D, F]\n")
    text = text.replace("relu(I[B_X, D] · W1[D, F])", "relu(I[B_X, D] · W1[D, F]) + G[B_X, F]")
    p = shardc.plan(shardc.parse(text), explain=True)
    rows = [r for r in shardc.cost(p).forward.rows if r.op is Op.EINSUM]
    chosen = [a for c in p.choices for a in c.alternatives if a.chosen][:len(rows)]
    q = 1 + SCALE_BYTES / TILE
    assert rows[0].quantize_bytes == 0 and rows[1].quantize_bytes == pytest.approx(4096 * 4096 * (2 + q), rel=1e-12)
    for row, alternative in zip(rows, chosen, strict=True):
        assert alternative.time == pytest.approx(row.compute_s + row.memory_s, rel=1e-9)


def test_a_bf16_gemm_transposes_nothing() -> None:
    """Only FP8 values carry tiles of scales: O's Wgrad in BF16 (`gemm bf16 O`) reads H as stored, along the
    tokens, at no cost beside its matmul."""
    rows = _rows(MLP.replace("gemm f8\n", "gemm f8\ngemm bf16 O\n"))
    wgrad = [r for r in rows if "-> dW2[" in r.text]
    assert len(wgrad) == 1 and wgrad[0].quantize_bytes == 0


ONE_GEMM = """\
mesh X=2
dims B=256, D=512, F=1024
gemm f8
param W
O[B_X, F] = I[B_X, D] · W[D, F]
Loss[] = cross_entropy(O[B_X, F], Tok[B_X])
"""


@pytest.mark.parametrize("cached", [False, True])
def test_a_gemms_quantized_inputs_are_temporaries_while_it_runs(cached: bool) -> None:
    """Each quantize pass's copy (its FP8 values and a 4-byte scale a 1 x 128 tile) is a temporary of its
    phase while its GEMM runs.  The forward: I's copy (W read as held: its copy is state); I cached in FP8
    along D, the GEMM reads it as it is.  The backward's Wgrad dW = I · dO over the gathered I and dO: their
    copies (I's transposed where cached) beside the gathered values and dO, its peak."""
    from shardc.costmodel.phase_memory import phase_memory

    sizes = {"X": 2, "B": 256, "D": 512, "F": 1024}
    spec = ONE_GEMM.replace("gemm f8\n", "gemm f8\ndtype f8 I\n") if cached else ONE_GEMM
    plan = shardc.plan(shardc.parse(spec))
    assert [str(s.dst) for s in plan.backward] == ["dO[B_X, F]", "I[B, D]", "dO[B, F]", "dW[D, F]", "dI[B_X, D]"]
    forward, backward = phase_memory(plan, sizes)
    plain_forward, plain_backward = phase_memory(shardc.plan(shardc.parse(spec.replace("gemm f8\n", ""))), sizes)
    q = 1 + SCALE_BYTES / TILE
    assert forward.temporaries == (plain_forward.temporaries if cached else 128 * 512 * q)
    assert backward.temporaries - plain_backward.temporaries == (256 * 512 + 256 * 1024) * q
