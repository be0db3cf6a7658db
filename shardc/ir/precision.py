"""The element types of a plan's tensors, and the type an einsum runs in.

A spec gives every tensor its ``dtype`` and some tensors another (``dtype bf16 Sc, Pr``:
:attr:`shardc.ir.spec.Spec.tensor_dtypes`); the planner extends them to gradients and intermediates
(:attr:`shardc.planner.graph.Graph.dtypes`).  An einsum runs at the fp8 rate only where both operands
are f8, as FP8 training runs a GEMM (DeepSeek-V3, arXiv 2412.19437, section 3.3).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from shardc.ir.spec import DType

__all__ = ["matmul_dtype", "Precision"]


def matmul_dtype(operands: Iterable[DType]) -> DType:
    """The element type an einsum of these operands runs in: f8 only when every operand is f8 (a chip's
    FP8 matrix unit takes two FP8 operands), else the widest of them (f32 over bf16 and f16; of two
    2-byte types the first), as a framework casts the narrower operand up.

    >>> matmul_dtype([DType.F8, DType.F8]), matmul_dtype([DType.F8, DType.BF16])
    (<DType.F8: 'f8'>, <DType.BF16: 'bf16'>)
    """
    kinds = list(operands)
    if not kinds:
        raise ValueError("an einsum has operands")
    if all(k is DType.F8 for k in kinds):
        return DType.F8
    return max((k for k in kinds if k is not DType.F8), key=lambda k: k.nbytes)


@dataclass(frozen=True, eq=False)
class Precision:
    """The element types of a plan's tensors: ``default`` (the spec's ``dtype``) but where ``tensors`` says
    (:attr:`shardc.planner.graph.Graph.dtypes`)."""

    default: DType = DType.BF16
    tensors: Mapping[str, DType] = field(default_factory=dict)

    def of(self, tensor: str) -> DType:
        return self.tensors.get(tensor, self.default)

    def matmul(self, operands: Iterable[str]) -> str:
        """The type an einsum (or a kernel's matmuls) reading ``operands`` runs in, by name (:func:`matmul_dtype`)."""
        kinds = [self.of(o) for o in operands] if self.tensors else []
        return matmul_dtype(kinds).value if kinds else self.default.value
