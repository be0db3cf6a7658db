"""Hostile command lines: every subcommand, every flag, values no user means, and still a clean exit.

The commands and their flags are read from ``shardc``'s own parser, so a flag added later is
fuzzed too.  A value is a good one for its flag (so runs get past the checks and into the
passes) or a hostile one: empty, huge (50 nines), negative, NaN and inf spelled every way,
non-ASCII digits, U+2028, a path to a directory, a device, a missing file.  ``main()``
runs in-process, in a scratch directory (an output path is never the project's), and must
exit 0, 1 or 2 with no traceback and no ``internal error`` line, within a CPU budget.
``verify`` and ``compare`` run up to the point where they would start XLA, which is where
their argument checks end (their runs are the slow tests' business).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import os
import shutil
import tempfile
import time
from pathlib import Path
from unittest import mock

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from small_examples import SMALL

from shardc.cli.main import full_parser, main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = [str(p) for p in SMALL]
WORK = Path(tempfile.mkdtemp(prefix="shardc-fuzz-cli-"))
atexit.register(shutil.rmtree, WORK, True)
(WORK / "folder").mkdir()
(WORK / "empty.shard").write_text("")
(WORK / "latin1.shard").write_bytes("# caf\xe9\nmesh X=2\nO[B_X] = I[B_X]\n".encode("latin-1"))
(WORK / "long.shard").write_text("mesh X=2\ndims B=64, D=32, F=16\n" + "".join(  # a chain of 400 einsums
    f"T{i + 1}[B_X, {'DF'[1 - i % 2]}] = T{i}[B_X, {'DF'[i % 2]}] · W{i}[{'DF'[i % 2]}, {'DF'[1 - i % 2]}]\n"
    for i in range(400)))
BUDGET_S = 20.0  # CPU seconds a run may take (the command's own budgets stop far sooner)


def _commands() -> dict[str, dict[str, argparse.Action]]:
    """Each subcommand's flags (``--help`` aside), from the parser ``shardc`` itself builds."""
    sub = next(a for a in full_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {a.option_strings[-1]: a for a in parser._actions
                   if a.option_strings and not isinstance(a, argparse._HelpAction)}
            for name, parser in sub.choices.items()}


COMMANDS = _commands()

PATHS = [str(WORK / "folder"), str(WORK / "missing.shard"), str(WORK / "no" / "such" / "x.png"), "/dev/null",
         "/dev/zero", ".", "/", str(WORK / "empty.shard"), str(WORK / "latin1.shard"), str(WORK / "out"),
         str(WORK / "out.png"), str(WORK / "out.xyz"), str(WORK / "\udcff.png"), "Ω.svg", "a\u2028b.py"]
HOSTILE = ["", " ", "0", "-0", "-1", "-4096", "9" * 50, "-" + "9" * 50, "1e400", "1e-400", "2.5", "1e18",
           "nan", "NaN", "-nan", "inf", "-inf", "Infinity", "0x10", "1_0", "\u0661\u0662", "\uff18", "Ω",
           "a\u2028b", "\u2028", "a`", "x" * 5000, "=", "B=", "=4", "B=nan", "B=-4", "B=0", "B=" + "9" * 50,
           "X=1e9", "Ω=2", "B=1:", ":", "B=1e3:1e6:7", "B=inf:1", "X=2:64", *PATHS]
GOOD = {"--set": ["B=64", "X=2", "D=1e3"], "--hardware": ["tpu-v5p", "h100"], "--chips": ["64", "4096", "1"],
        "--mfu": ["0.4"], "--spans": ["X=2"], "--sweep": ["B=1e3:1e6", "X=2:64"], "--points": ["3"],
        "--top": ["3"], "--devices": ["8", "1"], "--with": EXAMPLES[:3],
        "--output": [str(WORK / "module.py")], "--plot": [str(WORK / "sweep.svg")],
        "--schedule-plot": [str(WORK / "gantt.svg")], "--out": [str(WORK / "chip.toml")], "--name": ["host"]}


# `layouts` plans over a process pool when it has 8 plans or more: here one process, whatever is drawn
JOBS = ["1", "-1", "", "x", "-" + "9" * 50]


def values(flag: str, action: argparse.Action) -> st.SearchStrategy[str]:
    if flag == "--jobs":
        return st.sampled_from(JOBS)
    good = list(GOOD.get(flag, [])) + [str(c) for c in action.choices or ()]
    if not good:
        return st.sampled_from(HOSTILE)
    return st.one_of(st.sampled_from(good), st.sampled_from(good), st.sampled_from(HOSTILE))


@st.composite
def argvs(draw: st.DrawFn) -> list[str]:
    """One command line: a subcommand, a file (or a hostile path), flags in any order, values good or not."""
    command = draw(st.sampled_from(sorted(COMMANDS)))
    argv = [command]
    flags = COMMANDS[command]
    if command not in ("hardware", "calibrate"):  # every other command reads FILE
        files = st.sampled_from([e for e in EXAMPLES if command != "layouts" or "pipeline" not in e])
        argv.append(draw(st.one_of(files, files, files, st.sampled_from(PATHS + [str(WORK / "long.shard")]))))
    if command == "layouts":
        argv += ["--jobs", "1"]
    for flag in draw(st.lists(st.sampled_from(sorted(flags)), max_size=4)):
        action = flags[flag]
        argv += [flag] if action.nargs == 0 else [flag, draw(values(flag, action))]
    if draw(st.integers(0, 7)) == 0:
        argv.insert(draw(st.integers(0, len(argv))), draw(st.sampled_from(["--bogus", "--", "-", "extra", "-o"])))
    return argv


class _WouldCompile(BaseException):
    """Raised where ``verify``, ``compare`` or ``cost --check-memory`` would start XLA, or ``calibrate`` would
    start measuring: every argument check is behind it."""


def _stop(*args: object, **kwargs: object) -> None:
    raise _WouldCompile


def run_cli(argv: list[str]) -> tuple[int | str, str, float]:
    """``main(argv)`` in the scratch directory: its status, its stderr and the CPU seconds it took."""
    out, err = io.StringIO(), io.StringIO()
    saved = os.environ.get("XLA_FLAGS")  # verify and compare set the device count jax will start with
    start = time.process_time()
    with (contextlib.chdir(WORK), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err),
          mock.patch("shardc.cli.lower_cmd.verify", _stop),  # where the commands call them
          mock.patch("shardc.cli.lower_cmd.compare", _stop),
          mock.patch("shardc.calibrate.run.measure", _stop),
          mock.patch("shardc.verification.memory_check.check_plan_memory", _stop)):
        try:
            status: int | str = main(argv)
        except SystemExit as stop:  # argparse: --help, --version, a malformed flag
            status = stop.code if isinstance(stop.code, int) else 2
        except _WouldCompile:
            status = "would compile"
        finally:
            if saved is None:
                os.environ.pop("XLA_FLAGS", None)
            else:
                os.environ["XLA_FLAGS"] = saved
    return status, err.getvalue(), time.process_time() - start


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(argvs())
def test_no_command_line_gives_a_traceback_or_runs_past_its_budget(argv: list[str]) -> None:
    status, err, seconds = run_cli(argv)
    event(f"{argv[0]} exit {status}")
    assert status in (0, 1, 2, "would compile"), (argv, status, err)
    assert "Traceback" not in err and "internal error" not in err, (argv, err)
    assert seconds < BUDGET_S, (argv, seconds)
    assert all(len(line) < 400 for line in err.splitlines()), (argv, err)  # huge values are not echoed whole


def test_every_command_and_flag_is_drawn() -> None:
    """The strategy reaches every subcommand ``shardc --help`` lists and each of its flags."""
    assert set(COMMANDS) >= {"plan", "cost", "layouts", "hardware", "lower", "verify", "compare"}
    assert all(flags for flags in COMMANDS.values())
    assert COMMANDS["layouts"]["--chips"].nargs is None and COMMANDS["plan"]["--json"].nargs == 0


def test_a_huge_value_argparse_rejects_is_echoed_clipped() -> None:
    """argparse repeats a rejected value whole; shardc's parser clips it (a 5000-character line before)."""
    status, err, _ = run_cli(["lower", EXAMPLES[0], "--save", "x" * 5000])
    assert status == 2 and "invalid choice" in err and "(5002 characters)" in err, err
    assert max(len(line) for line in err.splitlines()) < 300
    status, err, _ = run_cli(["plan", EXAMPLES[0], "y" * 5000])
    assert status == 2 and "unrecognized arguments" in err and "(5000 characters)" in err, err
