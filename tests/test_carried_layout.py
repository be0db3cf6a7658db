"""A `layers` block whose carried activation is declared sharded over a model axis in a non-batch dim
(PaLM's and Gopher's X0[B_X, S, D_Y]): every layer gathers it, and a pipeline's block part receives it."""

from __future__ import annotations

import pytest

import shardc
from shardc.ir.plan import Op
from shardc.lowering.pipeline_ends import cut_parts

# the embedding made whole (W_emb replicated), so the block's input is a free slice of a value made before it
SPEC = """mesh {mesh}
dims B=8, S=4, D=8, F=16, V=16
{micro}const Tok, Next
param W_emb, W_in, W_out, W_lm
X0[B_X, S, D_Y] = embed(Tok[B_X, S], W_emb[V, D])
layers 2 {{
  L1[B_X, S, D] = rmsnorm(X0[B_X, S, D_Y] over D)
  X1[B_X, S, D_Y] = X0[B_X, S, D_Y] + gelu(L1[B_X, S, D] · W_in[D, F_Y]) · W_out[F_Y, D]
}}
Lg[B_X, S, V] = X1[B_X, S, D_Y] · W_lm[D, V]
Loss[] = cross_entropy(Lg[B_X, S, V], Next[B_X, S])
"""


@pytest.fixture(scope="module")
def piped() -> shardc.Plan:
    return shardc.plan(shardc.parse(SPEC.format(mesh="P=2 pipeline, X=2, Y=2", micro="microbatches 2\n")))


def _gathers(steps: tuple[shardc.ir.plan.Step, ...], tensor: str, inside: bool) -> int:
    return sum(s.op is Op.ALL_GATHER and s.tensor == tensor and (s.region is not None) == inside for s in steps)


def test_every_layer_gathers_the_carried_input_and_the_head_the_last_output() -> None:
    """A layer read X0[B_X, S, D], the embedding's whole value made before the block, as if it were every layer's
    input (the gather folded away as a slice of it): layer 2 would read layer 0's input, and the head read X1[..., D]
    as a layer made it on the way, not as the last layer hands it on."""
    plan = shardc.plan(shardc.parse(SPEC.format(mesh="X=2, Y=2", micro="")))
    assert _gathers(plan.forward, "X0", inside=True) == 1
    assert _gathers(plan.forward, "X1", inside=False) == 1


def test_the_block_part_receives_its_input_though_it_gathers_it(piped: shardc.Plan) -> None:
    """The block part took X0 for an activation it makes (its gather's result bears the name), so it had no input
    and the lowering refused: "a pipelined block's output must be laid out as its input to repeat: ... vs None"."""
    roles = {i.name: i.role for i in cut_parts(piped).block.tensors}
    assert roles["X0"] == "input" and roles["X1"] == "activation"
