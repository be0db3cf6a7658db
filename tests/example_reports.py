"""Each example verified once a test process: several files check different parts of one verification
(its values and collectives, its memory against XLA's), and compiling dominates the slow tests.

A report is shared, so the tests reading it must not change it.
"""

from __future__ import annotations

import functools
from pathlib import Path

import shardc
from shardc.verification.report import Report
from shardc.verification.verify import verify

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@functools.cache
def example_report(name: str) -> Report:
    """``shardc verify examples/<name>.shard``: the example planned as ``shardc plan`` plans it, verified on
    the devices verify picks."""
    path = EXAMPLES / f"{name}.shard"
    return verify(shardc.parse(path.read_text(encoding="utf-8"), filename=str(path)))
