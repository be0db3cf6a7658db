"""A rotary position embedding in a program read as the language's ``rotary(X, T[, theta])`` (:mod:`shardc.ops.rotary`).

JAX programs write RoFormer's rotation (arXiv 2104.09864) in its half-split form, as LLaMA's reference code and
MaxText's ``apply_rotary_embedding`` do: ``x * cos + rotate_half(x) * sin``, ``rotate_half(x) =
concatenate([-x2, x1])`` of the halves of the last dim, the tables ``cos`` and ``sin`` of the angles ``t *
theta ** (-2i / H)`` made in the program from positions (``jnp.arange``, folded to their values as a causal
mask's are, :class:`shardc.explanation.causal_masks.Constants`) or closed over as constant arrays (numpy
tables: the constants of a jitted function's jaxpr, :func:`enter_constants`).  Users write it many ways (``jnp.split``
or slices, ``jnp.outer`` or a broadcast product, the tables concatenated or tiled), so it is not matched
equation by equation: the run of maps over x, its slices and concatenation among them, is evaluated on a
sample x (its own equations in numpy, the tables at their values) and compared with the language's rotation
along each dim of x but the last taken as the position, theta read off the angle of the first pair's
neighbour at position 1 (its rate, theta ** (-2 / H)).  A run that matches none is no rotation of the language
(interleaved pairs ``x[..., ::2]``, positions offset or scaled, another frequency rule): the caller refuses it
at its line, as any run of maps that moves elements along a dim, with how to rewrite it where it is a rotation
the language could say from positions 0, 1, ... (:func:`rewrite`): positions passed in as an input (MaxText's
``positions[B, T]`` ints, a cache's offset) or tables of cos and sin passed as arguments, or positions offset
by a constant (a decode step after a cache).  The op takes no positions operand yet: its angles are each
element's index along the position dim (a device's block offset by its index on the mesh, no table or positions
read), so these forms are refused rather than read as a rotation by other positions than the program's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from jax import numpy as jnp
from jax.extend import core as jex

from shardc.explanation.numpy_prims import evaluate
from shardc.ops.rotary import THETA, rotate

__all__ = ["enter_constants", "passed_positions", "rewrite", "rotation"]

# how to rewrite a rotation the language would say from positions 0, 1, ... along the sequence
_PASSED_IN = ("a rotary embedding's angles made from positions passed in (an integer input: MaxText's positions[B, T], "
              "a cache's offset) or its cos and sin tables passed as arguments: the language's rotary(X, T, theta) "
              "rotates by each element's position 0, 1, ... along T; make the positions in the function "
              "(jnp.arange along the sequence) or close over the tables as numpy arrays, and explain that, or "
              "write the .shard spec with Qr[B, T, N, H] = rotary(Q[B, T, N, H], T, theta)")
_OFFSET = ("positions that start at {k:g}, not 0 (a decode step after a cache of {k:g} tokens): the language's "
           "rotary(X, T, theta) counts each position from 0 along T; explain the step with positions from 0 "
           "(training, or prefill), or write the .shard spec with Qr[B, T, N, H] = rotary(Q[B, T, N, H], T, theta)")
_LIMIT = 1 << 22  # the most elements of x a check evaluates the run on (the program's sizes: explain a smaller one)


def enter_constants(reader: Any, closed: Any, inner: Any) -> None:
    """A jitted function's closed-over arrays (numpy tables of a rotary embedding's cos and sin): constants of
    the program at their values, no tensor of the spec."""
    for var, value in zip(inner.constvars, getattr(closed, "consts", ()), strict=False):
        reader.constants.values[var] = np.asarray(value)
        reader.constant(var)


def rotation(reader: Any, steps: list[tuple[Any, frozenset[str]]], source: Any,
             operand: Any) -> tuple[int, float] | None:
    """(the id of the position dim, theta) where the run of ``steps`` over ``source`` (the tensor ``operand``) is
    the language's rotary embedding of the last dim of the view of it the run reads (heads reshaped out of a
    projection), that dim written last in the tensor; None where it is not."""
    view = next((v for e, _ in steps for v in e.invars if not isinstance(v, jex.Literal) and reader.base(v) is source),
                None)
    if view is None or not any(isinstance(e, jex.JaxprEqn) and e.primitive.name == "concatenate" for e, _ in steps):
        return None
    shape, head = tuple(view.aval.shape), reader.atoms(reader.dims_of(view)[-1]) if view.aval.shape else []
    layout = reader.layout(operand)
    if len(head) != 1 or not layout or layout[-1][0] != head[0] or shape[-1] % 2 or math.prod(shape) > _LIMIT:
        return None
    x = np.random.default_rng(0).standard_normal(shape)
    y = _run(reader, steps, source, x)
    if y is None or y.shape != shape:
        return None
    out = steps[-1][0].outvars[0]
    dtype = out.aval.dtype if jnp.issubdtype(out.aval.dtype, jnp.floating) else jnp.float32
    labels = tuple(str(k) for k in range(len(shape)))
    for d in (k for k in range(len(shape) - 1) if shape[k] > 1):
        # the tables' own rounding grows with the angle, at most the last position (its type's unit of the last place)
        tolerance = max(1e-3, 4 * float(jnp.finfo(dtype).eps)) + 4e-7 * shape[d]
        for theta in _thetas(x, y, d):
            want = rotate(x, labels, str(d), theta, 1.0, np)
            if np.allclose(y, want, rtol=tolerance, atol=tolerance * float(np.abs(x).max())):
                return reader.dims_of(view)[d], theta
    return None


def passed_positions(reader: Any, arrays: list[Any]) -> str:
    """How to rewrite a map refused where it reads an integer input of the program (positions passed in, the
    angles of MaxText's ``apply_rotary_embedding``: positions / timescale); "" where it reads none."""
    ints = [a for a in arrays if jnp.issubdtype(reader.base(reader.source(a)).aval.dtype, jnp.integer)]
    return _PASSED_IN if ints else ""


def rewrite(reader: Any, steps: list[tuple[Any, frozenset[str]]], source: Any) -> str:
    """How to rewrite the run of ``steps`` over ``source``, where it is rotate-half's form but no rotation of the
    language: its tables read from an input (:data:`_PASSED_IN`), or its positions offset by a constant (pair
    0's angle, position times 1 whatever theta, is k at position 0 and k + 1 at 1); "" where it is neither."""
    if not any(isinstance(e, jex.JaxprEqn) and e.primitive.name == "concatenate" for e, _ in steps):
        return ""
    made = {source} | {v for e, _ in steps for v in e.outvars}
    if any(not isinstance(v, jex.Literal) and reader.base(v) not in made and reader.constants.value(reader, v) is None
           for e, _ in steps for v in e.invars):
        return _PASSED_IN
    view = next((v for e, _ in steps for v in e.invars if not isinstance(v, jex.Literal) and reader.base(v) is source),
                None)
    if view is None:
        return ""
    shape = tuple(view.aval.shape)  # the view of it the run reads (heads reshaped out of a projection)
    if not shape or shape[-1] % 2 or math.prod(shape) > _LIMIT:
        return ""
    x = np.random.default_rng(0).standard_normal(shape)
    y = _run(reader, steps, source, x)
    if y is None or y.shape != shape:
        return ""
    x1, x2 = np.split(x, 2, axis=-1)
    if np.allclose(y, np.concatenate([-x2, x1], axis=-1)):
        return _PASSED_IN  # rotate_half alone: the tables it is multiplied by are no constants, so passed in
    offsets = [k for d in range(len(shape) - 1) if shape[d] > 1 and (k := _offset(x, y, d)) is not None]
    return _OFFSET.format(k=offsets[0]) if offsets else ""


def _offset(x: np.ndarray, y: np.ndarray, d: int) -> float | None:
    """k where the run turns pair 0 (rate 1 whatever theta) by k + t at position t along ``d``, k not 0: k off
    pair 1's slower angle at position 0 (k * rate, under pi where the offset is a cache's), pair 0's wrapping at
    2 pi; None where the angles are no such progression."""
    first, second = _angle(x, y, d, 0, pair=0), _angle(x, y, d, 1, pair=0)
    if first is None or second is None or abs(first) < 1e-3:
        return None
    if abs(math.remainder(second - first - 1, 2 * math.pi)) > 1e-3:
        return None
    slow, rate = _angle(x, y, d, 0), (_angle(x, y, d, 1) or 0.0) - (_angle(x, y, d, 0) or 0.0)
    return round(slow / rate if x.shape[-1] >= 4 and slow is not None and 0 < rate < 1 else first, 2)


def _thetas(x: np.ndarray, y: np.ndarray, d: int) -> list[float]:
    """The frequency bases to try: the language's default (where the program's values are its, at their type's
    rounding, the spec need not say another), then the one the run's angles of pair 1 imply (rate theta **
    (-2 / H)), read at the farthest position along ``d`` whose angle is under 3 (a table's rounding is a smaller
    share of a larger angle), rounded to 5 digits, then as it is."""
    half = x.shape[-1] // 2
    if half < 2:
        return [THETA]  # one pair: its rate is 1 whatever theta
    rate = _angle(x, y, d, 1) or 0.0
    if not 0 < rate < 1:
        return [THETA]
    far = min(x.shape[d] - 1, int(3 / rate))
    rate = (_angle(x, y, d, far) or 0.0) / far
    theta = rate ** (-half) if 0 < rate < 1 else THETA
    return [THETA, float(f"{theta:.5g}"), theta]


def _angle(x: np.ndarray, y: np.ndarray, d: int, t: int, pair: int = 1) -> float | None:
    """The angle the run turns ``pair`` by at position ``t`` along ``d`` (the other dims at 0)."""
    at = tuple(t if k == d else 0 for k in range(x.ndim - 1))
    half = x.shape[-1] // 2
    turned = complex(x[(*at, pair)], x[(*at, pair + half)])
    if turned == 0:
        return None
    ratio = complex(y[(*at, pair)], y[(*at, pair + half)]) / turned
    return math.atan2(ratio.imag, ratio.real)


def _run(reader: Any, steps: list[tuple[Any, frozenset[str]]], source: Any, x: np.ndarray) -> np.ndarray | None:
    """The run's value for x, its equations in order in float64 (tables at their folded values); None where a step
    reads what the run does not make nor the program holds as a constant, or is no primitive explain evaluates."""
    values: dict[Any, Any] = {source: x}
    for eqn, _ in steps:
        if not isinstance(eqn, jex.JaxprEqn):
            return None  # a custom function of one array (relu): no part of a rotation
        inputs = [_input(reader, v, values) for v in eqn.invars]
        if any(v is None for v in inputs):
            return None
        try:
            made = _evaluate(eqn, inputs)
        except (KeyError, ValueError, TypeError):
            return None
        values.update(zip(eqn.outvars, made, strict=True))
    return np.asarray(values[steps[-1][0].outvars[0]], np.float64) if steps else None


def _input(reader: Any, var: Any, values: dict[Any, Any]) -> Any:
    if isinstance(var, jex.Literal):
        return np.asarray(var.val, np.float64)
    base = reader.base(var)
    if base in values:
        value = values[base]
        return value if tuple(np.shape(value)) == tuple(var.aval.shape) else None  # a view of another shape
    value = reader.constants.value(reader, var)
    return None if value is None else np.asarray(value, np.float64)


def _evaluate(eqn: Any, xs: list[Any]) -> list[Any]:
    """One equation's results in numpy (a split's halves of rotate-half, several)."""
    if eqn.primitive.name == "split":  # its several results
        return list(np.split(xs[0], np.cumsum(eqn.params["sizes"])[:-1], axis=eqn.params["axis"]))
    return [evaluate(eqn, xs)]
