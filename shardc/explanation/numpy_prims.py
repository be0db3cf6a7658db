"""The few jax primitives explain evaluates itself, in numpy: a run of maps at sample points
(:mod:`shardc.explanation.run_values`) and a mask made of positions (:mod:`shardc.explanation.causal_masks`).

Explain reads a program and never runs its ops: binding a primitive eagerly would compile it with XLA, once per
primitive and shape, which is slow and is not what reading a program should cost.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["ELEMENTWISE", "STRUCTURAL", "evaluate"]

ELEMENTWISE: dict[str, Callable[..., Any]] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "neg": np.negative, "max": np.maximum,
    "min": np.minimum, "exp": np.exp, "log": np.log, "tanh": np.tanh, "logistic": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "sqrt": np.sqrt, "rsqrt": lambda x: 1.0 / np.sqrt(x), "abs": np.abs, "sin": np.sin, "cos": np.cos,
    "square": np.square, "pow": np.power, "sign": np.sign, "log1p": np.log1p, "expm1": np.expm1, "cbrt": np.cbrt,
    "erf": np.vectorize(math.erf), "ge": np.greater_equal, "gt": np.greater, "le": np.less_equal, "lt": np.less,
    "eq": np.equal, "ne": np.not_equal, "and": np.logical_and, "or": np.logical_or, "not": np.logical_not,
}


def _iota(params: dict[str, Any]) -> Any:
    shape, dim = tuple(params["shape"]), params["dimension"]
    line = np.arange(shape[dim]).reshape([-1 if k == dim else 1 for k in range(len(shape))])
    return np.broadcast_to(line, shape)


def _broadcast(x: Any, params: dict[str, Any]) -> Any:
    shape, dims = tuple(params["shape"]), tuple(params["broadcast_dimensions"])
    placed = np.reshape(x, [np.shape(x)[dims.index(k)] if k in dims else 1 for k in range(len(shape))])
    return np.broadcast_to(placed, shape)


def _dot(xs: list[Any], params: dict[str, Any]) -> Any:
    """``dot_general`` as an einsum: contracted and batch dims share a letter; the result's batch dims, then the
    left's free ones, then the right's (a rotary embedding's positions times its frequencies, jnp.einsum's)."""
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    a, b = np.asarray(xs[0]), np.asarray(xs[1])
    left, right = list("abcdefghijklm"[:a.ndim]), list("nopqrstuvwxyz"[:b.ndim])
    for i, j in (*zip(lc, rc, strict=True), *zip(lb, rb, strict=True)):
        right[j] = left[i]
    out = [left[i] for i in lb] + [left[i] for i in range(a.ndim) if i not in (*lc, *lb)]
    out += [right[j] for j in range(b.ndim) if j not in (*rc, *rb)]
    return np.einsum(f"{''.join(left)},{''.join(right)}->{''.join(out)}", a, b)


STRUCTURAL: dict[str, Callable[[list[Any], dict[str, Any]], Any]] = {
    "iota": lambda xs, p: _iota(p),
    "broadcast_in_dim": lambda xs, p: _broadcast(xs[0], p),
    "reshape": lambda xs, p: np.reshape(xs[0], tuple(p["new_sizes"])),
    "transpose": lambda xs, p: np.transpose(xs[0], tuple(p["permutation"])),
    "squeeze": lambda xs, p: np.squeeze(xs[0], tuple(p["dimensions"])),
    "expand_dims": lambda xs, p: np.expand_dims(xs[0], tuple(p["dimensions"])),
    "convert_element_type": lambda xs, p: np.asarray(xs[0]),
    "integer_pow": lambda xs, p: np.asarray(xs[0]) ** p["y"],
    # a rotary embedding's: its tables' halves put together, rotate-half's parts (unit strides: jnp's slices)
    "dot_general": _dot,
    "concatenate": lambda xs, p: np.concatenate([np.asarray(x) for x in xs], axis=p["dimension"]),
    "slice": lambda xs, p: np.asarray(xs[0])[tuple(slice(a, b, s) for a, b, s in zip(
        p["start_indices"], p["limit_indices"], p["strides"] or (1,) * len(p["start_indices"]), strict=True))],
    # select_n(which, *cases): the case at each element's index
    "select_n": lambda xs, p: np.choose(np.asarray(xs[0], int), [np.asarray(c) for c in xs[1:]]),
}


_BITWISE: dict[str, Callable[..., Any]] = {"and": np.bitwise_and, "or": np.bitwise_or, "not": np.invert}


def evaluate(eqn: Any, xs: list[Any], exact: bool = False) -> Any:
    """One primitive in numpy; KeyError where it is none of :data:`ELEMENTWISE` or :data:`STRUCTURAL`.
    ``exact``: in the equation's own element type (an integer division truncates, a comparison is bool), as
    a mask's positions need; else as numpy computes it (float64 at a run's sample points)."""
    name = eqn.primitive.name
    if name in STRUCTURAL:
        value = STRUCTURAL[name](xs, eqn.params)
    elif exact and name == "div" and all(np.issubdtype(np.asarray(x).dtype, np.integer) for x in xs):
        value = np.trunc(np.divide(*xs))  # lax.div of integers rounds toward zero
    elif exact and name in _BITWISE and all(np.issubdtype(np.asarray(x).dtype, np.integer) for x in xs):
        value = _BITWISE[name](*xs)  # lax's and, or, not of integers are bitwise
    else:
        value = ELEMENTWISE[name](*xs)
    if exact:
        return np.asarray(value).astype(np.dtype(eqn.outvars[0].aval.dtype))
    return value
