"""Pipeline parallelism: the language, the schedule simulator against the closed forms, the cost figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardc
from shardc.costmodel.cost_text import render
from shardc.errors import ShardcError
from shardc.ir.spec import SCHEDULES, MeshAxis, Schedule
from shardc.pipeline.backward_split import weight_steps
from shardc.pipeline.boundary import boundary_tensor, gradient_reductions, microbatch_dim
from shardc.pipeline.bubbles import EXACT, bubble, held, inflight, sends_per_microbatch
from shardc.pipeline.schedules import Timing, device_of, simulate
from shardc.spec.stages import pipeline_of, stage_spec
from shardc.units import fmt_seconds

EXAMPLE = Path(__file__).parents[1] / "examples" / "pipeline_llama.shard"
BLOCK = """\
dims B=4096, D=256, F=1024
param W_in, W_out
Tmp[B_X, F_Y] = In[B_X, D_Y] · W_in[D_X, F_Y]
Out[B_X, D_Y] = Tmp[B_X, F_Y] · W_out[F_Y, D_X]
"""


def spec(head: str, block: str = BLOCK) -> shardc.ir.spec.Spec:  # type: ignore[name-defined]
    return shardc.parse(head + "\n" + block)


# --- the language ------------------------------------------------------------------------

def test_pipeline_lines_parse_and_print_back() -> None:
    s = spec("mesh P=4 pipeline, X=8 over dcn, Y=4\nlayers 8\nmicrobatches 8\nschedule interleaved 2")
    assert s.mesh.axes[0] == MeshAxis("P", 4, pipeline=True)
    assert s.mesh.pipeline_axis == s.mesh.axes[0] and not s.mesh.axes[1].pipeline
    assert s.microbatches == 8 and s.schedule == Schedule("interleaved", 2)
    text = str(s)
    assert "mesh P=4 pipeline, X=8 over dcn, Y=4" in text and "schedule interleaved 2" in text
    assert shardc.parse(text) == s


@pytest.mark.parametrize("name", [n for n in SCHEDULES if n != "interleaved"])
def test_every_schedule_parses(name: str) -> None:
    s = spec(f"mesh P=2 pipeline, X=2, Y=2\nlayers 4\nmicrobatches 4\nschedule {name}")
    assert s.schedule == Schedule(name) and shardc.parse(str(s)) == s


def test_defaults_one_f_one_b_and_a_microbatch_a_stage() -> None:
    pipe = pipeline_of(spec("mesh P=4 pipeline, X=2, Y=2\nlayers 10"))
    assert pipe is not None and pipe.schedule == Schedule("1f1b") and pipe.microbatches == 4
    assert not pipe.microbatches_given
    assert pipe.stage_layers == (3, 3, 2, 2) and "unevenly" in pipe.split_text()  # uneven split stated


@pytest.mark.parametrize(("head", "message", "line", "column"), [
    ("mesh P=4 pipeline, X=2, Y=2\nlayers 8\nschedule foo", "unknown pipeline schedule `foo`", 3, 10),
    ("mesh P=4 pipeline, X=2, Y=2\nlayers 8\nschedule gpipe 2", "takes no number", 3, 16),
    ("mesh P=4 pipeline, X=2, Y=2\nlayers 8\nschedule interleaved", "needs its virtual stages", 3, 10),
    ("mesh P=4 pipeline, X=2, Y=2\nlayers 8\nschedule interleaved 1", "at least 2 virtual", 3, 22),
    ("mesh P=4 pipeline, X=2 pipeline, Y=2\nlayers 8", "both marked pipeline", 1, 20),
    ("mesh X=2, Y=2\nmicrobatches 4", "`microbatches` needs a pipeline axis", 2, 1),
    ("mesh X=2, Y=2\nschedule gpipe", "`schedule` needs a pipeline axis", 2, 1),
    ("mesh P=4 pipeline, X=2, Y=2\nlayers 3", "3 layer(s) cannot fill 4 stages", 2, 1),
    ("mesh P=4 pipeline, X=2, Y=2\nlayers 4\nschedule zbv", "cannot fill 4 stages of 2 chunks", 2, 1),
    ("mesh P=4 pipeline, X=2, Y=2", "1 layer(s) cannot fill 4 stages", 1, 6),
    ("mesh P=4 pipeline, X=2, Y=2\nlayers 8\nmicrobatches 0", "size must be positive", 3, 14),
    ("mesh P=4 pipelin, X=2", "syntax error", 1, 10),
    ("mesh P=4 pipeline, X=2, Y=2\nlayers 8\nmicrobatches 6\nschedule interleaved 2", "a multiple of the 4", 3, 1),
])
def test_pipeline_errors_point_at_the_mistake(head: str, message: str, line: int, column: int) -> None:
    with pytest.raises(ShardcError) as err:
        spec(head)
    assert message in err.value.message and err.value.fix
    assert err.value.span is not None and (err.value.span.line, err.value.span.column) == (line, column)


def test_a_tensor_cannot_be_sharded_over_the_stage_axis() -> None:
    with pytest.raises(ShardcError, match="sharded over P, the pipeline axis") as err:
        spec("mesh P=2 pipeline, X=2\nlayers 2", "Out[B_X, F] = In[B_P, D] · W[D, F]\n")
    assert err.value.span is not None and err.value.span.column == 15


def test_the_stage_plan_never_uses_the_stage_axis() -> None:
    s = spec("mesh P=4 pipeline, X=2, Y=2\nlayers 8")
    plan = shardc.plan(s)
    assert plan.spec == s and ("P", 4) in (plan.sizes or ())
    assert all("P" not in step.axes for step in plan.forward + plan.backward)
    # under the book's model (the whole batch at once) the stage's plan is the stage spec's own; under the
    # chip's, its candidates are timed a microbatch at a time, as the pipeline runs them
    assert shardc.plan(s, model="book").forward == shardc.plan(stage_spec(s), model="book").forward


# --- the simulator against the closed forms ---------------------------------------------

GRID = [(p, m) for p in (2, 3, 4, 8) for m in (1, 2, p, 2 * p, 3 * p + 1, 4 * p)]


def _runs(schedule: str, p: int, m: int) -> bool:
    """Whether the schedule runs p stages and m microbatches: Megatron's interleaved order needs m a
    multiple of p; DualPipe p and m even, m at least 2p; DualPipeV m at least 2p."""
    return not ((schedule == "interleaved" and m % p) or (schedule == "dualpipe" and (p % 2 or m % 2 or m < 2 * p))
                or (schedule == "dualpipev" and m < 2 * p))


@pytest.mark.parametrize(("schedule", "p", "m"), [(s, p, m) for s in SCHEDULES for p, m in GRID if _runs(s, p, m)])
def test_bubble_formulas_agree_with_the_simulation(schedule: str, p: int, m: int) -> None:
    # The exact schedules at unequal times; zbv and dualpipe at T_F = T_B = T_W, the papers' case.
    timing = Timing(1.0, 1.7, 0.6) if schedule in EXACT else Timing(1.0, 1.0, 1.0)
    virtual = 2 if schedule == "interleaved" else 1
    sim = simulate(schedule, p, m, timing, virtual)
    closed = bubble(schedule, p, m, timing, virtual)
    if schedule in ("zb-h1", "zbv") and m < p:
        assert sim.bubble_of_ideal >= closed.of_ideal - 1e-9  # too few microbatches to fill: a bound
        return
    assert sim.bubble_of_ideal == pytest.approx(closed.of_ideal, abs=1e-9)
    assert sim.bubble_of_total == pytest.approx(closed.of_total, abs=1e-9)
    assert sim.peak_inflight(0) == pytest.approx(held(schedule, p, m, virtual))


@pytest.mark.parametrize(("schedule", "p", "m", "of_ideal", "of_total"), [
    ("gpipe", 4, 8, 3 / 8, 3 / 11),  # (p-1)/m of ideal = (p-1)/(m+p-1) of total
    ("1f1b", 4, 8, 3 / 8, 3 / 11),
    ("interleaved", 4, 8, 3 / 16, 3 / 19),  # (p-1)/(V m), V = 2
    ("zb-h1", 4, 8, 3 / 24, 3 / 27),  # (p-1)/(3m)
    ("zbv", 4, 8, 3 / 48, 3 / 51),  # (p-1)/(6m): about 0
])
def test_golden_bubbles(schedule: str, p: int, m: int, of_ideal: float, of_total: float) -> None:
    sim = simulate(schedule, p, m, Timing(1.0, 1.0, 1.0), virtual=2)
    assert sim.bubble_of_ideal == pytest.approx(of_ideal) and sim.bubble_of_total == pytest.approx(of_total)


@pytest.mark.parametrize(("schedule", "p", "m", "want"), [
    ("gpipe", 4, 8, 8), ("1f1b", 4, 8, 4), ("1f1b", 4, 2, 2), ("zb-h1", 4, 8, 4), ("zbv", 4, 8, 4),
    ("interleaved", 4, 8, 4 * (1 + 3 / 8)),  # p (1 + (p-1)/(p V)) with V = 2
])
def test_golden_inflight(schedule: str, p: int, m: int, want: float) -> None:
    sim = simulate(schedule, p, m, Timing(1.0, 1.0, 1.0), virtual=2)
    assert sim.peak_inflight(0) == pytest.approx(want)
    assert held(schedule, p, m, 2) == pytest.approx(want)


def test_one_f_one_b_stage_s_holds_p_minus_s() -> None:
    sim = simulate("1f1b", 4, 8, Timing(1.0, 2.0))
    assert [sim.peak_inflight(s) for s in range(4)] == [4, 3, 2, 1]
    assert inflight("1f1b", 4, 8) == 4 and inflight("gpipe", 4, 8) == 8


def test_zbv_is_a_v_and_sends_twice_as_much() -> None:
    assert [device_of("zbv", c, 4) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert sends_per_microbatch("zbv", 4) == 2 * sends_per_microbatch("1f1b", 4)
    sim = simulate("zbv", 4, 8, Timing(1.0, 1.0, 1.0))
    assert {op.device for op in sim.ops if op.chunk == 7} == {0}  # the loss is on device 0


@settings(max_examples=40, deadline=None)
@given(schedule=st.sampled_from(SCHEDULES), p=st.integers(1, 6), m=st.integers(1, 12),
       times=st.tuples(*[st.floats(0.01, 5.0)] * 3), comm=st.floats(0.0, 0.5), back=st.floats(0.0, 0.5))
def test_the_step_never_undercuts_one_microbatch_through_every_stage(
        schedule: str, p: int, m: int, times: tuple[float, float, float], comm: float, back: float) -> None:
    if schedule == "interleaved":
        m = p * max(1, m // p)
    if schedule == "dualpipe":
        p, m = 2 * max(1, p // 2), max(2 * max(1, p // 2) * 2, m + m % 2)
    if schedule == "dualpipev":
        m = max(2 * p, m)
    timing = Timing(*times, comm=comm, comm_back=back)  # the gradient's send back may take longer
    sim = simulate(schedule, p, m, timing, virtual=2)
    sends = sends_per_microbatch(schedule, p, 2)
    # One microbatch's chain: every stage's F, then every stage's B, sends both ways; a separate
    # W (zero-bubble) waits on nothing after it, so only the last one is on the chain.
    split, v = ("zb-h1", "zbv", "dualpipe", "dualpipev"), schedule in ("zbv", "dualpipev")
    chain = p * timing.total if schedule not in split else p * (timing.forward + timing.backward)
    chain += (timing.weight / (2 if v else 1)) if schedule in split else 0.0
    assert sim.makespan >= chain + sends * (comm + back) - 1e-9
    assert sim.makespan >= sim.ideal - 1e-9
    by_device: dict[int, list[tuple[float, float]]] = {}
    for op in sim.ops:
        by_device.setdefault(op.device, []).append((op.start, op.end))
    for spans in by_device.values():  # a device runs one op at a time
        spans.sort()
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:], strict=False))
    kinds = 3 if schedule in split else 2
    assert len(sim.ops) == kinds * m * p * (2 if schedule in ("interleaved", "zbv", "dualpipev") else 1)


def test_a_gradient_goes_back_at_its_own_send_time() -> None:
    """Issue 20: the backward's send is the gradient's, not the activation's.  GPipe, 2 stages, 1 microbatch:
    F, send on, F, B, send back, B."""
    sim = simulate("gpipe", 2, 1, Timing(1.0, 1.0, comm=0.5, comm_back=2.0))
    assert sim.makespan == pytest.approx(1 + 0.5 + 1 + 1 + 2.0 + 1)
    assert simulate("gpipe", 2, 1, Timing(1.0, 1.0, comm=0.5)).makespan == pytest.approx(5.0)  # None: comm both ways


def _h100_pipeline(mesh: str, lines: str = "") -> str:
    """Two matmuls a layer on H100s, 8 layers in 8 microbatches of 1F1B, on ``mesh`` (``lines`` before the params)."""
    return (f"mesh {mesh}\nlayers 8\nmicrobatches 8\nschedule 1f1b\nhardware h100\n"
            f"dims B=4096, D=4096, E=4096\n{lines}param W1, W2\n"
            "H[B_X, E] = In[B_X, D] · W1[D_X, E]\nOut[B_X, D] = H[B_X, E] · W2[E_X, D]\n")


def test_an_fp8_boundary_sends_its_gradient_back_in_the_storage_type() -> None:
    """Issue 20: an FP8 block output's gradient is BF16 (shardc.ir.precision.gradient_dtype), twice its bytes:
    the simulation and each stage's communication price the send back at them; a BF16 boundary's are unchanged."""
    f8, bf16 = (shardc.cost(shardc.plan(shardc.parse(_h100_pipeline("P=4 pipeline, X=4", line), "f8.shard"))).pipeline
                for line in ("dtype f8 Out\n", ""))
    assert f8 is not None and bf16 is not None
    assert f8.p2p_bytes * 2 == bf16.p2p_bytes and f8.p2p_s < bf16.p2p_s
    assert f8.timing.send_back == pytest.approx(bf16.p2p_s)  # the gradient's bytes: BF16's
    assert bf16.timing.comm_back is None and "p2p_back_s" not in bf16.to_json()
    assert f8.to_json()["p2p_back_s"] == f8.timing.send_back
    inner = [s for s in f8.stages if 0 < s.stage < 3]  # two boundaries: each sends on and back
    assert all(s.comm_s - f8.stages[0].comm_s == pytest.approx(f8.p2p_s + bf16.p2p_s) for s in inner)


# --- cost -----------------------------------------------------------------------------------

def test_cost_json_has_the_pipeline_object() -> None:
    report = shardc.cost(shardc.plan(shardc.parse(EXAMPLE.read_text(), str(EXAMPLE))))
    data = json.loads(report.json_text())["pipeline"]
    for key in ("stages", "microbatches", "schedule", "bubble_of_ideal", "bubble_of_total",
                "inflight_microbatches", "activation_factor", "p2p_bytes"):
        assert key in data
    assert (data["stages"], data["microbatches"], data["schedule"]) == (4, 64, "1f1b")
    assert data["bubble_of_ideal"] == pytest.approx(3 / 64) and data["bubble_of_total"] == pytest.approx(3 / 67)
    assert data["inflight_microbatches"] == 4 and data["activation_factor"] == 1
    # Out[B_X, S, D] of one microbatch: B/64 sequences over X=8, S=4096 tokens of D=4096, bf16.
    assert data["p2p_bytes"] == 1024 // 64 // 8 * 4096 * 4096 * 2
    assert data["p2p_bytes_global"] == data["p2p_bytes"] * 8
    assert data["network"] == "ici" and data["p2p_s"] > 0
    stages = data["per_stage"]
    assert [s["layers"] for s in stages] == [8] * 4 and [s["inflight_microbatches"] for s in stages] == [4, 3, 2, 1]
    assert stages[0]["activation_bytes"] == pytest.approx(4 * stages[3]["activation_bytes"])
    assert all(s["bound"] in ("compute", "communication") for s in stages)
    # The step: the stage time times (m + bubble), sends free; the simulation adds the sends.
    assert data["step_closed_s"] == pytest.approx(data["stage_time_s"] * (64 + 64 * 3 / 64))
    assert data["step_s"] >= data["step_closed_s"]
    text = report.render()
    assert "pipeline over P: 4 stages, schedule 1f1b, 64 microbatches" in text
    assert "bubble 4.7% of the ideal time ((p-1)/m), 4.5% of the step" in text
    assert all(s["fits"] for s in stages)  # 64 microbatches: the first stage holds 4 of 16 sequences


def test_a_dcn_stage_axis_pays_dcn_for_its_sends() -> None:
    from shardc.hardware import get_hardware

    hw = get_hardware("tpu-v5p")

    def p2p(mesh: str) -> tuple[float, float, str]:
        s = spec(f"{mesh}\nlayers 8\nmicrobatches 8")
        report = shardc.cost(shardc.plan(s), hardware="tpu-v5p")
        assert report.pipeline is not None
        return report.pipeline.p2p_s, report.pipeline.p2p_bytes, report.pipeline.network

    slow, nbytes, net = p2p("mesh P=4 pipeline over dcn, X=2, Y=2")
    assert net == "dcn" and slow == pytest.approx(nbytes / hw.dcn_bandwidth + hw.hop_latency)
    fast, nbytes, net = p2p("mesh P=4 pipeline, X=2, Y=2")  # one ICI link, one way
    assert net == "ici" and fast == pytest.approx(nbytes / hw.ici_bandwidth + hw.hop_latency)
    assert nbytes == 4096 // 8 // 2 * 256 // 2 * 2  # Out[B_X, D_Y]: a microbatch's shard, bf16


def test_weight_gradient_steps_and_the_boundary() -> None:
    plan = shardc.plan(spec("mesh P=2 pipeline, X=2, Y=2\nlayers 2"))
    assert microbatch_dim(plan) == "B" and str(boundary_tensor(plan)) == "Out[B_X, D_Y]"
    assert plan.model_dims == {"D", "F"}  # the params' dims: B, which none has, is the one microbatches cut
    assert {plan.backward[k].tensor for k in weight_steps(plan)} == {"dW_in", "dW_out"}
    # data parallel over X: of the weight-gradient steps, the AllReduces over X are run once a step
    dp = shardc.plan(spec("mesh P=2 pipeline, X=2\nlayers 2", BLOCK.replace("_Y", "").replace("D_X", "D")))
    reduced = gradient_reductions(dp)
    assert reduced and reduced < weight_steps(dp)
    assert {(dp.backward[k].op.value, dp.backward[k].tensor) for k in reduced} == {
        ("all_reduce", "dW_in"), ("all_reduce", "dW_out")}


# A layer's dead end (O0, read by nothing) shaped like its input, before the output that feeds the next layer
DEAD_END = """mesh P=2 pipeline, X=2
dims B=16, D=8, E=8, V=16
microbatches 2
const Tok, Next
param W1, W2, W_emb, W_out
X0[B_X, D] = embed(Tok[B_X], W_emb[V, D])
layers 2 {
  O0[B_X, D] = silu(X0[B_X, D])
  X1[B_X, D] = X0[B_X, D] + X0[B_X, D] · W1[D, E] · W2[E, D]
}
Lg[B_X, V] = X1[B_X, D] · W_out[D, V]
Loss[] = cross_entropy(Lg[B_X, V], Next[B_X])
"""


def test_a_stage_sends_the_output_that_feeds_the_next_layer_not_a_dead_end() -> None:
    """The block's part alone has no block of its own: its boundary was its first output of the input's
    shape (O0), where the whole plan's is the last (X1, the one that feeds the next layer, as validate's
    block_feeds reads it): `shardc lower` raised KeyError 'X1' (1f1b) or 'O0' (zb-h1).  Found by the search
    of chains in layers blocks (issue 20, point 3)."""
    from shardc.lowering.pipeline_ends import cut_parts
    plan = shardc.plan(shardc.parse(DEAD_END))
    assert boundary_tensor(plan).name == boundary_tensor(cut_parts(plan).block).name == "X1"


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_layer_with_a_dead_end_verifies(schedule: str) -> None:
    from shardc.verification.verify import render_report, verify
    report = verify(shardc.parse(DEAD_END.replace("microbatches 2", f"microbatches 2\nschedule {schedule}")))
    assert report.ok, render_report(report)


def test_microbatches_must_divide_the_batch() -> None:
    s = spec("mesh P=2 pipeline, X=2, Y=2\nlayers 2\nmicrobatches 3")
    with pytest.raises(ShardcError, match="does not split into 3 microbatches"):
        shardc.cost(shardc.plan(s))


def test_schedule_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shardc.cli.main import main

    out = tmp_path / "gantt.png"
    assert main(["cost", str(EXAMPLE), "--schedule-plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert f"wrote {out}" in capsys.readouterr().out


def test_schedule_plot_needs_a_pipeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shardc.cli.main import main

    examples = Path(__file__).parents[1] / "examples"
    assert main(["cost", str(examples / "fsdp_tp.shard"), "--schedule-plot", str(tmp_path / "x.png")]) != 0
    assert "needs a pipelined spec" in capsys.readouterr().err


def test_uneven_stages_pace_the_pipeline() -> None:
    report = shardc.cost(shardc.plan(spec("mesh P=4 pipeline, X=2, Y=2\nlayers 10\nmicrobatches 8")))
    assert report.pipeline is not None
    stages = report.pipeline.stages
    assert [s.layers for s in stages] == [3, 3, 2, 2]
    assert stages[0].forward_s == pytest.approx(1.5 * stages[3].forward_s)
    assert report.pipeline.timing.forward == pytest.approx(stages[0].forward_s)
    assert math.isclose(report.layers, 3)


def test_stage_activations_follow_the_save_policy() -> None:
    s = spec("mesh P=2 pipeline, X=2, Y=2\nlayers 4\nmicrobatches 4")

    def activations(save: str) -> float:  # one plan choice for every policy: the book's model's
        report = shardc.cost(shardc.plan(s, save=save, model="book"))
        assert report.pipeline is not None
        first = report.pipeline.stages[0]
        # The tables' residuals are one stage's layers on the whole batch (4 microbatches) at once.
        per_micro = sum(b for v, b in report.memory.residuals if "B" in v) / 4
        weights = sum(b for v, b in report.memory.residuals if "B" not in v)
        assert first.activation_bytes == pytest.approx(first.layers * (per_micro * first.held + weights))
        return first.activation_bytes

    assert activations("none") < activations("default") <= activations("all")


def test_uneven_split_is_stated_in_the_text() -> None:
    report = shardc.cost(shardc.plan(spec("mesh P=4 pipeline, X=2, Y=2\nlayers 10\nmicrobatches 8")))
    assert "10 layers over 4 stages, unevenly: 3, 3, 2, 2" in report.render()


def test_plan_text_says_it_is_one_stage() -> None:
    from shardc.planner.plan_text import render_text

    text = render_text(shardc.plan(shardc.parse(EXAMPLE.read_text(), str(EXAMPLE))))
    assert text.splitlines()[1] == ("# pipeline over P: 32 layers over 4 stages: 8 a stage; 64 microbatches, "
                                    "schedule 1f1b; below is one stage's plan, for one layer (nothing is "
                                    "sharded over P); `shardc cost` gives the pipeline's step time")
    assert "# step time" not in text  # one stage's plan over every layer is not the pipeline's step


def test_gradient_reductions_run_once_a_step_under_a_pipeline() -> None:
    """Each microbatch's weight gradients are accumulated and reduced once a step (Megatron-LM,
    DeepSpeed, torchtitan), so more microbatches add no reductions; what the last microbatch's
    backward does not hide is added to the step."""
    path = Path(__file__).resolve().parent.parent / "examples" / "pipeline_llama2_13b.shard"
    text = path.read_text(encoding="utf-8")
    costs = [shardc.cost(shardc.plan(shardc.parse(text.replace("microbatches 16", f"microbatches {m}"))))
             for m in (8, 16)]  # 16 sequences a device: at most 16
    for report in costs:
        pipe = report.pipeline
        assert pipe is not None and pipe.grad_reduce_s > 0 and 0 <= pipe.grad_reduce_exposed_s <= pipe.grad_reduce_s
        assert pipe.step_s == pytest.approx(pipe.simulation.makespan + pipe.grad_reduce_exposed_s + pipe.optimizer_s
                                            + pipe.update_s)
        data = report.to_json()["pipeline"]
        assert data["grad_reduce_s"] == pipe.grad_reduce_s  # type: ignore[index]
    # the reductions move the params' gradients, whatever the microbatch count
    assert costs[0].pipeline.grad_reduce_s == pytest.approx(costs[1].pipeline.grad_reduce_s)  # type: ignore[union-attr]


def test_a_pipeline_axis_of_size_one_is_pipelining_switched_off() -> None:
    """`P=1 pipeline` costs what the spec without the axis costs: the whole batch at once, not its
    microbatches one after another (before: 6.1 s against 1.49 s for LLaMA-2 13B on 1024 v5p)."""
    text = (Path(__file__).resolve().parent.parent / "examples" / "pipeline_llama2_13b.shard").read_text()
    off = text.replace("mesh P=4 pipeline, X=64, Y=4", "mesh P=1 pipeline, X=256, Y=4")
    plain = "\n".join(line for line in off.replace("mesh P=1 pipeline, X=256, Y=4", "mesh X=256, Y=4").splitlines()
                      if not line.startswith(("microbatches", "schedule")))
    got, want = (shardc.cost(shardc.plan(shardc.parse(t))) for t in (off, plain))
    assert got.pipeline is None and got.step.step_s == pytest.approx(want.step.step_s, rel=1e-12)


def test_the_free_sends_step_of_an_uneven_split_is_no_longer_than_the_step() -> None:
    """`stage_layers 3, 5, 5, 3` (Mixtral 8x7B's 32 layers as 7, 9, 9, 7 showed it): the closed form took every stage
    at the slowest's times, so "[1.75 s with free sends]" stood beside a 1.67 s step with its sends; an uneven split's
    bracket is the schedule simulated with free sends."""
    text = ("mesh P=4 pipeline, X=4\nlayers 16\nstage_layers 3, 5, 5, 3\nmicrobatches 8\nschedule 1f1b\nhardware h100\n"
            "dims B=4096, D=4096, E=4096\nparam W1, W2\n"
            "H[B_X, E] = In[B_X, D] · W1[D_X, E]\nOut[B_X, D] = H[B_X, E] · W2[E_X, D]\n")
    pipe = shardc.cost(shardc.plan(shardc.parse(text))).pipeline
    assert pipe is not None and pipe.free_simulation is not None
    assert pipe.closed.idle_s + pipe.simulation.ideal > pipe.free_simulation.makespan  # the closed form overstates
    assert pipe.simulation.makespan >= pipe.step_closed_s - pipe.optimizer_s > pipe.simulation.ideal


def test_a_gpu_stage_axis_across_nodes_sends_over_infiniband_and_says_so() -> None:
    """Issue 21: a stage axis declared without `over dcn` that the GPU cluster's topology lays across nodes sends
    at the InfiniBand rate, and the cost says DCN (it said ICI); one inside a node stays ICI."""
    across, inside = (shardc.cost(shardc.plan(shardc.parse(_h100_pipeline(mesh), "nodes.shard"))).pipeline
                      for mesh in ("P=2 pipeline, X=8", "X=2, P=8 pipeline"))
    assert across is not None and inside is not None
    assert (across.network, inside.network) == ("dcn", "ici")
    assert across.to_json()["network"] == "dcn" and across.p2p_s > inside.p2p_s
    assert any("t_send over one DCN)" in line for line in across.thresholds)


def test_a_microbatch_its_data_parallel_devices_do_not_divide_is_refused() -> None:
    """Issue 20: 64 sequences over 16 data-parallel devices in 8 microbatches left each device 0.5 of a
    sequence a microbatch, costed as it was; Megatron-LM's micro-batch is a data-parallel rank's, whole."""
    text = ("mesh P=2 pipeline, X=16\nlayers 4\nmicrobatches {}\nschedule 1f1b\n"
            "dims B=64, D=256, E=256\nparam W1, W2\n"
            "H[B_X, E] = In[B_X, D] · W1[D, E]\nOut[B_X, D] = H[B_X, E] · W2[E, D]\n")
    with pytest.raises(shardc.ShardcError, match="8 a microbatch, which its 16 devices") as caught:
        shardc.plan(shardc.parse(text.format(8), "half.shard"))
    assert "microbatches 1, 2, 4" in (caught.value.fix or "")
    assert shardc.cost(shardc.plan(shardc.parse(text.format(4), "whole.shard"))).pipeline is not None


def test_the_free_sends_bracket_is_the_whole_step_with_free_sends() -> None:
    """Megatron 145.6B's cost read "step 15.7 s = ... + exposed gradient reductions 409 ms + update 33.2 ms
    [15.2 s with free sends]" where its sends cost 8 ms: the bracket left out what the step adds after the
    schedule. It is now the step with only the sends made free."""
    text = ("mesh P=4 pipeline, X=4\nlayers 16\nmicrobatches 8\nschedule 1f1b\nhardware h100\n"
            "grad_reduce after-backward\ndims B=4096, D=4096, E=4096\nparam W1, W2\n"
            "H[B_X, E] = In[B_X, D] · W1[D_X, E]\nOut[B_X, D] = H[B_X, E] · W2[E_X, D]\n")
    report = shardc.cost(shardc.plan(shardc.parse(text)))
    pipe = report.pipeline
    assert pipe is not None and pipe.grad_reduce_exposed_s > 0.01 * pipe.step_s
    free_schedule = pipe.step_closed_s - pipe.optimizer_s
    whole = pipe.step_s - pipe.simulation.makespan + free_schedule
    assert pipe.free_sends_step_s == pytest.approx(whole)
    assert f"[{fmt_seconds(whole)} with free sends" in render(report)
    assert fmt_seconds(whole) != fmt_seconds(pipe.step_closed_s)
