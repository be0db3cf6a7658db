"""Several `layers N { ... }` blocks in one spec (DeepSeek-V3's 3 dense layers then 58 MoE layers):
each repeats its own count, in the plan, the cost, the formulas and memory (under a pipeline:
tests/test_layers_pipeline.py)."""

from __future__ import annotations

import pytest

import shardc
from shardc.errors import ShardcError
from shardc.planner.plan_text import render_text
from shardc.spec.stages import pipeline_of
from shardc.verification.verify import render_report, verify

TWO = """mesh X=2
dims B=4096, D=4096, F=16384, M=5
param W1, W2, V1, V2
E0[B_X, D] = In[B_X, D]
layers 3 {
  H[B_X, F] = gelu(E0[B_X, D] · W1[D, F])
  E1[B_X, D] = E0[B_X, D] + H[B_X, F] · W2[F, D]
}
layers M {
  G[B_X, F] = gelu(E1[B_X, D] · V1[D, F])
  E2[B_X, D] = E1[B_X, D] + G[B_X, F] · V2[F, D]
}
Out[B_X, D] = E2[B_X, D]
"""


def _spec(text: str = TWO) -> shardc.Spec:
    return shardc.parse(text)


def test_each_block_repeats_its_own_statements() -> None:
    spec = _spec()
    assert spec.block == (1, 3) and spec.more_blocks == ((3, 5, "M"),)
    assert [spec.block_of(k) for k in range(len(spec.statements))] == [None, 0, 0, 1, 1, None]
    assert shardc.parse(str(spec)) == spec  # round trip


def test_steps_carry_their_block_and_the_cost_counts_each_blocks_layers() -> None:
    plan = shardc.plan(_spec())
    assert {s.block for s in plan.forward if not s.once and s.tensor.startswith(("G", "E2"))} == {1}
    assert {s.block for s in plan.forward if not s.once and s.tensor.startswith(("H", "E1"))} == {0}
    report = shardc.cost(plan)
    einsum = 2 * (4096 // 2) * 4096 * 16384  # one layer's matmul, a device
    assert report.forward.compute_flops == pytest.approx(2 * einsum * (3 + 5))
    assert str(report.forward.formula.flops) in ("4*B*D*F*M/X + 12*B*D*F/X", "12*B*D*F/X + 4*B*D*F*M/X")
    assert report.memory.params_total == 2 * 4096 * 16384 * (3 + 5)
    a_layer = {name: nbytes for name, nbytes in report.memory.residuals}
    kept_g = a_layer["G[B_X, F]"] + a_layer["G_t1[B_X, F]"]
    kept_h = a_layer["H[B_X, F]"] + a_layer["H_t1[B_X, F]"]
    assert kept_g == kept_h  # the two blocks' layers keep alike: their counts tell them apart
    assert report.memory.residual_bytes == pytest.approx(5 * kept_g + 3 * kept_h + 3 * a_layer["E1[B_X, D]"]
                                                         + a_layer["E0[B_X, D]"])


def test_a_second_block_counts_at_the_size_its_dim_is_given() -> None:
    plan = shardc.plan(_spec())
    small, large = shardc.cost(plan, sizes={"M": 1}), shardc.cost(plan, sizes={"M": 9})
    one_layer = (large.forward.compute_flops - small.forward.compute_flops) / 8
    assert small.forward.compute_flops == pytest.approx(one_layer * (3 + 1))


def test_the_listing_marks_the_later_blocks_steps() -> None:
    text = render_text(shardc.plan(_spec()))
    assert "[layers block 2]" in text and "[once: outside the layers block]" in text


def test_a_pipeline_cuts_several_blocks_as_one_run_of_layers() -> None:
    spec = _spec(TWO.replace("mesh X=2", "mesh P=2 pipeline, X=2"))  # once an error at the second block
    pipe = pipeline_of(spec)
    assert pipe is not None and pipe.layers == 8 and pipe.blocks == (3, 5) and pipe.stage_layers == (4, 4)
    assert "8 layers (3 + 5, the blocks' in order) over 2 stages" in pipe.split_text()


def test_a_later_block_whose_output_does_not_feed_its_input_is_an_error() -> None:
    broken = TWO.replace("E2[B_X, D] = E1[B_X, D] + G[B_X, F] · V2[F, D]", "E2[B_X, F] = gelu(G[B_X, F])")
    with pytest.raises(ShardcError, match="`layers M` repeats the block") as err:
        shardc.parse(broken.replace("Out[B_X, D] = E2[B_X, D]", "Out[B_X, F] = E2[B_X, F]")
                     .replace("param W1, W2, V1, V2", "param W1, W2, V1"))
    assert err.value.span is not None and err.value.span.line == 9


@pytest.mark.slow
def test_two_blocks_verify() -> None:
    report = verify(_spec())
    assert report.ok, render_report(report)
