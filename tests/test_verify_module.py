"""``shardc verify FILE --module MOD.py``: a module `shardc lower` wrote (or a user edited) judged as
verify judges its own; a module that cannot be the plan's fails with a message, never a traceback."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import shardc
from shardc.cli.main import main
from shardc.lowering.api import module_source
from shardc.verification.module_check import ModuleRejected
from shardc.verification.verify import render_report, verify

pytestmark = pytest.mark.slow  # every test here compiles and runs a module

TP = "mesh Y=2\ndims B=8, D=8, F=12\ndtype f32\nIn[B, D_Y] · W_in[D, F_Y] · W_out[F_Y, D] -> Out[B, D_Y]\n"
DP = "mesh X=2\ndims B=8, D=8, F=12\ndtype f32\nOut[B_X, F] = In[B_X, D] · W[D, F]\n"


def _files(tmp_path: Path, text: str = TP) -> tuple[Path, Path]:
    spec = tmp_path / "tp.shard"
    spec.write_text(text, encoding="utf-8")
    module = tmp_path / "tp.py"
    assert main(["lower", str(spec), "-o", str(module)]) == 0
    return spec, module


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["verify", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def test_the_module_lower_wrote_verifies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec, module = _files(tmp_path)
    capsys.readouterr()
    code, out, _ = _run(capsys, str(spec), "--module", str(module))
    assert code == 0, out
    assert f"the module run is {module}" in out and "verified" in out


def test_an_edited_module_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec, module = _files(tmp_path)
    text = module.read_text(encoding="utf-8")
    edited, count = re.subn(r"(?m)^(    Tmp = jnp\.einsum\([^)]*\))", r"\1 * 1.1", text)
    assert count == 1
    module.write_text(edited, encoding="utf-8")
    capsys.readouterr()
    code, out, _ = _run(capsys, str(spec), "--module", str(module))
    assert code == 1 and "FAILED" in out


@pytest.mark.parametrize(("source", "message"), [
    ("def forward(:\n", "does not load (line 1): SyntaxError"),
    ("import no_such_module_here\n", "does not load"),
    ("raise SystemExit(3)\n", "does not load"),
    ("x = 1\n", "lacks forward, grad, programs, MESH_AXES"),
])
def test_a_module_that_does_not_load_or_lacks_entry_points_fails_cleanly(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str, message: str) -> None:
    spec, module = _files(tmp_path)
    module.write_text(source, encoding="utf-8")
    capsys.readouterr()
    code, _, err = _run(capsys, str(spec), "--module", str(module))
    assert code == 1 and message in err, err
    assert "fix: write the module with `shardc lower" in err


def test_a_module_of_another_spec_fails_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, module = _files(tmp_path)
    other = tmp_path / "dp.shard"
    other.write_text(DP, encoding="utf-8")
    capsys.readouterr()
    code, _, err = _run(capsys, str(other), "--module", str(module))
    assert code == 1 and "was written for another spec or plan: its FORWARD_IN" in err, err


def test_a_module_that_raises_while_it_runs_fails_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec, module = _files(tmp_path)
    text = module.read_text(encoding="utf-8")
    edited, count = re.subn(r"Tmp = jnp\.einsum\('bd,df->bf', (\w+), W_in\)",
                            r"Tmp = jnp.einsum('bd,fd->bf', \1, W_in)", text)
    assert count == 1
    module.write_text(edited, encoding="utf-8")
    capsys.readouterr()
    code, _, err = _run(capsys, str(spec), "--module", str(module))
    assert code == 1 and "failed while verify ran it: ValueError" in err, err


def test_a_module_written_at_a_larger_mesh_runs_at_verifys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = "mesh X=16\ndims B=32, D=16, F=6\ndtype f32\nzero 2 over X\nH[B_X, F] = tanh(In[B_X, D] · W[D, F])\n"
    spec, module = _files(tmp_path, text)
    assert "MESH_AXES = {'X': 16}" in module.read_text(encoding="utf-8")
    capsys.readouterr()
    code, out, _ = _run(capsys, str(spec), "--module", str(module), "--devices", "8")
    assert code == 0, out
    assert "was written for the mesh X=16; it runs at verify's X=8" in out
    assert "optimizer" in out  # ZeRO-2's optimizer phase ran from the given module too


def test_missing_files_pipelines_and_fixed_capacities_are_usage_errors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec, _ = _files(tmp_path)
    capsys.readouterr()
    code, _, err = _run(capsys, str(spec), "--module", str(tmp_path / "missing.py"))
    assert code == 2 and "cannot read module" in err
    code, out, err = _run(capsys, "examples/pipeline_llama.shard", "--module", str(spec))
    assert code == 1 and "does not load" in out + err  # a pipelined spec's module is judged as any other
    fine = tmp_path / "fine.shard"  # a capacity of 97 slots per 1024 tokens: 97 slots at least
    fine.write_text(Path("examples/moe_layer.shard").read_text(encoding="utf-8").replace("C=320", "C=97"),
                    encoding="utf-8")
    code, _, err = _run(capsys, str(fine), "--module", str(spec))
    assert code == 2 and "capacity C=97" in err and "--set C=" in err


def test_the_python_api_takes_a_path_or_the_source() -> None:
    plan = shardc.plan(shardc.parse(TP))
    source, _ = module_source(plan)
    report = verify(plan, module=source)
    assert report.ok, render_report(report)
    assert "the module run is the given module, not verify's own lowering" in report.notes
    edited = source.replace("psum_scatter(Out_1,", "psum_scatter(1.1 * Out_1,")
    assert edited != source
    assert not verify(plan, module=edited).ok
    with pytest.raises(ModuleRejected, match="does not load"):
        verify(plan, module="this is not python\n")
