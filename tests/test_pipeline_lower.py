"""Lowering a pipelined spec to GPipe over the stage axis, and verifying it (values and HLO permutes)."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardc
from shardc.errors import ShardcError
from shardc.lowering.pipeline_lowering import lower_pipeline, tick_tables
from shardc.spec.stages import pipeline_of
from shardc.verification.pipeline_hlo import loop_rows, stage_rows
from shardc.verification.pipeline_verify import run_sizes, verify_pipeline
from tests.example_reports import example_report

EXAMPLE = Path(__file__).parents[1] / "examples" / "pipeline_llama.shard"


@pytest.fixture(scope="module")
def plan() -> shardc.ir.plan.Plan:  # type: ignore[name-defined]
    return shardc.plan(shardc.parse(EXAMPLE.read_text(), str(EXAMPLE)))


def test_lower_writes_a_gpipe_module(plan: object, capsys: pytest.CaptureFixture[str]) -> None:
    from shardc.cli.main import main

    assert main(["lower", str(EXAMPLE)]) == 0
    source = capsys.readouterr().out
    compile(source, "pipeline_llama.py", "exec")  # valid Python
    for line in ("STAGES = 4", "LAYERS = 32", "MICROBATCHES = 64", "F_TABLE = (\n    (0, -1, -1, -1),\n",
                 "def forward_local(", "def backward_local(", "PIPELINE = block_pipeline(globals())",
                 "pipeline_forward, pipeline_grad = PIPELINE.outputs, PIPELINE.gradients"):
        assert line in source
    forward, backward = tick_tables("1f1b", 4, 64)
    assert f"    {tuple(forward[5])!r},\n" in source and f"    {tuple(backward[-1])!r},\n" in source
    assert "jax.lax.all_gather(" in source  # the stage's own plan (FSDP over X) is composed in


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved 2", "zb-h1", "zbv", "dualpipe", "dualpipev"])
def test_lower_says_which_schedule_the_program_runs(schedule: str, capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    """Each costed schedule lowers with its own tick table (none as GPipe's), and none says it runs other
    than it is costed (the two DualPipes' F&B pairs run at one tick each, as the cost pairs them)."""
    from shardc.cli.main import main

    name = schedule.split()[0]
    spec = tmp_path / f"{name}.shard"
    spec.write_text(EXAMPLE.read_text().replace("schedule 1f1b", f"schedule {schedule}"))
    assert main(["lower", str(spec)]) == 0
    out, err = capsys.readouterr()
    assert "lowers as GPipe" not in err + out
    assert "note:" not in err and "in turn" not in err + out
    virtual = 2 if name == "interleaved" else 1  # zbv and the dualpipes place their two chunks themselves
    assert (tick_tables(name, 4, 64, virtual) == tick_tables("gpipe", 4, 64)) == (name == "gpipe")
    assert (tick_tables(name, 4, 64, virtual) == tick_tables("1f1b", 4, 64)) == (name == "1f1b")


def test_interleaved_tick_tables_run_each_chunk_of_each_microbatch_once_a_device() -> None:
    """Megatron-LM's interleaved order: an entry is chunk x M + microbatch; a device holds virtual stages
    c x P + s, and every (chunk, microbatch) runs forward once and backward once on every device."""
    forward, backward = tick_tables("interleaved", 2, 4, 2)
    assert len(forward) == 18  # the simulation's makespan at one tick a chunk
    for table in (forward, backward):
        for s in range(2):
            assert sorted(row[s] for row in table if row[s] >= 0) == list(range(8))
    assert [row[0] for row in forward[:4]] == [0, 1, 4, 5]  # microbatches 0, 1 through chunk 0, then chunk 1
    assert forward[1][1] == 0 and backward[4][1] == 4  # stage 1 runs chunk 0 of microbatch 0 after stage 0


@pytest.mark.slow
def test_the_python_api_lowers_a_pipelined_spec_to_its_pipeline() -> None:
    from shardc.lowering.pipeline_lowering import PipelineLowered

    spec = shardc.parse(EXAMPLE.read_text().replace("schedule 1f1b", "schedule gpipe"), "gpipe")
    lowered = shardc.lower(shardc.plan(spec), sizes={"X": 2, "Y": 1, "B": 128, "S": 4, "T": 4,
                                                      "D": 8, "F": 16, "N": 2, "H": 4})
    assert isinstance(lowered, PipelineLowered)
    assert "jax.lax.ppermute" in lowered.source and lowered.pipeline.stages == 4


def _values_ok(report: object) -> None:
    names = {(r.phase, r.tensor) for r in report.values}  # type: ignore[attr-defined]
    assert names == {("forward", "Out"), ("backward", "dX")} | {
        ("backward", f"dW_{w}") for w in ("q", "k", "v", "o", "gate", "up", "down")}
    assert all(r.ok for r in report.values), [r for r in report.values if not r.ok]  # type: ignore[attr-defined]


FOUR_STAGES = ("mesh P=4 pipeline, X=8, Y=4", "mesh P=4 pipeline, X=8, Y=1")  # P=4 x X=2 fits 8 devices


@pytest.mark.slow
def test_verify_runs_gpipe_on_eight_devices_against_numpy() -> None:
    text = EXAMPLE.read_text().replace("schedule 1f1b", "schedule gpipe").replace(*FOUR_STAGES)
    report = verify_pipeline(shardc.plan(shardc.parse(text, "gpipe")), devices=8)
    assert report.mesh == {"P": 4, "X": 2, "Y": 1}
    assert report.sizes["layers"] == 8 and report.sizes["microbatches"] == 8
    _values_ok(report)
    loop, down, up = report.collectives[:3]  # GPipe's tick table: every forward, then every backward
    assert loop.ok and loop.hlo_op == "while x [22]"  # 2 (m + p - 1) ticks
    assert not any("lowers as GPipe" in n for n in report.notes)
    assert down.ok and up.ok and down.hlo_op == up.hlo_op == "collective-permute x 1"
    gathers = [r for r in report.collectives if r.kind == "AllGather"]
    assert gathers and all(r.ok and r.hlo_bytes == r.plan_bytes for r in gathers)  # FSDP over X, in the stages
    assert report.ok, [r for r in report.collectives if not r.ok]


@pytest.mark.slow
def test_verify_runs_the_examples_1f1b() -> None:
    """8 devices run the example's P=4, X=8, Y=4 as P=2, X=2, Y=2: every axis moves something."""
    report = example_report("pipeline_llama")  # verify_pipeline(plan, devices=8), shared with test_lower's
    assert report.mesh == {"P": 2, "X": 2, "Y": 2}
    _values_ok(report)
    loop, down, up = report.collectives[:3]
    assert loop.ok and loop.hlo_op == "while x [10]"  # 2 (m + p - 1) ticks
    assert down.ok and up.ok and down.hlo_op == up.hlo_op == "collective-permute x 1"
    reduces = [r for r in report.collectives if r.kind == "AllReduce" and r.phase == "step"]
    assert len(reduces) >= 2 and all(r.ok and r.plan_axes == "Y" for r in reduces)  # Megatron's, 2 a layer forward
    assert any(r.plan_axes == "X" for r in report.collectives)  # the FSDP gathers and gradient reductions
    assert report.ok, [r for r in report.collectives if not r.ok]


@pytest.mark.slow
def test_an_axis_cut_to_one_fails_its_collectives(plan: object) -> None:
    """4 devices: P=2, X=2 and Y cut to 1, so the tensor-parallel collectives over Y did not run."""
    report = verify_pipeline(plan, devices=4)  # type: ignore[arg-type]
    assert report.mesh == {"P": 2, "X": 2, "Y": 1}
    _values_ok(report)
    failed = [r for r in report.collectives if not r.ok]
    assert failed and all("Y" in r.plan_axes and "cut to 1" in r.note for r in failed)
    assert any(r.kind == "AllReduce" for r in failed)  # Megatron's, forward
    assert not report.ok and any("Y cut to 1" in n for n in report.notes)


def test_a_collective_missing_from_the_hlo_is_a_mismatch(plan: object) -> None:
    sizes, layers, micro = run_sizes(plan, 8)  # type: ignore[arg-type]
    lowered = lower_pipeline(plan, sizes=sizes, layers=layers, microbatches=micro)  # type: ignore[arg-type]
    rows = stage_rows(lowered, "", None, ())
    assert rows and not any(r.ok for r in rows)


def test_missing_permutes_are_a_mismatch(plan: object) -> None:
    sizes, layers, micro = run_sizes(plan, 8)  # type: ignore[arg-type]
    lowered = lower_pipeline(plan, sizes=sizes, layers=layers, microbatches=micro)  # type: ignore[arg-type]
    loop, down, up, count = loop_rows(lowered, "")[:4]
    assert not any(r.ok for r in (loop, down, up, count)) and count.note == "0 permutes in the HLO, not 2"
    # Out[B_X, S, D] of a microbatch, bf16 (verify's sizes: every sharding of the plan divides them)
    assert down.plan_bytes == up.plan_bytes == sizes["B"] // micro // sizes["X"] * sizes["S"] * sizes["D"] * 2


def test_uneven_stages_lower_as_the_cost_splits_them(plan: object) -> None:
    """10 layers over 4 stages run as 3, 3, 2, 2 (the cost's split): 3 slots a stage, the last slot of
    the last two stages empty (zeros, handing its input on); a param's layers fill the slots in order."""
    lowered = lower_pipeline(plan, sizes={"X": 2, "Y": 1}, layers=10, microbatches=4)  # type: ignore[arg-type]
    pipeline = lowered.namespace.PIPELINE
    costed = pipeline_of(shardc.parse(EXAMPLE.read_text().replace("layers 32", "layers 10")))
    assert "LAYERS = 10 " in lowered.source and costed is not None
    assert pipeline.held == costed.stage_layers == (3, 3, 2, 2) and pipeline.slots == 3
    assert pipeline.slot_layers() == [0, 1, 2, 3, 4, 5, 6, 7, 10, 8, 9, 10]
    with pytest.raises(ShardcError, match="2 layers cannot fill 4 stages"):
        lower_pipeline(plan, layers=2, load=False)  # type: ignore[arg-type]


@pytest.mark.slow
def test_uneven_stages_verify() -> None:
    """The spec's own uneven split runs in verify (2P - 1 layers: the last stage's second slot empty)."""
    spec = EXAMPLE.read_text().replace("layers 32", "layers 30")
    report = verify_pipeline(shardc.plan(shardc.parse(spec)))
    assert report.sizes["layers"] == 3 and report.ok  # 2 and 1 over P=2 on 8 devices


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_tick_tables_follow_the_simulation(schedule: str) -> None:
    f_table, b_table = tick_tables(schedule, 4, 8)
    assert len(f_table) == 2 * (8 + 4 - 1)
    for table in (f_table, b_table):  # every microbatch once on every stage
        for s in range(4):
            assert sorted(row[s] for row in table if row[s] >= 0) == list(range(8))
    assert all(not (f >= 0 and b >= 0) for fr, br in zip(f_table, b_table, strict=True)
               for f, b in zip(fr, br, strict=True))  # one op a tick
    if schedule == "1f1b":  # stage 0: p - 1 warm-up forwards, then one more
        assert [row[0] for row in f_table[:5]] == [0, 1, 2, 3, -1]
    else:  # every forward, then every backward
        assert [row[0] for row in f_table[:8]] == list(range(8)) and b_table[-1][0] == 7


ROUTED = """mesh P=2 pipeline, X=2
dims B=8, S=4, D=6, E=4, C=3, F=5
dtype f32
layers 4
microbatches 2
param W_r, W_1, W_2
Gate[B_X, S, E] = softmax(X0[B_X, S, D] · W_r[D, E] over E)
Disp[B_X, S, E, C] = route(Gate[B_X, S, E], S, C, 2 over E)
Comb[B_X, S, E, C] = Gate[B_X, S, E] * Disp[B_X, S, E, C]
In[B, E_X, C, D] = Disp[B_X, S, E, C] · X0[B_X, S, D]
Ex[B, E_X, C, D] = gelu(In[B, E_X, C, D] · W_1[E_X, D, F]) · W_2[E_X, F, D]
X1[B_X, S, D] = X0[B_X, S, D] + Comb[B_X, S, E, C] · Ex[B, E_X, C, D]
"""


@pytest.mark.slow
def test_a_pipelined_routed_layer_verifies() -> None:
    """The reference gets the capacity C from the sizes (no input has it): it raised "C has no size"."""
    report = verify_pipeline(shardc.plan(shardc.parse(ROUTED)), devices=8)
    assert {r.tensor for r in report.values} == {"X1", "dX0", "dW_r", "dW_1", "dW_2"}
    assert report.ok, [r for r in report.values + report.collectives if not r.ok]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_tensor_parallel_stages_verify(schedule: str) -> None:
    # P=2 leaves X=2 and Y=2 on 8 devices: FSDP and tensor parallelism inside each stage (with P=4
    # verify shrinks Y to 1). GPipe's backward once rescaled the grads of params sharded over Y.
    text = EXAMPLE.read_text().replace("mesh P=4 pipeline, X=8, Y=4", "mesh P=2 pipeline, X=2, Y=2")
    report = verify_pipeline(shardc.plan(shardc.parse(text.replace("schedule 1f1b", f"schedule {schedule}"))))
    assert report.mesh == {"P": 2, "X": 2, "Y": 2}
    _values_ok(report)
    assert report.ok, [r for r in report.collectives if not r.ok]


SHADOWS = """mesh P=2 pipeline, X=2
dims B=8, D=6, F=4
dtype f32
layers 4
microbatches 2
param PARAMS, BLOCK
STAGES[B_X, F] = PIPELINE[B_X, D] · PARAMS[D, F]
layer[B_X, F] = gelu(STAGES[B_X, F])
route_topk[B_X, D] = PIPELINE[B_X, D] + layer[B_X, F] · BLOCK[F, D]
"""


@pytest.mark.slow
def test_tensors_named_like_the_pipeline_globals_verify() -> None:
    """A tensor named like a global of the pipeline module (STAGES, PARAMS, ...) once shadowed it."""
    from shardc.lowering.template import defined_names

    plan = shardc.plan(shardc.parse(SHADOWS))
    source = lower_pipeline(plan, load=False).source
    assert {"STAGES", "PARAMS", "PIPELINE", "block_pipeline", "route_topk"} <= defined_names(source)
    report = verify_pipeline(plan, devices=4)
    assert report.ok and {r.tensor for r in report.values} == {"route_topk", "dPIPELINE", "dPARAMS", "dBLOCK"}


@pytest.mark.slow
def test_interleaved_lowers_as_itself_and_verifies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two chunks a device (virtual stages c x P + s): the activations of chunk 0's last stage wrap around
    to stage 0's chunk 1, the cotangents back; a ring that does not wrap fails verify."""
    from shardc.lowering import pipeline_routes
    from tests.test_plan_sections import MODEL

    plan = shardc.plan(shardc.parse(MODEL.replace("microbatches 2", "microbatches 2\nschedule interleaved 2")))
    report = verify_pipeline(plan)
    assert report.ok and report.sizes["layers"] == 4 and not any("lowers as GPipe" in n for n in report.notes)
    assert sum(r.hlo_op.startswith("collective-permute") for r in report.collectives) == 2

    def chain(self: pipeline_routes.Placement, step: int) -> list[list[tuple[int, int]]]:
        p = self.stages
        return [[(s, s + 1) for s in range(p - 1)] if step > 0 else [(s + 1, s) for s in range(p - 1)]]

    monkeypatch.setattr(pipeline_routes.Placement, "links", chain)
    assert not verify_pipeline(plan).ok


F8_BOUNDARY = """mesh P=2 pipeline, X=2
dims B=8, D=6, F=4
layers 2
microbatches 2
dtype f8 X1
param W_1, W_2
H[B_X, F] = gelu(X0[B_X, D] · W_1[D, F])
X1[B_X, D] = X0[B_X, D] + H[B_X, F] · W_2[F, D]
"""


@pytest.mark.slow
def test_an_f8_boundarys_permutes_are_checked_in_each_directions_type() -> None:
    """Issue 20: verify priced both permutes of a `dtype f8` boundary at the activation's byte a float against
    the HLO's at the spec's, and failed both; the activation goes on in FP8, its gradient back in the storage
    type (shardc.ir.precision.gradient_dtype), as the cost prices the two sends."""
    report = verify_pipeline(shardc.plan(shardc.parse(F8_BOUNDARY)), devices=4)
    sends = {r.step.split(": ")[1].split(" ")[0]: r for r in report.collectives if r.kind == "CollectivePermute"}
    on, back = sends["activations"], sends["cotangents"]
    assert on.ok and back.ok and back.plan_bytes == 2 * on.plan_bytes == back.hlo_bytes  # BF16 back, FP8 on
    assert report.ok, [r for r in report.values + report.collectives if not r.ok]
