"""Fuzzing the command line: whatever the flags and the file, ``shardc`` exits 0, 1 or 2 with no traceback.

Flags are drawn from each command's own flags with values good and bad
(zero, negative, huge, ``inf``, ``nan``, words); files are valid specs, the
examples, their byte-level mutations and their other encodings.  ``main()``
runs in-process, with its own stdout and stderr; an ``internal error`` line
(an exception shardc did not expect) fails the test as a traceback would.
``verify`` and ``compare`` are left out: they compile with XLA.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from small_examples import SMALL

from shardc.cli.main import main
from shardc.testing import spec_texts

WORK = Path(tempfile.mkdtemp(prefix="shardc-cli-fuzz-"))
atexit.register(shutil.rmtree, WORK, True)


def mostly(good: list[str], bad: list[str]) -> st.SearchStrategy[str]:
    """A good value three times in four, so the runs get past the checks as often as they hit them."""
    return st.one_of(st.sampled_from(good), st.sampled_from(good), st.sampled_from(good), st.sampled_from(bad))


NUMBERS = mostly(["1", "2", "4", "1e3", "4096", "1_024", "1e18"],
                 ["0", "-1", "0.5", "1e-300", "1e19", "1e400", "inf", "nan", "x", ""])
FRACTIONS = mostly(["0.4", "1", "0.05"], ["0", "-1", "1.5", "inf", "nan", "x"])
NAMES = mostly(["B", "D", "F", "X", "Y", "L"], ["P", "Q", "b d", "", "=", "B_X"])


def pair(names: st.SearchStrategy[str], values: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.builds(lambda n, v, sep: f"{n}{sep}{v}", names, values, mostly(["="], [":", ""]))


SWEEPS = st.builds(lambda d, lo, hi: f"{d}={lo}:{hi}", NAMES, NUMBERS, NUMBERS)

CHIP_KEYS = ["flops", "ici_bandwidth", "hbm_bytes", "dcn_bandwidth", "hbm_bandwidth", "hop_latency", "ici_domain",
             "torus_side", "torus_dims", "name", "description", "colour"]
TOML_VALUES = mostly(["4.59e14", "9e10", "16", "3", '"chip"'],
                     ["0", "-1", "0.5", "inf", "nan", "1e400", "true", '"x"', "[1]", "{a=1}", '"caf\xe9"', "="])


@st.composite
def chip_files(draw: st.DrawFn) -> str:
    """A --hardware-file: the required keys mostly present, values good and bad, sometimes not UTF-8."""
    keys = draw(st.lists(st.sampled_from(CHIP_KEYS), max_size=4, unique=True))
    required = CHIP_KEYS[:4] if draw(st.integers(0, 3)) else CHIP_KEYS[:3]
    lines = [f"{key} = 4.5e10" for key in required if key not in keys]
    lines += [f"{key} = {draw(TOML_VALUES)}" for key in keys]
    path = WORK / "chip.toml"
    path.write_bytes("\n".join(lines).encode("latin-1"))
    return str(path)


FLAGS: dict[str, dict[str, st.SearchStrategy[str] | None]] = {
    "plan": {"--save": st.sampled_from(["default", "none", "all", "some"]), "--json": None,
             "--explain": None},
    "cost": {"--save": st.sampled_from(["default", "none", "all"]), "--json": None,
             "--hardware": st.sampled_from(["tpu-v5p", "h100", "TPU_V5E", "abacus", ""]),
             "--optimizer": st.sampled_from(["adam10", "adam16", "sgd"]), "--hardware-file": chip_files(),
             "--mfu": FRACTIONS, "--spans": pair(NAMES, NUMBERS), "--sweep": SWEEPS,
             "--points": mostly(["2", "3", "13"], ["1", "0", "-4", "1000000000", "x"]),
             "--with": st.sampled_from([str(p) for p in SMALL] + [str(WORK / "missing.shard")])},
    "lower": {"--save": st.sampled_from(["default", "all"]),
              "-o": st.sampled_from([str(WORK / "out.py"), str(WORK / "no" / "such" / "out.py"), str(WORK)])},
    "hardware": {"--json": None},
}


@st.composite
def file_bytes(draw: st.DrawFn) -> bytes:
    """A spec's bytes: valid, an example, mutated at the byte level, or in another encoding."""
    kind = draw(st.sampled_from(["spec", "spec", "example", "example", "mutated", "encoded", "bytes"]))
    if kind == "spec":
        return draw(spec_texts()).encode()
    text = draw(st.sampled_from(SMALL)).read_text(encoding="utf-8")
    if kind == "example":
        return text.encode()
    if kind == "encoded":
        encoding = draw(st.sampled_from(["utf-8-sig", "utf-16", "utf-16-le", "utf-32", "latin-1", "cp1252"]))
        return ("# é\n" + text).encode(encoding, errors="replace")
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    data = bytearray(text.encode())
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        piece = draw(st.sampled_from([b"", b"\x00", b"\xff", b"\xef\xbb\xbf", b"\n", b"_", b"X", b"9" * 30,
                                      b"{U_X}", b"\xc3", b" \xc2\xb7 ", b"=", b"[", b"]"]))
        drop = draw(st.integers(0, 3))
        data[at:at + drop] = piece
    return bytes(data)


@st.composite
def command_lines(draw: st.DrawFn) -> list[str]:
    command = draw(st.sampled_from(sorted(FLAGS)))
    args = [command]
    if command != "hardware":
        path = WORK / f"spec{draw(st.integers(0, 3))}.shard"
        path.write_bytes(draw(file_bytes()))
        args.append(str(path))
        for _ in range(draw(st.integers(0, 2)) // 2):
            args += ["--set", draw(pair(NAMES, NUMBERS))]
    options = FLAGS[command]
    for flag in draw(st.lists(st.sampled_from(sorted(options)), max_size=3, unique=True)):
        value = options[flag]
        args += [flag] if value is None else [flag, draw(value)]
    if draw(st.integers(0, 9)) == 0:
        args.append(draw(st.sampled_from(["--bogus", "--version", "--help", "extra"])))
    return args


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(command_lines())
def test_no_flag_or_file_gives_a_traceback(args: list[str]) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(args)
        except SystemExit as stop:  # argparse: --help, --version, a malformed flag
            status = stop.code if isinstance(stop.code, int) else 2
    text = err.getvalue()
    event(f"{args[0]} exit {status}")
    assert status in (0, 1, 2), (args, status, text)
    assert "Traceback" not in text and "internal error" not in text, (args, text)
    if status == 2 and "usage:" not in text:
        assert text.startswith(("error: ", "/", "fix: ")) or ": error: " in text, (args, text)
