"""A `layers L { ... }` block's plan in three sections (before, block, after), cut once by the planner,
costed and lowered from the same steps."""

from __future__ import annotations

from dataclasses import replace

import pytest

import shardc
from shardc.errors import InternalError
from shardc.ir.plan import SECTIONS, Plan, Sections
from shardc.lowering.pipeline_ends import cut_parts
from shardc.verification.verify import render_report, verify

MODEL = """\
mesh P=2 pipeline, X=2, Y=2
dims B=16, S=4, D=8, F=16, V=32
microbatches 2
const Tok, Next
param W_emb, W1, W2, W_out
X0[B_X, S, D] = embed(Tok[B_X, S], W_emb[V_Y, D_X])
layers 4 {
  H[B_X, S, F_Y] = gelu(X0[B_X, S, D] · W1[D_X, F_Y])
  X1[B_X, S, D] = X0[B_X, S, D] + H[B_X, S, F_Y] · W2[F_Y, D_X]
}
Fn[B_X, S, D] = rmsnorm(X1[B_X, S, D] over D)
Lg[B_X, S, V_Y] = Fn[B_X, S, D] · W_out[D_X, V_Y]
Loss[] = cross_entropy(Lg[B_X, S, V_Y], Next[B_X, S])
"""


def _plan(recompute: str = "none") -> Plan:
    return shardc.plan(shardc.parse(MODEL), recompute=recompute)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_sections_cut_every_phase_in_its_order(recompute: str) -> None:
    plan = _plan(recompute)
    sections = [plan.section(name) for name in SECTIONS]
    assert sum((s.forward for s in sections), ()) == plan.forward
    assert sum((s.recomputed for s in sections), ()) == plan.recomputed
    assert sum((s.backward for s in reversed(sections)), ()) == plan.backward  # the head's backward first
    before, block, after = sections
    assert before.forward and block.forward and after.forward and before.backward and after.backward
    assert all(s.once for s in before.forward + after.forward + before.backward + after.backward)
    assert not any(s.once for s in block.forward + block.backward)
    assert {s.dst.name for s in after.forward} >= {"Fn", "Lg", "Loss"}
    assert "X0" in {s.dst.name for s in before.forward} and "X1" in {s.dst.name for s in block.forward}


def test_the_lowered_parts_are_the_sections_steps() -> None:
    """Lowering plans nothing again: each part runs its section's steps, the ones the cost priced."""
    plan = _plan()
    ends = cut_parts(plan)
    for part, name in ((ends.pre, "before"), (ends.block, "block"), (ends.post, "after")):
        section = plan.section(name)
        assert (part.forward, part.backward) == (section.forward, section.backward)
    assert [g.name for g in ends.block.grads] == ["dX0", "dW1", "dW2"]
    assert ends.pre.cotangents == tuple(g for g in ends.block.grads if g.name == "dX0")
    assert [c.name for c in ends.block.cotangents] == ["dX1"] and [c.name for c in ends.post.cotangents] == ["dLoss"]
    assert [i.name for i in ends.post.tensors if i.role == "input"] == ["X1", "Next"]


def test_without_a_block_every_step_is_the_blocks() -> None:
    plan = shardc.plan(shardc.parse("mesh X=2\nOut[B_X, F] = In[B_X, D] · W[D, F]\n"))
    assert plan.section("block").forward == plan.forward and plan.section("block").backward == plan.backward
    assert not plan.section("before").forward and not plan.section("after").backward


def test_an_input_read_before_the_block_and_in_it_cuts_a_layers_sum_from_the_statements_before() -> None:
    """A data input read before the block and by the block: each layer sums its own contributions to the
    input's gradient (``dX0_layer``, the block's last backward step, as a layer hands it back), and the
    statements before the block add theirs to it once, so the plan cuts into sections."""
    spec = "mesh X=4\nO1[D, S] = X0[S_X, D]\nlayers 3 {\n  O2[D, S] = X0[S_X, D]\n  X1[S_X, D] = tanh(X0[S_X, D])\n}\n"
    plan = shardc.plan(shardc.parse(spec))
    assert plan.sections is not None and Sections.of(plan.forward, plan.backward, plan.recomputed) == plan.sections
    block, before = plan.section("block"), plan.section("before")
    assert str(block.backward[-1].dst) == "dX0_layer[S_X, D]" and not block.backward[-1].once
    last = before.backward[-1]
    assert last.dst.name == "dX0" and last.once and "dX0_layer" in {o.name for o in last.operands}
    with pytest.raises(InternalError, match="among the block's steps"):  # a plan whose once steps sit inside
        replace(plan, sections=None).section("block")


def test_a_value_made_before_the_block_and_read_by_it_and_before_it_cuts_too() -> None:
    """E, made before the block, read by X0's statement and by the block: the block's contribution (dE_1) is
    summed once the block's backward ends, the statements before it add theirs once (dE).  The sum was a step of
    the block placed after X0's backward (a step before it), the plan did not cut, and `shardc cost` of a
    pipelined spec so stopped with "a planner bug"."""
    spec = "mesh X=4\nE[S_X, D] = tanh(In[S_X, D])\nX0[S_X, D] = gelu(E[S_X, D])\nlayers 3 {\n" \
           "  X1[S_X, D] = tanh(X0[S_X, D]) + E[S_X, D]\n}\n"
    plan = shardc.plan(shardc.parse(spec))
    assert plan.sections is not None
    total = next(s for s in plan.section("before").backward if s.dst.name == "dE")
    assert total.once and {o.name for o in total.operands} == {"dE_1", "dE_2"}
    assert "dE_1" in {s.dst.name for s in plan.section("block").backward}


def test_a_block_input_without_a_gradient_is_refused_plainly() -> None:
    """Nothing before the block takes a gradient, so the plan makes none of the block's input, which the
    layers of a pipeline pass back to each other: lowering says so instead of running another backward."""
    from shardc.errors import ShardcError

    text = MODEL.replace("const Tok, Next\nparam W_emb, W1", "const Tok, Next, W_emb\nparam W1")
    with pytest.raises(ShardcError, match="no gradient of X0, the block's input"):
        cut_parts(shardc.plan(shardc.parse(text)))


# The block's input is laid out by sequence between layers and moved to the batch inside each: the
# layer's own layouts of X1 (before its move) and of dX0 (before its move back) are not what the
# last layer hands on, nor what the first hands back.
MOVED = MODEL.replace("X0[B_X, S, D] = embed(Tok[B_X, S], W_emb[V_Y, D_X])",
                      "E[B_X, S, D] = embed(Tok[B_X, S], W_emb[V_Y, D_X])\nX0[B, S_X, D] = E[B_X, S, D]").replace(
    "  H[B_X, S, F_Y] = gelu(X0[B_X, S, D] · W1[D_X, F_Y])\n"
    "  X1[B_X, S, D] = X0[B_X, S, D] + H[B_X, S, F_Y] · W2[F_Y, D_X]",
    "  Xs[B_X, S, D] = X0[B, S_X, D]\n  H[B_X, S, F_Y] = gelu(Xs[B_X, S, D] · W1[D_X, F_Y])\n"
    "  X1[B, S_X, D] = Xs[B_X, S, D] + H[B_X, S, F_Y] · W2[F_Y, D_X]").replace(
    "rmsnorm(X1[B_X, S, D] over D)", "rmsnorm(X1[B, S_X, D] over D)")


def test_what_crosses_the_blocks_edges_is_in_its_declared_sharding() -> None:
    assert MOVED.count("S_X") == 4
    plan = shardc.plan(shardc.parse(MOVED))
    after, block = plan.section("after"), plan.section("block")
    reads = {str(r) for s in after.forward for r in s.operands if r.name == "X1"}
    assert reads == {"X1[B, S_X, D]"}  # the last layer's output, not the first layer's before its move
    handed = [s.dst for s in block.backward if s.dst.name == "dX0"]
    assert str(handed[-1]) == "dX0[B, S_X, D]"  # each layer hands dX0 back as the layer before made X1
    before = plan.section("before")
    assert {str(r) for s in before.backward for r in s.operands if r.name == "dX0"} == {"dX0[B, S_X, D]"}


@pytest.mark.slow
def test_what_crosses_the_blocks_edges_verifies() -> None:
    report = verify(shardc.parse(MOVED))
    assert report.ok, render_report(report)


@pytest.mark.slow
def test_an_input_read_before_the_block_and_in_it_verifies() -> None:
    spec = "mesh X=4\ndims S=8, D=4\nO1[S_X, D] = gelu(X0[S_X, D])\nlayers 3 {\n  O2[D, S] = X0[S_X, D]\n" \
           "  X1[S_X, D] = tanh(X0[S_X, D])\n}\n"
    report = verify(shardc.parse(spec), devices=4)
    assert report.ok, render_report(report)


# A param a layer reads twice (the `G · G · I`-like chain of issue 20's point 3, found by a search of chains
# in blocks): its gradient's two contributions are the layer's own, summed in the block.
TWICE = """mesh P=2 pipeline, X=2
dims B=16, D=8, E=8, V=16
microbatches 2
const Tok, Next
param W1, W_emb, W_out
X0[B_X, D] = embed(Tok[B_X], W_emb[V, D])
layers 2 {
  P0[B_X, D] = W1[D, E] · W1[D, E] · X0[B_X, D]
  X1[B_X, D] = X0[B_X, D] + P0[B_X, D]
}
Lg[B_X, V] = X1[B_X, D] · W_out[D, V]
Loss[] = cross_entropy(Lg[B_X, V], Next[B_X])
"""


def test_a_param_a_layer_reads_twice_sums_its_gradient_in_the_layer() -> None:
    """``W1 · W1 · X0``: dW1 = dW1_1 + dW1_2 is the block's step, each layer's own weights' gradient.  It was
    summed into ``dW1_layer`` and aliased to dW1 once, after the block, in the statements before it, so the
    first stage's end read a sum only the block makes: ``shardc lower`` raised "the backward reads
    dW1_layer[D, E], which neither the forward nor the inputs, residuals or cotangents provide"."""
    plan = shardc.plan(shardc.parse(TWICE))
    block, before = plan.section("block"), plan.section("before")
    made = [s for s in block.backward if s.dst.name == "dW1"]
    assert len(made) == 1 and {o.name for o in made[0].operands} == {"dW1_1", "dW1_2"}
    assert not any(s.dst.name.startswith("dW1") for s in before.backward)
    assert [g.name for g in cut_parts(plan).block.grads].count("dW1") == 1


@pytest.mark.slow
def test_a_param_a_layer_reads_twice_verifies() -> None:
    report = verify(shardc.parse(TWICE))
    assert report.ok, render_report(report)


FIRST = "layers 2 {\n  X9[B_X, D] = X0[B_X, D] + silu(X0[B_X, D])\n}\n"  # a block before the one reading W1 twice
LATER = TWICE.replace("layers 2 {\n  P0", FIRST + "layers 2 {\n  P0").replace(
    "W1[D, E] · W1[D, E] · X0", "W1[D, E] · W1[D, E] · X9").replace("X0[B_X, D] + P0", "X9[B_X, D] + P0")


def test_a_later_blocks_param_read_twice_sums_its_gradient_in_that_block() -> None:
    """The same in the second of two blocks: the sum is that block's step, not the first's (block 0, where the
    lowering of block 1's layer found no dW1_1)."""
    plan = shardc.plan(shardc.parse(LATER))
    (made,) = [s for s in plan.backward if s.dst.name == "dW1"]
    assert made.block == 1 and not made.once


@pytest.mark.slow
def test_a_later_blocks_param_read_twice_verifies() -> None:
    report = verify(shardc.parse(LATER))
    assert report.ok, render_report(report)
