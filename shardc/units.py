"""Bytes, seconds and FLOPs as text, in SI units (kB = 1000 B): every report prints them through here.

Three significant figures by default (``126 ms``, ``11.2 GB``); a caller that compares figures the
3-digit table rounds alike asks for more. Zero prints as ``0 s``, ``0 B``, ``0 FLOP``.
"""

from __future__ import annotations

__all__ = ["fmt_bytes", "fmt_seconds", "fmt_flops"]

_BYTES = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1.0, "B"))
_FLOPS = ((1e18, "EFLOP"), (1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP"), (1.0, "FLOP"))
_SECONDS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns"))


def _scaled(x: float, units: tuple[tuple[float, str], ...], base: str, digits: int) -> str:
    """``x`` in the largest unit it reaches; below the smallest, in the smallest; zero in ``base``."""
    if x == 0:
        return f"0 {base}"
    for scale, unit in units:
        if abs(x) >= scale:
            return f"{x / scale:.{digits}g} {unit}"
    scale, unit = units[-1]
    return f"{x / scale:.{digits}g} {unit}"


def fmt_bytes(x: float, digits: int = 3) -> str:
    """``11.2 GB``, ``262 kB``, ``512 B``."""
    return _scaled(x, _BYTES, "B", digits)


def fmt_flops(x: float, digits: int = 3) -> str:
    """``1.2 PFLOP``, ``340 GFLOP``."""
    return _scaled(x, _FLOPS, "FLOP", digits)


def fmt_seconds(x: float, digits: int = 3) -> str:
    """``315 ms``, ``24 us``, ``0 s``."""
    return _scaled(x, _SECONDS, "s", digits)
