"""A move of an intermediate that no step reads is dropped, as XLA drops it: the spec's own results and the
residuals are what the forward hands on, not the layout the planner first recorded for an intermediate."""

from __future__ import annotations

import shardc
from shardc.ir.plan import Op
from shardc.planner.check import check_plan

# Megatron's learned positions: the embedding's partial sums plus a replicated table, reduced once
EMBED_PLUS_POSITIONS = """mesh Y=2
const Tok
param W_emb, W_pos
X0[B, S, D] = embed(Tok[B, S], W_emb[V_Y, D]) + W_pos[S, D]
"""


def test_an_embedding_added_to_positions_is_reduced_once() -> None:
    """Issue 21 (Megatron-LM's pipelined runs, MT-NLG's): the sum read the lookup's partial sums, and the
    AllReduce of the lookup itself, read by nothing, stayed in the plan beside the sum's (two where one runs)."""
    plan = shardc.plan(shardc.parse(EMBED_PLUS_POSITIONS, "positions.shard"))
    reduces = [s for s in plan.forward if s.op is Op.ALL_REDUCE]
    assert [s.dst.name for s in reduces] == ["X0"]
    assert check_plan(plan) == []
    assert plan.tensor("X0_t1").ref.unreduced == ("Y",)  # the intermediate as the program holds it
