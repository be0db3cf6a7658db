"""Hostile inputs: no crash, hang, overwrite or silent misreading, from the command line or the API.

Each test is a misuse seen in practice: an image path naming a directory, a device or
the user's own file; a name XLA cannot take; a size of the wrong type; a flag that would
otherwise be ignored; a number too long to echo.  None compiles with XLA.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardc
from shardc.cli.main import main
from shardc.errors import ShardcError

ROOT = Path(__file__).resolve().parent.parent
PIPELINE = str(ROOT / "examples" / "pipeline_llama.shard")
FSDP = str(ROOT / "examples" / "fsdp.shard")
TP = "mesh X=4\ndims B=64, D=32, F=16\nOut[B_X, F] = In[B_X, D] · W[D, F]\n"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


# --plot and --schedule-plot --------------------------------------------------------------------------

def _bad_paths(tmp: Path) -> list[tuple[str, str]]:
    (tmp / "folder.png").mkdir()
    fifo = tmp / "pipe.png"
    os.mkfifo(fifo)
    (tmp / "notes.png").write_text("my notes, not an image\n")
    return [(str(tmp / "out"), "no extension"), (str(tmp / "out.xyz"), "extension .xyz"),
            (str(tmp / "folder.png"), "is a directory"), (str(fifo), "device, FIFO or socket"),
            ("/dev/null", "no extension"), (str(tmp / "notes.png"), "exists and is not an image"),
            (str(tmp / "no" / "such.png"), "no directory")]


@pytest.mark.parametrize("flags", [["--schedule-plot"], ["--sweep", "B=1e3:1e6", "--points", "2", "--plot"]])
def test_image_paths_are_checked_before_anything_is_written(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str]) -> None:
    pytest.importorskip("matplotlib")
    spec = PIPELINE if flags[0] == "--schedule-plot" else FSDP
    before = sorted(p.name for p in tmp_path.iterdir())
    for path, says in _bad_paths(tmp_path):
        status, out, err = run(capsys, "cost", spec, *flags, path)
        assert status == 2 and says in err and "wrote" not in out, (path, err)
    assert (tmp_path / "notes.png").read_text() == "my notes, not an image\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before + ["folder.png", "pipe.png", "notes.png"])


def test_force_replaces_a_file_and_an_image_is_replaced_freely(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    spec = tmp_path / "few.shard"  # 4 microbatches: a chart of few bars draws fast
    spec.write_text(Path(PIPELINE).read_text().replace("microbatches 64", "microbatches 4"))
    notes = tmp_path / "notes.svg"
    notes.write_text("keep me")
    status, out, _ = run(capsys, "cost", str(spec), "--schedule-plot", str(notes), "--force")
    assert status == 0 and out.rstrip().endswith(f"wrote {notes}")
    assert "matplotlib" in notes.read_text().lower()
    status, out, _ = run(capsys, "cost", str(spec), "--schedule-plot", str(notes))  # its own image: no --force
    assert status == 0 and out.rstrip().endswith(f"wrote {notes}")


# internal errors, exit status -------------------------------------------------------------------

def test_sweeping_a_mesh_axis_of_an_fsdp_spec(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "cost", FSDP, "--sweep", "X=2:64", "--points", "4")
    assert status == 0 and not err
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["2", "6", "20", "64"]  # devices come whole


@pytest.mark.parametrize("command", ["plan", "cost", "lower", "layouts"])
def test_an_internal_error_exits_1_from_every_command(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.delenv("SHARDC_TRACEBACK", raising=False)
    monkeypatch.setattr("shardc.spec.parser.parse", broken)
    status, _, err = run(capsys, command, FSDP)
    assert status == 1 and err.startswith("error: internal error: ZeroDivisionError: a bug"), err
    assert "Traceback" not in err


# names that reach XLA ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["a`", "Ω", "a\u2028", "9a", "", "x" * 201, 5])
def test_names_outside_the_grammar_are_refused_before_jax(name: object) -> None:
    spec = shardc.parse("mesh X=2\nO[B_X] = I[B_X]\n")
    axis = dataclasses.replace(spec.mesh.axes[0], name=name)
    bad = dataclasses.replace(spec, mesh=dataclasses.replace(spec.mesh, axes=(axis,)))
    with pytest.raises(ShardcError, match="cannot name a mesh axis") as caught:
        shardc.plan(bad)
    assert "ASCII letters, digits and `_`" in str(caught.value)
    renamed = dataclasses.replace(spec, statements=(dataclasses.replace(
        spec.statements[0], result=dataclasses.replace(spec.statements[0].result, name=name)),))
    with pytest.raises(ShardcError, match="cannot name a tensor"):
        shardc.plan(renamed)


def test_a_name_outside_the_grammar_in_a_file_points_at_it() -> None:
    with pytest.raises(ShardcError) as caught:
        shardc.parse("mesh X=2\nO[B_X] = I[B_Ω]\n", filename="f.shard")
    text = str(caught.value)
    assert text.startswith("f.shard:2:14: error:") and "\n" + " " * 17 + "^\n" in text and "\nfix: " in text


# the public API's arguments --------------------------------------------------------------------------

@pytest.mark.parametrize(("call", "error", "says"), [
    (lambda p: shardc.cost(p, sizes={"B": -8}), ShardcError, "sizes['B'] = -8 is out of range"),
    (lambda p: shardc.cost(p, sizes={"B": 2.5}), ShardcError, "not a whole number"),
    (lambda p: shardc.cost(p, sizes={"B": 64.0}), ShardcError, "is a float"),
    (lambda p: shardc.cost(p, sizes=[1]), TypeError, "sizes must be a dict"),
    (lambda p: shardc.cost(None), TypeError, "plan must be a Plan"),
    (lambda p: shardc.cost(p, hardware=""), ShardcError, "empty name"),
    (lambda p: shardc.lower(p, sizes={"B": 2.5}), ShardcError, "not a whole number"),
    (lambda p: shardc.lower("spec"), TypeError, "plan_or_spec must be"),
    (lambda p: shardc.plan(p), TypeError, "spec must be a Spec"),
    (lambda p: shardc.plan(p.spec, save=None), TypeError, "save must be a str"),
    (lambda p: shardc.parse(None), TypeError, "text must be a str"),
    (lambda p: shardc.parse("#" * (1 << 21)), ShardcError, "larger than 1 MiB"),
])
def test_api_misuse_is_named(call: Any, error: type, says: str) -> None:
    plan = shardc.plan(shardc.parse(TP))
    with pytest.raises(error, match=None) as caught:
        call(plan)
    assert type(caught.value) is error or isinstance(caught.value, error)
    assert says in str(caught.value)


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20), st.floats(allow_nan=True),
                    st.text(max_size=20), st.just("x" * (1 << 21)), st.lists(st.integers(), max_size=2),
                    st.dictionaries(st.text(max_size=3), st.one_of(st.integers(-5, 5), st.floats(), st.none()),
                                    max_size=2),
                    st.sampled_from(["B", "D", "X", "tpu-v5p", "default", "none", "all", "rules"]))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(function=st.sampled_from(["parse", "plan", "cost", "lower"]), first=st.booleans(),
       args=st.lists(_VALUES, max_size=2),
       kwargs=st.dictionaries(st.sampled_from(["sizes", "hardware", "save", "spans", "mfu", "optimizer",
                                               "recompute", "strategy", "filename", "bogus"]),
                              _VALUES, max_size=3))
def test_api_misuse_raises_only_shardc_or_type_errors(function: str, first: bool, args: list[object],
                                                      kwargs: dict[str, object]) -> None:
    """Whatever the arguments, a public function answers or raises ShardcError or TypeError."""
    spec = shardc.parse(TP)
    head: object = {"parse": TP, "plan": spec, "cost": shardc.plan(spec), "lower": spec}[function]
    call = getattr(shardc, function)
    try:
        call(*([head] if first else []), *args, **kwargs)
    except (ShardcError, TypeError):
        pass
