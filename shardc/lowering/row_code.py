"""The token-id inputs of a lowered module (lowering feeds them as integers, verification draws them).

The row steps' and the vocabulary ops' JAX lines are their families' (:func:`shardc.ops.reductions.row_code`,
:func:`shardc.ops.vocabulary.lookup_code`).
"""

from __future__ import annotations

from typing import Any

from shardc.spec.walk import id_vocabulary

__all__ = ["id_inputs"]


def id_inputs(spec: Any) -> dict[str, str]:
    """Token-id tensors (integers in [0, vocabulary), ID_DTYPE) and their vocabulary index, from the spec."""
    return id_vocabulary(spec)
