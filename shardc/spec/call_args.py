"""A function call's arguments while parsing (``causal(Sc[...], S, T, window 4096)``,
``dropout(X[...], 0.1)``): tensors, then index names, then numbers, then a sliding window, each kind
kept with its span so a misplaced one is reported where it stands."""

from __future__ import annotations

from typing import Any

from shardc.errors import ShardcError, Span
from shardc.ir.spec import Expr

__all__ = ["IndexArg", "NumberArg", "WindowArg", "sort_args"]


class IndexArg:
    """An index name given to a function (``causal(Sc, S, T)``), while parsing."""

    def __init__(self, name: str, span: Span) -> None:
        self.name, self.span = name, span


class NumberArg:
    """A number given to a function (``dropout(X, 0.1)``), while parsing."""

    def __init__(self, value: float, span: Span) -> None:
        self.value, self.span = value, span


class WindowArg:
    """A causal mask's sliding window (``window 4096``), while parsing: the last argument."""

    def __init__(self, value: int, span: Span) -> None:
        self.value, self.span = value, span


def sort_args(func: str, args: list[Any]) -> tuple[list[Expr], list[str], list[float]]:
    """A call's arguments by kind: tensors first, then index names, then numbers, then a window, in that order."""
    rank = {IndexArg: 1, NumberArg: 2, WindowArg: 3}
    last = 0
    for arg in args:
        kind = rank.get(type(arg), 0)
        if kind < last or (kind and arg is args[0]):
            raise ShardcError(f"`{func}(...)`: arguments go tensors first, then index names, numbers, a window",
                              arg.span, fix=f"write e.g. `{func}(X[B, S, D], S, 0.1)`")
        last = kind
    exprs = [a for a in args if rank.get(type(a), 0) == 0]
    return exprs, [a.name for a in args if isinstance(a, IndexArg)], [a.value for a in args
                                                                       if isinstance(a, NumberArg)]
