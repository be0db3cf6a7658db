"""Under a pipeline the weight gradients are summed over the microbatches on each device and reduced once
a step, in the lowered program as in the cost (Megatron-LM's, DeepSpeed's and torchtitan's order)."""

from __future__ import annotations

import pytest

import shardc
from shardc.ir.plan import Op
from shardc.lowering.pipeline_grads import Split, split_reductions
from shardc.lowering.pipeline_lowering import lower_pipeline
from shardc.pipeline.boundary import gradient_reductions
from shardc.verification.pipeline_hlo import outside_loop
from tests.test_plan_sections import MODEL


def test_the_block_hands_on_partial_sums_and_reduces_them_apart() -> None:
    plan = shardc.plan(shardc.parse(MODEL))
    block = lower_pipeline(plan, load=False).ends.block  # type: ignore[union-attr]
    split = split_reductions(block)
    assert [(s.op, s.tensor) for s in split.once] == [(Op.REDUCE_SCATTER, "dW2"), (Op.REDUCE_SCATTER, "dW1")]
    assert {k for k in gradient_reductions(block)} == {block.backward.index(s) for s in split.once}
    assert not gradient_reductions(split.each)  # each microbatch's backward reduces no weight gradient
    assert [str(g) for g in split.each.grads] == ["dX0[B_X, S, D]", "dW1[D, F_Y]{U_X}", "dW2[F_Y, D]{U_X}"]
    assert [str(g) for g in split.finals] == ["dW1[D_X, F_Y]", "dW2[F_Y, D_X]"]


def test_the_module_reduces_each_parts_gradients_in_its_own_function() -> None:
    source = lower_pipeline(shardc.plan(shardc.parse(MODEL)), load=False).source
    for name in ("reduce_local", "pre_reduce_local", "post_reduce_local"):
        assert f"\ndef {name}(" in source
    backward = source.split("\ndef backward_local(")[1].split("\ndef ")[0]
    assert "psum_scatter" not in backward and "dW1[None]" in backward


def test_outside_loop_leaves_out_the_loop_body_and_what_it_calls() -> None:
    text = """HloModule m

%fused (p: f32[2]) -> f32[2] {
  %rs.1 = f32[1]{0} reduce-scatter(%p), replica_groups={{0,1}}, dimensions={0}
}

%body (p: (s32[])) -> (s32[]) {
  %f = f32[2]{0} fusion(%x), kind=kLoop, calls=%fused
}

%cond (p: (s32[])) -> pred[] {
  %c = pred[] constant(true)
}

ENTRY %main (a: f32[2]) -> f32[1] {
  %w = (s32[]) while(%t), condition=%cond, body=%body
  %rs.2 = f32[1]{0} reduce-scatter(%a), replica_groups={{0,1}}, dimensions={0}
}
"""
    lines = outside_loop(text)
    assert any("%rs.2" in line for line in lines) and not any("%rs.1" in line or "%c =" in line for line in lines)


@pytest.mark.slow
def test_reductions_left_in_the_loop_fail_the_hlo_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The verifier wants each weight-gradient reduction after the loop: a program that runs it every
    tick (no split) fails those rows, and the values still agree."""
    from shardc.lowering import pipeline_lowering
    from shardc.verification.pipeline_verify import verify_pipeline

    plan = shardc.plan(shardc.parse(MODEL))
    good = verify_pipeline(plan)
    once = [r for r in good.collectives if r.step.endswith("(once a step)")]
    assert good.ok and len(once) == 4 and all(r.ok for r in once)  # dW_emb, dW1, dW2, dW_out
    monkeypatch.setattr(pipeline_lowering, "split_reductions", Split)
    bad = verify_pipeline(plan)
    assert all(r.ok for r in bad.values)
    assert {r.step for r in bad.collectives if not r.ok} == {r.step for r in once}
