"""A tied embedding's gradient swapped between the end stages in the type the gradient is reduced in: DeepSpeed's
pipeline engine all-reduces ``weight._hp_grad`` (BF16_Optimizer's fp32 gradient) under bf16
(deepspeed/runtime/pipe/engine.py, _exec_reduce_tied_grads), as it reduces the data-parallel gradients."""

from __future__ import annotations

import pytest

import shardc
from shardc.collectives import Op, collective_time
from shardc.timing import plan_links

TIED = """\
mesh P=2 pipeline, X=2
dims B=16, S=512, D=1024, F=4096, V=32000
microbatches 4
hardware h100
const Tok, Next
param W_emb, W1, W2
X0[B_X, S, D] = embed(Tok[B_X, S], W_emb[V, D])
layers 4 {
  H[B_X, S, F] = gelu(X0[B_X, S, D] · W1[D, F])
  X1[B_X, S, D] = X0[B_X, S, D] + H[B_X, S, F] · W2[F, D]
}
Lg[B_X, S, V] = X1[B_X, S, D] · W_emb[V, D]
Loss[] = cross_entropy(Lg[B_X, S, V], Next[B_X, S])
"""


@pytest.mark.parametrize(("line", "nbytes"), [("", 2), ("optimizer bf16opt20\n", 4), ("grad_reduce in f32\n", 4)])
def test_the_tied_gradient_moves_in_its_reduction_type(line: str, nbytes: int) -> None:
    report = shardc.cost(shardc.plan(shardc.parse(line + TIED)))
    assert report.pipeline is not None
    plan, sizes = report.plan, report.sizes
    # the whole V x D gradient (W_emb is not sharded), once, over the stage axis: 32000 x 1024 elements
    want = collective_time(Op.COLLECTIVE_PERMUTE, 32000 * 1024 * nbytes, ("P",), plan.spec.mesh, sizes,
                           report.hardware, plan_links(plan, report.hardware, sizes)[0]).seconds
    assert report.pipeline.tied_exchange_s == pytest.approx(want, rel=1e-12)
