"""How one local einsum is timed, beneath :mod:`shardc.timing` and the planner's search.

:mod:`shardc.timing` times a plan's einsums with these; the planner's einsum search
(:meth:`shardc.sharding.layout.CostContext.einsum_seconds`) prices each configuration it
weighs with the same functions, so the search and ``shardc cost`` share one model.  They live apart from
:mod:`shardc.timing` because that module reads the op families (their HBM traffic),
which themselves plan through the search.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from shardc.hardware import Hardware

__all__ = ["einsum_compute_seconds", "product_bytes"]


def einsum_compute_seconds(flops: float, product: bool, hw: Hardware, dtype: str = "bf16") -> float:
    """The matmul time of a local einsum of ``flops`` FLOPs a device: at the rate the chip reaches on a
    matmul of that size; an elementwise product (``product``: no index contracted) runs as a multiply,
    memory-bound (its HBM bytes are its traffic, :func:`shardc.fusion.memory_traffic`), except under the
    book's model, where every einsum runs at peak."""
    return 0.0 if product and not hw.book else hw.matmul_seconds(flops, dtype)


def product_bytes(operands: Iterable[float], result: float) -> float:
    """The HBM bytes of an elementwise product before fusion: it reads its operands and writes its result
    (the traffic :func:`shardc.fusion.memory_traffic` starts from; what fusion saves depends on its
    neighbours in the program)."""
    return math.fsum((*operands, result))
