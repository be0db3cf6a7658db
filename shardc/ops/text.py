"""Text helpers the families' JAX emitters share (no jax import: the emitters write code)."""

from __future__ import annotations

__all__ = ["broadcast_text", "aligned_text"]


def broadcast_text(name: str, indices: tuple[str, ...], out: tuple[str, ...]) -> str:
    """``name`` (with ``indices``) as an array that broadcasts against one with ``out``."""
    order = [i for i in out if i in indices]
    text = name
    if tuple(order) != indices:
        perm = tuple(indices.index(i) for i in order)
        text = f"jnp.transpose({text}, {perm})"
    if len(order) != len(out):
        text += "[" + ", ".join(":" if i in indices else "None" for i in out) + "]"
    return text


def aligned_text(name: str, indices: tuple[str, ...], out: tuple[str, ...]) -> str:
    """``name`` (with ``indices``) in the index order ``out``, where those are the same indices permuted."""
    if indices == out or sorted(indices) != sorted(out):
        return name
    perm = tuple(indices.index(i) for i in out)
    return f"jnp.transpose({name}, {perm})"
