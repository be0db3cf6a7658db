"""Golden outputs: ``shardc plan --json`` and ``shardc cost --json`` of every example and test spec.

Each spec's two outputs are committed under ``tests/golden/`` (``NAME.plan.json``, ``NAME.cost.json``)
and compared exactly, so a refactoring that changes any plan, cost figure or formula fails here.
They are computed in-process through the command's ``main`` (no interpreter start-up), run from
the repository's root as the command is documented (``shardc plan --json examples/fsdp.shard``).

When a change of output is intended, rewrite the snapshots and review the diff:

    python tests/test_golden.py            # rewrites tests/golden/*.json
    git diff --stat tests/golden/
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import shardc.cli.plan_cmd
import shardc.costmodel.fitting
import shardc.planner.planner
from shardc.cli.main import main
from shardc.ir.plan import Plan
from shardc.ir.spec import Spec

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
SPECS = sorted([*ROOT.glob("examples/*.shard"), *ROOT.glob("tests/specs/*.shard")])
COMMANDS = ("plan", "cost")


def output(spec: Path, command: str) -> str:
    """``shardc COMMAND --json SPEC`` run from the repository's root: its stdout, which must succeed."""
    cwd = os.getcwd()
    os.chdir(ROOT)  # the cost report names the file as given: relative, as in the README
    try:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main([command, "--json", str(spec.relative_to(ROOT))])
    finally:
        os.chdir(cwd)
    if status != 0:
        raise AssertionError(f"shardc {command} --json {spec.name} exited {status}: {err.getvalue()}")
    return out.getvalue()


def snapshot(spec: Path, command: str) -> Path:
    return GOLDEN / f"{spec.stem}.{command}.json"


def planned_once(fitting: Callable[..., Plan]) -> Callable[..., Plan]:
    """``fitting_plan`` remembered by all its arguments (the planner's defaults filled in), for the spec last
    planned: `shardc plan` and `shardc cost` both plan the fastest plan that fits, with the same options where
    neither is given any, and a plan is a pure function of them, so the cost command reads the plan the plan
    command made (a frozen Plan); a call with any other argument plans anew."""
    seen: dict[str, tuple[Spec, Plan]] = {}

    def plan(spec: Spec, optimizer: str | None = None, offload: str = "none", **options: Any) -> Plan:
        bound = inspect.signature(shardc.planner.planner.plan).bind(spec, **options)
        bound.apply_defaults()
        key = repr((spec.filename, optimizer, offload, [(k, v) for k, v in bound.arguments.items() if k != "spec"]))
        hit = seen.get(key)
        if hit is None or hit[0] != spec:
            seen.clear()  # only the spec in hand: its two commands run one after the other
            hit = seen[key] = (spec, fitting(spec, optimizer, offload, **options))
        return hit[1]
    return plan


@pytest.fixture(autouse=True, scope="module")
def _one_plan_a_spec() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        once = planned_once(shardc.costmodel.fitting.fitting_plan)
        patch.setattr(shardc.costmodel.fitting, "fitting_plan", once)  # shardc.plan's, which `shardc cost` calls
        patch.setattr(shardc.cli.plan_cmd, "plan", once)  # `shardc plan`'s, imported by name
        yield


def test_every_spec_has_one_snapshot_per_command_and_no_other() -> None:
    assert len({s.stem for s in SPECS}) == len(SPECS), "two specs share a name: their snapshots would collide"
    expected = {snapshot(s, c).name for s in SPECS for c in COMMANDS}
    assert {p.name for p in GOLDEN.glob("*.json")} == expected, "run: python tests/test_golden.py"


@pytest.mark.parametrize("spec", SPECS, ids=[s.stem for s in SPECS])
def test_plan_and_cost_json_match_the_snapshot(spec: Path) -> None:
    for command in COMMANDS:
        path = snapshot(spec, command)
        assert path.exists(), f"no snapshot {path.name}: run python tests/test_golden.py"
        assert output(spec, command) == path.read_text(encoding="utf-8"), \
            f"shardc {command} --json {spec.name} changed; if intended, run python tests/test_golden.py"


def regenerate() -> None:
    """Rewrite every snapshot (and drop those of specs that are gone)."""
    GOLDEN.mkdir(exist_ok=True)
    for stale in GOLDEN.glob("*.json"):
        stale.unlink()
    for spec in SPECS:
        for command in COMMANDS:
            snapshot(spec, command).write_text(output(spec, command), encoding="utf-8")
    print(f"wrote {len(SPECS) * len(COMMANDS)} snapshots to {GOLDEN.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    regenerate()
