"""A causal mask as attention code writes it, ``jnp.where(mask, scores, -inf)``, read as the language's
``causal(Sc[..., S, T], S, T)``.

Users make the mask many ways (``jnp.tril(jnp.ones((S, T), bool))``, ``arange(S)[:, None] >=
arange(T)[None, :]``, a float ``tril`` compared with 0, ``where(~mask, -inf, s)``), so it is not matched
equation by equation: every array the program makes of literals and positions alone (``iota``) is folded
to its values as the reader walks (:class:`Constants`), and a ``select_n`` between an array and a
constant fill, whose predicate is such a constant, is causal where the kept entries are exactly those
with the key position (T) at or before the query position (S), along two of the array's dims (and,
within a sliding window of W keys, ``causal(Sc, S, T, window W)``: Mistral's, Gemma 2's local layers).
Any other mask stays a map of the array (``identity``: its sharding is all the spec needs of it).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex

from shardc.ops.masks import in_window

__all__ = ["Constants", "read_mask"]

_FOLDED = frozenset({"iota", "broadcast_in_dim", "convert_element_type", "add", "sub", "mul", "neg", "ge", "gt",
                     "le", "lt", "eq", "ne", "and", "or", "not", "select_n", "reshape", "transpose", "squeeze",
                     "expand_dims", "max", "min"})  # what a mask is made of, each free of effects
_LIMIT = 1 << 24  # the most elements a folded value holds (an S x T mask of 4096 x 4096)
# A finite fill is the language's -inf where the softmax after it weighs it exp(fill - max) = 0 in float32:
# e^-104 is below float32's smallest subnormal, 2^-149 (IEEE 754), so any fill 1e4 under scores of
# magnitude up to ~9.9e3 (scaled dot products of unit activations are tens); users write -1e9 or finfo.min.
_FILL = -1e4


class Constants:
    """The values of the arrays a program makes of literals and positions alone, by variable."""

    def __init__(self) -> None:
        self.values: dict[Any, np.ndarray] = {}

    def value(self, reader: Any, var: Any) -> np.ndarray | None:
        """``var``'s value, through the reader's views of one shape (a call's inputs and results are
        views of the caller's); None where it is not a constant."""
        while not isinstance(var, jex.Literal) and var not in self.values:
            source = reader.alias.get(var)
            if source is None or tuple(source.aval.shape) != tuple(var.aval.shape):
                return None
            var = source
        return np.asarray(var.val) if isinstance(var, jex.Literal) else self.values[var]

    def enter(self, reader: Any, outer: list[Any], inner: list[Any]) -> None:
        """A call's inputs: the values of its constant arguments (a literal fill, ``where``'s -inf) are its
        inner variables'."""
        for outer_var, inner_var in zip(outer, inner, strict=False):
            value = self.value(reader, outer_var)
            if value is not None:
                self.values[inner_var] = value

    def fold(self, reader: Any, eqn: Any) -> None:
        """Record ``eqn``'s results where it is a mask's op of constants alone."""
        if eqn.primitive.name not in _FOLDED or any(math.prod(v.aval.shape) > _LIMIT for v in eqn.outvars):
            return
        inputs = [self.value(reader, v) for v in eqn.invars]
        if any(x is None for x in inputs):
            return
        with jax.default_device(jax.devices("cpu")[0]):
            results = eqn.primitive.bind(*inputs, **eqn.params)
        for var, result in zip(eqn.outvars, results if eqn.primitive.multiple_results else [results], strict=True):
            self.values[var] = np.asarray(result)


def _causal_dims(keep: np.ndarray) -> tuple[int, int, int] | None:
    """(query, key, window or 0): the two dims along which ``keep`` holds exactly the entries the
    language's causal mask keeps (the key at or before the query, within a sliding window W of keys when
    it has one: :func:`in_window`), the same along every other dim; None where no two are."""
    for i, j in itertools.permutations(range(keep.ndim), 2):
        query = np.arange(keep.shape[i]).reshape([-1 if k == i else 1 for k in range(keep.ndim)])
        key = np.arange(keep.shape[j]).reshape([-1 if k == j else 1 for k in range(keep.ndim)])
        distance = np.broadcast_to(query - key, keep.shape)[keep]
        window = int(distance.max()) + 1 if distance.size and distance.min() >= 0 else 0
        for w in (None, window):
            if w != 0 and np.array_equal(keep, np.broadcast_to(in_window(query, key, w), keep.shape)):
                return i, j, w or 0
    return None


def read_mask(reader: Any, eqn: Any, line: str) -> bool:
    """Read ``eqn`` as ``causal(X, S, T)`` where it is a ``select_n`` keeping an array X at a causal
    constant mask and a fill of -inf (or a finite one the softmax weighs 0) elsewhere; False otherwise."""
    if eqn.primitive.name != "select_n" or len(eqn.invars) != 3:
        return False
    predicate = reader.constants.value(reader, eqn.invars[0])
    cases = [reader.constants.value(reader, v) for v in eqn.invars[1:]]
    arrays = [k for k, value in enumerate(cases) if value is None]
    if predicate is None or len(arrays) != 1:
        return False
    kept, fill = eqn.invars[1 + arrays[0]], cases[1 - arrays[0]]
    assert fill is not None  # the other case is the constant
    if fill.size == 0 or not np.all(fill == fill.flat[0]) or not float(fill.flat[0]) <= _FILL:
        return False
    found = _causal_dims(np.broadcast_to(predicate == arrays[0], tuple(kept.aval.shape)))
    if found is None:
        return False
    out = eqn.outvars[0]
    for d, e in zip(reader.dims_of(kept), reader.dims_of(out), strict=True):
        reader.join(d, e)
    dims = reader.dims_of(out)
    reader.make(out, "causal", (reader.tensor(kept),), names=(dims[found[0]], dims[found[1]]), number=found[2],
                line=line)
    if math.isfinite(float(fill.flat[0])):
        reader.notes.append(f"the causal mask at {line or 'its where'} fills {float(fill.flat[0]):g} where the "
                            "language writes -inf: the same softmax after it (both weigh 0 in float32)")
    return True
