"""A map's constant scales and shifts (``x * 0.5``, ``s / sqrt(d)``, ``x + 1e-6``, ``1 - x``): written, or refused.

``tanh(x * 0.5)`` is not ``tanh(x)`` (nor ``softmax(s / 8)`` ``softmax(s)``).  A run of elementwise ops over
one array is one function of the language named by its primitives
(:func:`shardc.explanation.patterns.function_of`), which says nothing of their order, so a scale or a shift by
a scalar inside it would vanish from the spec's values.  Each one is kept with the run it is in, with the
run's equations in order.  Where it is the run's first op, the rest reading the array only through it, or
its last, and the program knows the scalar (a literal, or one it makes of literals: flax's
``1 / sqrt(head dim)``), it is written apart as the language's ``scale(X, a)`` or ``shift(X, b)``
(:func:`write_run`): ``tanh(scale(x, 0.5))``, ``scale(relu(x), 3.0)`` (``x / c`` a scale by 1 / c, ``x - c``
a shift by -c, ``c - x`` a shift of a scale by -1, ``c / x`` a scale of its reciprocal by c).  The rest of the
run must be a function whose own definition holds its constants (the tanh GELU's
``0.5 * x * (1 + tanh(0.797 * (x + 0.0447 * x**3)))``); any other (a constant inside the run,
``exp(tanh(x) * 0.5)``) is refused with its equation and source line.
What explain reads as part of a function of the language elsewhere (a mean's division by the count, a norm's
``+ eps``, a softmax's parts) never reaches this rule: those runs are read whole before the walk.
"""

from __future__ import annotations

import linecache
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from jax import numpy as jnp
from jax.extend import core as jex

from shardc.errors import ShardcError, Span
from shardc.explanation.patterns import PRIMITIVE_MAPS, function_of
from shardc.explanation.rotary_runs import rewrite, rotation
from shardc.explanation.run_values import differs
from shardc.explanation.sources import equation_text, source_line
from shardc.explanation.spec_text import Made
from shardc.ops.reductions import LN_EPS, RMS_EPS
from shardc.spec.functions import ELEMENTWISE

__all__ = ["Constant", "checked", "norm_of", "record", "scaled", "write_run"]

# an equation of a run and its primitives' names there (``scaled``: "scale" for x * c); a custom function of
# one array (relu, gelu: a run of its own, ``unary_call``) is one step, a stand-in of its result and argument
Step = tuple[Any, frozenset[str]]

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
    if (name == "integer_pow" and eqn.params.get("y") == -1) or _numerator(reader, eqn) is not None:
        name = "reciprocal"  # jnp.reciprocal(x), c / x: the language's map, times c (written apart: _apply)
    if name in _ARITHMETIC and scalars and arrays:
        first = eqn.invars[0] is scalars[0]  # c - x, c / x
        what = {"sub": "a subtraction from", "div": "a division of"}.get(name, _ARITHMETIC[name]) if first \
            else _ARITHMETIC[name]
        value = _value(scalars[0])
        found.append(Constant(f"{what} {'a scalar' if math.isnan(value) else f'{value:g}'}", equation_text(eqn),
                              line, value, _rounding(scalars[0]), id(eqn)))
    if found:
        reader.scalars[eqn.outvars[0]] = tuple(dict.fromkeys(found))
    name = "scale" if name == "mul" and len(arrays) < len(eqn.invars) else name
    record(reader, eqn, name, arrays)
    return name


def _numerator(reader: Any, eqn: Any) -> float | None:
    """``c`` where ``eqn`` is ``c / x`` by a finite scalar the program knows (a literal, or one it makes of
    literals), ``reciprocal(x)`` times ``c``; None otherwise."""
    scalars = _scalars(reader, eqn)
    if eqn.primitive.name != "div" or not scalars or eqn.invars[0] is not scalars[0]:
        return None
    number = _number(reader, eqn.invars[0])
    return number if number is not None and math.isfinite(number) else None


def record(reader: Any, eqn: Any, name: str, arrays: list[Any]) -> None:
    """Keep ``eqn`` with the run its results are in: the equations of its arrays' runs, then itself (in order); a
    slice's and a concatenation's too (rotate-half's, :mod:`shardc.explanation.rotary_runs` evaluates them)."""
    steps: dict[int, Step] = {}
    for a in map(reader.base, arrays):
        if a in reader.region and a not in reader.runs and reader.region[a][0] is not a:  # a custom function
            steps[id(a)] = (SimpleNamespace(outvars=[a], invars=[reader.region[a][0]]), reader.region[a][1])
        steps.update((id(e), (e, n)) for e, n in reader.runs.get(a, ()))
    steps[id(eqn)] = (eqn, frozenset({name}))
    for out in eqn.outvars:
        reader.runs[out] = tuple(steps.values())


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
                        f"`{function}(...)` the spec's values would differ from the program's (the language's "
                        "scale(X, a) and shift(X, b) write a constant the program knows at a run of maps' start or "
                        "end, not inside it; its functions are named maps)", first.line,
                "apply the constant first or last in the run of maps, fold it into an input (scale a weight, or the "
                "data, before the program), or write the .shard spec of the program")
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


def _number(reader: Any, var: Any) -> float | None:
    """A scalar's value where the program makes it of literals alone; None otherwise."""
    value = reader.constants.value(reader, var)
    return float(value.flat[0]) if value is not None and value.size == 1 else None


def _affine(reader: Any, step: Step) -> tuple[Any, float, float] | None:
    """(the array, scale, shift) where the step is ``x * a``, ``x / a``, ``x + b``, ``x - b`` or ``b - x`` of one
    array by a known scalar; None otherwise."""
    eqn, names = step
    if names not in ({"scale"}, {"div"}, {"add"}, {"sub"}) or len(eqn.invars) != 2:
        return None
    (name,) = names
    arrays = [v for v in eqn.invars if not isinstance(v, jex.Literal) and v.aval.shape == eqn.outvars[0].aval.shape
              and not reader.is_constant(v)]
    if len(arrays) != 1:
        return None
    first = eqn.invars[0] is arrays[0]
    number = _number(reader, eqn.invars[1] if first else eqn.invars[0])
    if number is None or not math.isfinite(number) or (name == "div" and (not first or number == 0)):
        return None
    scale, shift = {"scale": (number, 0.0), "div": (1.0 / number, 0.0), "add": (1.0, number),
                    "sub": (1.0, -number) if first else (-1.0, number)}[name]
    return arrays[0], scale, shift


def _peel(reader: Any, steps: list[Step], source: Any, out: Any) -> tuple[list[Step], list[Step]]:
    """(the leading affine steps, the trailing ones), each taken off ``steps`` where the run reads its array only
    through it (leading) or it makes the run's result of the rest's (trailing)."""
    lead: list[Step] = []
    while steps:
        readers = [s for s in steps if any(not isinstance(v, jex.Literal) and reader.base(v) is source
                                            for v in s[0].invars)]
        found = _affine(reader, readers[0]) if len(readers) == 1 else None
        if found is None or reader.base(found[0]) is not source:
            break
        lead.append(readers[0])
        steps.remove(readers[0])
        source = readers[0][0].outvars[0]
    trail: list[Step] = []
    while steps and steps[-1][0].outvars[0] is out:
        found = _operand(reader, steps[-1])
        # a run's last step maps what an earlier one makes; c / x (a reciprocal and a scale) may be its only step
        if found is None or reader.base(found) not in {id_(s) for s in steps[:-1]} and (
                len(steps) > 1 or _numerator(reader, steps[-1][0]) in (None, 1.0)):
            break
        trail.insert(0, steps.pop())
        out = reader.base(found)
    return lead, trail


def _named(step: Step) -> str | None:
    """The language's map a step of one primitive is (``tanh(x) ** 2``'s square); None otherwise."""
    eqn, names = step
    if len(names) != 1 or not isinstance(eqn, jex.JaxprEqn):
        return None
    (name,) = names
    return "square" if name == "integer_pow" and eqn.params.get("y") == 2 else PRIMITIVE_MAPS.get(name)


def _operand(reader: Any, step: Step) -> Any:
    """The array a trailing step maps: a scale's or shift's, or a named map's one operand; None otherwise."""
    found = _affine(reader, step)
    if found is not None:
        return found[0]
    arrays = [v for v in step[0].invars if not isinstance(v, jex.Literal)]
    return arrays[0] if _named(step) is not None and len(arrays) == 1 else None


def id_(step: Step) -> Any:
    """The variable a step makes."""
    return step[0].outvars[0]


def _apply(reader: Any, step: Step, operand: Any, line: str) -> Any:
    """The statements of one affine step on the tensor ``operand``: a scale, a shift, or both (``b - x``)."""
    out = id_(step)
    named = _named(step)
    times = _numerator(reader, step[0]) if named == "reciprocal" else None
    if times is not None and times != 1.0:  # c / x: reciprocal(x), then its scale by c
        made = Made()
        reader.dims[made] = reader.dims_of(out)
        reader.make(made, "fn", (operand,), fn=named, line=line)
        reader.make(out, "fn", (made,), fn="scale", value=times, line=line)
        reader.region.pop(out, None)
        return out
    if named is not None:
        reader.make(out, "fn", (operand,), fn=named, line=line)
        reader.region.pop(out, None)
        return out
    _, scale, shift = _affine(reader, step) or (None, 1.0, 0.0)
    if scale != 1.0 and shift != 0.0:
        made = Made()
        reader.dims[made] = reader.dims_of(out)
        reader.make(made, "fn", (operand,), fn="scale", value=scale, line=line)
        operand = made
    reader.make(out, "fn", (operand,), fn="shift" if shift != 0.0 else "scale",
                value=shift if shift != 0.0 else scale, line=line)
    reader.region.pop(out, None)
    return out


def _function(reader: Any, steps: list[Step], start: Any, rest: Any, operand: Any, ops: frozenset[str],
              line: str) -> None:
    """``rest`` as the language's map of ``operand`` the run's primitives name, checked at sample points; else the
    error (under ``approximate`` a note), with how to rewrite a rotary embedding the language would say otherwise."""
    function = checked(reader, rest, function_of(ops))
    wrong = differs(reader, steps, start, ops, function)
    if wrong:
        _refuse(reader, f"{wrong[0]}{f' at {line}' if line else ''} {wrong[1]}", line,
                rewrite(reader, steps, start)
                or f"write the run as the language's maps ({', '.join(sorted(ELEMENTWISE))}; a scale or shift "
                "first or last), or write the .shard spec of the program")
    reader.make(rest, "fn", (operand,), fn=function, line=line)


def write_run(reader: Any, var: Any, source: Any, ops: frozenset[str], line: str) -> None:
    """The statements making ``var``, the run of maps of ``source``: its leading and trailing scales and
    shifts written apart, the rest one function (:func:`~shardc.explanation.constants.checked`)."""
    steps = list(reader.runs.get(var, ()))
    if not steps and reader.base(source) is not var:  # a custom function of one array alone (relu)
        steps = [(SimpleNamespace(outvars=[var], invars=[reader.base(source)]), ops)]
    lead, trail = _peel(reader, steps, reader.base(source), var)
    operand = reader.tensor(source)
    for step in lead:
        operand = _apply(reader, step, operand, line)
    if steps or not (lead or trail):
        peeled = {id(s[0]) for s in lead + trail}
        rest = reader.base(_operand(reader, trail[0])) if trail else var
        reader.scalars[rest] = tuple(c for c in reader.scalars.get(var, ()) if c.at not in peeled)
        rest_ops = frozenset().union(*(n for _, n in steps)) if lead or trail else ops
        start = id_(lead[-1]) if lead else reader.base(source)
        rotated = rotation(reader, steps, start, operand)
        if rotated is not None:  # x * cos + rotate_half(x) * sin: the language's rotary
            reader.make(rest, "rotary", (operand,), names=(rotated[0],), value=rotated[1], line=line)
        else:
            _function(reader, steps, start, rest, operand, rest_ops, line)
        reader.region.pop(rest, None)
        operand = rest
    for step in trail:
        operand = _apply(reader, step, operand, line)
