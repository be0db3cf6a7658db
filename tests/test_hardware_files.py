"""Hardware files that start from a preset (`base = "a100"`), and a spec's `hardware` line naming one."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardc
from shardc.chip_choice import hardware_from_mapping, resolve_hardware
from shardc.errors import ShardcError
from shardc.hardware import get_hardware

SPEC = "mesh X=2\ndims B=64, D=128, F=256\nhardware {chip}\nY[B_X, F] = A[B_X, D] · W[D, F]\n"


def test_a_file_on_a_preset_keeps_its_measured_figures_and_replaces_what_it_names() -> None:
    a100 = get_hardware("a100")
    chip = hardware_from_mapping({"base": "a100", "name": "jz", "dcn_bandwidth": 6.25e9}, source="jz.toml")
    assert (chip.name, chip.dcn_bandwidth) == ("jz", 6.25e9)
    assert chip.matmul_efficiency == a100.matmul_efficiency and chip.attention_forward == a100.attention_forward
    assert (chip.flops, chip.ici_efficiency, chip.dcn_efficiency) == (a100.flops, a100.ici_efficiency,
                                                                      a100.dcn_efficiency)


def test_a_file_on_a_preset_runs_the_attention_kernels_measured_on_its_chip() -> None:
    """A chip file on `base = "h100"` (another HBM, say) runs `attention_kernel flash2` at the rates measured
    on the H100, as the preset does (it was refused: the kernel tables are keyed by the preset's name)."""
    chip = hardware_from_mapping({"base": "h100", "name": "h100-96gb", "hbm_bytes": 96e9}, source="t.toml")
    h100 = get_hardware("h100").with_attention("flash2")
    assert chip.with_attention("flash2").attention_forward == h100.attention_forward
    assert hardware_from_mapping({"base": "a100", "name": "jz"}, source="jz.toml").with_attention("flash2").name == "jz"


@pytest.mark.parametrize(("data", "words"), [({"base": 3}, "preset's name"), ({"base": "nope"}, "unknown hardware"),
                                             ({"flops": 1e14}, "missing key"),
                                             ({"base": "a100", "chip": "h100"}, "unknown key")])
def test_a_bad_base_or_no_base_and_missing_figures_is_an_error(data: dict[str, object], words: str) -> None:
    with pytest.raises(ShardcError, match=words):
        hardware_from_mapping(data, source="chip.toml")


def test_a_specs_hardware_line_reads_a_file_beside_the_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "slow_ib.toml").write_text('base = "a100"\nname = "slow-ib"\ndcn_bandwidth = 1e9\n', encoding="utf-8")
    path = tmp_path / "m.shard"
    path.write_text(SPEC.format(chip="slow_ib.toml"), encoding="utf-8")
    monkeypatch.chdir(Path(__file__).parent)  # not the spec's folder: the path is the spec's, not the cwd's
    spec = shardc.parse(path.read_text(encoding="utf-8"), filename=str(path))
    assert resolve_hardware(None, None, spec).dcn_bandwidth == 1e9
    assert shardc.cost(shardc.plan(spec)).to_json()["hardware"]["name"] == "slow-ib"
    assert resolve_hardware("h100", None, spec).name == "h100"  # a flag beats the spec's line


def test_a_missing_hardware_file_points_at_the_specs_line(tmp_path: Path) -> None:
    path = tmp_path / "m.shard"
    spec = shardc.parse(SPEC.format(chip="gone.toml"), filename=str(path))
    with pytest.raises(ShardcError) as err:
        resolve_hardware(None, None, spec)
    assert err.value.span is not None and err.value.span.line == 3 and "gone.toml" in err.value.message


def test_a_hardware_line_that_is_neither_a_name_nor_a_toml_file_is_a_syntax_error() -> None:
    with pytest.raises(ShardcError, match="syntax error"):
        shardc.parse(SPEC.format(chip="chips/a100.json"))
