"""An input without the batch dim read inside a pipelined block (BLOOM's ALiBi bias [N, T]) is the same for
every microbatch and layer: every stage holds it whole, laid out over the other axes as its spec says.
An input with the batch dim stays refused (tests/test_robust.py)."""

from __future__ import annotations

from typing import Any

import pytest

import shardc
from shardc.verification.pipeline_verify import verify_pipeline

SPEC = """mesh P=2 pipeline, X=2, Y=2
dims B=8, S=4, T=4, D=8, N=2, V=16
microbatches 2
schedule {schedule}
const Tok, Next, Bias
X0[B_X, S, D] = embed(Tok[B_X, S], W_emb[V, D])
layers 2 {{
  Sc[B_X, N_Y, S, T] = X0[B_X, S, D] · W_q[D, N_Y, T] · Bias[N_Y, T] + Bias[N_Y, T]
  X1[B_X, S, D] = X0[B_X, S, D] + Sc[B_X, N_Y, S, T] · W_o[N_Y, T, D]
}}
Lg[B_X, S, V] = X1[B_X, S, D] · W_out[D, V]
Loss[] = cross_entropy(Lg[B_X, S, V], Next[B_X, S])
"""


@pytest.mark.slow  # compiles a pipelined module
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_an_input_without_the_batch_dim_is_held_by_every_stage(schedule: str) -> None:
    """BLOOM's ALiBi was refused ("a pipelined stage receives only the previous stage's activation"); here
    W_q's gradient reads the bias in the backward, so a stage without it would compute another."""
    from jax.sharding import PartitionSpec as P

    plan = shardc.plan(shardc.parse(SPEC.format(schedule=schedule), "bias.shard"))
    report = verify_pipeline(plan)
    assert report.ok, [r for r in report.values + report.collectives if not r.ok]
    assert shardc.lower(plan, sizes={"P": 2, "X": 2, "Y": 2}).namespace.PIPELINE.shared == {"Bias": P("Y", None)}


def test_an_input_with_the_batch_dim_in_the_block_is_refused_with_a_true_fix() -> None:
    from shardc.errors import ShardcError
    from shardc.pipeline.boundary import check_lowerable, shared_inputs

    text = SPEC.format(schedule="1f1b").replace("Bias[N_Y, T]", "Bias[B_X, N_Y, T]")
    plan = shardc.plan(shardc.parse(text, "bias.shard"))
    assert shared_inputs(plan) == frozenset()
    with pytest.raises(ShardcError, match="reads Bias, an input with the batch dim B") as err:
        check_lowerable(plan)
    assert err.value.span is not None and err.value.span.line == 8
    assert "drop its dim B where every sequence shares it" in (err.value.fix or "")
    assert shared_inputs(shardc.plan(shardc.parse(SPEC.format(schedule="1f1b")))) == {"Bias"}


@pytest.mark.slow  # compiles two pipelined schedules (not run)
def test_the_memory_check_prices_the_split_the_program_runs() -> None:
    """BLOOM's `stage_layers 5, 6, ..., 5` of 70 layers, run as 2 a stage: the check priced stage 1 at 6 of the
    run's 24 layers (params 43.8 kB beside XLA's 16.9 kB of arguments).  A spec's `stage_layers 3, 1` runs as
    (2, 1), the program of 3 layers split evenly: the two checks price the same stage."""
    from shardc.verification.pipeline_verify import check_pipeline_memory

    even = SPEC.format(schedule="1f1b").replace("layers 2 {", "layers 3 {")
    split = SPEC.format(schedule="1f1b").replace("layers 2 {", "layers 4 {").replace("schedule 1f1b",
                                                                                    "schedule 1f1b\nstage_layers 3, 1")
    checks = [check_pipeline_memory(shardc.plan(shardc.parse(text)), 8) for text in (split, even)]
    assert checks[0].shardc_parts == checks[1].shardc_parts and checks[0].stage == checks[1].stage == 0


def test_the_cost_keeps_a_shared_input_once_a_device() -> None:
    """W_q's backward reads the bias, so it is a residual; as an input without the microbatch dim it was counted
    once a layer (a saved weight's count), where the lowered pipeline passes one copy to every stage."""
    from shardc.costmodel.stage_memory import kept_copies
    from shardc.spec.stages import pipeline_of

    plan = shardc.plan(shardc.parse(SPEC.format(schedule="1f1b").replace("layers 2 {", "layers 4 {")))
    pipe = pipeline_of(plan.spec)
    assert pipe is not None
    copies = kept_copies(plan, pipe, [2.0, 1.0])
    assert [{str(r): k for r, k in c.items() if r.name == "Bias"} for c in copies] == [{"Bias[N_Y, T]": 1.0}] * 2
    assert all(k == 2 * held for c, held in zip(copies, (2, 1), strict=True) for r, k in c.items() if r.name == "Sc")


# an input without the batch dim read before the block (a learned position table) and one after it (the
# output layer's bias): each held whole by the end stage that reads it, its gradient summed there
ENDS = """mesh P=2 pipeline, X=2, Y=2
dims B=8, S=4, D=8, F=16, V=16
microbatches 4
schedule {schedule}
const Tok, Next
X0[B_X, S, D] = embed(Tok[B_X, S], W_emb[V, D]) + Pos[S, D]
layers 2 {{
  H[B_X, S, F] = gelu(X0[B_X, S, D] · W1[D, F_Y])
  X1[B_X, S, D] = X0[B_X, S, D] + H[B_X, S, F] · W2[F_Y, D]
}}
Lg[B_X, S, V] = X1[B_X, S, D] · W_out[D, V_Y] + Bias[V_Y]
Loss[] = cross_entropy(Lg[B_X, S, V], Next[B_X, S])
"""


def test_an_input_without_the_batch_dim_around_the_block_is_lowerable_and_one_with_it_given_a_gradient_is_not() -> None:
    """One with the batch dim is data cut into the microbatches, as token ids are: `const`, it lowers (a mask: it was
    refused, "an input with the batch dim B"); given a gradient it is refused, as the pipeline returns none of it."""
    from shardc.errors import ShardcError
    from shardc.pipeline.boundary import check_lowerable

    check_lowerable(shardc.plan(shardc.parse(ENDS.format(schedule="1f1b"))))  # was refused: "an input; ..."
    batched = ENDS.format(schedule="1f1b").replace("Pos[S, D]", "Pos[B_X, S, D]")
    check_lowerable(shardc.plan(shardc.parse(batched.replace("const Tok, Next", "const Tok, Next, Pos"))))
    with pytest.raises(ShardcError, match="around the pipelined block read Pos, an input with the batch dim B that "
                       "gets a gradient") as err:
        check_lowerable(shardc.plan(shardc.parse(batched)))
    assert "declare Pos `const`" in (err.value.fix or "")


@pytest.mark.slow  # compiles a pipelined module
def test_an_input_without_the_batch_dim_around_the_block_is_held_by_its_end_stage() -> None:
    """Pos on stage 0, Bias on the last, each whole (PRE_WHOLE, POST_WHOLE), their gradients (not `const`)
    summed over the microbatches as an end param's are; under ZB-H1 Bias's in the head's W.  Pos fed to the
    last stage and Bias to stage 0 instead, verify fails (Loss off by 1%)."""
    lowered = shardc.lower(shardc.plan(shardc.parse(ENDS.format(schedule="zb-h1"))), sizes={"P": 2, "X": 2, "Y": 2})
    ends = lowered.namespace.PIPELINE.ends
    assert (ends.pre_whole, ends.post_whole, ends.stages_of("Pos"), ends.stages_of("Bias")) == (
        ("Pos",), ("Bias",), (0,), (1,))
    report = verify_pipeline(shardc.plan(shardc.parse(ENDS.format(schedule="zb-h1"))))
    assert report.ok, [r for r in report.values + report.collectives if not r.ok]
    assert {"dPos", "dBias"} <= {r.tensor for r in report.values}


def test_a_pipelined_block_starting_from_an_input_is_costed_and_its_lowering_refused_saying_why() -> None:
    """A `layers { }` block whose layers start from an input (X0[B, D], no statement before the block) was
    refused at plan time with a false reason: "every input dim is a param's" (X0's B is no param's).  Its
    microbatches cut B, it is costed, and the lowering refuses it for what it is."""
    from shardc.errors import ShardcError
    from shardc.pipeline.boundary import check_lowerable, microbatch_dim

    text = ("mesh P=2 pipeline over dcn, Y=4\ndims B=8, D=256, F=1024\nmicrobatches 2\nhardware tpu-v3\n"
            "param W_in, W_out\nlayers 2 {\n  H[B, F_Y] = gelu(X0[B, D] · W_in[D, F_Y])\n"
            "  X1[B, D] = H[B, F_Y] · W_out[F_Y, D]\n}\n")
    plan = shardc.plan(shardc.parse(text, "stack.shard"))
    assert microbatch_dim(plan) == "B" and shardc.cost(plan).step.step_s > 0
    with pytest.raises(ShardcError, match="the pipelined block reads X0, an input with the batch dim B"):
        check_lowerable(plan)


# an input without the batch dim read on both ends (a position table trained, a scale table `const`): held whole by
# the first and the last stage, as a tied embedding is; token ids read by both (the embedding's, the loss's targets:
# a model repeating its input) and a `const` mask, cut into microbatches on both
BOTH = ENDS.replace("const Tok, Next", "const Tok, Sc, Mask").replace("Next[B_X, S])", "Tok[B_X, S])").replace(
    "W_emb[V, D]) + Pos[S, D]\n", "W_emb[V, D]) * Mask[B_X, S] + Pos[S, D_Y] * Sc[S, D]\n").replace(
    "Lg[B_X, S, V] = X1[B_X, S, D] · W_out[D, V_Y] + Bias[V_Y]",
    "Lg[B_X, S, V] = (X1[B_X, S, D] + Pos[S, D_Y] + Sc[S, D]) · W_out[D, V_Y] * Mask[B_X, S]")


def test_an_input_read_on_both_sides_of_the_block_is_held_by_both_end_stages() -> None:
    """Refused ("Pos is read both before and after the pipelined block ... only a param may be"), though cost
    priced it.  Pos's gradient is two contributions, one an end, summed once a step after the end stages swap
    theirs (TIED, as a tied embedding's); Sc, `const`, has none: each end reads its copy.  Tok and Mask, read by
    both (refused so too; Mask, not token ids, refused on either end), are cut into microbatches for both."""
    from shardc.lowering.pipeline_lowering import lower_pipeline

    lowered = lower_pipeline(shardc.plan(shardc.parse(BOTH.format(schedule="1f1b"))), load=False)
    assert lowered.ends is not None and [t[0] for t in lowered.ends.tied] == ["Pos"]
    assert "PRE_WHOLE = ('Pos', 'Sc')" in lowered.source and "POST_WHOLE = ('Pos', 'Sc')" in lowered.source
    assert "PRE_DATA = ('Tok', 'Mask')" in lowered.source and "POST_DATA = ('Tok', 'Mask')" in lowered.source


@pytest.mark.slow  # compiles a pipelined module
def test_an_input_read_on_both_sides_of_the_block_verifies() -> None:
    """Values and gradients against the unsharded reference (dPos the sum of the two ends'), and the two
    once-a-step permutes of Pos's contributions between the end stages in the HLO.  Under ZB-H1: the head's
    contribution is made at its W tick.  Pos, laid out over Y, gathered by each end.  With Pos fed to stage 0
    alone, the loss is off (by 3%)."""
    report = verify_pipeline(shardc.plan(shardc.parse(BOTH.format(schedule="zb-h1"))))
    assert report.ok, [r for r in report.values + report.collectives if not r.ok]
    assert "dPos" in {r.tensor for r in report.values}
    assert sum("(tied Pos)" in r.step and r.ok for r in report.collectives) == 2


# E, made before the block and read in it beside the carried X0 (the value the last statement before the block
# makes): the spec feeds both from the layer's output X1 (shardc.spec.walk.block_feeds), so the model's first layer
# reads the E made before the block, on stage 0, and each later layer its input; no stage sends E
MAKE_X0 = "X0[B_X, S, D] = embed(Tok[B_X, S], W_emb[V, D]) + Pos[S, D]"
MAKE_E = "E[B_X, S, D] = embed(Tok[B_X, S], W_e[V, D])"
SIDE = ENDS.replace("H[B_X, S, F] · W2[F_Y, D]", "H[B_X, S, F] · W2[F_Y, D] + E[B_X, S, D]")


def _side(first: str, schedule: str = "1f1b") -> str:
    """SIDE with E made first (``first="E"``: X0 carried) or X0 made first (E carried)."""
    return SIDE.format(schedule=schedule).replace(MAKE_X0, "\n".join(
        (MAKE_E, MAKE_X0) if first == "E" else (MAKE_X0, MAKE_E)))


def test_a_block_reading_a_second_value_made_before_it_lowers_in_either_order() -> None:
    """Refused at the read ("a stage receives one activation from the stage before"), though cost priced it; before
    that it lowered and failed inside jax, the block's input taken to be E.  The carried value is the one made
    last before the block, the other fed beside it (FED); cost sends one value a tick, alike in both orders (with
    X0 made first, cost once stopped with "a planner bug": E's embed backward ran before X0's gradient was summed)."""
    from shardc.lowering.pipeline_lowering import lower_pipeline
    from shardc.pipeline.boundary import boundary_tensor, check_lowerable, fed_beside

    plans = {first: shardc.plan(shardc.parse(_side(first), "side.shard")) for first in ("E", "X0")}
    assert shardc.cost(plans["X0"]).step.step_s == shardc.cost(plans["E"]).step.step_s > 0
    for first, carried in (("E", "X0"), ("X0", "E")):
        check_lowerable(plans[first])
        assert boundary_tensor(plans[first]).name == "X1" and fed_beside(plans[first].spec) == (first,)
        source = lower_pipeline(plans[first], load=False).source
        assert f"BLOCK_INPUT = '{carried}'" in source and f"FED = ('{first}',)" in source


@pytest.mark.slow  # compiles a pipelined module
@pytest.mark.parametrize(("first", "schedule"), [("E", "1f1b"), ("X0", "zb-h1")])
def test_a_block_reading_a_second_value_made_before_it_verifies(first: str, schedule: str) -> None:
    """Values and gradients against the unsharded reference: dW_e is the first layer's gradient of E (under
    ZB-H1 made in B, as the cost's B/W rule puts it), and a later layer's input gradient the sum of its X0's
    and E's.  With the first layer fed its input for E, every row fails; with the first layer's gradient of
    E dropped, dW_e does."""
    report = verify_pipeline(shardc.plan(shardc.parse(_side(first, schedule), "side.shard")))
    assert report.ok, [r for r in report.values + report.collectives if not r.ok]
    assert {"dW_e", "dW_emb", "dW1", "dW2"} <= {r.tensor for r in report.values}


# E[B, S, F], fed by the layer's G as X0 is by X1: a second value each layer hands the next
HANDED = ENDS.format(schedule="1f1b").replace(MAKE_X0, "E[B_X, S, F] = embed(Tok[B_X, S], W_e[V, F])\n"
                                              + MAKE_X0).replace(
    "H[B_X, S, F] = gelu(X0[B_X, S, D] · W1[D, F_Y])", "H[B_X, S, F] = gelu(X0[B_X, S, D] · W1[D, F_Y]) + E[B_X, S, F]"
    "\n  G[B_X, S, F] = H[B_X, S, F] * H[B_X, S, F]")


def test_a_value_made_before_the_block_fed_by_another_output_is_refused_at_the_read() -> None:
    """E[B, S, F], fed by the layer's G as X0 is by X1: a second value each layer hands the next, which the stages
    do not make; refused at the read, saying what to write."""
    from shardc.errors import ShardcError
    from shardc.pipeline.boundary import check_lowerable

    text = HANDED

    with pytest.raises(ShardcError, match="reads E, made before the blocks; the block feeds it from G, X0 from X1: "
                       "two values") as err:
        check_lowerable(shardc.plan(shardc.parse(text, "side.shard")))
    assert err.value.span is not None and (err.value.span.line, err.value.span.column) == (9, 53)
    assert "write E with X0's indices and sharding" in (err.value.fix or "")


# E made before the block and read after it (the head adds it to the block's output): it rides to the last stage
RIDE = ENDS.replace(MAKE_X0, MAKE_E + "\n" + MAKE_X0).replace("Lg[B_X, S, V] = X1[B_X, S, D]",
                                                              "Lg[B_X, S, V] = (X1[B_X, S, D] + E[B_X, S, D])")


def test_a_value_made_before_the_block_and_read_after_it_rides_with_the_activation() -> None:
    """Refused ("only the block's output reaches the last stage"), though cost priced it, and priced its send at
    nothing.  Now E rides with X1 from stage to stage, one array of both a hop (RIDERS), and the cost's send carries
    its bytes too: twice ENDS' a hop, E being X1's size (one rule, boundary.carried_refs, which verify's HLO check
    reads as well)."""
    from shardc.lowering.pipeline_lowering import lower_pipeline
    from shardc.pipeline.boundary import carried_refs, check_lowerable

    plan = shardc.plan(shardc.parse(RIDE.format(schedule="1f1b"), "ride.shard"))
    check_lowerable(plan)
    assert [r.name for r in carried_refs(plan)] == ["X1", "E"]
    assert "RIDERS = ('E',)" in lower_pipeline(plan, load=False).source
    alone = shardc.cost(shardc.plan(shardc.parse(ENDS.format(schedule="1f1b")))).pipeline
    riding = shardc.cost(plan).pipeline
    assert alone is not None and riding is not None
    assert (riding.p2p_bytes, riding.p2p_bytes_global) == (2 * alone.p2p_bytes, 2 * alone.p2p_bytes_global)
    assert [r.name for r in riding.riders] == ["E"] and alone.riders == ()  # `shardc cost` names it beside X1


@pytest.mark.slow  # compiles a pipelined module
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_value_riding_to_the_last_stage_verifies(schedule: str) -> None:
    """Values and gradients against the unsharded reference, and the HLO's permutes each of the cost's bytes (X1's
    and E's): dW_e is the head's gradient of E, handed back with X1's through every stage (under ZB-H1 made in
    the head's B).  With E not sent (zeros on the last stage), every row fails; with its gradient not handed
    back, dW_e does."""
    report = verify_pipeline(shardc.plan(shardc.parse(RIDE.format(schedule=schedule), "ride.shard")))
    assert report.ok, [r for r in report.values + report.collectives if not r.ok]
    assert {"dW_e", "dW_emb"} <= {r.tensor for r in report.values}


# X0, the block's input, read by the head too: it rides to the last stage, its gradient two contributions
SKIP = ENDS.replace("Lg[B_X, S, V] = X1[B_X, S, D]", "Lg[B_X, S, V] = (X1[B_X, S, D] + X0[B_X, S, D])")


def test_the_blocks_input_read_after_it_too_rides_and_its_gradients_two_contributions_come_back_apart() -> None:
    """X0, read by the block and the head: refused ("its gradient is two contributions ... which the lowered stages
    do not hand back apart"), though cost priced it.  Now it rides to the last stage as E does, the head's
    contribution (dX0_1) its rider's gradient, the block's (dX0_layer) its input's, and the statements before the
    block take the plan's sum of the two (dX0) as their cotangent.  E fed beside X0 and read by the head is still
    refused at the head's read, with a rewrite that lowers (the statement made twice)."""
    from shardc.errors import ShardcError
    from shardc.lowering.pipeline_lowering import lower_pipeline
    from shardc.pipeline.boundary import check_lowerable, rider_contributions, rider_sums

    plan = shardc.plan(shardc.parse(SKIP.format(schedule="1f1b"), "skip.shard"))
    check_lowerable(plan)
    assert {n: s.dst.name for n, s in rider_sums(plan).items()} == {"X0": "dX0"}
    assert [(n, c.name) for n, c in rider_contributions(plan, "after") + rider_contributions(plan, "block")] == [
        ("X0", "dX0_1"), ("X0", "dX0_layer")]
    source = lower_pipeline(plan, load=False).source
    assert "RIDERS = ('X0',)" in source and "PRE_COTANGENTS = {'dX0': 'X0'}" in source
    assert "'X0': 'dX0_1'}" in source and "GRADS = {'W1': 'dW1', 'W2': 'dW2', 'X0': 'dX0_layer'}" in source
    fed = _side("E").replace("Lg[B_X, S, V] = X1[B_X, S, D]", "Lg[B_X, S, V] = (X1[B_X, S, D] + E[B_X, S, D])")
    with pytest.raises(ShardcError, match="E is made before the pipelined block and read both in it and after it"
                       ) as err:
        check_lowerable(shardc.plan(shardc.parse(fed, "skip.shard")))
    assert err.value.span is not None and err.value.span.line == 12
    assert "make E's statement twice" in (err.value.fix or "")


@pytest.mark.slow  # compiles a pipelined module
def test_the_blocks_input_read_after_it_too_verifies() -> None:
    """Values and gradients against the unsharded reference under ZB-H1 (the head's contribution made in its B, the
    sum in stage 0's W; 1F1B passes too): dW_emb and dPos read X0's whole gradient.  With the head's contribution
    not added on stage 0, dW_emb and dPos fail."""
    report = verify_pipeline(shardc.plan(shardc.parse(SKIP.format(schedule="zb-h1"), "skip.shard")))
    assert report.ok, [r for r in report.values + report.collectives if not r.ok]
    assert {"dW_emb", "dPos"} <= {r.tensor for r in report.values}


def test_a_rider_made_last_before_the_block_is_refused_saying_to_make_it_first() -> None:
    """Stage 0 hands the block the value made last before it; with E made after X0 the block's read of X0 was
    refused as "a second value made before it", which it is not: now refused for what it is, at X0's read."""
    from shardc.errors import ShardcError
    from shardc.pipeline.boundary import check_lowerable

    late = RIDE.format(schedule="1f1b").replace(MAKE_E + "\n" + MAKE_X0, MAKE_X0 + "\n" + MAKE_E)
    with pytest.raises(ShardcError, match="the statement just before the pipelined block makes E, which the block "
                       "does not read") as err:
        check_lowerable(shardc.plan(shardc.parse(late, "late.shard")))
    assert err.value.span is not None and err.value.span.line == 9
    assert err.value.fix == "make E before X0, so that X0 is made last before the block"


@pytest.fixture(scope="module")
def ride_costs() -> tuple[Any, Any]:
    """The pipeline costs of RIDE and of ENDS (the same spec without the rider), under 1F1B."""
    return tuple(shardc.cost(shardc.plan(shardc.parse(text.format(schedule="1f1b")))).pipeline
                 for text in (RIDE, ENDS))


def test_a_riders_send_buffers_are_in_each_stages_memory(ride_costs: tuple[Any, Any]) -> None:
    """E rides in the buffer a stage receives the activation in and the one its gradient comes back in (one
    microbatch each under 1F1B: the lowered program's rings of one slot): it was counted nowhere, as no
    backward reads it.  A microbatch's E is X1's size, so each stage holds two of X1's shards more."""
    from shardc.costmodel.stage_memory import RIDER_SLOTS, rider_slots
    from shardc.spec.stages import pipeline_of

    riding, alone = ride_costs
    one = riding.p2p_bytes - alone.p2p_bytes  # a microbatch's E, as a hop sends it
    assert one > 0 and [s.rider_bytes for s in riding.stages] == [RIDER_SLOTS * one] * 2 and RIDER_SLOTS == 2
    assert [s.rider_bytes for s in alone.stages] == [0.0, 0.0]
    # under ZB-H1 stage 0 holds the riders' gradients from B to W too, where the backward before the block runs
    zb = pipeline_of(shardc.parse(RIDE.format(schedule="zb-h1")))
    assert zb is not None and [rider_slots(zb, s) for s in (0, 1)] == [3, 2]
    assert all(s.memory_bytes == s.state_bytes + s.activation_bytes + s.gathered_bytes + s.working_bytes
               + s.accumulator_bytes + s.rider_bytes for s in riding.stages)
    assert riding.stages[0].to_json()["rider_bytes"] == 2 * one and "rider_bytes" not in alone.stages[0].to_json()


@pytest.mark.slow  # compiles a pipelined schedule (not run)
def test_the_pipeline_memory_check_counts_a_rider_in_the_programs_rings() -> None:
    """The program holds E in its ring of received activations and its ring of gradients (one slot each under
    1F1B, laid end to end with X1 in each): verify's run of 4 microbatches of B=32 cut over X=2, S=4, D=8, in
    4-byte floats, 512 bytes a slot.  The check counted none (stage 0: 22,216 B beside XLA's 33,876)."""
    from shardc.verification.pipeline_verify import check_pipeline_memory

    check = check_pipeline_memory(shardc.plan(shardc.parse(RIDE.format(schedule="1f1b"))), 8)
    assert check.element == 4 and dict(check.shardc_parts)["riders"] == 2 * (32 // 4 // 2) * 4 * 8 * 4


def test_the_programs_sum_of_a_fed_values_gradient_is_charged_in_each_layers_backward(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The lowered program adds a layer's dE to its dX0 in every layer's backward (E being the layer's input past
    the first), one microbatch's activation, where the plan has no step: charged in the layer's B, as a
    memory-bound add after the step that made dX0 (fused with it: dX0 not read back; dE read, the sum written)."""
    import shardc.costmodel.section_times as section
    from shardc.costmodel.fed_sum import fed_sum_rows, fed_sums
    from shardc.costmodel.pipeline_times import microbatch_sizes
    from shardc.spec.stages import pipeline_of
    from shardc.timing import local_bytes_of, plan_links

    plan = shardc.plan(shardc.parse(_side("E"), "side.shard"))
    assert fed_sums(shardc.plan(shardc.parse(ENDS.format(schedule="1f1b")))) == ()
    [add] = fed_sums(plan)
    assert (add.dst.name, [r.name for r in add.operands], add.block) == ("dX0", ["dX0", "dE"], 0)
    pipe = pipeline_of(plan.spec)
    assert pipe is not None
    hw = plan.chip.configured(None, None)
    _, micro = microbatch_sizes(plan, pipe, {**plan.spec.sizes, "P": 2, "X": 2, "Y": 2})
    spans = plan_links(plan, hw, micro)[0]
    [row] = fed_sum_rows(plan, micro, hw, spans)
    assert row.memory_bytes == 2 * local_bytes_of(plan, micro)(add.dst) > 0 and row.memory_s > 0
    charged = section.section_times(plan, micro, hw, spans)["layer 0"][1]
    monkeypatch.setattr(section, "fed_sum_rows", lambda *_: [])
    bare = section.section_times(plan, micro, hw, spans)["layer 0"][1]
    assert charged.busy == pytest.approx(bare.busy + row.busy_s, rel=1e-12)


def test_a_value_the_block_hands_on_beside_its_activation_is_charged_in_each_send(
        ride_costs: tuple[Any, Any]) -> None:
    """HANDED's E (refused by lower) is a second value each hop sends, and its gradient back: the cost charged one
    send of X1 (ENDS' bytes), under-charging E's each hop; now X1's and E's, E being twice X1's size (F = 2 D)."""
    from shardc.pipeline.boundary import carried_refs, handed_beside

    plan = shardc.plan(shardc.parse(HANDED, "side.shard"))
    assert handed_beside(plan.spec) == ("E",) and [r.name for r in carried_refs(plan)] == ["X1", "E"]
    assert handed_beside(shardc.plan(shardc.parse(_side("E"), "side.shard")).spec) == ()  # fed alike: not sent
    handed = shardc.cost(plan).pipeline
    _, alone = ride_costs
    assert handed is not None and handed.p2p_bytes == 3 * alone.p2p_bytes
