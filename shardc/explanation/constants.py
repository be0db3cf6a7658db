"""A map's constant scales and shifts (``x * 0.5``, ``s / sqrt(d)``, ``x + 1e-6``, ``1 - x``): read, or refused.

The spec language has no constant: a function of it is one of its named maps, and ``tanh(x * 0.5)``
is not ``tanh(x)`` (nor ``softmax(s / 8)`` ``softmax(s)``).  A run of elementwise ops over one array is
one function of the language named by its primitives (:func:`shardc.explanation.patterns.function_of`),
so a scale or a shift by a scalar inside it would vanish from the spec's values.  Each one is kept
with the run it is in, and where the run becomes a function, the function must be one whose own
definition holds those constants (the tanh GELU's ``0.5 * x * (1 + tanh(0.797 * (x + 0.0447 * x**3)))``);
any other is refused with the constant's equation and source line.  What explain reads as part of a
function of the language elsewhere (a mean's division by the count, a norm's ``+ eps``, a softmax's
parts) never reaches this rule: those runs are read whole before the walk.
"""

from __future__ import annotations

import linecache
import math
from dataclasses import dataclass
from typing import Any

from jax import numpy as jnp
from jax.extend import core as jex

from shardc.errors import ShardcError, Span
from shardc.explanation.sources import equation_text, source_line
from shardc.ops.reductions import LN_EPS, RMS_EPS

__all__ = ["Constant", "checked", "norm_of", "scaled"]

_ARITHMETIC = {"mul": "a scale by", "div": "a division by", "add": "an addition of", "sub": "a subtraction of"}
# the functions of the language whose definition holds scalar constants, and those constants: the tanh form of
# GELU, jax.nn.gelu's default (shardc/ops/elementwise.py writes it with these 0.5, 1, 0.044715 and sqrt(2 / pi));
# its erf form (approximate=False) has others, and is not the language's gelu
_HOLDS_CONSTANTS = {"gelu": (0.044715, 0.5, 0.7978845608028654, 1.0)}
_EPS = {"rmsnorm": RMS_EPS, "layernorm": LN_EPS}  # the epsilon each norm of the language adds (ops/reductions.py)


@dataclass(frozen=True)
class Constant:
    """A scalar constant an elementwise equation applies: what it does, the equation, its source line."""

    what: str
    equation: str
    line: str
    value: float  # nan where the program computes it (jnp.sqrt(8.0))
    tolerance: float  # the relative rounding of its type (bf16 holds 0.044715 as 0.0446777)
    at: int  # the equation's id: two alike are two constants


def _scalars(reader: Any, eqn: Any) -> list[Any]:
    """The operands of ``eqn`` that are scalars: a literal, a 0-d value the program makes of literals, or one
    broadcast (a constant of no map)."""
    return [v for v in eqn.invars if isinstance(v, jex.Literal) or not v.aval.shape
            or (reader.is_constant(v) and not reader.region[reader.base(v)][1])]


def _value(var: Any) -> float:
    return float(var.val) if isinstance(var, jex.Literal) and not getattr(var.val, "shape", ()) else math.nan


def _rounding(var: Any) -> float:
    """The relative rounding of a constant's type: at least 1e-6, an integer's that too."""
    dtype = var.aval.dtype
    return max(1e-6, float(jnp.finfo(dtype).eps)) if jnp.issubdtype(dtype, jnp.floating) else 1e-6


def scaled(reader: Any, eqn: Any, name: str, arrays: list[Any], line: str) -> str:
    """The name a run of maps keeps for ``eqn`` (a product with a constant is ``scale``, not a square),
    its scalar constant, if it applies one, kept with the run its result ``eqn.outvars[0]`` is in."""
    found = [c for a in arrays for c in reader.scalars.get(reader.base(a), ())]
    scalars = _scalars(reader, eqn)
    if name in _ARITHMETIC and scalars and arrays:
        what = "a subtraction from" if name == "sub" and eqn.invars[0] is scalars[0] else _ARITHMETIC[name]
        value = _value(scalars[0])
        found.append(Constant(f"{what} {'a scalar' if math.isnan(value) else f'{value:g}'}", equation_text(eqn),
                              line, value, _rounding(scalars[0]), id(eqn)))
    if found:
        reader.scalars[eqn.outvars[0]] = tuple(dict.fromkeys(found))
    return "scale" if name == "mul" and len(arrays) < len(eqn.invars) else name


def checked(reader: Any, var: Any, function: str) -> str:
    """``function``, the language's function for the run making ``var``, where it says every constant of the
    run; else the error naming the first constant it would drop."""
    kept = reader.scalars.get(var, ())
    left, extra = list(_HOLDS_CONSTANTS.get(function, ())), []
    for c in kept:  # each of the function's own constants matches one of the run's
        match = next((a for a in left if math.isclose(c.value, a, rel_tol=c.tolerance)), None)
        left.remove(match) if match is not None else extra.append(c)
    if extra or (kept and left):
        first = (extra or list(kept))[0]
        where = f" at {first.line}" if first.line else ""
        _refuse(reader, f"{first.what} (`{first.equation}`){where} is not in the spec language: read as "
                        f"`{function}(...)` the spec's values would differ from the program's (the language has no "
                        "constant scale or shift; its functions are named maps)", first.line,
                "fold the constant into an input (scale a weight, or the data, before the program), or write the "
                ".shard spec of the program without it")
    return function


def _refuse(reader: Any, message: str, line: str, fix: str) -> None:
    """The error, or under ``approximate`` a note of the spec (read for its shardings and collectives alone)."""
    if not reader.approximate:
        raise ShardcError(message, _span(line), fix=f"{fix}; or explain it with --approximate (approximate=True), "
                                                      "its spec then for shardings and collectives alone")
    reader.notes.append(f"approximate: {message}")


def norm_of(reader: Any, run: Any) -> str:
    """The function of a norm's run (``run.function``) where the epsilon it adds is the language's norm's;
    else the error naming it (``x * rsqrt(mean(x**2) + 1e-5)`` is not the language's rmsnorm, whose is 1e-6)."""
    eps = _EPS.get(run.function, 0.0)
    for eqn in run.run if run.function in _EPS else ():
        added = [v for v in eqn.invars if isinstance(v, jex.Literal)] if eqn.primitive.name == "add" else []
        if added and not math.isclose(float(added[0].val), eps, rel_tol=1e-6):
            line = source_line(eqn) or reader.caller
            _refuse(reader, f"the epsilon {float(added[0].val):g} of a {run.function} (`{equation_text(eqn)}`)"
                            + (f" at {line}" if line else "") + f" is not the language's: its {run.function} adds "
                            f"{eps:g}, and read as it the spec's values would differ from the program's", line,
                    f"use {eps:g} as the {run.function}'s epsilon, or write the .shard spec of the program")
    return str(run.function)


def _span(line: str) -> Span | None:
    """The span of a ``file:line`` source line, the whole line marked."""
    path, _, number = line.rpartition(":")
    if not number.isdigit():
        return None
    text = linecache.getline(path, int(number)).rstrip("\n")
    start = len(text) - len(text.lstrip())
    return Span(int(number), start + 1, max(1, len(text) - start), path, text) if text else None
