"""Fitting microbenchmark times to the cost model's figures (numpy only, no jax).

A collective of V bytes is timed at several sizes and fitted to ``t = a + V / B``
(least squares over the sizes, as NCCL's and the book's alpha-beta model write it):
``a`` is its latency, ``B`` its bandwidth.  The chip file does not store ``B``
directly: it stores the link figure that makes shardc's own collective model
(:func:`shardc.collectives.collective_time`) predict the measured slope, so the
model's conventions (bidirectional rings on a torus, NVLink egress on a GPU) hold
for a calibrated chip exactly as for a preset.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Line", "fit_line", "efficiency_points", "median"]


@dataclass(frozen=True)
class Line:
    """``seconds = latency_s + bytes * seconds_per_byte``, fitted; ``points`` the measurements."""

    latency_s: float
    seconds_per_byte: float
    points: tuple[tuple[float, float], ...]  # (bytes, seconds)

    @property
    def bandwidth(self) -> float:
        """Bytes a second the slope gives (inf: no measurable slope)."""
        return math.inf if self.seconds_per_byte <= 0 else 1.0 / self.seconds_per_byte

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes * self.seconds_per_byte


def fit_line(points: Sequence[tuple[float, float]]) -> Line:
    """Least squares of ``t = a + b V`` over (V bytes, t seconds), with ``a, b >= 0``.

    Each point is weighted by 1/t, so a small message's microseconds count as much as a
    large one's milliseconds (relative error, as nccl-tests reports).  A negative
    intercept (noise at small sizes) is clamped to 0 and the slope refitted through
    the origin; a negative slope (no size dependence seen) likewise gives ``b = 0``.
    """
    if len(points) < 2:
        raise ValueError("a line needs two points or more")
    v = np.array([p[0] for p in points], dtype=np.float64)
    t = np.array([p[1] for p in points], dtype=np.float64)
    if not (np.all(np.isfinite(t)) and np.all(t > 0) and np.all(v >= 0)):
        raise ValueError("times must be positive and sizes non-negative")
    w = 1.0 / t
    design = np.stack([np.ones_like(v), v], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    if a < 0:
        a, b = 0.0, float(np.sum(w * w * v * t) / np.sum(w * w * v * v))
    if b < 0:
        a, b = float(np.sum(w * w * t) / np.sum(w * w)), 0.0
    return Line(float(a), float(b), tuple((float(x), float(y)) for x, y in zip(v, t, strict=True)))


def efficiency_points(rates: Sequence[tuple[float, float]], peak: float) -> tuple[tuple[float, float], ...]:
    """(FLOPs of one matmul, fraction of ``peak``) from measured (FLOPs, FLOP/s), by FLOPs.

    A fraction is capped at 1: a measurement above the data sheet's peak is timer noise
    (or a peak written too low), never a reason to predict faster than peak.
    """
    if peak <= 0:
        raise ValueError("peak must be positive")
    return tuple(sorted((float(f), min(1.0, float(r) / peak)) for f, r in rates))


def median(values: Sequence[float]) -> float:
    """The median (the middle of an odd count, the mean of the two middles of an even one)."""
    if not values:
        raise ValueError("no values")
    return float(np.median(np.array(values, dtype=np.float64)))
