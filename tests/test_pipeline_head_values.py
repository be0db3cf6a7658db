"""A pipelined stage holds the values the plan makes outside the ``layers`` block, not only the spec's names:
the loss's row logsumexp (``Loss_lse``), which the cross-entropy's backward reads, is the last stage's."""

from __future__ import annotations

import pytest

import shardc
from shardc.costmodel.memory import kept_once, residual_values, value_bytes
from shardc.costmodel.stage_memory import kept_copies
from shardc.ir.plan import Plan
from shardc.spec.stages import pipeline_of

MODEL = """\
mesh P=2 pipeline, X=2
dims B=16, S=32, D=64, F=128, V=128
microbatches 4
schedule 1f1b
hardware tpu-v5p
const Tok, Next
param W_emb, W_in, W_down, W_out

X0[B_X, S, D] = embed(Tok[B_X, S], W_emb[V, D_X])
layers 4 {
  L1[B_X, S, D] = rmsnorm(X0[B_X, S, D] over D)
  G[B_X, S, F] = silu(L1[B_X, S, D] · W_in[D_X, F])
  X1[B_X, S, D] = X0[B_X, S, D] + G[B_X, S, F] · W_down[F, D_X]
}
Lg[B_X, S, V] = X1[B_X, S, D] · W_out[D_X, V]
Loss[] = cross_entropy(Lg[B_X, S, V], Next[B_X, S])
"""


@pytest.fixture(scope="module")
def plan() -> Plan:
    return shardc.plan(shardc.parse(MODEL))


def test_the_last_stage_keeps_the_losss_logsumexp(plan: Plan) -> None:
    """Issue 21: the stages held only the spec's names outside the block, so ``Loss_lse``, which the planner
    makes, was kept on no stage of a pipelined spec."""
    lse = next(r for r in residual_values(plan) if r.name == "Loss_lse")
    pipe = pipeline_of(plan.spec)
    assert pipe is not None
    copies = kept_copies(plan, pipe, [1.0] * pipe.stages)
    assert [c[lse] for c in copies] == [0.0, 1.0]  # the last stage's, one microbatch's in flight
    report = shardc.cost(plan)
    assert report.pipeline is not None
    last = report.pipeline.stages[-1]
    micro = dict(report.sizes) | {report.pipeline.dim: report.pipeline.microbatch_size}
    assert last.activation_bytes >= value_bytes(plan, lse, micro) * last.held


def test_every_value_kept_once_is_held_by_a_stage(plan: Plan) -> None:
    """Each value outside the block that the backward reads sits on some stage (the first's or the last's)."""
    pipe = pipeline_of(plan.spec)
    assert pipe is not None
    copies = kept_copies(plan, pipe, [1.0] * pipe.stages)
    values = residual_values(plan)
    assert all(any(c[r] > 0 for c in copies) for r in kept_once(plan, values))
