"""Runs of jaxpr equations that are one function of the spec language, found before the walk.

``jax.nn.softmax(x, axis)`` traces to ``exp(x - max(x)) / sum(exp(x - max(x)))`` (a reduce_max, its
broadcast back, a subtraction, an exp, a reduce_sum, its broadcast, a division); read equation by
equation it is a division of two arrays, which the language has no form for, but the whole run is
``softmax(X over I)``.  :func:`softmaxes` finds each such run whose inner values nothing else reads.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from jax.extend import core as jex

__all__ = ["Softmax", "softmaxes"]

_PASS = ("broadcast_in_dim", "stop_gradient", "max")  # what lies between the max and the subtraction


@dataclass(frozen=True)
class Softmax:
    """``out = softmax(source over axis)``, made by the equations ``run`` (the division last)."""

    source: Any
    axis: int
    run: tuple[Any, ...]


def _producers(jaxpr: Any) -> dict[Any, Any]:
    return {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}


def _uses(jaxpr: Any) -> Counter[Any]:
    uses: Counter[Any] = Counter(v for eqn in jaxpr.eqns for v in eqn.invars if not isinstance(v, jex.Literal))
    uses.update(v for v in jaxpr.outvars if not isinstance(v, jex.Literal))
    return uses


def _array(eqn: Any) -> Any:
    """The one non-literal operand of ``eqn`` (None if it has another count)."""
    arrays = [v for v in eqn.invars if not isinstance(v, jex.Literal)]
    return arrays[0] if len(arrays) == 1 else None


def _max_of(var: Any, made: dict[Any, Any], run: list[Any]) -> tuple[Any, int] | None:
    """(x, axis) where ``var`` is reduce_max(x, axis), through broadcasts, a stop_gradient, a max with -inf."""
    eqn = made.get(var)
    while eqn is not None and eqn.primitive.name in _PASS:
        run.append(eqn)
        eqn = made.get(_array(eqn))
    if eqn is None or eqn.primitive.name != "reduce_max" or len(eqn.params["axes"]) != 1:
        return None
    run.append(eqn)
    return eqn.invars[0], eqn.params["axes"][0]


def _match(div: Any, made: dict[Any, Any]) -> Softmax | None:
    num, den = div.invars
    run: list[Any] = []
    exp, bcast = made.get(num), made.get(den)
    if exp is None or exp.primitive.name != "exp" or bcast is None or bcast.primitive.name != "broadcast_in_dim":
        return None
    total = made.get(bcast.invars[0])
    if total is None or total.primitive.name != "reduce_sum" or total.invars[0] is not num:
        return None
    sub = made.get(exp.invars[0])
    if sub is None or sub.primitive.name != "sub":
        return None
    found = _max_of(sub.invars[1], made, run)
    if found is None or found[0] is not sub.invars[0] or (found[1],) != tuple(total.params["axes"]):
        return None
    return Softmax(sub.invars[0], found[1], (*run, sub, exp, total, bcast, div))


def softmaxes(jaxpr: Any) -> dict[Any, Softmax]:
    """Each softmax run of ``jaxpr`` by its division equation, where the run's inner values are read by
    the run alone (a value read elsewhere too keeps its equations, and the run is read equation by
    equation)."""
    made, uses = _producers(jaxpr), _uses(jaxpr)
    found: dict[Any, Softmax] = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "div" or len(eqn.invars) != 2:
            continue
        match = _match(eqn, made)
        if match is None:
            continue
        inner = [v for e in match.run[:-1] for v in e.outvars]
        reads = Counter(v for e in match.run for v in e.invars if not isinstance(v, jex.Literal))
        if all(uses[v] == reads[v] for v in inner):
            found[eqn] = match
    return found
