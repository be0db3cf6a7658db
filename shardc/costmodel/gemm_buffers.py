"""The buffers a GEMM's quantized inputs take while it runs (``gemm T`` lines: :mod:`shardc.quantize`), as a
backend makes them (:func:`shardc.costmodel.phase_memory.phase_memory` adds them to a phase's temporaries).

A TPU or GPU holds each quantize pass's copy, its T values and a scale a tile (DeepSeek-V3, arXiv 2412.19437,
section 3.3.2; a cached FP8 value's transposed copy for Wgrad, section 3.3.4), from the pass (the epilogue of
the step that made the operand, where the pass fuses there) to the last GEMM reading it; a weight read as
held has its copy kept all step instead, in the training state (:func:`shardc.quantize.quantized_weights`).

The lowered module at verify's width casts each operand of such a GEMM elementwise in its own type
(:func:`shardc.lowering.runtime.gemm_input`), a copy of the operand's size, held weights' too, one per value
and type a phase whichever index a GEMM contracts (XLA's CSE merges the casts of a value), and XLA's CPU
backend (``Buffers.gemm_casts``) makes a copy of an argument first (``Buffers.arguments_first``: its
scheduler runs first what reads only the arguments), casts a map's result inside that map's fusion where
only such GEMMs read it (no buffer beside the map's own), and makes any other copy at the first GEMM reading
it, alive to the last (``fp8.shard`` at 16x verify's sizes: W1's and W2's casts from the forward's start,
64 kB of its 65.5 kB of temporaries; in the backward the cotangents' casts made in the fusions making them).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from shardc.costmodel.heap import Span
from shardc.fusion import fusible
from shardc.ir.plan import Plan, Step
from shardc.ir.spec import DType, TensorRef
from shardc.quantize import gemm_reads, quantized_copies

__all__ = ["gemm_buffers"]


def gemm_buffers(plan: Plan, steps: Sequence[Step], sizes: dict[str, int], casts: bool, first: bool,
                 outs: Collection[TensorRef], args: Collection[TensorRef], nbytes: Callable[[TensorRef], float]
                 ) -> tuple[list[Span], float]:
    """The quantized inputs' buffers of the GEMMs among ``steps`` (one phase, in program order), and of their
    bytes those of the copies of ``args`` made first (``first``); ``casts``: as the lowered module's casts (XLA's
    CPU backend), else as a chip's quantize passes; ``nbytes``: a value's bytes as the backend lays it."""
    if not plan.precision.gemms:
        return [], 0.0
    if not casts:
        return quantized_copies(plan, steps, sizes), 0.0
    reads = gemm_reads(plan, steps)
    by_value: dict[tuple[TensorRef, DType], list[int]] = {}
    for k, ref, _, kind in reads:
        by_value.setdefault((ref, kind), []).append(k)
    made = {s.dst: s for s in steps}
    spans: list[Span] = []
    early = 0.0
    for (ref, _), at in by_value.items():
        readers = {j for j, s in enumerate(steps) if ref in s.reads}
        if ref in args and first:
            early += nbytes(ref)
        elif ref not in outs and fusible(made.get(ref)) and readers <= set(at):
            continue  # the map's fusion writes the cast in its own result's place
        spans.append((0 if ref in args and first else at[0], at[-1], nbytes(ref)))
    return spans, early
