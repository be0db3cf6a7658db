"""The one formatter of bytes, seconds and FLOPs every report prints through (SI units)."""

from __future__ import annotations

import pytest

from shardc.units import fmt_bytes, fmt_flops, fmt_seconds


@pytest.mark.parametrize(("x", "text"), [(0, "0 B"), (576, "576 B"), (262e3, "262 kB"), (11.2e9, "11.2 GB"),
                                         (2.5e12, "2.5 TB"), (0.5, "0.5 B")])
def test_bytes(x: float, text: str) -> None:
    assert fmt_bytes(x) == text


@pytest.mark.parametrize(("x", "text"), [(0, "0 s"), (1.5, "1.5 s"), (0.126, "126 ms"), (24e-6, "24 us"),
                                         (1.12e-9, "1.12 ns"), (1.12e-12, "0.00112 ns")])
def test_seconds(x: float, text: str) -> None:
    assert fmt_seconds(x) == text


def test_seconds_to_more_digits() -> None:
    assert fmt_seconds(0.12578, digits=4) == "125.8 ms"


@pytest.mark.parametrize(("x", "text"), [(0, "0 FLOP"), (512, "512 FLOP"),
                                         (3.4e11, "340 GFLOP"), (1.2e15, "1.2 PFLOP")])
def test_flops(x: float, text: str) -> None:
    assert fmt_flops(x) == text
