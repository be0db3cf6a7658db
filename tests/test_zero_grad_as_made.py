"""ZeRO-1: a gradient the backward makes sliced further than its param is handed to the optimizer as made.

StarCoder's learned position table (benchmarks/runs/starcoder_15b.shard) had its gradient made sliced over Y
(the sum over the batch is cheaper on a quarter of the rows), all-gathered over Y to the table's layout, and
sliced over Y again by the optimizer's move onto the ZeRO shard: the AllGather bought nothing.
"""

from __future__ import annotations

import pytest

import shardc
from shardc.ir.plan import Op, Plan, Step
from shardc.planner import backward, candidates
from shardc.timing import plan_time

# an embedding plus a learned position table, a layernorm (its cotangent replicated over Y) and a Y-sharded MLP
SPEC = """\
mesh X=32, Y=4
dims B=512, S=8192, D=6144, V=49152, F=24576
hardware a100
zero 1 over X
const Tok, Next
param W_emb, W_pos, W_in, W_out
X0[B_X, S, D] = embed(Tok[B_X, S], W_emb[V_Y, D]) + W_pos[S, D]
L1[B_X, S, D] = layernorm(X0[B_X, S, D] over D)
Hd[B_X, S, F_Y] = L1[B_X, S, D] · W_in[D, F_Y]
X1[B_X, S, D] = X0[B_X, S, D] + Hd[B_X, S, F_Y] · W_out[F_Y, D]
Lg[B_X, S, V_Y] = X1[B_X, S, D] · W_emb[V_Y, D]
Loss[] = cross_entropy(Lg[B_X, S, V_Y], Next[B_X, S])
"""


@pytest.fixture(scope="module")
def planned() -> Plan:
    return shardc.plan(shardc.parse(SPEC))


def _moves(steps: tuple[Step, ...], tensor: str) -> list[tuple[Op, str, str, str]]:
    return [(s.op, "".join(s.axes), str(s.src), str(s.dst)) for s in steps if s.is_collective and s.tensor == tensor]


def test_position_gradient_is_not_gathered_then_sliced(planned: Plan) -> None:
    (grad,) = [g for g in planned.grads if g.name == "dW_pos"]
    assert str(grad) == "dW_pos[S_Y, D]{U_X}"  # as the sum over the batch made it
    assert _moves(planned.backward, "dW_pos") == []
    assert _moves(planned.optimizer, "dW_pos") == [
        (Op.ALL_TO_ALL, "Y", "dW_pos[S_Y, D]{U_X}", "dW_pos[S, D_Y]{U_X}"),
        (Op.REDUCE_SCATTER, "X", "dW_pos[S, D_Y]{U_X}", "dW_pos[S_X, D_Y]"),
        (Op.ALL_GATHER, "Y", "dW_pos[S_X, D_Y]", "dW_pos[S_X, D]"),
    ]


def test_no_dearer_than_gathering_to_the_table_layout(planned: Plan, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backward, "_finer", lambda layout, made: layout)  # the gradient made in W_pos's layout
    gathered = shardc.plan(shardc.parse(SPEC))
    assert [str(g) for g in gathered.grads if g.name == "dW_pos"] == ["dW_pos[S, D]{U_X}"]
    assert candidates.objective(plan_time(planned)) <= candidates.objective(plan_time(gathered))
