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

import numpy as np
from jax.extend import core as jex

from shardc.explanation.dim_classes import unwritable
from shardc.explanation.numpy_prims import evaluate
from shardc.ops.masks import in_window

__all__ = ["Constants", "read_mask"]

_FOLDED = frozenset({"iota", "broadcast_in_dim", "convert_element_type", "add", "sub", "mul", "neg", "ge", "gt",
                     "le", "lt", "eq", "ne", "and", "or", "not", "select_n", "reshape", "transpose", "squeeze",
                     "expand_dims", "max", "min", "div", "sqrt", "rsqrt", "sin", "cos", "pow", "exp",
                     "integer_pow", "concatenate", "slice", "dot_general"})
# what a mask (or a scale: flax's 1 / sqrt(head dim), a rotary embedding's tables of cos and sin) is made of, each
# free of effects
_KEYS = frozenset({"random_seed", "random_wrap", "random_unwrap", "random_split", "random_fold_in",
                   "random_clone"})  # a random key's making: no array of the spec
_LIMIT = 1 << 24  # the most elements a folded value holds (an S x T mask of 4096 x 4096)
# A finite fill is the language's -inf where the softmax after it weighs it exp(fill - max) = 0 in float32:
# e^-104 is below float32's smallest subnormal, 2^-149 (IEEE 754), so any fill 1e4 under scores of
# magnitude up to ~9.9e3 (scaled dot products of unit activations are tens); users write -1e9 or finfo.min.
_FILL = -1e4


def find(reader: Any, var: Any, table: dict[Any, Any]) -> Any:
    """``table``'s entry of ``var``, through the reader's views of one shape (a call's inputs and results
    are views of the caller's); None where it has none."""
    while var not in table:
        source = reader.alias.get(var)
        if source is None or isinstance(source, jex.Literal) or tuple(source.aval.shape) != tuple(var.aval.shape):
            return None
        var = source
    return table[var]


class Constants:
    """The values of the arrays a program makes of literals and positions alone, by variable; a dropout's
    keep draws (``jax.random.bernoulli``) by their keep probability, and arrays scaled by a literal."""

    def __init__(self) -> None:
        self.values: dict[Any, np.ndarray] = {}
        self.draws: dict[Any, float] = {}  # a keep-mask drawn at random -> the probability it keeps
        self.scaled: dict[Any, tuple[Any, float]] = {}  # x * c, x / c -> (x, its factor)

    def value(self, reader: Any, var: Any) -> np.ndarray | None:
        """``var``'s value, through the reader's views of one shape (a call's inputs and results are
        views of the caller's); None where it is not a constant."""
        if isinstance(var, jex.Literal):
            return np.asarray(var.val)
        return find(reader, var, self.values)

    def enter(self, reader: Any, outer: list[Any], inner: list[Any]) -> None:
        """A call's inputs: the values of its constant arguments (a literal fill, ``where``'s -inf) are its
        inner variables'."""
        for outer_var, inner_var in zip(outer, inner, strict=False):
            value = self.value(reader, outer_var)
            if value is not None:
                self.values[inner_var] = value

    def fold(self, reader: Any, eqn: Any) -> bool:
        """Record ``eqn``'s results where it is a mask's op of constants alone (or an array times a literal);
        True where the reader reads no more of it: a random key's making, a dropout's keep draw."""
        name = eqn.primitive.name
        if name in _KEYS:
            return True
        if name in ("pjit", "jit") and eqn.params.get("name") == "_bernoulli":
            keep = self.value(reader, eqn.invars[1])
            if keep is not None and keep.size == 1:
                self.draws[eqn.outvars[0]] = float(keep.flat[0])
                reader.unreadable[eqn.outvars[0]] = (
                    "a random keep-mask is read other than by a dropout's where (jnp.where(keep, x / p, 0)), and a "
                    "random array has no tensor in the spec", "write the dropout as jnp.where(keep, x / p, 0)")
            return keep is not None and keep.size == 1
        if _neutral(eqn):  # max(x, -inf) is x: jnp.max's initial (log_softmax's, optax's cross entropy's)
            reader.view(eqn.outvars[0], eqn.invars[1], list(range(len(eqn.outvars[0].aval.shape))))
            return True
        if name in ("div", "mul") and isinstance(eqn.invars[1], jex.Literal) and eqn.outvars[0].aval.shape:
            factor = float(eqn.invars[1].val)
            self.scaled[eqn.outvars[0]] = (eqn.invars[0], 1.0 / factor if name == "div" and factor else factor)
        self._evaluate(reader, eqn)
        return False

    def _evaluate(self, reader: Any, eqn: Any) -> None:
        if eqn.primitive.name not in _FOLDED or any(math.prod(v.aval.shape) > _LIMIT for v in eqn.outvars):
            return
        inputs = [self.value(reader, v) for v in eqn.invars]
        if any(x is None for x in inputs):
            return
        self.values[eqn.outvars[0]] = evaluate(eqn, inputs, exact=True)


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


def _neutral(eqn: Any) -> bool:
    """Whether ``eqn`` is ``max(-inf, x)`` or ``min(inf, x)`` of an array x (jax puts the literal first): x
    itself, which the reader reads as a view of x, not as a map (a max of a constant is relu's)."""
    if eqn.primitive.name not in ("max", "min") or len(eqn.invars) != 2 or not eqn.outvars[0].aval.shape:
        return False
    first, second = eqn.invars
    fill = -math.inf if eqn.primitive.name == "max" else math.inf
    return isinstance(first, jex.Literal) and not isinstance(second, jex.Literal) and float(first.val) == fill \
        and second.aval.shape == eqn.outvars[0].aval.shape


def read_mask(reader: Any, eqn: Any, line: str) -> bool:
    """Read ``eqn`` as ``causal(X, S, T)`` where it is a ``select_n`` keeping an array X at a causal
    constant mask and a fill of -inf (or a finite one the softmax weighs 0) elsewhere; False otherwise."""
    if eqn.primitive.name != "select_n" or len(eqn.invars) != 3:
        return False
    keep = find(reader, eqn.invars[0], reader.constants.draws)
    if keep is not None:
        return _dropout(reader, eqn, keep, line)
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


def _dropout(reader: Any, eqn: Any, keep: float, line: str) -> bool:
    """``jnp.where(bernoulli(key, p, shape), x / p, 0)``: the language's ``dropout(X, 1 - p)`` (which draws
    its own mask, keeps with probability p and scales by 1 / p); where the kept values are scaled otherwise
    or the rest is not 0, it is an error: a random mask has no other form in the spec."""
    fill = reader.constants.value(reader, eqn.invars[1])
    scaled = find(reader, eqn.invars[2], reader.constants.scaled)
    if fill is None or np.any(fill != 0) or scaled is None or not math.isclose(scaled[1] * keep, 1.0, rel_tol=1e-6):
        raise unwritable("a random mask other than a dropout's (jnp.where(keep, x / p, 0), keep drawn with "
                         "jax.random.bernoulli(key, p)) has no form in the spec language",
                         fix="write the dropout as jnp.where(keep, x / p, 0), or write the .shard spec")
    source, out = scaled[0], eqn.outvars[0]
    for d, e in zip(reader.dims_of(source), reader.dims_of(out), strict=True):
        reader.join(d, e)
    reader.make(out, "dropout", (reader.tensor(source),), fn=f"{1.0 - keep:.6g}", line=line)
    return True
