"""Host offload (`--offload`): kept activations and the optimizer state in the host's memory, moved over
the chip's host link under the phases, what exceeds a phase's time exposed in the step."""

from __future__ import annotations

import json

import pytest

import shardc
from shardc.cli.main import main
from shardc.costmodel.offload import IN_FLIGHT_LAYERS
from shardc.errors import ShardcError
from shardc.hardware import get_hardware, hardware_from_mapping

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


def test_offloaded_optimizer_state_streams_through_the_link() -> None:
    plain, moved = _costs(MLP, "optimizer")
    assert moved.memory.optimizer_bytes == 0 and moved.memory.host_bytes == plain.memory.optimizer_bytes > 0
    assert moved.memory.residual_bytes == plain.memory.residual_bytes
    assert moved.offload is not None and moved.offload.optimizer_bytes == plain.memory.optimizer_bytes
    both = shardc.cost(shardc.plan(shardc.parse(MLP)), offload="both")
    assert both.offload is not None
    assert both.offload.bytes_each_way == pytest.approx(moved.offload.optimizer_bytes
                                                        + _costs(MLP, "activations")[1].memory.host_bytes)


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


PIPELINED = "mesh P=2 pipeline, X=4\ndims B=64, D=8\nlayers 4\nhardware h100\nE2[B_X, D] = gelu(E[B_X, D])\n"


@pytest.mark.parametrize("text, offload, message", [
    (MLP.replace("hardware h100", "hardware tpu-v5p"), "activations", "tpu-v5p has no host link figure"),
    (MLP, "disk", "unknown offload 'disk'"),
    (PIPELINED, "optimizer", "without a pipeline axis"),
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


def test_offload_with_a_sweep_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cost", "examples/fsdp.shard", "--hardware", "h100", "--offload", "both",
                 "--sweep", "B=64:1024"]) == 2
    assert "--offload changes the report" in capsys.readouterr().err
