"""Planning is deterministic: the budget counts search work, never seconds, and a plan is the same every run.

Whether a spec plans, and what the plan is, must not depend on the machine's load or on
Python's string hashing; ``--explain`` only adds the alternatives, never changes the plan.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shardc
from shardc.hardware import get_hardware
from shardc.layouts import Options, search_layouts
from shardc.planner.planner import BUDGET

ROOT = Path(__file__).resolve().parents[1]
THREE = """mesh X=2, Y=2, Z=2
dims B=64, D=32, F=128
T[B_X, F_YZ] = In[B_XY, D] · W_in[D_Z, F_Y]
Out[B_X, D_Z] = T[B_X, F_YZ] · W_out[F_Y, D_X]
"""


def _gives_up(text: str, budget: int) -> str | None:
    """The planner's message when ``budget`` is too small for ``text``, else None."""
    try:
        shardc.plan(shardc.parse(text), budget=budget)
    except shardc.ShardcError as err:
        assert "gave up" in err.message and err.fix is not None and "merge axes" in err.fix
        return err.message
    return None


@pytest.mark.slow  # the spec planned again at each budget of a bisection (about 20 plans)
def test_the_budget_is_a_count_of_work_with_one_exact_threshold() -> None:
    """Just enough budget plans, one less stops, every time: no clock decides."""
    lo, hi = 1, BUDGET  # lo gives up, hi plans
    assert _gives_up(THREE, lo) is not None and _gives_up(THREE, hi) is None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _gives_up(THREE, mid) is not None else (lo, mid)
    for _ in range(2):
        message = _gives_up(THREE, lo)
        assert message is not None and f"after {lo:,} steps of search" in message
        assert _gives_up(THREE, hi) is None


@pytest.mark.parametrize("budget", [0, -5, 1.5, True])
def test_a_budget_must_be_a_positive_whole_number(budget: object) -> None:
    with pytest.raises(shardc.ShardcError, match="budget"):
        shardc.plan(shardc.parse(THREE), budget=budget)


def test_a_plan_is_the_same_in_every_process() -> None:
    """Two fresh interpreters with different string hashing print the same plan."""
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        done = subprocess.run([sys.executable, "-m", "shardc", "plan", "--json", "--explain",
                               str(ROOT / "examples" / "llama_layer_fsdp_tp.shard")],
                              capture_output=True, text=True, cwd=ROOT, env=env, check=True)
        outs.append(done.stdout)
    assert outs[0] == outs[1]


def test_explain_adds_the_alternatives_and_changes_nothing_else() -> None:
    spec = shardc.parse(THREE)
    plain, explained = shardc.plan(spec), shardc.plan(spec, explain=True)
    assert plain.choices == () and explained.choices
    assert all(any(a.chosen for a in c.alternatives) for c in explained.choices)
    assert plain == explained and plain.notes == explained.notes
    assert shardc.plan(spec) == plain  # and planning again gives the same plan


def test_a_busy_machine_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that jumps an hour at every reading (a machine under any load) changes no plan and no
    ``shardc layouts`` answer: nothing the planner or the layout search decides reads the clock."""
    spec = shardc.parse((ROOT / "examples" / "fsdp_tp.shard").read_text(encoding="utf-8"), "fsdp_tp.shard")
    options = Options(get_hardware("tpu-v5p"))
    plan, search = shardc.plan(spec), search_layouts([spec], options, chips=16)
    hours = itertools.count(0.0, 3600.0)
    monkeypatch.setattr(time, "monotonic", lambda: next(hours))
    monkeypatch.setattr(time, "time", lambda: next(hours))
    assert shardc.plan(spec) == plan
    busy = search_layouts([spec], options, chips=16)
    assert busy.layouts == search.layouts and busy.skipped == search.skipped == ()


PIPED = ("mesh P=2 pipeline, X=2, W=2\ndims B=64, D=32, F=128\nlayers 2\nmicrobatches 2\nparam W_in, W_out\n"
         "T[B_X, F] = In[B_X, D] · W_in[D, F]\nOut[B_X, D] = In[B_X, D] + T[B_X, F] · W_out[F, D]\n")


@pytest.mark.parametrize("text, free", [(THREE.replace("Z=2", "Z=2, W=2"), "W"), (PIPED, "W"),
                                        (THREE.replace("Z=2", "Z=2, W=1"), None)])
def test_giving_up_points_at_the_mesh_and_names_an_axis_no_tensor_is_written_over(text: str,
                                                                                   free: str | None) -> None:
    """A 4-axis mesh (two `over dcn` axes) with one axis written nowhere gave up with no span and a fix that did
    not apply ("merge axes that always shard together"); written where it goes (B_ZWX) the spec planned."""
    with pytest.raises(shardc.ShardcError, match="gave up") as err:
        shardc.plan(shardc.parse(text, "m.shard"), budget=1)
    assert err.value.span is not None and err.value.span.line == 1 and err.value.fix is not None
    assert (f"no tensor is written over {free}," in err.value.fix) == (free is not None)
    assert "written over P" not in err.value.fix and "merge axes" in err.value.fix
