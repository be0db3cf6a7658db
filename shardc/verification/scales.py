"""Per-input scales at which every op of a spec matters, for ``shardc verify``.

A check passes a wrong program only where the wrong part barely moves the value.
Inputs at one common scale make that common: a norm of tiny values divides by
``sqrt(eps)`` rather than by its statistic (an error in the statistic, or in the
AllReduce computing it, vanishes), a softmax of large scores is one-hot, a
residual sum of terms of unequal size hides the smaller one.  So each input gets
its own scale, set in the reference's order of operations, the way weight
initialisation keeps activations at unit size (Glorot and Bengio 2010): the
argument of each nonlinear function (an activation, a norm, a softmax, a
logsumexp, a loss) is brought to unit root mean square, and each term of a sum
to the size of the sum's first term, by rescaling an input that only this and
later operations read.  Inputs already used to set an earlier operation stay put.
"""

from __future__ import annotations

import math

import numpy as np

from shardc.ir.spec import Spec
from shardc.lowering import reference

__all__ = ["input_scales"]

_TRIES = 4  # rescalings per target: one is exact where the value is linear in the input
_CLOSE = 1.1  # a root mean square within this factor of its target is left alone


# a sum's later terms at half its first term's size: both matter, and no element of a difference
# cancels to nothing (two scalars of one size would, leaving only rounding to compare)
_TERM = 0.5
_REACH = 2.0**20  # the furthest an input is rescaled from its common scale


def _rms(x: np.ndarray) -> float:
    finite = np.asarray(x)[np.isfinite(x)]  # a causal mask's -inf is no term
    return float(np.sqrt(np.mean(np.square(finite)))) if finite.size else 0.0


def _targets(node: reference._Node) -> list[tuple[str, str | None]]:
    """(operand, the operand whose size it should match; None: unit size) for one node."""
    if node.fn is not None and node.family.reference.nonlinear(node.fn):  # its family says so
        return [(node.operands[0], None)]
    if node.signs and len(node.operands) > 1:  # a sum of terms
        return [(o, node.operands[0]) for o in node.operands[1:]]
    return []


def input_scales(spec: Spec, inputs: dict[str, np.ndarray], ids: set[str],
                 sizes: dict[str, int] | None = None) -> dict[str, float]:
    """A scale per float input (``inputs`` as the reference reads them, in float64) at which every
    nonlinear operation sees unit-size arguments and every sum's terms are of one size."""
    nodes = reference._nodes(spec)
    scales = {n: 1.0 for n in inputs if n not in ids}
    upstream: dict[str, set[str]] = {n: {n} for n in inputs}  # the unscaled ones too: a sum's first term
    for node in nodes:
        upstream[node.result] = set().union(*(upstream.get(o, set()) for o in node.operands))
    fixed: set[str] = set()
    for k, node in enumerate(nodes):
        for operand, like in _targets(node):
            free = [n for n in scales if n in upstream[operand] and n not in fixed]
            if free:
                _calibrate(nodes[:k], inputs, scales, free[-1], operand, like, sizes)
            fixed |= upstream[operand] | (upstream[like] if like else set())
        if node.signs:  # a sum
            fixed |= upstream[node.result]  # its first term sets the size of the others
    return scales


def _calibrate(nodes: list[reference._Node], inputs: dict[str, np.ndarray], scales: dict[str, float],
               leaf: str, operand: str, like: str | None, sizes: dict[str, int] | None) -> None:
    """Rescale ``leaf`` until ``operand`` has unit root mean square (or half that of ``like``); a leaf
    that does not move it (a norm in between) keeps its scale."""
    start, before = scales[leaf], math.nan
    for _ in range(_TRIES):
        scaled = {n: v * scales.get(n, 1.0) for n, v in inputs.items()}
        with np.errstate(all="ignore"):
            values, _ = reference._run(nodes, scaled, np, None, sizes)
        got, want = _rms(values[operand]), (_TERM * _rms(values[like]) if like else 1.0)
        if not (got > 0 and want > 0 and math.isfinite(got) and math.isfinite(want)):
            scales[leaf] = start
            return
        if abs(math.log(want / got)) < math.log(_CLOSE):
            return
        if abs(got - before) <= 1e-3 * got:  # the last rescaling did not move it
            scales[leaf] = start
            return
        before = got
        scales[leaf] *= want / got
        if not _REACH ** -1 <= scales[leaf] / start <= _REACH:  # a leaf this far off barely moves it: as is
            scales[leaf] = start
            return
