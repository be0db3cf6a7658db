"""Per-tensor element types: `dtype bf16 Sc, Pr` beside the spec's `dtype f8`, read by every pass."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

import shardc
from shardc.collectives import Op
from shardc.errors import ShardcError
from shardc.ir.precision import Precision, matmul_dtype
from shardc.ir.spec import DType, Spec
from shardc.spec.parser import parse
from shardc.spec.walk import leaves
from shardc.testing import specs

MLP = """\
mesh X=8
dims B=65536, D=8192, F=32768
dtype f8
dtype bf16 W_out, Out
hardware h100
Tmp[B_X, F] = In[B_X, D] · W_in[D, F]
Out[B_X, D] = Tmp[B_X, F] · W_out[F, D]
"""


def test_a_dtype_line_names_tensors_of_another_type() -> None:
    spec = parse(MLP)
    assert spec.dtype is DType.F8 and spec.tensor_dtypes == (("Out", DType.BF16), ("W_out", DType.BF16))
    assert [spec.dtype_of(t) for t in ("In", "W_in", "Tmp", "W_out", "Out")] == [DType.F8] * 3 + [DType.BF16] * 2
    assert "dtype f8\ndtype bf16 Out, W_out\n" in str(spec) and parse(str(spec)) == spec


def test_lines_of_one_type_merge_and_without_a_default_the_spec_is_bf16() -> None:
    spec = parse("mesh X=2\ndtype f8 W\ndtype f32 I\ndtype f8 O\nO[B, F] = I[B, D] · W[D, F]\n")
    assert spec.dtype is DType.BF16
    assert dict(spec.tensor_dtypes) == {"W": DType.F8, "I": DType.F32, "O": DType.F8}
    assert spec.dtype_lines() == ["dtype f32 I", "dtype f8 O, W"] and parse(str(spec)) == spec


@pytest.mark.parametrize(("line", "message", "column"), [
    ("dtype q8 W", "unknown dtype `q8`", 7),
    ("dtype bf16 Z", "no tensor of the spec is named Z", 12),
    ("dtype f8 W, E, W", "tensor W is given a dtype twice", 16),
    ("dtype bf16 W", "the spec's dtype already", 12),
    ("dtype f8 Tok", "token ids, which are int32", 10),
])
def test_mistakes_in_a_dtype_line_point_at_the_word(line: str, message: str, column: int) -> None:
    text = f"mesh X=2\n{line}\nE[B, D] = embed(Tok[B], W_e[V, D])\nO[B, F] = E[B, D] · W[D, F]\n"
    with pytest.raises(ShardcError, match=message) as err:
        parse(text)
    assert err.value.span is not None and (err.value.span.line, err.value.span.column) == (2, column)


def test_a_spec_built_in_python_names_a_dtype_by_the_enum() -> None:
    from shardc.spec.validate import validate

    spec = dataclasses.replace(parse(MLP), tensor_dtypes=(("W_out", "bf16"),))  # type: ignore[arg-type]
    with pytest.raises(ShardcError, match="'bf16' is not a dtype"):
        validate(spec)


@given(specs(), st.data())
def test_declared_types_print_back(spec: Spec, data: st.DataObject) -> None:
    tensors = sorted({r.name for s in spec.statements for r in (s.result, *leaves(s.expr))})
    named = data.draw(st.lists(st.sampled_from(tensors), unique=True, max_size=3))
    other = [d for d in DType if d is not spec.dtype]
    declared = tuple((name, data.draw(st.sampled_from(other))) for name in named)
    mixed = dataclasses.replace(spec, tensor_dtypes=declared)
    assert parse(str(mixed)) == mixed and str(parse(str(mixed))) == str(mixed)


def test_an_einsum_runs_in_fp8_only_when_both_operands_are_fp8() -> None:
    assert matmul_dtype([DType.F8, DType.F8]) is DType.F8
    assert matmul_dtype([DType.F8, DType.BF16]) is DType.BF16 and matmul_dtype([DType.F32, DType.F8]) is DType.F32
    kinds = Precision(DType.F8, {"W": DType.BF16})
    assert (kinds.matmul(["X", "W"]), kinds.matmul(["X", "Y"]), kinds.matmul([])) == ("bf16", "f8", "f8")


def _einsums(text: str) -> list[tuple[str, float, float]]:
    p = shardc.plan(shardc.parse(text))
    report = shardc.cost(p)
    return [(r.text, r.flops, r.compute_s) for r in report.forward.rows + report.backward.rows if r.op is Op.EINSUM]


def test_an_f8_by_bf16_einsum_runs_at_the_bf16_rate() -> None:
    h100 = shardc.hardware.PRESETS["h100"]
    rows = _einsums(MLP)
    assert len(rows) == 6
    for text, flops, seconds in rows:
        wide = "W_out" in text or "dOut" in text  # W_out, Out and Out's gradient are bf16, the rest f8
        assert seconds == pytest.approx(h100.matmul_seconds(flops, "bf16" if wide else "f8"), rel=1e-12)
    assert sum(("W_out" in t or "dOut" in t) for t, _, _ in rows) == 3
    all_f8 = _einsums(MLP.replace("dtype bf16 W_out, Out\n", ""))
    assert all(s == pytest.approx(h100.matmul_seconds(f, "f8"), rel=1e-12) for _, f, s in all_f8)
    assert sum(s for *_, s in rows) > sum(s for *_, s in all_f8)


def test_bytes_are_each_tensors_own() -> None:
    p = shardc.plan(shardc.parse(MLP))
    assert [p.nbytes(t) for t in ("In", "W_in", "Tmp", "W_out", "Out", "dW_out", "dOut", "dW_in")] == \
        [1, 1, 1, 2, 2, 2, 2, 1]
    report = shardc.cost(p)
    volumes = {r.tensor: r.volume for r in report.backward.rows if r.op is Op.ALL_REDUCE}
    assert volumes == {"dW_out": 2 * 8192 * 32768, "dW_in": 8192 * 32768}  # each gradient at its type's bytes
    wider = shardc.cost(shardc.plan(shardc.parse(MLP.replace("W_out, Out", "W_out, Out, Tmp"))))
    kept, widened = dict(report.memory.residuals), dict(wider.memory.residuals)
    tmp, x = "Tmp[B_X, F]", "In[B_X, D]"
    assert kept[tmp] == 65536 // 8 * 32768 and widened[tmp] == 2 * kept[tmp]  # kept at its type's bytes
    assert widened[x] == kept[x] == 65536 // 8 * 8192


def test_the_search_prices_a_mixed_einsum_as_cost_reports_it() -> None:
    p = shardc.plan(shardc.parse(MLP), explain=True)
    report = shardc.cost(p)
    rows = [r for r in report.forward.rows if r.op is Op.EINSUM]
    chosen = [a for c in p.choices for a in c.alternatives if a.chosen][:len(rows)]
    assert [r.dtype for r in rows] == ["", "bf16"]
    for row, alternative in zip(rows, chosen, strict=True):
        assert alternative.time == pytest.approx(row.compute_s + row.memory_s, rel=1e-9)


@pytest.mark.parametrize("module", ["shardc.spec.dtypes", "shardc.spec.lexicon", "shardc.ir.precision"])
def test_docstring_examples(module: str) -> None:
    import doctest
    import importlib

    failures, _ = doctest.testmod(importlib.import_module(module))
    assert failures == 0


def test_a_run_computes_in_the_type_all_its_tensors_compute_in() -> None:
    from shardc.verification.verify import compute_dtype

    text = "mesh X=2\n{}O[B, F] = I[B, D] · W[D, F]\n"
    assert compute_dtype(parse(text.format("dtype f8\ndtype bf16 W\n"))).name == "bfloat16"  # f8 computes in bf16
    assert compute_dtype(parse(text.format("dtype f16 W\n"))).name == "float32"  # bf16 beside f16
    assert compute_dtype(parse(text.format("dtype f8\ndtype f32 O\n"))).name == "float32"


FSDP_TP = """\
mesh X=2, Y=2
dims B=8, D=4, F=6
dtype f8
dtype bf16 W_out, Out
Tmp[B_X, F_Y] = In[B_X, D] · W_in[D_X, F_Y]
Out[B_X, D] = Tmp[B_X, F_Y] · W_out[F_Y, D_X]
"""


@pytest.mark.slow
def test_verify_prices_each_collective_at_its_tensors_type() -> None:
    from shardc.verification.verify import render_report, verify

    report = verify(shardc.parse(FSDP_TP))
    assert report.ok, render_report(report)
    assert report.compute_dtype == "bfloat16"
    assert any(n.startswith("dtype bf16 Out, W_out: those inputs") for n in report.notes)
    gathers = {r.step.split()[1]: r for r in report.collectives if r.phase == "forward" and r.kind == "AllGather"}
    assert set(gathers) == {"W_in[D_X,", "W_out[F_Y,"}
    assert all(r.ok and r.plan_bytes == r.hlo_bytes for r in gathers.values())
    # one shape, W_out in bf16 and W_in in f8: the HLO's elements priced at each tensor's bytes
    assert gathers["W_out[F_Y,"].plan_bytes == 2 * gathers["W_in[D_X,"].plan_bytes  # type: ignore[operator]


PIPELINED = """mesh P=2 pipeline, X=2
dims B=4096, D=4096, F=16384, M=1, V=32000
dtype f8
dtype bf16 E0, H, V2, W_out, Lg
param W_emb, W1, W2, V1, V2, W_out
E0[B_X, D] = embed(Tok[B_X], W_emb[V, D])
layers 3 {
  H[B_X, F] = gelu(E0[B_X, D] · W1[D, F])
  E1[B_X, D] = E0[B_X, D] + H[B_X, F] · W2[F, D]
}
layers M {
  G[B_X, F] = gelu(E1[B_X, D] · V1[D, F])
  E2[B_X, D] = E1[B_X, D] + G[B_X, F] · V2[F, D]
}
Lg[B_X, V] = E2[B_X, D] · W_out[D, V]
Loss[] = cross_entropy(Lg[B_X, V], Next[B_X])
"""


def test_a_pipelines_parts_keep_their_tensors_types() -> None:
    """Lowering cuts the spec into the statements before the blocks, each block and those after them: each
    part names its own tensors' types."""
    from shardc.lowering.pipeline_ends import split_spec
    from shardc.spec.dtypes import check_dtypes

    before, blocks, after = split_spec(shardc.parse(PIPELINED))  # 3 + 1 layers in two blocks
    parts = (before, *blocks, after)
    for part in parts:
        check_dtypes(part)  # every tensor a part's `dtype` lines name is the part's
    assert [{t for t, _ in p.tensor_dtypes} for p in parts] == [{"E0"}, {"E0", "H"}, {"V2"}, {"W_out", "Lg"}]


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["", "zero 1 over X\n"])
def test_a_pipeline_verifies_each_collective_at_its_tensors_type(zero: str) -> None:
    """A pipelined spec of two types verifies: the stage program's collectives, those once a step after its
    loop and a ZeRO stage's optimizer phase are each priced at the bytes of their tensor's type (dW_emb's
    AllReduce in bf16, dW1's in f8), not all at the spec's (both failed so on DeepSeek-V3's spec)."""
    from shardc.verification.verify import render_report, verify

    report = verify(shardc.parse(PIPELINED.replace("dtype f8\n", "dtype f8\n" + zero)))
    assert report.ok, render_report(report)
    rows = {r.step.split()[1]: r for r in report.collectives if r.kind == "AllReduce"}
    assert rows["dW_emb[V,"].ok and rows["dW1[D,"].ok  # a bf16 and an f8 gradient, each matched at its bytes


def test_a_ring_kernel_sends_its_keys_and_values_at_their_type() -> None:
    """Ring attention over 16 devices with Q, K and V in f32: its forward sends twice the bf16 ones, in the
    cost formulas as in the numbers, and the report says its kernel's type."""
    from shardc.costmodel.formulas import evaluate
    from tests.test_ring_attention import _FLAT_H100

    text = ("mesh X=16\ndims B=1, S=131072, T=131072, G=8, R=16, H=128\nhardware h100\n{}"
            "O[B, S_X, G, R, H] = attention(Q[B, S_X, G, R, H], K[B, T_X, G, H], V[B, T_X, G, H] over T)\n")
    narrow, wide = (shardc.cost(shardc.plan(shardc.parse(text.format(line)), hardware=_FLAT_H100))
                    for line in ("", "dtype f32 Q, K, V\n"))
    (kernel,) = [r for r in wide.forward.rows if r.ring_steps]
    assert kernel.dtype == "f32" and kernel.weighted > 0
    assert wide.forward.comm_bytes == pytest.approx(2 * narrow.forward.comm_bytes, rel=1e-12)
    hw = wide.hardware
    values = {k: float(v) for k, v in wide.sizes.items()} | {"C": hw.flops, "W_ici": hw.w_ici, "W_dcn": hw.w_dcn}
    for phase in (wide.forward, wide.backward):
        assert evaluate(phase.formula.comm_bytes, values) == pytest.approx(phase.comm_bytes, rel=1e-12)


def test_the_listings_say_which_tensors_and_matmuls_are_of_another_type() -> None:
    from shardc.costmodel.cost_text import render
    from shardc.planner.plan_text import render_text

    p = shardc.plan(shardc.parse(MLP))
    assert "# dtype f8; dtype bf16 Out, W_out (each with its gradient" in render_text(p)
    report = shardc.cost(p)
    marked = [line for line in render(report).splitlines() if line.endswith("(in bf16)")]
    assert len(marked) == 3 and all("W_out" in line or "dOut" in line for line in marked)
    forward = report.to_json()["forward"]
    assert [r.get("dtype") for r in forward["rows"] if r["op"] == "einsum"] == [None, "bf16"]  # type: ignore[index]
