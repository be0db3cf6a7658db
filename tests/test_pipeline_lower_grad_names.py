"""A lowered pipeline's gradients carry the plan's names (:meth:`Plan.grad_name`), not ``d`` + name.

The book names ``W``'s gradient ``dW`` only when the spec has no tensor of that name
(:mod:`shardc.names`). A pipelined ``layers`` block is lowered as three parts, the sections
of the whole plan (the one costed); each keeps its names, where a part planned alone that
does not read the tensor ``dW`` would call ``W``'s gradient ``dW`` and the whole plan ``d_W``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import shardc
from shardc.lowering.pipeline_ends import cut_parts
from shardc.lowering.pipeline_lowering import lower_pipeline

BLOCK = """mesh P=2 pipeline, X=2
dims B=8, D=6, F=4
dtype f32
layers 4
microbatches 2
param W, V
dW[B_X, F] = X[B_X, D] · W[D, F]
dX[B_X, F] = gelu(dW[B_X, F])
Out[B_X, D] = X[B_X, D] + dX[B_X, F] · V[F, D]
"""

# the block reads a tensor named like the head's weight's gradient, the head one named like the block's
ENDS = """mesh P=2 pipeline, X=2, Y=2
dims B=16, S=4, D=8, F=16, V=32
microbatches 2
const Tok, Next
param W_emb, W1, W2, W_out
X0[B_X, S, D] = embed(Tok[B_X, S], W_emb[V_Y, D_X])
layers 4 {
  dW_out[B_X, S, F_Y] = gelu(X0[B_X, S, D] · W1[D_X, F_Y])
  X1[B_X, S, D] = X0[B_X, S, D] + dW_out[B_X, S, F_Y] · W2[F_Y, D_X]
}
dW1[B_X, S, D] = rmsnorm(X1[B_X, S, D] over D)
Lg[B_X, S, V_Y] = dW1[B_X, S, D] · W_out[D_X, V_Y]
Loss[] = cross_entropy(Lg[B_X, S, V_Y], Next[B_X, S])
"""


def _weights(plan: shardc.ir.plan.Plan) -> set[str]:  # type: ignore[name-defined]
    return {plan.grad_name(i.name) for i in plan.tensors if i.role == "param"}


def test_the_parts_keep_the_whole_plans_gradient_names() -> None:
    plan = shardc.plan(shardc.parse(ENDS))
    assert plan.grad_name("W1") == "d_W1" and plan.grad_name("W_out") == "d_W_out"
    ends = cut_parts(plan)
    for part in (ends.pre, ends.block, ends.post):
        assert part.gradient_names and all(plan.grad_name(t) == g for t, g in part.gradient_names)


def test_the_block_module_names_its_gradients_as_the_plan() -> None:
    plan = shardc.plan(shardc.parse(BLOCK))
    source = lower_pipeline(plan, load=False).source
    grads = {t: plan.grad_name(t) for t in ("X", "W", "V")}
    assert grads == {"X": "d_X", "W": "d_W", "V": "dV"}
    assert re.search(r"^GRADS = (.*?)  #", source, re.M).group(1) == repr(grads)  # type: ignore[union-attr]


@pytest.mark.slow
def test_a_block_beside_tensors_named_dW_and_dX_verifies_from_the_cli(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from shardc.cli.main import main

    path = tmp_path / "named.shard"
    path.write_text(BLOCK, encoding="utf-8")
    assert main(["verify", str(path)]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    for grad in ("d_W", "d_X", "dV"):
        assert re.search(rf"\b{grad}\b", out), out


@pytest.mark.slow
def test_ends_beside_tensors_named_like_gradients_verify() -> None:
    from shardc.verification.verify import verify

    plan = shardc.plan(shardc.parse(ENDS))
    report = verify(plan)
    assert report.ok, [r for r in report.values + report.collectives if not r.ok]
    assert {r.tensor for r in report.values if r.phase == "backward"} == _weights(plan)
    assert {"d_W1", "d_W_out"} <= _weights(plan)
