"""The buffers an attention kernel holds in memory beyond its operands and results while it runs:
FlashAttention-2's on a GPU (its HBM workspace), or the lowered loop over key blocks where a backend
with no scratchpad runs it (:mod:`shardc.costmodel.phase_memory` counts either per step)."""

from __future__ import annotations

__all__ = ["flash_workspace", "loop_state"]


def flash_workspace(part: str, rows: int, head: int, element: float, expanded: int) -> list[float]:
    """What FlashAttention-2 (Dao 2023, arXiv 2307.08691; ``mha_bwd`` in its ``flash_api.cpp``) holds in
    memory (HBM) beyond its operands and results, for the step making ``part``.  The forward (the paper's
    algorithm 1) keeps a block of queries' running max, sum and output accumulator on chip and writes the
    output and the logsumexp, values of the plan: nothing more.  The backward (algorithm 2) first writes
    D = rowsum(dO * O) to HBM (``softmax_d``, float32, a row's each) and adds each key block's part of dQ
    into an accumulator in HBM (``dq_accum``, float32, atomically; converted to dQ's dtype at the end, so
    where ``element`` is 4 bytes it is dQ's own buffer), while a block's dK and dV are summed on chip and
    written once; with grouped-query heads it writes dK and dV for every query head (``dk_expanded``,
    ``dv_expanded``: ``expanded`` elements each, K's times the group, in the ``element`` dtype) and sums
    them over the group after.  JAX's Pallas TPU kernel likewise writes D (``di``) to HBM and keeps its
    accumulators in VMEM."""
    if part == "out":
        return []
    return _gradient_workspace(rows, head, element) + [float(expanded) * element] * (2 if expanded else 0)


def _gradient_workspace(rows: int, head: int, element: float) -> list[float]:
    """D = rowsum(dO * O) (float32, a row's each) and the float32 dQ accumulator unless dQ is float32."""
    return [float(rows) * 4] + ([float(rows * head) * 4] if element < 4 else [])


def loop_state(part: str, rows: int, head: int, block: int, element: float, blocked: bool) -> list[float]:
    """The lowered attention kernel's buffers (:func:`shardc.lowering.runtime.attention`'s loop over
    ``block`` keys a step), as XLA's CPU backend, with no scratchpad (SRAM, VMEM) for a kernel's on-chip
    state, holds them (its buffer assignment).  The forward: its running max (a row's) and each block's
    scores and probabilities (the rows by the block), beside its running sum and output accumulator
    (:func:`shardc.costmodel.phase_memory._remade_outputs`).  The backward: D and dQ's accumulator as a chip's
    (:func:`_gradient_workspace`; dK and dV are its results, no group expanded), and its loop body at the
    larger of two moments: Q and dO each copied transposed for each of the two dots of a block that read
    it (the scores' and dK's, dV's and dP's), unless Q is ``blocked`` (its indices shared with K first,
    the dots' batch), all four made at the start of each step beside the block's scores; then, the copies
    dead, the block's probabilities, dP and dS and dQ's part from the block (the rows by the head dim)
    before it is added in.  Float32 (the kernel computes in it)."""
    blocks, queries = float(rows * block) * 4, float(rows * head) * 4
    if part == "out":
        return [float(rows) * 4] + [blocks] * 2
    copies = 0 if blocked else 4
    return _gradient_workspace(rows, head, element) + [max(copies * queries + blocks, 3 * blocks + queries)]
