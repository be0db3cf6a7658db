"""The examples the fuzzers draw from: those of fewer than 16 statements, which plan in milliseconds.

The whole models (an embedding, a `layers` block, a loss: 16 statements and more) take seconds to
plan and to search layouts for, and tens of seconds to verify.
"""

from __future__ import annotations

from pathlib import Path

import shardc

ROOT = Path(__file__).resolve().parent.parent


def _small(path: Path) -> bool:
    return len(shardc.parse(path.read_text(encoding="utf-8"), filename=str(path)).statements) < 16


SMALL = [p for p in sorted((ROOT / "examples").glob("*.shard")) if _small(p)]
