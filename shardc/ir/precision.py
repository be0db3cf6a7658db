"""The element types of a plan's tensors, and the type an einsum runs in.

A spec gives every tensor its ``dtype`` and some tensors another (``dtype bf16 Sc, Pr``:
:attr:`shardc.ir.spec.Spec.tensor_dtypes`); the planner extends them to gradients and intermediates
(:attr:`shardc.planner.graph.Graph.dtypes`).  An einsum runs at the fp8 rate only where both operands
are f8, unless a ``gemm T`` line gives its GEMMs a compute type apart from storage
(:meth:`shardc.ir.spec.Spec.gemm_of`): then the forward GEMM and the backward's two (Dgrad, Wgrad) quantize
their inputs to T, as FP8 training runs a GEMM (DeepSeek-V3, arXiv 2412.19437, section 3.3, Figure 6).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from shardc.ir.spec import DType

__all__ = ["matmul_dtype", "Precision", "ARRAY_DTYPE", "SCALE_BYTES", "TILE", "quantized_bytes", "pass_bytes",
           "copy_bytes", "gradient_dtype", "tiled_along"]

# The array type (numpy's via ml_dtypes, jax's) each element type is held in: f8 is E4M3, the format
# DeepSeek-V3 uses for every FP8 tensor, activations, weights and gradients alike (arXiv 2412.19437,
# section 3.3.2), and NVIDIA Transformer Engine's for the forward.
ARRAY_DTYPE = {DType.F32: "float32", DType.BF16: "bfloat16", DType.F16: "float16", DType.F8: "float8_e4m3fn"}

SCALE_BYTES = 4  # one FP32 scale a tile (DeepSeek-V3, arXiv 2412.19437, section 3.3.2)
TILE = 128  # an activation tile 1 x 128, a weight block 128 x 128 (section 3.3.2)


def gradient_dtype(kind: DType, storage: DType) -> DType:
    """The type the gradient of a tensor of type ``kind`` is held in, ``storage`` the spec's ``dtype``: its
    tensor's, but for FP8, the format a value is cached in for its GEMMs, whose gradient flows back in the
    storage type (DeepSeek-V3, arXiv 2412.19437, section 3.3.4: activations cached in FP8, the gradients
    in BF16, as its combine backward moves them).

    >>> gradient_dtype(DType.F8, DType.BF16), gradient_dtype(DType.F32, DType.BF16)
    (<DType.BF16: 'bf16'>, <DType.F32: 'f32'>)
    """
    return storage if kind is DType.F8 else kind


def quantized_bytes(elements: float, kind: DType, block: int = TILE) -> float:
    """Bytes of the quantized copy of ``elements`` values in ``kind``, one scale a ``block`` of them."""
    return elements * (kind.nbytes + SCALE_BYTES / block)


def copy_bytes(elements: float, stored: DType, kind: DType, tiled: bool) -> float:
    """Bytes of the copy a GEMM quantizing its inputs to ``kind`` reads of an operand of ``elements`` values
    stored in ``stored`` (:func:`pass_bytes` writes it): none where the GEMM reads the operand as it is held
    (stored in ``kind`` and ``tiled`` along the index the GEMM contracts, or in a type without tiles of
    scales: BF16, F16, F32), else its ``kind`` values and a scale a 1 x 128 tile (a cached FP8 value tiled the
    other way: its transposed copy, DeepSeek-V3, arXiv 2412.19437, section 3.3.4 and Figure 6)."""
    if stored is kind and (tiled or kind is not DType.F8):
        return 0.0
    return quantized_bytes(elements, kind)


def pass_bytes(elements: float, stored: DType, nbytes: float, kind: DType, tiled: bool, fused: bool) -> float:
    """The HBM bytes a GEMM quantizing its inputs to ``kind`` spends on one operand of ``elements`` values
    stored in ``stored`` (``nbytes`` an element) before it (:mod:`shardc.quantize` says when a GEMM runs one;
    ``shardc cost`` and the planner's search both price it here): its copy written (:func:`copy_bytes`; none,
    no pass), and read

    * a cached FP8 value tiled the other way: its FP8 values and scales, dequantized, transposed and
      quantized again (DeepSeek-V3, section 3.3.4 and Figure 6);
    * else the operand, unless the pass is ``fused`` into the kernel that made it.
    """
    written = copy_bytes(elements, stored, kind, tiled)
    if not written:
        return 0.0
    return (written if stored is kind else 0.0 if fused else elements * nbytes) + written


def tiled_along(indices: Sequence[str], along: Iterable[str], weight: bool) -> bool:
    """Whether a value of ``indices`` held in a GEMM's type has its tiles along the indices ``along`` the
    GEMM contracts: a weight's 128 x 128 blocks serve either direction (section 3.3.2); another value's
    1 x 128 tiles run along its last index, the features of a row (section 3.3.2's per-token groups)."""
    return weight or not indices or indices[-1] in set(along)


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
    (:attr:`shardc.planner.graph.Graph.dtypes`); ``gemms``: a contraction's result -> the type its GEMMs
    quantize their inputs to (:attr:`shardc.planner.graph.Graph.gemms`), ``primals``: a gradient's name ->
    its tensor's, by which a backward GEMM finds its forward one."""

    default: DType = DType.BF16
    tensors: Mapping[str, DType] = field(default_factory=dict)
    gemms: Mapping[str, DType] = field(default_factory=dict)
    primals: Mapping[str, str] = field(default_factory=dict)

    def of(self, tensor: str) -> DType:
        return self.tensors.get(tensor, self.default)

    def gemm(self, tensor: str, operands: Sequence[str]) -> DType | None:
        """The type a contraction's GEMM computing ``tensor`` from ``operands`` quantizes its inputs to: the
        forward's (``tensor`` a contraction's result), or a backward GEMM's, which reads the cotangent of
        the forward's result (Dgrad ``dX = dY · W``, Wgrad ``dW = X · dY``: both run in Y's type); None
        where no ``gemm`` line names it (the operands' type then, :meth:`matmul`)."""
        if tensor in self.gemms:
            return self.gemms[tensor]
        primals = (self.primals.get(o, "") for o in operands)
        return next((self.gemms[p] for p in primals if p in self.gemms), None)

    def matmul(self, operands: Iterable[str]) -> str:
        """The type an einsum (or a kernel's matmuls) reading ``operands`` runs in, by name (:func:`matmul_dtype`)."""
        kinds = [self.of(o) for o in operands] if self.tensors else []
        return matmul_dtype(kinds).value if kinds else self.default.value
