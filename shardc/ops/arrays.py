"""Whole-array math the families' references and the einsum reference share, over an array module
``xp`` (numpy or jax.numpy)."""

from __future__ import annotations

import string
from typing import Any

from shardc.errors import ShardcError

__all__ = ["contract"]

Array = Any
_LETTERS = string.ascii_letters  # einsum subscripts, assigned per call


def _subscripts(labels: list[tuple[str, ...]], out: tuple[str, ...]) -> str:
    names = list(dict.fromkeys([i for group in labels for i in group] + list(out)))
    if len(names) > len(_LETTERS):
        raise ShardcError(f"one product has {len(names)} distinct indices; einsum takes at most "
                          f"{len(_LETTERS)}", fix="split the product into statements of fewer indices")
    letters = {name: _LETTERS[k] for k, name in enumerate(names)}
    ins = ",".join("".join(letters[i] for i in group) for group in labels)
    return ins + "->" + "".join(letters[i] for i in out)


def contract(xp: Any, arrays: list[Array], labels: list[tuple[str, ...]], out: tuple[str, ...],
             shape: dict[str, int]) -> Array:
    """einsum to ``out``, broadcasting output indices no operand has (gradients of sums)."""
    present = {i for group in labels for i in group}
    kept = tuple(i for i in out if i in present)
    value = xp.einsum(_subscripts(labels, kept), *arrays)
    if len(kept) == len(out):
        return value
    value = xp.reshape(value, [shape[i] if i in present else 1 for i in out])
    return xp.broadcast_to(value, [shape[i] for i in out])
