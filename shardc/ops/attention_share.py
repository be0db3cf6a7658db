"""The share of the S x T scores a fused attention kernel runs, for its FLOPs (:mod:`shardc.ops.attention`).

A blockwise kernel skips the blocks its mask hides wholly (FlashAttention-2, Dao 2023: the causal kernel
skips the blocks above the diagonal, and its ``window_size`` those wholly before the sliding window), so a
causal call runs half of the S x T scores, counted as the area of the triangle (S^2 / 2, the count
FlashAttention's benchmarks use, not the S (S + 1) / 2 pairs).  With a sliding window of W keys (query s
sees keys s - W < t <= s, :func:`shardc.ops.masks.in_window`) it runs the band below the diagonal, counted
alike as an area: row s runs min(s, W) keys, so rows [lo, hi) run

    A(lo, hi) = integral from lo to hi of min(s, W) ds,

the whole band A(0, S) = S W - W^2 / 2 (S >= W), the causal half when W >= S.  The keys' positions run as
the queries' (self-attention, T = S), as the causal count takes them.  Where S is sharded the busiest device
sets the time: in n contiguous blocks the last (its rows see the most keys: ``A(S - S/n, S)`` of its
``S/n x S``, (2n - 1) / 2n with no window), in zig-zag chunks the device whose two chunks sum the most.

With sizes the shares are exact fractions; in formulas (sizes as symbols) the window's is written for the
long sequences a window is for: S >= W, and the busiest of n >= 2 devices past the first W positions (W / S).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from shardc.ir.localops import Attention
from shardc.ir.plan import Step

__all__ = ["busiest_share", "total_share", "band"]


def band(lo: Fraction, hi: Fraction, window: int) -> Fraction:
    """The area of the causal band of ``window`` keys over the rows [lo, hi): the integral of min(s, W).

    >>> band(Fraction(0), Fraction(8), 8), band(Fraction(0), Fraction(8), 2), band(Fraction(4), Fraction(8), 2)
    (Fraction(32, 1), Fraction(14, 1), Fraction(8, 1))
    """
    w = Fraction(window)
    below = (min(hi, w) ** 2 - min(lo, w) ** 2) / 2  # rows before W: each sees s keys
    return below + max(hi - max(lo, w), Fraction(0)) * w  # rows from W on: W each


def _devices(step: Step, size: Callable[[str], Any]) -> Any:
    """How many devices share the queries along S (their product of axis sizes)."""
    assert isinstance(step.fn, Attention) and step.fn.query is not None
    q = step.operands[0]
    return math.prod((size(a) for a in q.dims[q.indices.index(step.fn.query)].axes), start=1)


def _rows(length: Fraction, n: int, zigzag: bool) -> list[list[tuple[Fraction, Fraction]]]:
    """Each device's query rows along S: contiguous blocks, or zig-zag chunks i and 2n - 1 - i of 2n."""
    if not zigzag:
        block = length / n
        return [[(i * block, (i + 1) * block)] for i in range(n)]
    chunk = length / (2 * n)
    return [[(i * chunk, (i + 1) * chunk), ((2 * n - 1 - i) * chunk, (2 * n - i) * chunk)] for i in range(n)]


def busiest_share(step: Step, size: Callable[[str], Any]) -> tuple[Any, Any]:
    """The share of its S x T blocks the busiest device runs, as (numerator, denominator): all but causal;
    causal, a half with S whole, and with S in n contiguous blocks the last's, (2n - 1) / 2n (its queries
    see every key but half of its own block's: the all-gather form and a contiguous ring do not balance
    the load); in zig-zag chunks every device's is the average, a half.  With a sliding window, its band's
    rows on that device over its rows times S (the module's docstring)."""
    assert isinstance(step.fn, Attention)
    if step.fn.query is None:
        return 1, 1
    n = _devices(step, size)
    if step.fn.window is not None:
        return _windowed(step, size, n)
    if step.fn.zigzag:
        return 1, 2
    return 2 * n - 1, 2 * n  # (numerator, denominator): exact in a formula


def _windowed(step: Step, size: Callable[[str], Any], n: Any) -> tuple[Any, Any]:
    assert isinstance(step.fn, Attention) and step.fn.query is not None and step.fn.window is not None
    length, w = size(step.fn.query), step.fn.window
    if not isinstance(length, int) or not isinstance(n, int):  # a formula: S >= W, the busiest device past W
        return (2 * length * w - w * w, 2 * length * length) if n == 1 else (w, length)
    rows = _rows(Fraction(length), n, step.fn.zigzag)
    area = max(sum((band(lo, hi, w) for lo, hi in device), Fraction(0)) for device in rows)
    share = area / (Fraction(length, n) * length)
    return share.numerator, share.denominator


def total_share(step: Step, size: Callable[[str], Any]) -> tuple[Any, Any]:
    """The share of the S x T scores all the devices together run (hardware FLOPs): all, the causal half,
    or a sliding window's band over S^2 (S >= W in a formula)."""
    assert isinstance(step.fn, Attention)
    if step.fn.query is None:
        return 1, 1
    if step.fn.window is None:
        return 1, 2
    length, w = size(step.fn.query), step.fn.window
    if not isinstance(length, int):
        return 2 * length * w - w * w, 2 * length * length
    share = band(Fraction(0), Fraction(length), w) / (length * length)
    return share.numerator, share.denominator
