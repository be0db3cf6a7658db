"""What to do about an op ``shardc explain`` does not read, by primitive: the fix its error gives.

Each names what the spec language can say instead, where it can say anything (a dropout is the
language's ``dropout``), else how to explain the rest of the program.
"""

from __future__ import annotations

__all__ = ["refusal_fix"]

_RANDOM = ("a random draw other than a dropout's keep-mask (jnp.where(jax.random.bernoulli(key, p, shape), x / p, 0), "
           "read as the language's `dropout(X, 1 - p)`) has no tensor in the spec: explain the program without it, "
           "or write its .shard spec")
_FIXES = {
    "shard_map": "a shard_map's body is already per-device code with its own collectives: explain the program "
                 "as jax.jit with shardings writes it (the compiler partitions it), or write its .shard spec",
    "cond": "a branch chosen at run time has no form in the spec: explain each branch as a program of its own "
            "(jax.jit of it), or write its .shard spec",
    "while": "a loop of a trip count known only at run time has no form in the spec (a jax.lax.scan, or a "
             "fori_loop of constant bounds, is read as a `layers` block): explain its body as a program",
    "cumsum": "a running sum along a dim has no form in the spec (beside an MoE router's slot count, read with "
              "its routing): explain the program without it, or write its .shard spec",
    "pad": "a pad grows a dim, which no op of the spec does: pad the input before the program (an input of the "
           "padded size), or write its .shard spec",
    "conv_general_dilated": "a convolution has no form in the spec: write it as a contraction with its "
                            "patches (jnp.einsum over an input of the patches), or write its .shard spec",
    **{name: _RANDOM for name in ("random_seed", "random_bits", "random_wrap", "random_unwrap", "threefry2x32")},
}
_DEFAULT = "explain a program (or the part of it) made of those, or write its .shard spec"


def refusal_fix(primitive: str) -> str:
    """The fix of the error refusing ``primitive``."""
    return _FIXES.get(primitive, _DEFAULT)
