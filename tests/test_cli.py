"""The ``shardc`` command: version, help, the README's flags and snippet, and clear errors at the edges.

Each test runs ``main()`` in-process (fast) unless the point is the process itself
(the exit status, a fresh interpreter); every error must be a diagnostic on
stderr with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import math
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import shardc
from shardc.cli import plan_cmd
from shardc.cli.main import COMMANDS, full_parser, main
from shardc.errors import ShardcError
from shardc.files import MAX_BYTES, read_text

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
README = (ROOT / "README.md").read_text(encoding="utf-8")
SPEC = "mesh X=4\ndims B=64, D=32, F=16\nparam W\nOut[B_X, F] = In[B_X, D] · W[D, F]\n"


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``shardc ARGS`` in-process: (status, stdout, stderr); argparse's exits are statuses too."""
    try:
        status = main(list(args))
    except SystemExit as stop:
        status = int(stop.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def shardc_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``shardc ARGS`` in-process, as the finished process ``python -m shardc ARGS`` would be: its status (argparse's
    exits too), stdout and stderr; for tests of what a command prints, where a fresh interpreter (half a second
    of CPU) is not the point."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(list(args))
        except SystemExit as stop:
            status = int(stop.code or 0)
    return subprocess.CompletedProcess(["shardc", *args], status, out.getvalue(), err.getvalue())


def fails_clearly(capsys: pytest.CaptureFixture[str], *args: str, says: str) -> str:
    status, _, err = run_main(capsys, *args)
    assert status == 2, err
    assert "Traceback" not in err and "internal error" not in err, err
    assert says in err, err
    return err


# --version, --help, the README ------------------------------------------------------------------

def test_version_is_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_main(capsys, "--version")
    assert status == 0 and out.strip() == f"shardc {shardc.__version__}"
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'dynamic = ["version"]' in pyproject and 'path = "shardc/__init__.py"' in pyproject


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_help_describes_every_command_and_flag(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_main(capsys, "--help")
    assert status == 0
    for name, (_, line) in COMMANDS.items():
        assert re.search(rf"^\s+{name}\s+{re.escape(line)}", out, re.M), (name, out)
    for name, parser in subcommands(full_parser()).items():
        assert parser.description, f"`shardc {name} --help` has no description"
        for action in parser._actions:
            assert action.help and action.help != argparse.SUPPRESS, (name, action.option_strings)
        status, out, _ = run_main(capsys, name, "--help")
        assert status == 0 and parser.description.split()[0] in out


def test_argument_parsing_imports_no_pass() -> None:
    # `shardc --help` loads argparse and the dispatcher only
    code = ("import sys; from shardc.cli.main import build_parser; build_parser(None); "
            "print(sorted(m for m in sys.modules if m.startswith(('shardc.planner', 'shardc.costmodel', "
            "'shardc.lowering', 'shardc.spec', 'shardc.hardware', 'jax', 'sympy', 'symengine', 'lark', 'numpy'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.strip() == "[]", done.stdout


def test_no_command_parser_imports_jax() -> None:
    # a command's parser loads its module and the passes it runs, but never jax or matplotlib
    code = ("import sys; from shardc.cli.main import COMMANDS, build_parser, full_parser; "
            "[build_parser(c) for c in COMMANDS]; full_parser(); "
            "print(sorted(m for m in sys.modules if m.startswith(('jax', 'matplotlib'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.strip() == "[]", done.stdout


def readme_section(name: str) -> str:
    """The README's bullet of ``shardc NAME`` up to the next command's bullet."""
    start = README.index(f"- **`shardc {name}")
    end = README.find("- **`shardc ", start + 1)
    return README[start:end if end >= 0 else len(README)]


def test_readme_lists_every_flag_of_every_command() -> None:
    common = README[README.index("## The command"):README.index("- **`shardc plan")]
    for flag in ("--version", "--help", "--set"):
        assert flag in common, flag
    for name, parser in subcommands(full_parser()).items():
        section = readme_section(name)
        for action in parser._actions:
            for flag in action.option_strings:
                if flag in ("-h", "--help", "--set"):
                    continue  # said once for every command
                assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", section), \
                    f"README's `shardc {name}` does not mention {flag}"


@pytest.mark.slow
def test_readme_python_snippet_runs_as_written(tmp_path: Path) -> None:
    block = re.search(r"```python\n(.*?)```", README, re.S)
    assert block is not None
    script = tmp_path / "snippet.py"
    script.write_text(block.group(1), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}  # the tests' XLA set-up
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compute-bound iff" in done.stdout and "'Out': (256, 64)" in done.stdout


def test_grammar_cache_is_made_reused_and_survives_corruption(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME"} | {"XDG_CACHE_HOME": str(tmp_path)}

    def plan_text() -> str:
        done = subprocess.run([sys.executable, "-m", "shardc", "plan", str(EXAMPLES / "tp.shard")], cwd=ROOT,
                              env=env, capture_output=True, text=True, check=False)
        assert done.returncode == 0 and not done.stderr, done.stderr
        return done.stdout

    first = plan_text()
    [cache] = (tmp_path / "shardc").iterdir()
    assert plan_text() == first
    cache.write_bytes(b"not a pickle\n\x00\x01")
    assert plan_text() == first
    blocked = tmp_path / "a-file"
    blocked.write_text("", encoding="utf-8")
    env["XDG_CACHE_HOME"] = str(blocked)  # no directory can be made there: planning goes on without a cache
    assert plan_text() == first


# files: encodings, sizes, devices ----------------------------------------------------------------

def write(tmp_path: Path, data: bytes, name: str = "x.shard") -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def test_utf8_with_a_bom_reads_like_without(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plain = run_main(capsys, "plan", write(tmp_path, SPEC.encode(), "a.shard"))
    bom = run_main(capsys, "plan", write(tmp_path, b"\xef\xbb\xbf" + SPEC.encode(), "a.shard"))
    assert plain[0] == bom[0] == 0 and plain[1] == bom[1]


def test_parse_accepts_a_bom_read_as_text(tmp_path: Path) -> None:
    path = write(tmp_path, b"\xef\xbb\xbf" + SPEC.encode())
    with open(path, encoding="utf-8") as handle:  # keeps the BOM as U+FEFF
        text = handle.read()
    assert text.startswith("\ufeff") and shardc.parse(text) == shardc.parse(SPEC)


@pytest.mark.parametrize(("encoding", "says"), [
    ("latin-1", "is not UTF-8: byte 0xe9"),
    ("utf-16", "is UTF-16 text"),
    ("utf-16-le", "a NUL byte (UTF-16 text without a byte order mark?)"),
    ("utf-32", "is UTF-32 text"),
])
def test_other_encodings_are_clear_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path, encoding: str,
                                          says: str) -> None:
    path = write(tmp_path, ("# café\n" + SPEC).encode(encoding))
    err = fails_clearly(capsys, "plan", path, says=says)
    assert "fix: " in err and "iconv" in err


def test_latin1_error_points_at_the_byte(tmp_path: Path) -> None:
    path = write(tmp_path, ("mesh X=4\n# café au lait\n" + SPEC).encode("latin-1"))
    with pytest.raises(ShardcError) as info:
        read_text(path)
    assert info.value.span is not None and (info.value.span.line, info.value.span.column) == (2, 6)


def test_huge_file_and_device_are_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    big = write(tmp_path, b"#" * (MAX_BYTES + 1))
    fails_clearly(capsys, "plan", big, says="larger than 1 MiB")
    if os.path.exists("/dev/zero"):
        fails_clearly(capsys, "plan", "/dev/zero", says="larger than 1 MiB")
    fails_clearly(capsys, "plan", str(tmp_path), says="it is a directory")
    fails_clearly(capsys, "plan", str(tmp_path / "missing.shard"), says="No such file")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_without_writer_does_not_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "spec.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ShardcError, match="nothing arrived"):
        read_text(str(fifo), wait=0.2)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_with_a_writer_is_read(tmp_path: Path) -> None:
    fifo = tmp_path / "spec.fifo"
    os.mkfifo(fifo)

    def feed() -> None:
        with open(fifo, "w", encoding="utf-8") as handle:
            handle.write(SPEC)

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        assert read_text(str(fifo), wait=10) == SPEC
    finally:
        writer.join(timeout=10)


# hardware files, sweeps, plots -------------------------------------------------------------------

CHIP = 'flops = 4.59e14\nici_bandwidth = 4.5e10\nhbm_bytes = 96e9\ndcn_bandwidth = 6.25e9\n'


@pytest.mark.parametrize(("extra", "says"), [
    ("torus_side = 0.5\n", "torus_side must be a whole number of at least 2"),
    ("torus_side = 1\n", "torus_side must be a whole number of at least 2"),
    ("torus_dims = 0\n", "torus_dims must be a whole number"),
    ("ici_domain = 2.5\n", "ici_domain must be a whole number"),
    ('name = 7\n', "name must be a string"),
    ("hop_latency = 1e-320\n", "outside 1e-30..1e30"),
])
def test_hardware_file_values(capsys: pytest.CaptureFixture[str], tmp_path: Path, extra: str, says: str) -> None:
    chip = write(tmp_path, (CHIP + extra).encode(), "chip.toml")
    fails_clearly(capsys, "cost", str(EXAMPLES / "dp.shard"), "--hardware-file", chip, says=says)


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_hardware_file_infinite_figures(capsys: pytest.CaptureFixture[str], tmp_path: Path, value: str) -> None:
    chip = write(tmp_path, CHIP.replace("4.59e14", value).encode(), "chip.toml")
    fails_clearly(capsys, "cost", str(EXAMPLES / "dp.shard"), "--hardware-file", chip, says="flops must be")


def test_hardware_file_not_utf8(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    chip = write(tmp_path, CHIP.encode() + 'description = "caf\xe9"\n'.encode("latin-1"), "chip.toml")
    fails_clearly(capsys, "cost", str(EXAMPLES / "dp.shard"), "--hardware-file", chip, says="is not UTF-8")


@pytest.mark.parametrize(("flags", "says"), [
    (["--sweep", "B=1e3:1e7", "--plot", "out.txt"], "extension .txt is not an image format"),
    (["--sweep", "B=1e3:1e7", "--plot", "out.xyz"], "extension .xyz is not an image format"),
    (["--sweep", "B=1e3:1e7", "--plot", "out"], "no extension"),
    (["--sweep", "B=1e3:1e7", "--plot", "no/such/dir/out.png"], "no directory"),
    (["--sweep", "B=1:inf"], "1 <= LOW < HIGH <= 1e18"),
    (["--sweep", "B=nan:1e7"], "1 <= LOW < HIGH <= 1e18"),
    (["--sweep", "B=1e-300:1e18"], "1 <= LOW < HIGH <= 1e18"),
    (["--sweep", "B=1e3:1e7", "--points", "100000000"], "--points must be from 2 to"),
    (["--sweep", "Q=1e3:1e7"], "no dim or mesh axis of that name"),
])
def test_sweep_and_plot_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str],
                               says: str) -> None:
    pytest.importorskip("matplotlib")
    flags = [str(tmp_path / f) if f.startswith(("out", "no/")) else f for f in flags]
    fails_clearly(capsys, "cost", str(EXAMPLES / "fsdp_tp.shard"), *flags, says=says)


def test_sweep_plot_writes_svg(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "sweep.svg"
    status, text, err = run_main(capsys, "cost", str(EXAMPLES / "fsdp_tp.shard"), "--sweep", "B=1e3:1e7",
                                 "--points", "3", "--plot", str(out))
    assert status == 0, err
    assert out.read_bytes().lstrip().startswith(b"<?xml") and f"wrote {out}" in text


@pytest.mark.parametrize(("spec", "flags", "flag"), [
    ("fsdp_tp.shard", ["--sweep", "B=1e3:1e7", "--points", "3", "--plot"], "--plot"),
    ("pipeline_llama.shard", ["--schedule-plot"], "--schedule-plot")])
def test_a_plot_the_disk_refuses_is_a_diagnostic_naming_its_flag(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str,
        flags: list[str], flag: str) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib import pyplot as plt
    from matplotlib.figure import Figure

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Figure, "savefig", full)
    out = tmp_path / "out.svg"
    err = fails_clearly(capsys, "cost", str(EXAMPLES / spec), *flags, str(out),
                        says=f"cannot write {out}: {os.strerror(errno.ENOSPC)}")
    assert f"check the {flag} path" in err
    assert not plt.get_fignums()  # the figure is closed all the same


# the exits of last resort ------------------------------------------------------------------------

def test_memory_error_is_a_diagnostic(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def exhausted(*args: object, **kwargs: object) -> None:
        raise MemoryError

    monkeypatch.setattr(plan_cmd, "plan", exhausted)
    fails_clearly(capsys, "plan", str(EXAMPLES / "tp.shard"), says="error: out of memory")


def test_a_bug_is_one_line_not_a_traceback(capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("oops")

    monkeypatch.setattr(plan_cmd, "plan", broken)
    monkeypatch.delenv("SHARDC_TRACEBACK", raising=False)
    status, _, err = run_main(capsys, "plan", str(EXAMPLES / "tp.shard"))
    assert status == 1 and "Traceback" not in err  # an internal error exits 1 from every command
    assert err.startswith("error: internal error: KeyError") and "please report it" in err


def test_exit_status_of_the_process(tmp_path: Path) -> None:
    bad = write(tmp_path, b"mesh X=4\nOut[B_Z] = In[B_Z]\n")
    done = subprocess.run([sys.executable, "-m", "shardc", "plan", bad], capture_output=True, text=True,
                          check=False, cwd=ROOT)
    assert done.returncode == 2 and "Traceback" not in done.stderr and ":2:" in done.stderr


# cost: no dims, zero intensity, names like hardware symbols --------------------------------------

def strict_json(text: str) -> object:
    def refuse(constant: str) -> float:
        raise AssertionError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_cost_of_a_reduction_alone(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # issue 9 item 2: the thresholds raised AttributeError on this spec
    for head in ("mesh X=4\ndims B=8, D=16\n", "mesh X=4\n"):
        path = write(tmp_path, (head + "Out[B, D] = In[B, D]{U_X}\n").encode())
        status, out, err = run_main(capsys, "cost", path)
        assert status == 0, err
        assert "thresholds" in out and "AllReduce" in out
        status, out, err = run_main(capsys, "cost", path, "--json")
        assert status == 0 and strict_json(out)


def dimsless(tmp_path: Path, name: str) -> str:
    text = (EXAMPLES / f"{name}.shard").read_text(encoding="utf-8")
    kept = [line for line in text.splitlines() if not line.lstrip().startswith("dims")]
    return write(tmp_path, ("\n".join(kept) + "\n").encode(), f"{name}_nodims.shard")


@pytest.mark.parametrize("name", ["fsdp_tp", "dp_dcn", "tp", "llama2_13b"])
def test_cost_without_dims_prints_the_formulas(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                               name: str) -> None:
    path = dimsless(tmp_path, name)
    status, out, err = run_main(capsys, "cost", path)
    assert status == 0, err
    assert "formulas only: numbers need the size of" in out and "compute-bound iff" in out
    assert "here " not in out  # no number is made up
    status, text, err = run_main(capsys, "cost", path, "--json")
    assert status == 0, err
    data = strict_json(text)
    assert isinstance(data, dict) and data["formulas_only"] is True and data["missing_sizes"]
    # without sizes no collective runs as a ring (the choice is the chip's step time): the same plan with sizes
    with_dims = shardc.cost(shardc.plan(shardc.parse((EXAMPLES / f"{name}.shard").read_text(encoding="utf-8")),
                                        collective_matmul=False))
    for phase in ("forward", "backward", "step"):
        mine, theirs = data[phase], with_dims.to_json()[phase]
        for key in ("comm_bytes_expr", "comm_s_expr", "compute_flops_expr", "compute_s_expr"):
            if name != "llama2_13b":  # that spec's plan depends on its sizes
                assert mine[key] == theirs[key], (phase, key)  # type: ignore[index]


def test_cost_without_dims_rows_are_formulas(tmp_path: Path) -> None:
    from shardc.costmodel.symbolic import cost_formulas

    text = Path(dimsless(tmp_path, "fsdp_tp")).read_text(encoding="utf-8")
    report = cost_formulas(shardc.plan(shardc.parse(text)))
    gathers = [r for r in report.forward.rows if r.op.value == "all_gather"]
    # X=16 lies on two wrapped axes of the 4x4x4 slice (twice the links), Y=4 on the third
    assert {(r.amount, r.time) for r in gathers} == {("2*B*D/X", "2*B*D/(W_ici*X)"), ("2*D*F/Y", "D*F/(W_ici*Y)")}
    einsum = next(r for r in report.forward.rows if r.op.value == "einsum")
    assert (einsum.amount, einsum.time) == ("2*B*D*F/(X*Y)", "2*B*D*F/(C*X*Y)")
    with pytest.raises(ShardcError, match="cost_formulas"):
        shardc.cost(report.plan)


def test_dims_named_like_hardware_symbols(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # issue 9 item 17: `flops / C` cancelled a dim named C
    from shardc.costmodel.formulas import evaluate

    spec = "mesh X=4\ndims B=4096, C=64, W=128\nparam Wt\nOut[B_X, W] = In[B_X, C] · Wt[C_X, W]\n"
    report = shardc.cost(shardc.plan(shardc.parse(spec)), model="book")  # the formulas are the book's model
    f = report.forward.formula
    assert f.compute_s_text() == "2*B*C*W/(C_chip*X)"
    assert f.comm_s_text() == "2*C*W/W_ici"  # the book's model: X=4 spans one axis (no topology)
    hw = report.hardware
    values = {"B": 4096.0, "C": 64.0, "W": 128.0, "X": 4.0, "C_chip": hw.flops, "W_ici": hw.w_ici}
    assert math.isclose(evaluate(f.compute_s, values), report.forward.compute_s)
    assert math.isclose(evaluate(f.comm_s, values), report.forward.comm_bandwidth_s)
    assert any("C is written C_chip" in n for n in report.notes)
    assert all("C_chip/" in t.sentence for t in report.thresholds)
    status, out, _ = run_main(capsys, "cost", write(tmp_path, spec.encode()), "--json")
    data = strict_json(out)
    assert status == 0 and data["hardware"]["symbols"]["C"] == "C_chip"  # type: ignore[index]
    axis = "mesh W_ici=4\ndims B=4096, C=64, F=128\nparam W\nOut[B_{W_ici}, F] = In[B_{W_ici}, C] · W[C_{W_ici}, F]\n"
    forward = shardc.cost(shardc.plan(shardc.parse(axis))).forward.formula
    assert (forward.compute_s_text(), forward.comm_s_text()) == ("2*B*C*F/(C_chip*W_ici)", "C*F/W_ici_chip")


def test_an_output_that_cannot_be_written_is_one_clear_error(capsys: pytest.CaptureFixture[str],
                                                              tmp_path: Path) -> None:
    """`lower -o` and `export -o` write through one helper (shardc.files.write_text): one message, status 2."""
    target = str(tmp_path / "no" / "such" / "dir" / "out.py")
    for command in (["lower", str(EXAMPLES / "tp.shard"), "-o", target],
                    ["export", str(EXAMPLES / "tp.shard"), "--to", "jax", "-o", target]):
        fails_clearly(capsys, *command, says=f"-o {target}: cannot write it")
