"""``shardc explain`` reads a rotary embedding as the language's ``rotary(X, T[, theta])``
(:mod:`shardc.explanation.rotary_runs`): the half-split form with its tables made in the program from positions
or closed over as numpy constants, checked by evaluating the run; other forms refused at their line.

The programs are traced (``jax.make_jaxpr``), never compiled, and written over an array module ``xp`` so numpy
gives their values in float64 to compare with the spec's reference.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardc
from shardc.errors import ShardcError
from shardc.explanation.jaxpr_spec import read_program
from shardc.lowering.reference import forward


def _rotate_half(x: Any, xp: Any) -> Any:
    x1, x2 = xp.split(x, 2, axis=-1)
    return xp.concatenate([-x2, x1], axis=-1)


def _rope(x: Any, xp: Any, theta: float = 10000.0, offset: int = 0) -> Any:
    """LLaMA's: the angles t * theta^(-2i/H) of positions t along x's second dim, halves concatenated."""
    s, h = x.shape[1], x.shape[-1]
    freqs = 1.0 / (theta ** (xp.arange(0, h, 2, dtype=xp.float32) / h))
    angles = xp.outer(xp.arange(s, dtype=xp.float32) + offset, freqs)
    angles = xp.concatenate([angles, angles], axis=-1)[:, None, :]
    return x * xp.cos(angles) + _rotate_half(x, xp) * xp.sin(angles)  # the rotary embedding


def _scores(xp: Any, rope: Any) -> Any:
    def scores(x: Any, wq: Any, wk: Any) -> Any:
        b, s, _ = x.shape
        q = rope((x @ wq).reshape(b, s, 4, -1), xp, 500000.0)
        k = rope((x @ wk).reshape(b, s, 4, -1), xp)
        return xp.einsum("bsnh,btnh->bnst", q, k)
    return scores


def _inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((2, 8, 16)), "wq": rng.standard_normal((16, 16)) / 4,
            "wk": rng.standard_normal((16, 16)) / 4}


def _read(fn: Any, inputs: dict[str, np.ndarray]) -> str:
    closed = jax.make_jaxpr(fn)(*(v.astype(np.float32) for v in inputs.values()))
    return read_program(closed, [()] * len(inputs), [()], list(inputs), {"data": 2}, "t").text


def _same_values(text: str, fn: Any, inputs: dict[str, np.ndarray]) -> None:
    """The spec's float64 reference gives the program's values (the program run in numpy)."""
    spec = shardc.parse(text)
    given = {k: v.reshape(16, 4, 4) if k.startswith("w") else v for k, v in inputs.items()}  # heads of the weights
    got = forward(spec, given)[spec.statements[-1].result.name]
    assert np.allclose(got, fn(*inputs.values()), rtol=1e-5, atol=1e-5)


def test_a_rotary_embedding_made_from_positions_is_the_languages_rotary() -> None:
    inputs = _inputs()
    text = _read(_scores(jnp, _rope), inputs)
    assert "H1[B, S, N, H] = rotary(Y1[B, S, N, H], S, 500000)" in text, text
    assert "H2[B, S, N, H] = rotary(Y2[B, S, N, H], S)" in text, text  # theta 10000, the language's default
    _same_values(text, _scores(np, _rope), inputs)


def _einsum_angles(x: Any) -> Any:
    """HF Flax's and GPT-NeoX's form: the angles an einsum of positions and frequencies, cos and sin in x's type."""
    s, h = x.shape[1], x.shape[-1]
    inv = 1.0 / (10000 ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    freqs = jnp.einsum("i,j->ij", jnp.arange(s, dtype=jnp.float32), inv)
    emb = jnp.concatenate([freqs, freqs], axis=-1)[None, :, None, :]
    return x * jnp.cos(emb).astype(x.dtype) + _rotate_half(x, jnp) * jnp.sin(emb).astype(x.dtype)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_angles_made_by_an_einsum_in_any_type_are_the_languages_rotary(dtype: Any) -> None:
    """In bfloat16 the tables' rounding moves the theta the angles imply (10011): the language's 10000 holds at
    that rounding, and is written."""
    closed = jax.make_jaxpr(_einsum_angles)(jax.ShapeDtypeStruct((2, 64, 4, 16), dtype))
    text = read_program(closed, [()], [()], ["x"], {"data": 2}, "t").text
    assert "H1[B, S, T, D] = rotary(x[B, S, T, D], S)  #" in text, text


def _tables() -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / (10000 ** (np.arange(0, 4, 2) / 4))
    angles = np.outer(np.arange(8), inv)
    angles = np.concatenate([angles, angles], -1)[:, None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def test_tables_closed_over_as_constants_are_read_at_their_values() -> None:
    cos, sin = _tables()

    def program(x: Any, wq: Any) -> Any:
        q = (x @ wq).reshape(2, 8, 4, 4)
        return q * cos + _rotate_half(q, jnp) * sin

    inputs = _inputs()
    del inputs["wk"]
    text = _read(program, inputs)
    assert "H1[B, S, D, F] = rotary(Y1[B, S, D, F], S)" in text, text


@pytest.mark.parametrize(("rope", "says"), [
    (lambda x, xp, theta=0: _rope(x, xp, offset=3), "rotary's rotate_half; read as the language's `rotary"),
    (lambda x, xp, theta=0: x * 2.0 + _rotate_half(x, xp), "rotary's rotate_half"),
])
def test_a_rotation_that_is_not_the_languages_is_refused_at_its_line(rope: Any, says: str) -> None:
    """Positions offset (a cache's), or no rotation at all: the run is no rotary of the language."""
    with pytest.raises(ShardcError, match=says):
        _read(_scores(jnp, rope), _inputs())


def test_interleaved_pairs_are_refused_naming_the_form() -> None:
    def interleaved(x: Any, wq: Any) -> Any:
        q = (x @ wq).reshape(2, 8, 4, 4)
        even, odd = q[..., ::2], q[..., 1::2]
        return jnp.stack([-odd, even], axis=-1).reshape(q.shape)

    inputs = _inputs()
    del inputs["wk"]
    with pytest.raises(ShardcError, match="interleaved pairs"):
        _read(interleaved, inputs)


def _maxtext_rope(q: Any, positions: Any) -> Any:
    """MaxText's apply_rotary_embedding: the angles positions / timescale of positions passed in, [B, S] ints."""
    h = q.shape[-1]
    timescale = 10000.0 ** (2 * jnp.arange(h // 2) / h)
    angles = positions[:, :, None, None] / timescale
    first, second = jnp.split(q, 2, axis=-1)
    return jnp.concatenate([first * jnp.cos(angles) - second * jnp.sin(angles),
                            second * jnp.cos(angles) + first * jnp.sin(angles)], axis=-1)


def _tables_passed(q: Any, cos: Any, sin: Any) -> Any:
    return q * cos + _rotate_half(q, jnp) * sin


@pytest.mark.parametrize(("program", "extra"), [
    (_maxtext_rope, [jax.ShapeDtypeStruct((2, 8), jnp.int32)]),
    (_tables_passed, [jax.ShapeDtypeStruct((8, 1, 4), jnp.float32)] * 2),
])
def test_positions_or_tables_passed_in_are_refused_saying_how_to_rewrite(program: Any, extra: list[Any]) -> None:
    """The language's rotary rotates by positions 0, 1, ... along its dim, not by an input's: the error's fix says
    to make them in the function (or close over the tables), or to write the spec's rotary."""
    def step(x: Any, wq: Any, *rest: Any) -> Any:
        return program((x @ wq).reshape(2, 8, 4, 4), *rest)

    args = [jax.ShapeDtypeStruct((2, 8, 16), jnp.float32), jax.ShapeDtypeStruct((16, 16), jnp.float32), *extra]
    closed = jax.make_jaxpr(step)(*args)
    names = ["x", "wq"] + (["positions"] if len(extra) == 1 else ["cos", "sin"])
    with pytest.raises(ShardcError, match=r"positions passed in .* make the positions in the function") as err:
        read_program(closed, [()] * len(args), [()], names, {"data": 2}, "t")
    assert "rotary(Q[B, T, N, H], T, theta)" in str(err.value)


def test_positions_offset_by_a_cache_are_refused_naming_the_offset() -> None:
    """A decode step's positions k, k + 1, ...: the fix names k (read off the angles) and the step to explain."""
    rope = _scores(jnp, lambda x, xp, theta=0: _rope(x, xp, offset=130))
    with pytest.raises(ShardcError, match="positions that start at 130, not 0 .* explain the step with positions from"):
        _read(rope, _inputs())
