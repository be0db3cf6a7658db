"""The words of the ``.shard`` language below its grammar: where the grammar file is, where lark caches
its analysis, and how a size is written (``5120``, ``3_000_000``, ``1e6``).

>>> parse_size("3_000_000", "B"), parse_size("2.5e3", "D")
(3000000, 2500)
"""

from __future__ import annotations

import os
import re
import sys
from decimal import Decimal, InvalidOperation
from pathlib import Path

import lark

from shardc.errors import ShardcError, clip

__all__ = ["grammar_text", "cache_file", "parse_size", "MAX_SIZE"]

MAX_SIZE = 10**18  # sizes beyond this are typos; they would also overflow int64 shapes

_SIZE_RE = re.compile(r"[0-9](?:_?[0-9])*(?:\.[0-9](?:_?[0-9])*)?(?:[eE][+-]?[0-9]{1,4})?")


def grammar_text() -> str:
    """The lark grammar: the copy inside the wheel, else the source checkout's ``grammar/``."""
    for path in (Path(__file__).parents[1] / "grammar" / "shard.lark",  # the wheel's copy, read directly
                 Path(__file__).parents[2] / "grammar" / "shard.lark"):  # a source checkout
        try:
            return path.read_text(encoding="utf-8")
        except OSError:
            continue
    from importlib import resources  # a zipped install: the slow but general route

    return (resources.files("shardc") / "grammar" / "shard.lark").read_text(encoding="utf-8")


def cache_file() -> str | bool:
    """Where lark keeps its grammar analysis between runs (a third of ``shardc plan``'s time without it).

    A private per-user directory (lark's default is the shared temp dir, and the cache
    is a pickle); lark checks the grammar's hash in the file, so a stale cache is rebuilt.
    False (no cache) when the directory cannot be made.
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(base, "shardc")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError:
        return False
    if not os.access(folder, os.W_OK | os.R_OK):
        return False
    version = f"{sys.version_info[0]}{sys.version_info[1]}"
    return os.path.join(folder, f"grammar-lark{lark.__version__}-py{version}.cache")


def parse_size(text: str, what: str) -> int:
    """A positive integer written ``5120``, ``3_000_000``, ``1e6`` or ``2.5e3``.

    >>> parse_size("1e6", "B")
    1000000
    """
    t = text.strip()
    shown = clip(text)
    if not _SIZE_RE.fullmatch(t):
        raise ShardcError(f"{what}: `{shown}` is not a size",
                          fix="write a positive integer such as 5120, 3_000_000, 1e6 or 2.5e3")
    mantissa, _, exponent = t.replace("_", "").lower().partition("e")
    try:
        value = Decimal(mantissa).scaleb(int(exponent or "0"))
    except (InvalidOperation, ValueError):
        raise ShardcError(f"{what}: `{shown}` is not a size",
                          fix="write a positive integer such as 5120") from None
    if value > MAX_SIZE:
        raise ShardcError(f"{what}: {shown} is too large (more than 1e18)", fix="check the number for a typo")
    if value != value.to_integral_value():
        raise ShardcError(f"{what}: {shown} is not a whole number", fix="sizes count elements or devices: "
                          f"use a whole number such as {max(1, int(value))}")
    if value <= 0:
        raise ShardcError(f"{what}: size must be positive, not {shown}", fix="use a size of at least 1")
    return int(value)
