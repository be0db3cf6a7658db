"""A pipeline's stage is searched as the stage program runs: at a microbatch's sizes, each step charged as often
as the program runs it a training step (an activation's move, an einsum and a weight's reshard once a
microbatch; a gradient's reduction once, on the microbatches' sums), so the search's objective is what the
cost then charges.  Searched at the whole batch instead, a weight's reshard weighed as if it ran once a step
(m times too little) and an activation's move at the whole batch's size."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardc
from shardc import timing
from shardc.hardware import PRESETS
from shardc.ir.plan import Op, Plan
from shardc.planner import planner
from shardc.planner.contexts import search_context, stage_run_of
from shardc.planner.graph import build_graph
from shardc.sharding.layout import Move, Value
from shardc.spec.stages import stage_spec
from shardc.timing import plan_time

ROOT = Path(__file__).resolve().parents[1]
V5P = PRESETS["tpu-v5p"]


def fsdp(batch: int, d: int, m: int) -> str:
    """Two FSDP-sharded matmuls a layer, pipelined over two stages in ``m`` microbatches."""
    return (f"mesh P=2 pipeline, X=4\nlayers 4\nmicrobatches {m}\ndims B={batch}, D={d}, E={d}\nparam W1, W2\n"
            "H[B_X, E] = In[B_X, D] · W1[D_X, E]\nOut[B_X, D] = H[B_X, E] · W2[E_X, D]\n")


def whole_batch(spec: shardc.ir.spec.Spec, monkeypatch: pytest.MonkeyPatch) -> Plan:  # type: ignore[name-defined]
    """The plan of the search before: the stage searched at the whole batch's sizes, each step once."""
    with monkeypatch.context() as patched:
        patched.setattr(planner, "stage_run_of", lambda spec, graph, outer, hw: (spec, 1))
        return shardc.plan(spec)


def gathers(p: Plan) -> set[str]:
    return {s.tensor for s in p.forward if s.op is Op.ALL_GATHER}


def test_the_search_charges_each_step_as_often_as_the_stage_runs_it() -> None:
    spec = shardc.parse(fsdp(4096, 4096, 8))
    stage = stage_spec(spec)
    graph = build_graph(stage)
    run = stage_run_of(stage, graph, spec, V5P)
    assert run[1] == 8 and run[0].sizes["B"] == 512 and run[0].sizes["D"] == 4096  # a microbatch's batch
    ctx = search_context(stage, graph, V5P, None, run=run)
    once = search_context(stage, graph, V5P, None)
    assert ctx.sizes == run[0].sizes and once.sizes == stage.sizes and once.repeats == 1
    sharded, whole = Value((("X",), ())), Value(((), ()))
    gather = Move(Op.ALL_GATHER, sharded, whole, ("X",), 0, volume=ctx.local_bytes(("D", "E"), whole))
    reduce = Move(Op.REDUCE_SCATTER, Value(((), ()), ("X",)), sharded, ("X",), 0,
                  volume=ctx.local_bytes(("D", "E"), Value(((), ()), ("X",))))
    act = Move(Op.ALL_GATHER, sharded, whole, ("X",), 0, volume=ctx.local_bytes(("B", "E"), whole))
    one = {m: ctx.seconds(m.op, m.volume, m.axes) for m in (gather, reduce, act)}  # a microbatch's, once
    assert ctx.move_cost(gather, "W1")[0] == pytest.approx(8 * one[gather])  # a weight's gather: each microbatch
    assert ctx.move_cost(reduce, "dW1")[0] == pytest.approx(one[reduce])  # a gradient's reduction: once a step
    assert ctx.move_cost(act, "H")[0] == pytest.approx(8 * one[act])  # an activation: each microbatch, its size
    assert ctx.move_cost(act, "H")[0] == pytest.approx(once.move_cost(act, "H")[0], rel=0.05)  # ~ the batch's
    assert ctx.move_cost(gather, "W1")[0] == pytest.approx(8 * once.move_cost(gather, "W1")[0])  # 8x the batch's


def test_the_stage_objective_is_the_cost_of_the_stage_the_reductions_once() -> None:
    """Data parallel under a pipeline: the weights' gradients reduced once a step, after the backward, every
    other step once a microbatch, in the planner's objective and in the report's stage tables alike."""
    text = fsdp(4096, 4096, 8).replace("W1[D_X, E]", "W1[D, E]").replace("W2[E_X, D]", "W2[E, D]")
    p = shardc.plan(shardc.parse(text))
    report = shardc.cost(p)
    t = plan_time(p)
    assert t.step_s == pytest.approx(report.step.step_s, rel=1e-12)  # the planner's objective
    # the reductions once a step, under the last microbatch's backward: what of them outlasts it (tpu-v5p's
    # collectives hold no cores), as the pipeline's cost adds them
    assert t.optimizer.seconds + t.reduce_exposed_s == pytest.approx(report.optimizer.step_s, rel=1e-12)
    assert 0 < t.reduce_exposed_s < t.reduce.seconds
    assert t.reduce_exposed_s == pytest.approx(report.pipeline.grad_reduce_exposed_s, rel=1e-12)  # type: ignore[union-attr]
    reduced = [r for r in report.optimizer.rows if r.op in (Op.ALL_REDUCE, Op.REDUCE_SCATTER)]
    assert {r.tensor for r in reduced} == {"dW1", "dW2"}  # once a step, on the microbatches' sums
    assert not [r for r in report.backward.rows if r.tensor in ("dW1", "dW2") and r.is_collective]
    for r in report.backward.rows:  # each of a stage's 2 layers: each step once a microbatch, 8 of them
        assert report.backward._count(r) == 2 * 8
    assert all(report.optimizer._count(r) == 2 for r in reduced)
    one = shardc.cost(shardc.plan(shardc.parse(text.replace("microbatches 8", "microbatches 1"))))
    assert [r.comm_s for r in reduced] == pytest.approx([r.comm_s for r in one.backward.rows if r in reduced or (
        r.tensor in ("dW1", "dW2") and r.is_collective)])  # the reduction a step is the whole batch's


@pytest.mark.parametrize(("batch", "d", "m"), [(4096, 4096, 8), (1024, 1024, 32), (16384, 4096, 32)])
def test_a_weight_gathered_each_microbatch_loses_to_moving_the_microbatch(batch: int, d: int, m: int,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP under a pipeline: gathering W1 and W2 runs once a microbatch, m times a step; moving the
    activation moves a microbatch's.  Searched at the whole batch the gathers looked m times cheaper and won
    (4096 x 4096 at m = 8: 6.47 ms a step against 2.08 ms moving the activations)."""
    spec = shardc.parse(fsdp(batch, d, m))
    chosen, before = shardc.plan(spec), whole_batch(spec, monkeypatch)
    assert gathers(before) == {"W1", "W2"} and not gathers(chosen) & {"W1", "W2"}
    assert plan_time(chosen).step_s < plan_time(before).step_s
    step = [shardc.cost(p).pipeline.step_s for p in (chosen, before)]  # type: ignore[union-attr]
    assert step[0] < step[1]  # the pipeline's simulated step too


@pytest.mark.parametrize(("batch", "d", "m"), [(256, 1024, 8), (1024, 4096, 32), (4096, 1024, 1)])
def test_the_stage_plan_is_never_slower_than_the_whole_batch_search(batch: int, d: int, m: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The search solves einsum by einsum, so its objective made true can still lead it to a worse whole plan
    (256 x 1024 at m = 8: a gradient's reduction taken once a step, the backward's einsums after it resharded
    a weight, 0.294 ms against 0.253): the whole batch's candidates are weighed too, by the true objective."""
    spec = shardc.parse(fsdp(batch, d, m))
    assert plan_time(shardc.plan(spec)).step_s <= plan_time(whole_batch(spec, monkeypatch)).step_s


@pytest.mark.slow
def test_the_128k_stage_offers_no_ulysses_over_a_microbatch_too_small() -> None:
    """LLaMA 3 405B at 128K: a microbatch's B is 8 over X=8, so C cannot move onto B (it did at B=128)."""
    path = ROOT / "examples" / "llama3_405b_128k.shard"
    p = shardc.plan(shardc.parse(path.read_text(), filename=str(path)), recompute="full", explain=True)
    forms = [a.description for c in p.choices if "Vl[" in c.statement and c.statement.startswith("C[")
             for a in c.alternatives]
    assert forms and not [f for f in forms if "moved to B" in f]


MAXTEXT = """mesh data=16, stage=4 pipeline, fsdp=1, seq=1, tensor=4, expert=1, ctx=1, tt=1
dims B=1024, D=4096, F=16384
layers 32
microbatches 16
H[B_{data,fsdp}, F_{tensor,expert}] = In[B_{data,fsdp}, D_{seq}] · W_in[D_{fsdp}, F_{tensor,expert}]
Out[B_{data,fsdp}, D_{seq}] = H[B_{data,fsdp}, F_{tensor,expert}] · W_out[F_{tensor,tt}, D_{fsdp}]
"""


def test_the_reductions_once_a_step_run_after_the_backward_in_the_objective(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 8-axis MaxText-style mesh pipelined: its data-parallel gradient AllReduces run once a step, after
    the backward, where nothing hides them.  Timed as if the m microbatches' backward hid them, a plan that
    reduced its gradients won, the pipeline's step 18.1 ms against 16.8 ms before (where every microbatch
    reduced them); timed where they run, the stage's plan takes 13.9 ms."""
    spec = shardc.parse(MAXTEXT)
    chosen, before = shardc.plan(spec), whole_batch(spec, monkeypatch)
    steps = [shardc.cost(p).pipeline.step_s for p in (chosen, before)]  # type: ignore[union-attr]
    assert steps[0] < steps[1]


def test_data_parallel_wins_once_its_reductions_hide_under_the_last_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicated weights on H100, 16 microbatches of 16: reducing dW1 and dW2 once a step (0.60 ms, all but
    NCCL's share of it under the last microbatch's backward) beats moving every microbatch's activations.
    Weighed whole, as plan_time once weighed it, the reductions lost (4.45 ms against 4.36 + 0.60 ms) and the
    planner moved the activations, a pipeline 4.81 ms a step against 4.68 ms."""
    text = fsdp(256, 4096, 16).replace("W1[D_X, E]", "W1[D, E]").replace("W2[E_X, D]", "W2[E, D]") + "hardware h100\n"
    chosen = shardc.plan(shardc.parse(text))
    with monkeypatch.context() as patched:  # the objective before: the reductions exposed whole
        patched.setattr(timing, "reductions_exposed", lambda reduce, backward_s, hw: reduce.seconds)
        whole = shardc.plan(shardc.parse(text))
    moved = [{s.tensor for s in p.forward + p.backward if s.is_collective} for p in (chosen, whole)]
    assert moved[0] == {"dW1", "dW2"} and {"H", "In"} <= moved[1]
    took = plan_time(chosen)
    assert 0 < took.reduce_exposed_s < took.reduce.seconds
    step = [shardc.cost(p).pipeline.step_s for p in (chosen, whole)]  # type: ignore[union-attr]
    assert step[0] < step[1]
