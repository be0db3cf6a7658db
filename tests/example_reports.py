"""Each example planned and verified once a test process: several files check different parts of one
plan (its times, its residuals, its operations, its export) or one verification (its values and
collectives, its memory against XLA's); compiling dominates the slow tests, and planning the large
examples (a mixture of experts, LLaMA 3 405B) takes seconds each.

A plan or report is shared, so the tests reading it must not change it (plans are frozen).
"""

from __future__ import annotations

import functools
from pathlib import Path

import shardc
from shardc.ir.plan import Plan
from shardc.verification.report import Report
from shardc.verification.verify import verify

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@functools.cache
def example_plan(name: str) -> Plan:
    """``shardc.plan`` of ``examples/<name>.shard`` with no options (the fastest plan, memory not weighed),
    parsed under its path from the repository's root as the commands name it."""
    path = EXAMPLES / f"{name}.shard"
    return shardc.plan(shardc.parse(path.read_text(encoding="utf-8"), filename=f"examples/{name}.shard"))


@functools.cache
def example_report(name: str) -> Report:
    """``shardc verify examples/<name>.shard``: the example planned as ``shardc plan`` plans it, verified on
    the devices verify picks."""
    path = EXAMPLES / f"{name}.shard"
    return verify(shardc.parse(path.read_text(encoding="utf-8"), filename=str(path)))
