"""What a verify row must be able to catch, for the unpipelined and the pipelined verifier alike.

A row passes within a bound; a bound that would also pass an error of ``POWER`` (5%) of the
value proves nothing about a wrong plan, so such a row (:func:`weak`) is checked again in
float32 against the unsharded program's own error (:func:`differential`), and fails
(:func:`failed`) if it is still that loose.  A spec with dropout runs under each of
:data:`DROPOUT_KEYS`: a lowering that ignores the key draws the first key's masks under the
second, and fails there.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from shardc.verification.report import POWER, ValueRow

__all__ = ["DROPOUT_KEYS", "DIFFERENTIAL", "phase", "weak", "failed", "differential"]

DROPOUT_KEYS = (0, 1)  # a lowering that ignores the key draws key 0's masks under key 1, and fails
# a right plan only reorders sums: its float32 error is of the unsharded program's order, this many times it
DIFFERENTIAL = 16.0


def phase(name: str, key: int) -> str:
    """A row's phase: under a dropout key other than 0 the key is named."""
    return name if key == 0 else f"{name} key {key}"


def weak(row: ValueRow) -> bool:
    """A passing row whose bound would also pass an error of ``POWER`` times the value."""
    return row.ok and row.max_reference > 0 and row.tolerance > POWER * row.max_reference


def failed(row: ValueRow) -> ValueRow:
    return replace(row, ok=False, note=f"the bound would pass an error of {POWER:.0%} of the value: not compared")


def differential(phase: str, name: str, got: Any, ref: np.ndarray, plain: Any) -> ValueRow:
    """A float32 value against the float64 reference, bounded by ``DIFFERENTIAL`` times the unsharded
    float32 program's (``plain``) own error plus 64 float32 roundings of the value."""
    finite = ~np.isneginf(ref)
    value = np.where(finite, np.asarray(got).astype(np.float64), 0.0)
    unsharded = np.where(finite, np.asarray(plain).astype(np.float64), 0.0)
    ref = np.where(finite, ref, 0.0)
    if value.shape != ref.shape or not np.all(np.isfinite(value)):
        return ValueRow(phase, name, math.nan, 0.0, math.nan, False, "shape or NaN: not compared")
    peak = float(np.max(np.abs(ref))) if ref.size else 0.0
    own = float(np.max(np.abs(unsharded - ref))) if ref.size else 0.0
    bound = DIFFERENTIAL * own + 64 * float(np.finfo(np.float32).eps) * peak + 1e-30
    err = float(np.max(np.abs(value - ref))) if ref.size else 0.0
    return ValueRow(phase, name, err, peak, bound, err <= bound)
