"""What a long ``shardc verify`` is doing, said as it starts each part (compiling, running, comparing).

The verifiers call :func:`step`; nothing is said unless a caller asked for it with :func:`shown`
(``shardc verify`` does when stderr is a terminal, or under ``--progress``), so the library stays quiet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

__all__ = ["step", "shown"]

_SINK: ContextVar[Callable[[str], None] | None] = ContextVar("verify_progress", default=None)


def step(what: str) -> None:
    """Say that verify starts ``what`` (where a caller asked to be told)."""
    sink = _SINK.get()
    if sink is not None:
        sink(what)


@contextmanager
def shown(sink: Callable[[str], None]) -> Iterator[None]:
    """Within the block, each :func:`step` is passed to ``sink``."""
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)
