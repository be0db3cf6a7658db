"""The planner's speed caches (step seconds, refs and their text, shared by the candidate plans) change no plan."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given

import shardc
from shardc.planner import candidates, planner
from shardc.testing import specs
from shardc.timing import plan_time

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DEEP = "mesh X=16, Y=4\ndims B=1_048_576, D=8192, F=32768\n" + "".join(
    f"T{k}[B_X, F_Y] = H{k - 1}[B_X, D_Y] · W_in{k}[D_X, F_Y]\nH{k}[B_X, D_Y] = T{k}[B_X, F_Y] · W_out{k}[F_Y, D_X]\n"
    for k in range(1, 5))


def _every_candidate_fresh(spec: shardc.Spec) -> shardc.Plan:
    """The plan of least time among every candidate, each planned alone (none skipped): what the planner
    returns before it runs collectives as rings (``collective_matmul=False``), a pass on the plan chosen."""
    first = planner.plan_candidate(spec, "search")
    weights = candidates.candidate_weights(plan_time(first))
    planned = [first, *(planner.plan_candidate(spec, "search", w) for w in weights)]
    planned.append(planner.plan_candidate(spec, "rules"))
    return min(planned, key=lambda p: candidates.objective(plan_time(p)))


@pytest.mark.slow
@pytest.mark.parametrize("text", [DEEP, *(p.read_text() for p in sorted(EXAMPLES.glob("*.shard")))])
def test_shared_caches_pick_the_plan_fresh_candidates_pick(text: str) -> None:
    spec = shardc.parse(text)
    if not spec.dims:
        pytest.skip("without dims the rules plan alone")
    if spec.mesh.pipeline_axis is not None:
        pytest.skip("a pipelined spec plans one stage's spec (tests/test_pipeline.py)")
    assert shardc.plan(spec, collective_matmul=False) == _every_candidate_fresh(spec)


@pytest.mark.slow
@given(specs(max_statements=3, dims=True, chains=False))
def test_skipping_candidates_with_the_first_ones_steps_changes_no_plan(spec: shardc.Spec) -> None:
    """The planner skips a candidate whose solves repeat the first's moves: the result is as if it had not."""
    try:
        expected = _every_candidate_fresh(spec)
    except shardc.ShardcError:
        return  # a spec no sharding plans: the planner says so (tested elsewhere)
    assert shardc.plan(spec, collective_matmul=False) == expected


def test_memoised_step_seconds_match_a_fresh_count() -> None:
    spec = shardc.parse(DEEP)
    memo: dict[tuple[object, ...], tuple[float, float]] = {}
    for weights in (candidates.SUM, (0.0, 0.0)):
        p = planner.plan_candidate(spec, "search", weights)
        assert plan_time(p, memo=memo) == plan_time(p)
    assert memo  # the second plan read the first's figures
