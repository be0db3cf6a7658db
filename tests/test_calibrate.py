"""``shardc calibrate``: fitting, the measured chip, its file, and a quick run on emulated devices."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest

from shardc.calibrate.chip import Measurements, base_chip, calibrated, chip_toml, predicted_seconds
from shardc.calibrate.fit import Line, efficiency_points, fit_line
from shardc.chip_choice import load_hardware_file
from shardc.collectives import NCCL_NVLINK_STEP_S, Op
from shardc.hardware import PRESETS, Hardware

ROOT = Path(__file__).resolve().parent.parent
VOLUMES = [2.0**k for k in range(12, 31, 2)]


def test_a_line_through_exact_points_is_recovered() -> None:
    line = fit_line([(v, 20e-6 + v / 3e11) for v in VOLUMES])
    assert line.latency_s == pytest.approx(20e-6, rel=1e-6)
    assert line.bandwidth == pytest.approx(3e11, rel=1e-6)


def test_a_negative_intercept_is_clamped_and_a_flat_line_has_no_slope() -> None:
    line = fit_line([(1e3, 1e-6), (1e6, 3e-3), (1e9, 3.0)])  # through the origin, noise makes a < 0
    assert line.latency_s == 0.0 and line.seconds_per_byte > 0
    flat = fit_line([(1e3, 2e-5), (1e6, 1.9e-5), (1e9, 1.8e-5)])
    assert flat.seconds_per_byte == 0.0 and flat.bandwidth == math.inf and flat.latency_s > 0
    with pytest.raises(ValueError):
        fit_line([(1.0, 1.0)])
    with pytest.raises(ValueError):
        fit_line([(1.0, 1.0), (2.0, 0.0)])


def test_efficiency_is_a_fraction_of_peak_capped_at_one_and_sorted_by_flops() -> None:
    assert efficiency_points([(2e12, 9e14), (2e6, 1e13), (2e9, 1.2e15)], 1e15) == (
        (2e6, 0.01), (2e9, 1.0), (2e12, 0.9))


def test_device_kinds_find_their_presets() -> None:
    assert base_chip("NVIDIA H200") is PRESETS["h200"] and base_chip("NVIDIA H100 80GB HBM3") is PRESETS["h100"]
    assert base_chip("TPU v5p") is PRESETS["tpu-v5p"] and base_chip("TPU v5 lite") is PRESETS["tpu-v5e"]
    assert base_chip("TPU v3") is PRESETS["tpu-v3"]
    assert base_chip("cpu") is None


def _measured(kind: str, devices: int, slowdown: float, latency: float) -> Measurements:
    """Measurements as a chip ``slowdown`` times slower than its preset's links would give."""
    # a chip without a preset is costed with ring collectives: the H100's links without NVLink SHARP
    base = base_chip(kind) or replace(PRESETS["h100"], nvls_efficiency=None)
    lines = []
    for op in (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_REDUCE, Op.ALL_TO_ALL):
        probe = 2.0**30  # the model's seconds a byte: the growth of its time between two large volumes
        slope = (predicted_seconds(base, op, 2 * probe, devices) - predicted_seconds(base, op, probe, devices)) \
            / probe * slowdown
        lines.append((op, Line(latency, slope, tuple((v, latency + v * slope) for v in VOLUMES))))
    matmul = ((2e6, 0.05 * base.flops), (2e9, 0.6 * base.flops), (2e12, 0.8 * base.flops))
    return Measurements(kind, devices, "bfloat16", matmul, 0.9 * base.hbm_bandwidth, tuple(lines), 70e9)


def test_a_measured_chip_predicts_the_measured_collective_times() -> None:
    m = _measured("NVIDIA H100 80GB HBM3", 8, slowdown=1.6, latency=30e-6)
    chip = calibrated(m)
    assert chip.name == "h100-measured" and chip.hbm_bytes == 70e9
    assert chip.ici_bandwidth == pytest.approx(PRESETS["h100"].ici_bandwidth / 1.6, rel=1e-9)
    assert chip.hbm_bandwidth == pytest.approx(0.9 * PRESETS["h100"].hbm_bandwidth)
    assert chip.matmul_efficiency == ((2e6, 0.05), (2e9, 0.6), (2e12, 0.8))
    for op, line in m.collectives:
        _same_slope(chip, op, line, 8)
        # on a GPU the latency adds to the transfer (NCCL's model: a base, and 0.6 us a step of the ring, 7
        # steps for 8 GPUs, twice for an AllReduce): the base is the median over the collectives
        if op is not Op.ALL_REDUCE:
            small = line.points[0][0]
            assert predicted_seconds(chip, op, small, 8) == pytest.approx(line.seconds(small), rel=1e-6)
    assert chip.collective_base == pytest.approx(30e-6 - 7 * NCCL_NVLINK_STEP_S)


def _same_slope(chip: Hardware, op: Op, line: Line, devices: int) -> None:
    """The written chip's time grows with the volume as the measured line does."""
    v1, v2 = line.points[-2][0], line.points[-1][0]
    grown = predicted_seconds(chip, op, v2, devices) - predicted_seconds(chip, op, v1, devices)
    assert grown == pytest.approx(line.seconds(v2) - line.seconds(v1), rel=1e-6)


def test_a_chip_without_a_preset_takes_its_best_matmul_as_peak_and_its_links_for_dcn() -> None:
    m = _measured("cpu", 4, slowdown=1.0, latency=1e-5)
    chip = calibrated(m, name="host")
    assert chip.name == "host" and chip.flops == max(rate for _, rate in m.matmul)
    assert max(f for _, f in chip.matmul_efficiency) == 1.0
    assert chip.dcn_bandwidth == pytest.approx(chip.w_ici)
    for op, line in m.collectives:
        _same_slope(chip, op, line, 4)


def test_the_chip_file_loads_as_the_chip_it_was_written_from(tmp_path: Path) -> None:
    m = _measured("TPU v5p", 4, slowdown=2.0, latency=5e-6)
    chip = calibrated(m)
    path = tmp_path / "chip.toml"
    path.write_text(chip_toml(chip, m, "2026-12-05"), encoding="utf-8")
    loaded = load_hardware_file(str(path))
    for f in fields(chip):
        if f.name != "description":
            assert getattr(loaded, f.name) == getattr(chip, f.name), f.name
    assert "# shardc calibrate, 2026-12-05: 4 x TPU v5p" in path.read_text(encoding="utf-8")


@pytest.mark.slow
def test_a_quick_calibration_on_emulated_devices_writes_a_file_cost_accepts(tmp_path: Path) -> None:
    out = tmp_path / "chip.toml"
    shardc = [sys.executable, "-m", "shardc"]
    done = subprocess.run([*shardc, "calibrate", "--quick", "--out", str(out), "--name", "host"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    chip = load_hardware_file(str(out))
    assert chip.name == "host" and chip.ici_bandwidth > 0 and chip.hbm_bandwidth > 0
    assert "AllGather" in out.read_text(encoding="utf-8")
    again = subprocess.run([*shardc, "calibrate", "--quick", "--out", str(out)], capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
    assert again.returncode == 2 and "--force" in again.stderr and "Traceback" not in again.stderr
    cost = subprocess.run([*shardc, "cost", "examples/tp.shard", "--hardware-file", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert cost.returncode == 0, cost.stderr
    assert "host" in cost.stdout


def test_calibrate_refuses_outputs_it_must_not_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Checked before anything is measured: a directory, a device, an existing file without --force."""
    from shardc.cli.main import main

    kept = tmp_path / "kept.toml"
    kept.write_text("x", encoding="utf-8")
    for argv, says in ((["--out", str(tmp_path)], "not a file path"), (["--out", "/dev/null", "--force"], "regular"),
                       (["--out", str(kept)], "--force"), (["--devices", "0"], "1 to 512")):
        assert main(["calibrate", *argv]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err
    assert kept.read_text(encoding="utf-8") == "x"
