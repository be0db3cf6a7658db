"""The gathered weights' peak (:func:`shardc.costmodel.memory.peak_weights`), one sweep over births and last
reads, is the most alive at any step, counted step by step."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardc
from shardc.costmodel.memory import peak_weights, value_bytes
from shardc.ir.plan import Plan, Step
from shardc.ir.spec import TensorRef
from shardc.planner.graph import build_graph
from shardc.timing import plan_sizes

ROOT = Path(__file__).resolve().parents[1]


def _alive_at_every_step(plan: Plan, steps: tuple[Step, ...], weights: set[str]) -> float:
    """The oracle: at each step, the bytes of each weight value made by then and read at or after it."""
    sizes = plan_sizes(plan)
    born: dict[TensorRef, int] = {}
    last: dict[TensorRef, int] = {}
    for i, step in enumerate(steps):
        for ref in (*step.operands, *((step.src,) if step.src is not None else ())):
            if ref in born:
                last[ref] = i
        if step.tensor in weights and (step.is_collective or step.dst.unreduced):
            born.setdefault(step.dst, i)
            last.setdefault(step.dst, i)
    return max((sum(value_bytes(plan, r, sizes) for r in born if born[r] <= i <= last[r])
                for i in range(len(steps))), default=0.0)


@pytest.mark.parametrize(("path", "save"), [("tests/specs/book_ch5_fsdp_tp.shard", "default"),
                                             ("tests/specs/book_ch5_fsdp_tp.shard", "all"),
                                             ("examples/fsdp.shard", "default")])
def test_the_sweep_finds_the_most_alive_at_any_step(path: str, save: str) -> None:
    plan = shardc.plan(shardc.parse((ROOT / path).read_text()), save=save)
    params = build_graph(plan.spec).params
    names = {*params, *(plan.grad_name(p) for p in params)}
    sizes = plan_sizes(plan)
    peaks = [peak_weights(plan, steps, names, sizes) for steps in (plan.forward, plan.backward)]
    assert peaks == [_alive_at_every_step(plan, steps, names) for steps in (plan.forward, plan.backward)]
    assert max(peaks) > 0  # gathered weights there are: the sweep has something to find
