"""One plan's searches share one search context where the chip is the same chip, even made anew for each
(a spec's ``fusion`` line makes :func:`shardc.chip_choice.chip_for` build another Hardware each call): the
memory fit's save policies and candidates then reuse the search instead of searching again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import shardc
from shardc.costmodel.fitting import fitting_plan
from shardc.planner import contexts

ROOT = Path(__file__).resolve().parents[1]
# MPT-7B at 64k on 8 H100s, eager PyTorch (`fusion none`): at its defaults it fits no plan, so the memory fit
# plans every save policy and candidate
MPT = ROOT / "benchmarks" / "runs" / "mpt_7b_64k_h100.shard"


def test_the_memory_fit_searches_once_for_a_chip_made_anew(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = shardc.parse(MPT.read_text(), filename=str(MPT))
    made = []
    real = contexts.search_context

    def counted(*args: Any) -> Any:
        made.append(args)
        return real(*args)

    monkeypatch.setattr(contexts, "search_context", counted)
    planned = fitting_plan(spec)
    assert "memory: no plan fits" in planned.notes[-1]  # every variant was planned
    assert len(made) == 1
    monkeypatch.undo()
    assert fitting_plan(spec) == planned
