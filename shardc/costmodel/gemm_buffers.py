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
scheduler runs first what reads only the arguments), writes the cast of a value that dies into it (only such
GEMMs read it, the phase neither takes nor returns it) in that value's buffer, and a cast a dot reads
through a copy into its layout in that copy; any other it makes at the first GEMM reading it, alive to the
last.  Seen in the compiled examples' buffer assignment with ``gemm f8`` added, at 16x verify's sizes:
``tests/test_gemm_lowering.py``'s spec's forward holds W1's and W2's casts from its start, 64 kB of its 65.5
kB of temporaries, and its backward makes the cotangents' casts in the fusions making them;
``fsdp.shard``'s forward casts the gathered W_in in its buffer and the gathered W_out in its copy into
the dot's layout.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from shardc.costmodel.heap import Span
from shardc.costmodel.layout_copies import layout_copies
from shardc.ir.plan import Plan, Step
from shardc.ir.spec import DType, TensorRef
from shardc.quantize import gemm_reads, quantized_copies

__all__ = ["gemm_buffers"]


class Backend(Protocol):
    """What of a backend's buffer rules (:class:`shardc.costmodel.phase_memory.Buffers`) these buffers follow."""

    @property
    def gemm_casts(self) -> bool: ...
    @property
    def arguments_first(self) -> bool: ...
    @property
    def dots_canonical(self) -> bool: ...


def gemm_buffers(plan: Plan, steps: Sequence[Step], sizes: dict[str, int], backend: Backend,
                 outs: Collection[TensorRef], args: Collection[TensorRef], nbytes: Callable[[TensorRef], float]
                 ) -> tuple[list[Span], float]:
    """The quantized inputs' buffers of the GEMMs among ``steps`` (one phase, in program order), and of their
    bytes those of the copies of ``args`` made first; as the lowered module's casts where ``backend`` makes
    them (``gemm_casts``), else as a chip's quantize passes; ``nbytes``: a value's bytes as the backend lays
    it.  A cast a dot reads through a copy into its layout (:func:`shardc.costmodel.layout_copies.layout_copies`)
    is made in that copy, no buffer of its own."""
    if not plan.precision.gemms:
        return [], 0.0
    if not backend.gemm_casts:
        return quantized_copies(plan, steps, sizes), 0.0
    by_value: dict[tuple[TensorRef, DType], list[int]] = {}
    for k, ref, _, kind in gemm_reads(plan, steps):
        if ref not in layout_copies(steps[k], backend.dots_canonical):
            by_value.setdefault((ref, kind), []).append(k)
    spans: list[Span] = []
    early = 0.0
    for (ref, _), at in by_value.items():
        readers = {j for j, s in enumerate(steps) if ref in s.reads}
        first = ref in args and backend.arguments_first
        if first:
            early += nbytes(ref)
        elif ref not in outs and readers <= set(at):
            continue  # the cast takes the buffer of the value, which dies into it
        spans.append((0 if first else at[0], at[-1], nbytes(ref)))
    return spans, early
