"""``shardc verify`` says what it is doing on stderr under --progress (or on a terminal), else nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardc.verification import progress
from tests.test_cli import shardc_cli


def test_steps_reach_only_a_caller_that_asked() -> None:
    heard: list[str] = []
    progress.step("unheard")
    with progress.shown(heard.append):
        progress.step("compiling")
    progress.step("unheard again")
    assert heard == ["compiling"]


@pytest.mark.slow
@pytest.mark.parametrize("flags, told", [(["--progress"], True), ([], False)])
def test_verify_reports_progress_on_stderr_when_asked(tmp_path: Path, flags: list[str], told: bool) -> None:
    path = tmp_path / "tp.shard"
    path.write_text("mesh X=2\nOut[B_X, F] = In[B_X, D] · W[D, F]\n", encoding="utf-8")
    done = shardc_cli("verify", str(path), *flags)  # in-process: stderr is a buffer, not a terminal
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("verify: ")]
    if told:
        assert lines[0].startswith("verify: planning (") and lines[1].startswith("verify: lowering the plan at "), lines
        assert any("compiling" in line for line in lines) and any("comparing" in line for line in lines), lines
    else:
        assert lines == []
