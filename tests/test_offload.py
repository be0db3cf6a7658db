"""Host offload (`--offload`): kept activations and the optimizer state in the host's memory, moved over
the chip's host link under the phases, what exceeds a phase's time exposed in the step."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import shardc
from shardc.chip_choice import hardware_from_mapping
from shardc.cli.main import main
from shardc.costmodel.offload import IN_FLIGHT_LAYERS, OFFLOADS
from shardc.errors import ShardcError
from shardc.hardware import get_hardware
from shardc.layouts import Options, search_layouts
from shardc.layouts.rank import evaluate

MLP = """mesh X=8
dims B=4096, D=4096, F=16384, L=32
hardware h100
param W1, W2
layers L {
  H[B_X, F] = gelu(E[B_X, D] · W1[D, F])
  E2[B_X, D] = E[B_X, D] + H[B_X, F] · W2[F, D]
}
"""


def _costs(text: str, offload: str, **sizes: int) -> tuple[shardc.CostReport, shardc.CostReport]:
    plan = shardc.plan(shardc.parse(text))
    return shardc.cost(plan, sizes=sizes or None), shardc.cost(plan, sizes=sizes or None, offload=offload)


def test_offloaded_activations_leave_two_layers_on_the_device() -> None:
    plain, moved = _costs(MLP, "activations")
    a_layer = sum(b for _, b in plain.memory.residuals)
    assert moved.memory.residual_bytes == pytest.approx(IN_FLIGHT_LAYERS * a_layer)
    assert moved.memory.host_bytes == pytest.approx(plain.memory.residual_bytes - IN_FLIGHT_LAYERS * a_layer)
    assert moved.memory.total_bytes == pytest.approx(plain.memory.total_bytes - moved.memory.host_bytes)
    assert moved.offload is not None and moved.offload.optimizer_bytes == 0
    assert moved.memory.optimizer_bytes == plain.memory.optimizer_bytes


def test_copies_hidden_under_the_phases_leave_the_step_as_it_was() -> None:
    """A layer's copies hide under its matmuls when D F / (2F + D) > C / (2 host_bandwidth) (bf16): wide layers."""
    plain, moved = _costs(MLP, "activations", D=16384, F=65536)
    assert moved.offload is not None
    link = moved.offload.activation_bytes / get_hardware("h100").host_bandwidth  # type: ignore[operator]
    assert moved.offload.seconds == pytest.approx(link) and link < plain.forward.step_s
    assert moved.offload.exposed_s == 0 and moved.step.step_s == pytest.approx(plain.step.step_s)


def test_copies_longer_than_a_phase_add_what_exceeds_it() -> None:
    """At D = 4096 a layer's kept values take longer over PCIe than its matmuls on an H100."""
    plain, moved = _costs(MLP, "activations")
    assert moved.offload is not None
    link = moved.offload.seconds
    over = max(0.0, link - plain.forward.step_s) + max(0.0, link - plain.backward.step_s)
    assert over > 0 and moved.offload.exposed_s == pytest.approx(over)
    assert moved.step.step_s == pytest.approx(plain.step.step_s + over)


def test_an_offloaded_optimizer_is_updated_on_the_host_after_the_backward() -> None:
    """ZeRO-Offload: the state and gradients on the host, the gradients out under the backward, CPU-Adam at the
    chip's host rate, then the params back in: the device's own update is gone, the host's exposed."""
    plain, moved = _costs(MLP, "optimizer")
    hw = get_hardware("h100")
    assert hw.host_adam_rate == pytest.approx(1e10 / 2.57 / 8) and hw.host_bandwidth is not None
    assert moved.memory.optimizer_bytes == 0 and moved.memory.host_bytes == plain.memory.optimizer_bytes > 0
    assert moved.memory.residual_bytes == plain.memory.residual_bytes
    off = moved.offload
    assert off is not None and off.optimizer_bytes == plain.memory.optimizer_bytes and not off.delayed
    elements = plain.memory.optimizer_bytes / 8  # adam10: fp32 m and v
    assert elements == pytest.approx(plain.memory.params)  # params replicated: every one updated here
    assert off.host_update_s == pytest.approx(elements / hw.host_adam_rate)
    assert off.grad_bytes == off.param_bytes == pytest.approx(2 * elements)  # bf16 out, bf16 back
    over = max(0.0, off.grad_bytes / hw.host_bandwidth - plain.backward.step_s)
    assert off.exposed_s == pytest.approx(over + off.host_update_s + off.param_bytes / hw.host_bandwidth)
    assert moved.step.update_s == 0 < plain.step.update_s
    assert moved.step.step_s == pytest.approx(plain.step.step_s - plain.step.update_s + off.exposed_s)


def test_the_delayed_update_hides_under_the_next_step() -> None:
    """ZeRO-Offload's one-step delayed update: the host's update runs beside the next forward and backward,
    only what exceeds them exposed; sharded by ZeRO over X, each chip's host share updates an eighth."""
    text = MLP.replace("param W1, W2", "param W1, W2\nzero 1 over X")
    plan = shardc.plan(shardc.parse(text))
    late = shardc.cost(plan, offload="optimizer", offload_delayed=True)
    now = shardc.cost(plan, offload="optimizer")
    assert late.offload is not None and now.offload is not None and late.offload.delayed
    busy = late.offload.forward_busy_s + late.offload.backward_busy_s
    chain = late.offload.update_chain_s
    assert chain == pytest.approx(now.offload.update_chain_s) and chain > 0
    over = max(0.0, late.offload.grad_bytes / late.offload.host_bandwidth - late.offload.backward_busy_s)
    assert late.offload.exposed_s == pytest.approx(over + max(0.0, chain - busy))
    assert late.step.step_s < now.step.step_s
    unsharded = shardc.cost(shardc.plan(shardc.parse(MLP)), offload="optimizer")
    assert unsharded.offload is not None
    assert now.offload.host_update_s == pytest.approx(unsharded.offload.host_update_s / 8)


def test_both_share_the_link() -> None:
    both = shardc.cost(shardc.plan(shardc.parse(MLP)), offload="both")
    acts, opt = _costs(MLP, "activations")[1], _costs(MLP, "optimizer")[1]
    assert both.offload is not None and opt.offload is not None and acts.offload is not None
    assert both.offload.activation_bytes == pytest.approx(acts.offload.activation_bytes)
    assert both.offload.bytes_each_way == pytest.approx(acts.offload.activation_bytes
                                                        + max(opt.offload.grad_bytes, opt.offload.param_bytes))
    assert both.memory.host_bytes == pytest.approx(acts.memory.host_bytes + opt.memory.host_bytes)


def test_the_report_and_json_say_what_moved(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    path = f"{tmp_path}/mlp.shard"
    with open(path, "w") as f:
        f.write(MLP)
    assert main(["cost", path, "--offload", "both", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["offload"]["what"] == "both" and data["memory"]["host_bytes"] > 0
    assert data["step"]["offload_s"] == data["offload"]["exposed_s"]
    assert main(["cost", path, "--offload", "activations"]) == 0
    text = capsys.readouterr().out
    assert "host       " in text and "host link" in text and "--offload activations" in text


PIPELINED = """mesh P=4 pipeline, X=2
dims B=256, D=4096, F=16384
layers 32
microbatches 8
hardware h100
param W1, W2
H[B_X, F] = gelu(E[B_X, D] · W1[D, F])
E2[B_X, D] = E[B_X, D] + H[B_X, F] · W2[F, D]
"""


def test_a_pipeline_offloads_each_stage_of_its_microbatches_in_flight() -> None:
    """A stage keeps two layers of one microbatch; each microbatch's kept values of the stage go out under its
    forward through the stage and back under its backward, hidden here by the stage's matmuls."""
    plain, moved = _costs(PIPELINED, "activations")
    assert plain.pipeline is not None and moved.pipeline is not None and moved.offload is not None
    for before, after in zip(plain.pipeline.stages, moved.pipeline.stages, strict=True):
        per_microbatch = before.activation_bytes / before.held
        assert after.activation_bytes == pytest.approx(per_microbatch * IN_FLIGHT_LAYERS / before.layers)
        assert after.host_bytes == pytest.approx(before.activation_bytes - after.activation_bytes)
        assert after.state_bytes == before.state_bytes
    first = plain.pipeline.stages[0]
    m = plain.pipeline.pipeline.microbatches
    assert moved.offload.activation_bytes == pytest.approx(m * first.activation_bytes / first.held)
    assert moved.offload.forward_busy_s == pytest.approx(m * first.forward_s)
    assert moved.pipeline.offload_s == moved.offload.exposed_s == 0
    assert moved.pipeline.step_s == plain.pipeline.step_s


def test_a_pipeline_offloads_each_stages_optimizer_to_the_host() -> None:
    plain, moved = _costs(PIPELINED, "optimizer")
    assert plain.pipeline is not None and moved.pipeline is not None and moved.offload is not None
    hw = get_hardware("h100")
    assert hw.host_adam_rate is not None
    worst = max(s.optimizer_bytes for s in plain.pipeline.stages)
    assert moved.offload.host_update_s == pytest.approx(worst / 8 / hw.host_adam_rate)
    for before, after in zip(plain.pipeline.stages, moved.pipeline.stages, strict=True):
        assert after.state_bytes == pytest.approx(before.state_bytes - before.optimizer_bytes - before.grad_bytes)
        assert after.host_bytes == pytest.approx(before.optimizer_bytes + before.grad_bytes)
    assert moved.pipeline.update_s == 0 < plain.pipeline.update_s
    assert moved.pipeline.step_s == pytest.approx(plain.pipeline.step_s - plain.pipeline.update_s
                                                  + moved.offload.exposed_s)
    assert moved.pipeline.to_json()["offload_s"] == moved.offload.exposed_s > 0


@pytest.mark.parametrize("text, offload, message", [
    (MLP.replace("hardware h100", "hardware tpu-v5p"), "activations", "tpu-v5p has no host link figure"),
    (MLP, "disk", "unknown offload 'disk'"),
])
def test_offload_where_it_cannot_be_costed_is_an_error(text: str, offload: str, message: str) -> None:
    with pytest.raises(ShardcError, match=message):
        shardc.cost(shardc.plan(shardc.parse(text)), offload=offload)


def test_a_hardware_file_gives_the_host_link() -> None:
    chip = hardware_from_mapping({"flops": 1e14, "ici_bandwidth": 1e11, "hbm_bytes": 1.6e10,
                                  "dcn_bandwidth": 1e10, "host_bandwidth": 3.2e10})
    assert chip.host_bandwidth == 3.2e10
    with pytest.raises(ShardcError, match="host_bandwidth"):
        hardware_from_mapping({"flops": 1e14, "ici_bandwidth": 1e11, "hbm_bytes": 1.6e10,
                               "dcn_bandwidth": 1e10, "host_bandwidth": -1})
    plan = shardc.plan(shardc.parse(MLP))
    with pytest.raises(ShardcError, match="no figure for Adam on its host's CPU"):
        shardc.cost(plan, hardware=chip, offload="optimizer")
    assert shardc.cost(plan, hardware=chip, offload="activations").offload is not None
    adam = hardware_from_mapping({"flops": 1e14, "ici_bandwidth": 1e11, "hbm_bytes": 1.6e10, "dcn_bandwidth": 1e10,
                                  "host_bandwidth": 3.2e10, "host_adam_rate": 1e9})
    moved = shardc.cost(plan, hardware=adam, offload="optimizer").offload
    assert moved is not None and moved.host_update_s == pytest.approx(moved.optimizer_bytes / 8 / 1e9)


def test_offload_with_a_sweep_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cost", "examples/fsdp.shard", "--hardware", "h100", "--offload", "both",
                 "--sweep", "B=64:1024"]) == 2
    assert "--offload changes the report" in capsys.readouterr().err
    assert main(["cost", "examples/fsdp.shard", "--hardware", "h100", "--offload", "activations",
                 "--offload-delayed"]) == 2
    assert "--offload-delayed delays" in capsys.readouterr().err


def test_layouts_search_the_offload_knob_and_find_a_layout_that_fits_only_with_it() -> None:
    """On a 20 GB chip the MLP's training state (44 GB a device) fits only with the optimizer on the host:
    `shardc layouts --knobs offload` finds it, prices it as `shardc cost --offload` does, and prints it."""
    hw = replace(get_hardware("h100"), hbm_bytes=20e9)
    spec = shardc.parse(MLP, "mlp.shard")
    search = search_layouts([spec], Options(hw, knobs=("offload",)))
    chosen = search.chosen
    assert chosen is not None and chosen.fits
    offload = dict(chosen.knobs)["offload"]
    assert offload in ("optimizer", "both")
    report = shardc.cost(shardc.plan(spec, hardware=hw), offload=offload)
    assert chosen.step_s == pytest.approx(report.step.step_s)
    assert chosen.memory_bytes == pytest.approx(report.memory.total_bytes)
    assert dict(chosen.memory)["host"] == pytest.approx(report.memory.host_bytes)
    settings = {dict(r.knobs).get("offload", "none"): r for r in search.layouts}
    assert set(settings) == {"none", "activations", "optimizer", "both"}
    assert not settings["none"].fits and not settings["activations"].fits
    assert f"offload={offload}" in search.render()


def test_a_chip_without_a_host_link_has_no_offload_to_search() -> None:
    spec = shardc.parse(MLP.replace("hardware h100", "hardware tpu-v5p"), "mlp.shard")
    search = search_layouts([spec], Options(get_hardware("tpu-v5p"), knobs=("offload",)))
    assert all("offload" not in dict(r.knobs) for r in search.layouts)


def test_a_layout_whose_step_is_mostly_the_host_says_so() -> None:
    hw = replace(get_hardware("h100"), hbm_bytes=20e9)
    search = search_layouts([shardc.parse(MLP, "mlp.shard")], Options(hw, knobs=("offload",)))
    bounds = {dict(r.knobs).get("offload", "none"): r.bound for r in search.layouts}
    assert bounds["optimizer"] == bounds["both"] == "host" and bounds["none"] in ("compute", "communication")
    assert "host-bound" in search.reason()


def test_layouts_price_a_pipelined_layout_with_its_stages_offloaded() -> None:
    """A 5 GB chip: the pipeline's fullest stage (10.8 GB, its optimizer state 8.6 GB) fits only with the
    optimizer on the host, each stage's state there; the row is `shardc cost --offload`'s."""
    hw = replace(get_hardware("h100"), hbm_bytes=5e9)
    spec = shardc.parse(PIPELINED, "pp.shard")
    search = search_layouts([spec], Options(hw, knobs=("offload",)), fixed=frozenset({"P", "X"}))
    chosen = search.chosen
    assert chosen is not None and chosen.fits and dict(chosen.knobs)["offload"] in ("optimizer", "both")
    report = shardc.cost(shardc.plan(spec, hardware=hw), offload=dict(chosen.knobs)["offload"])
    assert report.pipeline is not None and chosen.step_s == pytest.approx(report.pipeline.step_s)
    assert chosen.memory_bytes == pytest.approx(report.pipeline.fullest.memory_bytes)
    assert not any(r.fits for r in search.layouts if dict(r.knobs).get("offload", "none") in ("none", "activations"))


def test_the_bound_says_host_where_the_copies_outlast_the_compute_beside_them(
        capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    """At D = 4096 a layer's kept values take longer over PCIe than its forward's matmuls (not than its
    backward's, twice the FLOPs): the forward, and the step, are bound by the host link; wide layers hide
    the copies and keep their roofline verdicts."""
    plain, moved = _costs(MLP, "activations")
    assert moved.offload is not None and moved.offload.forward_host and not moved.offload.backward_host
    assert moved.forward.bound == moved.step.bound == "host" and moved.backward.bound == plain.backward.bound
    assert plain.step.bound != "host" and moved.step.to_json(rows=False)["bound"] == "host"
    _, hidden = _costs(MLP, "activations", D=16384, F=65536)
    assert hidden.step.bound != "host" and hidden.offload is not None and not hidden.offload.host_bound
    path = f"{tmp_path}/mlp.shard"
    with open(path, "w", encoding="utf-8") as f:
        f.write(MLP)
    assert main(["cost", path, "--offload", "activations"]) == 0
    assert "  bound: host; step" in capsys.readouterr().out


def test_a_pipeline_stage_is_host_bound_by_its_own_copies() -> None:
    """Narrow layers (D = F = 256): each stage's kept values outlast its matmuls over PCIe, so the stage
    table's bound column says host; the same stages with wide layers hide them."""
    narrow = PIPELINED.replace("D=4096, F=16384", "D=256, F=256")
    plain, moved = _costs(narrow, "activations")
    assert moved.pipeline is not None and plain.pipeline is not None and moved.offload is not None
    assert moved.pipeline.offload_s > 0 and moved.offload.host_bound
    assert {s.bound for s in moved.pipeline.stages} == {"host"} and moved.step.bound == "host"
    assert "host" not in {s.bound for s in plain.pipeline.stages}
    _, wide = _costs(PIPELINED, "activations")
    assert wide.pipeline is not None and "host" not in {s.bound for s in wide.pipeline.stages}


@pytest.mark.parametrize("text", [MLP, MLP.replace("D=4096, F=16384", "D=16384, F=65536"),
                                  PIPELINED.replace("D=4096, F=16384", "D=256, F=256"), PIPELINED],
                         ids=["mlp", "mlp-wide", "pipeline-narrow", "pipeline"])
def test_layouts_and_cost_say_the_same_bound(text: str) -> None:
    """One rule says a step is bound by the host (the cost's, Offload.host_bound): a layout's row gives the
    bound `shardc cost --offload` gives the same spec, for every setting, a pipeline's too (its simulated
    schedule's, `pipeline.bound` in `shardc cost --json`, the step a pipelined row ranks by)."""
    hw = get_hardware("h100")
    spec = shardc.parse(text, "spec.shard")
    bounds = []
    for what in OFFLOADS:
        row = evaluate(spec, Options(hw), offload=what)
        assert not isinstance(row, str), row
        report = shardc.cost(shardc.plan(spec, hardware=hw), offload=what)
        # a pipelined spec's row ranks by the simulated schedule, whose bound `shardc cost` reports beside it
        said = report.pipeline.bound if report.pipeline is not None else report.step.bound
        assert row.bound == said, what
        assert report.step.bound == report.step.to_json(rows=False)["bound"], what
        assert (row.bound == "host") == (report.offload is not None and report.offload.host_bound), what
        bounds.append(row.bound)
    assert bounds[0] != "host"  # no offload: the roofline's verdict
