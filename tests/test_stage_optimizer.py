"""A pipelined ZeRO plan's optimizer phase runs on the devices one stage of the verify run had, its mesh
the run's: on all of them DeepSeek-V3's Z axis ran at 32 there (0.9 billion values drawn, most of the
optimizer check's 52 s of CPU) where the pipeline's run had it at 2."""

from __future__ import annotations

from typing import Any

import pytest

import shardc
from shardc.verification import verify as verify_module
from shardc.verification.report import Report
from tests.test_plan_sections import MODEL

pytestmark = pytest.mark.slow  # compiles the optimizer phase


@pytest.mark.parametrize("topology", ["", "topology 2x8\n"])
def test_a_stages_optimizer_runs_on_a_stages_devices(monkeypatch: pytest.MonkeyPatch, topology: str) -> None:
    """With a topology (BLOOM's 48x8) the whole run's cluster, which a stage's mesh does not fill: the stage's
    phase was refused ('topology 2x8 has 16 chips, the mesh's ICI axes 8')."""
    replicated = topology + MODEL.replace("X=2", "X=4").replace("W_emb[V_Y, D_X]", "W_emb[V_Y, D]") \
        .replace("W1[D_X, F_Y]", "W1[D, F_Y]").replace("W2[F_Y, D_X]", "W2[F_Y, D]") \
        .replace("W_out[D_X, V_Y]", "W_out[D, V_Y]")
    zero = shardc.plan(shardc.parse(replicated + "zero 1 over X\n"))
    seen: list[dict[str, int]] = []
    real = verify_module.lower

    def spy(plan: Any, sizes: dict[str, int]) -> Any:
        seen.append(sizes)
        return real(plan, sizes=sizes)

    monkeypatch.setattr(verify_module, "lower", spy)
    report = Report("x", {"P": 2, "X": 2, "Y": 2}, {}, "f32", "float32", (0, 0))  # the run's mesh on 8 devices
    verify_module._stage_optimizer(report, zero, "zero", 8, 0)
    assert [(s["X"], s["Y"]) for s in seen] == [(2, 2)]  # on all 8 devices: X=4
    assert {r.tensor for r in report.values} == {"W_emb", "W1", "W2", "W_out"} and all(r.ok for r in report.values)
    assert {(r.kind, r.ok) for r in report.collectives} == {("ReduceScatter", True), ("AllGather", True)}
