"""``layers L { ... }``: a block of the spec repeats, the statements around it run once."""

from __future__ import annotations

import dataclasses

import pytest

import shardc
from shardc.costmodel.formulas import text
from shardc.errors import ShardcError
from shardc.ir.spec import Spec
from shardc.timing import plan_time

MODEL = """\
mesh X=2, Y=2
dims B=8, D=16, F=32, V=64, L=4
E[B_X, D] = Tok[B_X, V] · W_emb[V, D]
layers L {
  H[B_X, F_Y] = gelu(E[B_X, D] · W1[D, F_Y])   # one layer
  E2[B_X, D] = E[B_X, D] + H[B_X, F_Y] · W2[F_Y, D]
}
O[B_X, V] = E2[B_X, D] · W_out[D, V]
"""


def test_the_block_parses_prints_back_and_validates() -> None:
    spec = shardc.parse(MODEL)
    assert spec.block == (1, 3) and spec.layers == "L"
    assert shardc.parse(str(spec)) == spec
    assert "layers L {\n  H[B_X, F_Y]" in str(spec) and str(spec).count("}") == 1
    assert [spec.repeats(k) for k in range(4)] == [False, True, True, False]


@pytest.mark.parametrize(("text_", "message"), [
    (MODEL.replace("E2[B_X, D] = E[B_X, D]", "E2[B, D_X] = E[B_X, D]")
     .replace("E2[B_X, D] · W_out", "E2[B, D_X] · W_out"), "shardings differ"),
    ("mesh X=2\nlayers 4 {\n}\n", "has no statements"),
])
def test_the_block_is_checked(text_: str, message: str) -> None:
    with pytest.raises(ShardcError, match=message):
        shardc.parse(text_)


def _once(spec: Spec) -> Spec:
    """The same statements, each run once."""
    return dataclasses.replace(spec, block=None, layers=None, dims=tuple((k, v) for k, v in spec.dims if k != "L"))


def test_only_the_block_is_counted_l_times() -> None:
    spec = shardc.parse(MODEL)
    plan = shardc.plan(spec)
    once = [s.tensor for s in plan.forward if s.once]
    assert once == ["E", "O"]  # the embedding and the output projection
    report = shardc.cost(plan)
    assert plan_time(plan).step_s == pytest.approx(report.step.step_s, rel=1e-12)  # the planner's objective
    flops = text(report.forward.formula.flops)
    assert flops == "4*B*D*F*L/(X*Y) + 4*B*D*V/X"  # the block L times, the embedding and the head once
    one = shardc.cost(shardc.plan(_once(spec)))
    per: dict[str, float] = {}
    for row in one.forward.rows:
        per[row.tensor] = per.get(row.tensor, 0.0) + row.flops
    assert report.forward.compute_flops == per["E"] + per["O"] + 4 * (per["H_t1"] + per["E2_t1"])
    params = report.memory.params_total
    assert params == 64 * 16 * 2 + 4 * (16 * 32 * 2)  # W_emb, W_out once; W1, W2 a layer


@pytest.mark.slow
def test_a_block_lowers_and_verifies() -> None:
    from shardc.verification.verify import verify

    assert verify(shardc.plan(shardc.parse(MODEL))).ok  # one layer runs: the values are the spec's


def test_residual_blocks_example_has_one_tensor_parallel_all_reduce_each_way_a_layer() -> None:
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "residual_blocks.shard"
    plan = shardc.plan(shardc.parse(path.read_text(), filename=str(path)))
    for steps in (plan.forward, plan.backward):
        per_layer = [f"{s.op.title}_{''.join(s.axes)}" for s in steps
                     if s.is_collective and not s.once and "Y" in s.axes]
        assert per_layer == ["AllReduce_Y"]  # the MLP's partial sum (bias added after), and its partial dX
