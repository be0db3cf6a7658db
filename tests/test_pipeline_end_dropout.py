"""A dropout in the statements around a pipelined block (Megatron-LM's embedding dropout, on the first
stage; a head's, on the last) lowers: each microbatch draws its slice of the whole batch's mask under
the step's key, as the unpipelined reference draws the statements around the block."""

from __future__ import annotations

import pytest

import shardc
from shardc.verification.pipeline_verify import verify_pipeline

pytestmark = pytest.mark.slow  # each test compiles a pipelined module

SPEC = """mesh P=2 pipeline, X=2
dims B=8, S=4, D=8, F=8, V=16
microbatches 2
schedule {schedule}
const Tok, Next
X0[B_X, S, D] = dropout(embed(Tok[B_X, S], W_emb[V, D]), 0.1)
layers 2 {{
  H[B_X, S, F] = X0[B_X, S, D] · W_in[D, F]
  X1[B_X, S, D] = H[B_X, S, F] · W_o[F, D]
}}
Lg[B_X, S, V] = dropout(X1[B_X, S, D] · W_out[D, V], 0.25)
Loss[] = cross_entropy(Lg[B_X, S, V], Next[B_X, S])
"""


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_dropout_around_the_block_verifies(schedule: str) -> None:
    """MT-NLG's and GPT-3's embedding dropout (benchmarks/runs/mtnlg_530b.shard) was refused; the block has
    no dropout here, so the two keys' losses differ only by the ends' masks."""
    report = verify_pipeline(shardc.plan(shardc.parse(SPEC.format(schedule=schedule), "ends.shard")), key=3)
    assert report.ok, [r for r in report.values + report.collectives if not r.ok]
    losses = {r.phase: r.max_reference for r in report.values if r.tensor == "Loss"}
    assert set(losses) == {"forward key 3", "forward key 4"} and len(set(losses.values())) == 2
