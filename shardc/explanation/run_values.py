"""Whether a run of maps is the function of the language explain names it: its values, on sample points.

A run of elementwise ops over one array is read as one of the language's maps named by its primitives
(:func:`shardc.explanation.patterns.function_of`), ``identity`` where none fits.  That name is the spec's
meaning only where the run computes it: ``tanh(x) ** 2`` is not ``tanh``, nor ``log(x)`` ``identity``.  So
the run's own equations are evaluated, in order, on sample points (primitives bind on any shape), and
compared with the named map's reference forward (:data:`shardc.ops.elementwise.FUNCTIONS`), within the
rounding of the run's type (a bf16 GELU's constants are bf16's), at the points where the named map is
defined (``log``'s x > 0, :data:`shardc.spec.functions.DOMAINS`: a NaN equals nothing, so its own NaNs
would refuse it).  A run that moves elements along a dim (a
flip, rotary's ``rotate_half``) or reads a constant array (a ``where`` at a mask other than causal, rotary's
cos and sin tables) is no map of one element: it differs whatever its primitives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from jax import numpy as jnp
from jax.extend import core as jex

from shardc.explanation.fresh import CALLS
from shardc.explanation.numpy_prims import evaluate
from shardc.explanation.patterns import function_of
from shardc.ops.elementwise import function
from shardc.spec.functions import DOMAINS, signature

__all__ = ["bound", "differs"]

# what a run reads positionally, by the primitives that bring it there (slices.py): no map of one element
_MOVES = {"rev": "a flip (jnp.flip), moving elements along a dim,", "concatenate": "parts of a dim put back "
          "together in another order (rotary's rotate_half; read as the language's `rotary(X, T)` only where the "
          "run is x * cos + rotate_half(x) * sin at the angles t * theta^(-2i/H) of positions 0, 1, ... along one "
          "dim), moving elements along it,",
          "slice": "a slice, moving elements along a dim,", "split": "a split, moving elements along a dim,"}
_POINTS = np.linspace(-3.0, 3.0, 25, dtype=np.float32)  # where the run and the named map are compared




class _ConstantArray(Exception):
    """A step reads a constant that is not one scalar (a mask, a table)."""


def differs(reader: Any, steps: list[tuple[Any, frozenset[str]]], source: Any, ops: frozenset[str],
            name: str) -> tuple[str, str] | None:
    """(what, how it differs) between the run of ``steps`` (reading ``source``; ``ops`` all its primitives) and
    the language's ``name``; None where the run computes ``name`` at the sample points."""
    read = f"read as `{name}(...)` the spec's values would differ from the program's"
    moved = [why for op, why in _MOVES.items() if op in ops]
    if moved:
        return moved[0], f"is no map of the language: {read}"
    points = _points(name)
    try:
        got = _evaluate(reader, steps, source, points)
    except _ConstantArray as err:
        return (f"a run of maps reading a constant array (`{err}`: a mask other than causal, a table of positions)",
                f"is no map of the language: {read}")
    except (KeyError, ValueError, TypeError) as err:  # a primitive no run of maps is made of
        return f"the run of maps ({', '.join(sorted(ops))})", f"could not be evaluated ({type(err).__name__}): {read}"
    want = function(name).forward(points, np)
    out = steps[-1][0].outvars[0] if steps else source
    dtype = out.aval.dtype if jnp.issubdtype(out.aval.dtype, jnp.floating) else jnp.float32
    tolerance = max(1e-3, 4 * float(jnp.finfo(dtype).eps))
    far = ~np.isclose(got, want, rtol=tolerance, atol=tolerance)
    if not far.any():
        return None
    k = int(np.argmax(far))
    return (f"the run of maps ({', '.join(sorted(ops))})",
            f"is not the language's `{name}`: {read} (at {float(points[k]):g}: {float(want[k]):.4g}, the "
            f"program's {float(got[k]):.4g})")


def _points(name: str) -> np.ndarray:
    """The sample points (float64) in the domain of the language's ``name``."""
    domain = signature(name).domain
    points = _POINTS.astype(np.float64)
    return points[DOMAINS[domain][1](points)] if domain else points


def _evaluate(reader: Any, steps: list[tuple[Any, frozenset[str]]], source: Any, points: np.ndarray) -> np.ndarray:
    """The run's value at the sample ``points``: each step bound on them, in order; a custom function (relu) its
    named map's."""
    values: dict[Any, Any] = {source: points}
    with np.errstate(all="ignore"):  # a log of 0, a square root of -3: the program's own nan or inf
        return _run(reader, steps, values, source)


def _run(reader: Any, steps: list[tuple[Any, frozenset[str]]], values: dict[Any, Any], source: Any) -> np.ndarray:
    for eqn, names in steps:
        call = reader.customs.get(eqn.outvars[0])
        if not isinstance(eqn, jex.JaxprEqn) and call is not None:  # a custom function of one array: its body
            values[eqn.outvars[0]] = _body(reader, call, values[eqn.invars[0]], values)
            continue
        if not isinstance(eqn, jex.JaxprEqn):  # a custom function of one array, read as its named map
            values[eqn.outvars[0]] = function(function_of(names)).forward(values[eqn.invars[0]], np)
            continue
        inputs = [_input(reader, v, values) for v in eqn.invars]
        values[eqn.outvars[0]] = evaluate(eqn, inputs)
    return np.asarray(values[steps[-1][0].outvars[0] if steps else source], np.float64)


def _body(reader: Any, call: Any, x: np.ndarray, values: dict[Any, Any]) -> np.ndarray:
    """A custom function's value at the sample points ``x`` (its one array's): its body's equations, bound in numpy,
    not the map its primitives name (softplus, jnp.logaddexp(x, 0), has exp's primitives and is not exp)."""
    inputs = [x if v.aval.shape else _input(reader, v, values) for v in call.invars]
    return np.asarray(bound(call.params.get("call_jaxpr") or call.params.get("fun_jaxpr"), inputs)[0])


def bound(closed: Any, inputs: list[Any], prim: Callable[[Any, list[Any]], Any] = evaluate) -> list[Any]:
    """A (closed) jaxpr's results, its inputs' values given: each equation in numpy (``prim``: a map's, a mask's
    primitives; a test's oracle binds sums too), a call's body inside."""
    jaxpr = getattr(closed, "jaxpr", closed)
    env = dict(zip(jaxpr.constvars, map(np.asarray, getattr(closed, "consts", ())), strict=True))
    env.update(zip(jaxpr.invars, inputs, strict=True))
    for eqn in jaxpr.eqns:
        xs = [np.asarray(v.val) if isinstance(v, jex.Literal) else env[v] for v in eqn.invars]
        inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
        outs = bound(inner, xs, prim) if eqn.primitive.name in CALLS and inner is not None else [prim(eqn, xs)]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [np.asarray(v.val) if isinstance(v, jex.Literal) else env[v] for v in jaxpr.outvars]


def _input(reader: Any, var: Any, values: dict[Any, Any]) -> Any:
    """A step's operand at the sample points: the run's own value, or a scalar constant (each the same)."""
    wide = np.float64 if jnp.issubdtype(var.aval.dtype, jnp.floating) else var.aval.dtype  # bf16's kind is not "f"
    if isinstance(var, jex.Literal):
        return np.asarray(var.val).astype(wide)
    base = reader.base(var)
    if base in values:
        return values[base]
    value = reader.constants.value(reader, var)
    if value is None or value.size == 0 or not np.all(value == value.flat[0]):
        raise _ConstantArray(str(var.aval.str_short()))
    return np.asarray(value.flat[0]).astype(wide)
