"""The elementwise functions a spec may call.

Only the names live here (validation needs them and must not import jax);
lowering maps each name to its jax/numpy implementation.  An elementwise
function keeps the sharding of its argument, so the planner treats every
name alike.

>>> is_known("gelu")
True
>>> "identity" in FUNCTIONS
True
>>> known_list().split(', ')[:3]
['exp', 'gelu', 'identity']
"""

from __future__ import annotations

__all__ = ["FUNCTIONS", "PASS_THROUGH", "is_known", "known_list"]

# name -> one-line meaning (documentation, and the `fix:` of an unknown-function error)
FUNCTIONS: dict[str, str] = {
    "exp": "e**x",
    "gelu": "Gaussian error linear unit (tanh approximation, as jax.nn.gelu)",
    "identity": "x",
    "relu": "max(x, 0)",
    "sigmoid": "1 / (1 + e**-x)",
    "silu": "x * sigmoid(x) (swish)",
    "square": "x**2",
    "tanh": "hyperbolic tangent",
}


# Functions whose gradient is the cotangent itself: the backward reads no argument (XLA would
# drop any move that made one, so the plan must not make it either).
PASS_THROUGH = frozenset({"identity"})


def is_known(name: str) -> bool:
    """Whether ``name`` is an elementwise function shardc can lower."""
    return name in FUNCTIONS


def known_list() -> str:
    """The known names, sorted, comma separated (for error messages)."""
    return ", ".join(sorted(FUNCTIONS))
