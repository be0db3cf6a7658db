"""Elementwise functions as lowering and the references see them.

Each function has the JAX expression the generated module calls (the backward
step ``<f>_vjp`` becomes ``jax.vjp`` of that same function, so the planned
backward differentiates exactly what the forward ran) and an array-module
generic forward and derivative (``xp`` is numpy or jax.numpy) for the numpy
reference and for the XLA-partitioner comparison.  GELU is the tanh form,
``jax.nn.gelu``'s default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardc.errors import ShardcError

__all__ = ["Function", "FUNCTIONS", "function"]

Array = Any
_C = 0.7978845608028654  # sqrt(2 / pi)


@dataclass(frozen=True)
class Function:
    name: str
    jax: str  # a callable expression in the generated module
    forward: Callable[[Array, Any], Array]
    derivative: Callable[[Array, Any], Array]
    # the terms a derivative's evaluation adds up, in absolute value (numpy): its rounding
    # error is a few units of the last place of this, however much they cancel
    slope_terms: Callable[[Array], Array]


def _gelu(x: Array, xp: Any) -> Array:
    return 0.5 * x * (1.0 + xp.tanh(_C * (x + 0.044715 * x**3)))


def _gelu_prime(x: Array, xp: Any) -> Array:
    t = xp.tanh(_C * (x + 0.044715 * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _C * (1.0 + 3 * 0.044715 * x * x)


def _sigmoid(x: Array, xp: Any) -> Array:
    return 1.0 / (1.0 + xp.exp(-x))


def _silu_prime(x: Array, xp: Any) -> Array:
    s = _sigmoid(x, xp)
    return s * (1.0 + x * (1.0 - s))


def _gelu_terms(x: Array) -> Array:
    t = np.tanh(_C * (x + 0.044715 * x**3))
    return 0.5 * (1.0 + np.abs(t)) + 0.5 * np.abs(x) * (1.0 + t * t) * _C * (1.0 + 3 * 0.044715 * x * x)


def _silu_terms(x: Array) -> Array:
    s = _sigmoid(x, np)
    return s * (1.0 + np.abs(x) * (1.0 + s))


FUNCTIONS: dict[str, Function] = {f.name: f for f in (
    Function("gelu", "jax.nn.gelu", _gelu, _gelu_prime, _gelu_terms),
    Function("relu", "jax.nn.relu", lambda x, xp: xp.maximum(x, 0.0), lambda x, xp: (x > 0) * 1.0,
             lambda x: np.ones_like(x)),
    Function("silu", "jax.nn.silu", lambda x, xp: x * _sigmoid(x, xp), _silu_prime, _silu_terms),
    Function("swish", "jax.nn.silu", lambda x, xp: x * _sigmoid(x, xp), _silu_prime, _silu_terms),
    Function("sigmoid", "jax.nn.sigmoid", _sigmoid,
             lambda x, xp: _sigmoid(x, xp) * (1.0 - _sigmoid(x, xp)),
             lambda x: _sigmoid(x, np) * (1.0 + _sigmoid(x, np))),
    Function("tanh", "jnp.tanh", lambda x, xp: xp.tanh(x), lambda x, xp: 1.0 - xp.tanh(x) ** 2,
             lambda x: 1.0 + np.tanh(x) ** 2),
    Function("exp", "jnp.exp", lambda x, xp: xp.exp(x), lambda x, xp: xp.exp(x), lambda x: np.exp(x)),
    Function("square", "jnp.square", lambda x, xp: x * x, lambda x, xp: 2.0 * x, lambda x: 2.0 * np.abs(x)),
    Function("identity", "(lambda x: x)", lambda x, xp: x, lambda x, xp: x * 0.0 + 1.0,
             lambda x: np.ones_like(x)),
)}


def function(name: str) -> Function:
    """The function called ``name``; a ShardcError names the ones lowering knows."""
    try:
        return FUNCTIONS[name]
    except KeyError:
        known = ", ".join(sorted(FUNCTIONS))
        raise ShardcError(f"lowering does not know the elementwise function {name!r}",
                          fix=f"use one of {known}") from None
