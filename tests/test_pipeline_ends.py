"""A pipelined ``layers L { ... }`` block: the statements before it on the first chunk, those after it
on the last (Megatron-LM's placement of the embedding and the loss), costed, lowered and verified."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import shardc
from shardc.accountings import ACCOUNTINGS
from shardc.costmodel.cost_text import render_pipeline
from shardc.costmodel.pipeline_figures import PipelineCost
from shardc.ir.plan import Plan
from shardc.ir.spec import Mesh, MeshAxis, Schedule
from shardc.pipeline.boundary import boundary_tensor, microbatch_dim
from shardc.pipeline.schedules import device_of, simulate

MODEL = """\
mesh X=4, Y=2
dims B=256, S=512, D=1024, F=4096, V=32000
hardware tpu-v5p
const Tok, Next
param W_emb, W1, W2, W_out
X0[B_X, S, D] = embed(Tok[B_X, S], W_emb[V_Y, D_X])
layers 8 {
  H[B_X, S, F_Y] = gelu(X0[B_X, S, D] · W1[D_X, F_Y])
  X1[B_X, S, D] = X0[B_X, S, D] + H[B_X, S, F_Y] · W2[F_Y, D_X]
}
Fn[B_X, S, D] = rmsnorm(X1[B_X, S, D] over D)
Lg[B_X, S, V_Y] = Fn[B_X, S, D] · W_out[D_X, V_Y]
Loss[] = cross_entropy(Lg[B_X, S, V_Y], Next[B_X, S])
"""
P, M = 4, 8


def _plan(schedule: str = "1f1b") -> Plan:
    spec = shardc.parse(MODEL)
    piped = dataclasses.replace(spec, mesh=Mesh((MeshAxis("P", P, pipeline=True), *spec.mesh.axes)),
                                microbatches=M, schedule=Schedule(schedule, 2 if schedule == "interleaved" else 1))
    return shardc.plan(piped)


def _pipe(schedule: str = "1f1b") -> PipelineCost:
    cost = shardc.cost(_plan(schedule)).pipeline
    assert cost is not None
    return cost


def test_the_block_sends_its_output_and_cuts_its_batch_dim() -> None:
    plan = _plan()
    assert boundary_tensor(plan).name == "X1" and microbatch_dim(plan) == "B"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zbv"])
def test_the_ends_extra_work_lengthens_the_step(schedule: str) -> None:
    """Fails if the first or last chunk's extra work is dropped: the step then is the block's alone."""
    cost = _pipe(schedule)
    assert cost.first.total > 0 and cost.last.total > 0 and cost.extra
    sim = cost.simulation
    alike = simulate(schedule, P, M, cost.timing, cost.pipeline.chunks)  # every chunk the block's only
    n = P * cost.pipeline.chunks
    ends = dict.fromkeys(range(P), 0.0)
    ends[device_of(schedule, 0, P)] += cost.first.total
    ends[device_of(schedule, n - 1, P)] += cost.last.total
    assert sim.ideal == pytest.approx(M * (cost.timing.total + max(ends.values())))
    assert cost.step_s > alike.makespan and cost.step_s >= sim.ideal
    if schedule != "zbv":  # device P-1 starts once microbatch 0 is through chunks 0..P-2, the first's extra too
        chunk_f = cost.timing.forward / cost.pipeline.chunks
        start = cost.first.forward + (P - 1) * chunk_f + (P - 1) * cost.timing.comm
        assert cost.step_s >= start + sim.work(P - 1) - 1e-12
    assert cost.step_closed_s == pytest.approx(sim.ideal + cost.closed.idle_s)


def test_the_ends_cost_what_the_unpipelined_spec_costs_outside_the_block() -> None:
    """Stage 0 computes the embedding's steps more than a middle stage, the last stage the head's;
    together the steps the unpipelined plan runs once, at one microbatch's sizes."""
    plan = _plan("1f1b")
    stages = shardc.cost(plan).pipeline.stages  # type: ignore[union-attr]
    middle = stages[1].compute_s
    assert stages[2].compute_s == pytest.approx(middle)
    alone = shardc.plan(shardc.parse(MODEL))
    once = shardc.cost(alone, sizes={"B": 256 // M})
    rows = once.forward.rows + once.backward.rows
    assert any(r.once for r in rows)
    extra = (stages[0].compute_s - middle) + (stages[-1].compute_s - middle)
    # compute exactly; memory-bound time but for one fusion boundary: the head's first map (the final
    # norm's statistic of X1) reads the block's output back in one count and not in the other (3 us)
    assert extra == pytest.approx(sum(r.busy_s for r in rows if r.once), rel=5e-3)
    assert stages[-1].compute_s > middle  # the output layer's einsums


@pytest.mark.parametrize(("schedule", "first", "last"), [("1f1b", 0, P - 1), ("zbv", 0, 0)])
def test_the_ends_params_live_on_their_stages(schedule: str, first: int, last: int) -> None:
    """The embedding's table on the first stage, the output layer's on the last (zbv's V: both on 0)."""
    stages = _pipe(schedule).stages
    per = sum(ACCOUNTINGS["adam10"][:3])
    emb = 32000 * 1024 / (2 * 4) * per  # W_emb[V_Y, D_X]
    out = 1024 * 32000 / (4 * 2) * per  # W_out[D_X, V_Y]
    block = 8 // P * 2 * (1024 * 4096 / 8) * per  # W1, W2 of each of a stage's layers
    want = [block + (emb if s == first else 0.0) + (out if s == last else 0.0) for s in range(P)]
    assert [s.state_bytes for s in stages] == pytest.approx(want)
    assert stages[first].activation_bytes > stages[1].activation_bytes  # the embedding's output, held


def test_the_report_states_the_ends() -> None:
    cost = _pipe()
    text = "\n".join(render_pipeline(cost))
    assert "the first chunk also runs the statements before the block" in text
    assert "the busiest stage's work" in text
    data = cost.to_json()
    assert data["first_extra_s"]["forward_s"] == cost.first.forward  # type: ignore[index]
    assert data["ideal_s"] == cost.simulation.ideal


def test_the_pipelined_block_parses() -> None:
    spec = shardc.parse(MODEL.replace("mesh X=4, Y=2", "mesh P=4 pipeline, X=4, Y=2"))
    assert spec.block == (1, 3) and spec.mesh.pipeline_axis is not None


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_whole_model_verifies(schedule: str) -> None:
    """The loss and every gradient (the embedding's, the block's stacked, the head's) against numpy,
    and the HLO: one permute each way in the loop of the schedule's tick table."""
    from shardc.verification.verify import verify

    report = verify(_plan(schedule))
    assert report.ok, report
    grads = {r.tensor for r in report.values if r.phase == "backward"}
    assert grads == {"dW_emb", "dW1", "dW2", "dW_out"}
    assert [r.tensor for r in report.values if r.phase == "forward"] == ["Loss"]
    assert any(r.kind == "CollectivePermute" and r.ok for r in report.collectives)


@pytest.mark.slow
def test_the_loss_is_the_mean_of_the_microbatches() -> None:
    """Summing the microbatches' losses instead (their cotangent the loss's, not over M) is caught."""
    from shardc.lowering.pipeline_lowering import lower_pipeline
    from shardc.verification.pipeline_verify import draw_inputs, reference, run_sizes

    lowered = lower_pipeline(_plan("gpipe"), *run_sizes(_plan("gpipe"), 8))
    ns = lowered.namespace
    inputs = draw_inputs(lowered, 0, 0)
    want = float(reference(lowered, inputs, {"dLoss": 1.0}, 0)[0]["Loss"])
    got = float(ns.model_forward(inputs)[ns.LOSS])
    assert got == pytest.approx(want, rel=1e-5)  # float32: not x64 here
    pipe = ns.PIPELINE
    (acc,) = pipe.program(backward=False)[1](*pipe.arguments(inputs, pipe.ends.cotangent(pipe, inputs, None)))
    sums = float(acc[0][-1].sum())
    m = lowered.pipeline.microbatches
    assert m > 1 and sums == pytest.approx(m * got, rel=1e-5) and abs(sums - want) > 1.0


TIED = ("W_out[D_X, V_Y]", "W_emb[V_Y, D_X]")  # the output layer reads the embedding's table
NO_LOSS = ("Loss[] = cross_entropy(Lg[B_X, S, V_Y], Next[B_X, S])", "Out[B_X, S, V_Y] = gelu(Lg[B_X, S, V_Y])")
# the block's input read after it too: it rides to the last stage, its gradient's two contributions, the block's
# and the head's, handed back apart (tests/test_pipeline_shared_input.py; it was refused)
CROSSING = ("Fn[B_X, S, D] · W_out", "(Fn[B_X, S, D] + X0[B_X, S, D]) · W_out")


def _tied_text(mesh: str = "mesh P=4 pipeline, X=4, Y=2") -> str:
    return MODEL.replace("mesh X=4, Y=2", mesh).replace(*TIED).replace(", W_out\n", "\n")


def test_what_the_lowering_refuses() -> None:
    """A head not ending in a loss; the block's input read by the head too (CROSSING) lowers now, riding."""
    from shardc.errors import ShardcError
    from shardc.lowering.pipeline_lowering import lower_pipeline

    def text(edit: tuple[str, str]) -> str:
        return MODEL.replace("mesh X=4, Y=2", "mesh P=4 pipeline, X=4, Y=2").replace(*edit).replace(", Next\n", "\n")

    with pytest.raises(ShardcError, match="cross_entropy loss"):
        lower_pipeline(shardc.plan(shardc.parse(text(NO_LOSS))), load=False)
    assert "RIDERS = ('X0',)" in lower_pipeline(shardc.plan(shardc.parse(text(CROSSING))), load=False).source


def test_a_tied_embedding_is_held_by_both_end_stages() -> None:
    """Megatron-LM's tied embedding: a copy on the first and the last stage, each stage's contribution
    to the gradient summed over the two once a step (a permute each way), costed on both."""
    from shardc.lowering.pipeline_lowering import lower_pipeline

    plan = shardc.plan(shardc.parse(_tied_text()))
    lowered = lower_pipeline(plan, load=False)
    assert lowered.ends is not None and lowered.ends.tied == (("W_emb", "dW_emb_1", "dW_emb"),)
    assert "TIED = {'W_emb': 'dW_emb_1'}" in lowered.source
    assert "PRE_FINAL_GRADS = {'dW_emb_2': 'dW_emb'}" in lowered.source
    cost = shardc.cost(plan).pipeline
    assert cost is not None and cost.tied_exchange_s > 0
    state = [s.state_bytes for s in cost.stages]
    assert state[0] == pytest.approx(state[3]) and state[0] > state[1]
    untied = shardc.cost(shardc.plan(shardc.parse(MODEL.replace("mesh X=4, Y=2",
                                                                 "mesh P=4 pipeline, X=4, Y=2")))).pipeline
    assert untied is not None and untied.tied_exchange_s == 0
    zbv = shardc.cost(shardc.plan(shardc.parse(_tied_text() + "schedule zbv\n"))).pipeline
    assert zbv is not None and zbv.tied_exchange_s == 0  # its V puts the first and last chunk on device 0
    assert cost.grad_reduce_s > 0
    assert "(a tied embedding's) swapped between the first and the last stage" in shardc.cost(plan).render()


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "mesh"), [("gpipe", "mesh P=2 pipeline, X=2, Y=2"),
                                                ("1f1b", "mesh P=4 pipeline, X=4, Y=2")])
def test_a_tied_embedding_verifies_and_both_copies_get_its_gradient(schedule: str, mesh: str) -> None:
    """Fails if either end's contribution is dropped (the reference sums both), or if the last stage's
    copy does not get the same gradient as the first's.  On the second mesh the plan gathers the table
    once before the block and the output layer reads it gathered: the last stage gathers it again."""
    import numpy as np

    from shardc.lowering.pipeline_lowering import lower_pipeline
    from shardc.verification.pipeline_verify import draw_cotangent, draw_inputs, run_sizes
    from shardc.verification.verify import verify

    plan = shardc.plan(shardc.parse(_tied_text(f"{mesh}\nschedule {schedule}\nmicrobatches 4")))
    report = verify(plan)
    assert report.ok, [r for r in report.values + report.collectives if not r.ok]
    assert any("tied W_emb" in r.step and r.ok for r in report.collectives)
    lowered = lower_pipeline(plan, *run_sizes(plan, 8))
    pipe, inputs = lowered.namespace.PIPELINE, draw_inputs(lowered, 0, 0)
    cot = pipe.ends.cotangent(pipe, inputs, draw_cotangent(lowered, inputs, 0))
    acc, _ = pipe.program()[1](*pipe.arguments(inputs, cot))
    first, last = np.asarray(acc[1]["W_emb"][0]), np.asarray(acc[1]["W_emb@last"][-1])
    assert np.abs(first).max() > 0 and np.array_equal(first, last)


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pipeline_llama2_13b.shard"


def test_the_llama2_13b_example_costs_its_ends_on_stages_0_and_3() -> None:
    plan = shardc.plan(shardc.parse(EXAMPLE.read_text(encoding="utf-8"), filename=str(EXAMPLE)))
    from shardc.spec.stages import pipeline_note

    assert "the steps marked once on the first stage" in pipeline_note(plan.spec)[0]
    cost = shardc.cost(plan).pipeline
    assert cost is not None and cost.pipeline.stage_layers == (10,) * 4
    state = [s.state_bytes for s in cost.stages]
    table = 32000 * 5120 / (64 * 4) * sum(ACCOUNTINGS["adam10"][:3])  # W_emb[V_Y, D_X], W_out[D_X, V_Y]
    assert state[0] - state[1] == pytest.approx(table) and state[3] - state[1] == pytest.approx(table)
    assert state[1] == pytest.approx(state[2])
    assert all(s.memory_bytes <= s.hbm_bytes for s in cost.stages)
    assert cost.last.forward > 0 and cost.step_s > cost.simulation.ideal


@pytest.mark.slow
def test_the_llama2_13b_example_verifies_from_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from shardc.cli.main import main

    assert main(["verify", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert "verified" in out and "dW_emb" in out and "dW_out" in out and "Loss" in out


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_tensor_parallel_stages_with_a_vocabulary_parallel_loss_verify(schedule: str) -> None:
    """P=2 leaves X=2 and Y=2 on 8 devices: the embedding's table and the logits cut over Y."""
    from shardc.verification.verify import verify

    text = MODEL.replace("mesh X=4, Y=2", f"mesh P=2 pipeline, X=2, Y=2\nschedule {schedule}\nmicrobatches 4")
    report = verify(shardc.plan(shardc.parse(text)))
    assert report.mesh == {"P": 2, "X": 2, "Y": 2}
    assert report.ok, [r for r in report.values + report.collectives if not r.ok]


VOCAB_HEAVY = """mesh P=2 pipeline, X=4
dims B=64, S=128, D=1024, F=256, V=65536
microbatches 8
schedule {schedule}
hardware h100
const Tok, Next
param W_emb, W1, W2, W_out
X0[B_X, S, D] = embed(Tok[B_X, S], W_emb[V, D])
layers 4 {{
  H[B_X, S, F] = gelu(X0[B_X, S, D] · W1[D, F])
  X1[B_X, S, D] = X0[B_X, S, D] + H[B_X, S, F] · W2[F, D]
}}
Lg[B_X, S, V] = X1[B_X, S, D] · W_out[D, V]
Loss[] = cross_entropy(Lg[B_X, S, V], Next[B_X, S])
"""


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_on_a_v_both_ends_gradient_reductions_are_the_first_devices(schedule: str) -> None:
    """Under 1F1B the embedding's gradient is reduced on device 0 and the output layer's on the last; on a V
    both ends sit on device 0 (its chunks 0 and 1), so both reductions are its.  The two V x D weights' reductions
    are alike and the layers' small beside them, so the busiest device's reductions come near twice 1F1B's (they
    were 1F1B's when the output layer's was placed on the last device)."""
    def reductions(name: str) -> float:
        report = shardc.cost(shardc.plan(shardc.parse(VOCAB_HEAVY.format(schedule=name))))
        assert report.pipeline is not None
        return report.pipeline.grad_reduce_s

    apart, together = reductions("1f1b"), reductions(schedule)
    assert 1.8 * apart < together < 2 * apart


# a second head after the block (DeepSeek-V3's multi-token-prediction module), its loss added to the first's:
# the block's output and the output layer each read by both heads
TWO_HEADS = MODEL.replace("mesh X=4, Y=2", "mesh P=2 pipeline, X=2, Y=2\nmicrobatches 2").replace(
    "const Tok, Next", "const Tok, Next, Next2").replace(
    "Loss[] = cross_entropy(Lg[B_X, S, V_Y], Next[B_X, S])\n", "") + (
    "Fm[B_X, S, D] = gelu(X1[B_X, S, D])\n"
    "Lm[B_X, S, V_Y] = Fm[B_X, S, D] · W_out[D_X, V_Y]\n"
    "Loss[] = cross_entropy(Lg[B_X, S, V_Y], Next[B_X, S]) + cross_entropy(Lm[B_X, S, V_Y], Next2[B_X, S])\n")


def test_two_heads_after_the_block_sum_their_gradients_on_the_last_stage() -> None:
    """The contributions of the two heads to the block output's gradient and to the shared output layer's are
    summed after the block (on the last stage, which makes them), not in the block's or the first stage's
    backward, which the lowering refused; and the lowering takes a sum of losses as the spec's loss."""
    from shardc.lowering.pipeline_lowering import lower_pipeline

    plan = shardc.plan(shardc.parse(TWO_HEADS))
    sums = {s.dst.name: s for s in plan.backward if s.dst.name in ("dX1", "dW_out") and str(s.fn).startswith("add")}
    assert set(sums) == {"dX1", "dW_out"} and all(s.once for s in sums.values())
    assert plan.sections is not None
    after = {s.dst.name for s in plan.sections.steps("backward", plan.backward, "after")}
    assert {"dX1", "dW_out"} <= after
    lower_pipeline(plan, load=False)


@pytest.mark.slow
def test_two_heads_after_the_block_verify() -> None:
    from shardc.verification.verify import render_report, verify

    report = verify(shardc.plan(shardc.parse(TWO_HEADS)))
    assert report.ok, render_report(report)
