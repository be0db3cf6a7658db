"""What a fused attention kernel's step costs: its FLOPs, its time on the chip and its HBM traffic.

The family (:mod:`shardc.ops.attention`) registers these as its :attr:`Family.flops`, :attr:`Family.seconds`,
:attr:`Family.traffic` and :attr:`Family.further`; the family's choice among its forms (all-gather, Ulysses, ring) times
their kernels by :func:`kernel_seconds` too.

FLOPs (the steps' :attr:`Family.flops`): the forward is two matmuls, ``Q·K`` and ``P·V``, ``4 B S T N H``
(each head dim counted where it is contracted; a second pair's ``Qr·Kr`` adds ``2 B S T N J``); with
``causal`` the chip runs only the unmasked half of the S x T blocks, ``2 B S T N H`` (the count
FlashAttention's benchmarks use); with ``causal, window W`` (a sliding window: query s sees keys
s - W < t <= s) only the band of the window's blocks, FlashAttention-2's ``window_size`` skipping the rest
(:mod:`shardc.ops.attention_share`; no ring form: :mod:`shardc.ops.ring_attention` says why).  The backward
makes the scores again and runs four more (``dV = P·dO``, ``dP = dO·V``, ``dQ = dS·K``,
``dK = dS·Q``): 2.5 times the forward's FLOPs on the chip.  Model FLOPs (MFU's) count the whole
S x T, causal, windowed or not, and the backward as twice the forward (the recomputation not counted): the
convention of PaLM's MFU (Chowdhery et al. 2022, appendix B: ``6N + 12 L H Q T`` a token) and of
Megatron-LM's (Narayanan et al. 2021), which the published MFUs shardc is compared with used.  Hardware
FLOPs (HFU's) are what all the devices run: the unmasked half where causal (a window's band), and the backward's
recomputed scores (2.5 times the forward).  The kernel runs below the chip's matmul rate, its backward
below its forward: :func:`kernel_seconds` prices it at the chip's attention figures.  The
step making the logsumexp is the same kernel as the output's: no FLOPs of its own, and likewise
the backward's kernel is the first gradient step's, the others its further results.

HBM traffic (:attr:`Family.traffic`): the forward reads Q, K and V and writes O and the
logsumexp; the backward reads Q, K, V, O, the logsumexp and dO and writes dQ, dK and dV.  The kernel's
measured rate times whole calls, these reads and writes inside them: its step's bytes, its further results'
writes with them, take time only where they outlast its FLOPs (:func:`shardc.step_cost.cost_step`, the
roofline a matmul has).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shardc.collectives import einsum_flops, piece
from shardc.ir.localops import Attention
from shardc.ir.plan import Step
from shardc.ops.attention_share import busiest_share, total_share
from shardc.ops.registry import Sizer
from shardc.spec.attention_call import roles

if TYPE_CHECKING:
    from shardc.hardware import Hardware

__all__ = ["attention_flops", "kernel_seconds", "kernel_traffic", "further_result"]


def attention_flops(step: Step, size: Callable[[str], Any]) -> tuple[Any, Any, Any]:
    """(per-device FLOPs, model FLOPs, hardware FLOPs) of a step: see the module's doc."""
    assert isinstance(step.fn, Attention)
    part = step.fn.part
    if not step.fn.kernel:
        return 0, 0, 0  # a further result of the kernel another step runs
    q, k, v = step.operands[:3]
    keys = tuple(d for d in k.dims if d.name == step.fn.key)
    queries = (q, step.operands[3]) if step.fn.rope else (q,)  # Q·K: rows x T x H; the second pair's: x J
    terms = [einsum_flops(((d.name, d.axes) for d in (*x.dims, *keys)), size) for x in queries]
    scores = (sum(t[0] for t in terms), sum(t[1] for t in terms))
    r = roles(q.indices, k.indices, v.indices, step.fn.key)
    rows = tuple(d for d in q.dims if d.name != r.head)
    values = einsum_flops(((d.name, d.axes) for d in (*rows, *keys, v.dims[-1])), size)  # P·V: rows x T x Hv
    num, den = busiest_share(step, size)
    num *= math.prod((size(a) for a in step.fn.ring), start=1)  # a ring's n steps each take a block of T
    run, of = total_share(step, size)  # all devices together: the causal half of S x T, or a window's band
    if part == "out":
        model = scores[1] + values[1]
        return (scores[0] + values[0]) * num / den, model, model * run / of
    # the backward's kernel: the scores again, dP = dO·V, dQ = dS·K, dK = dS·Q, dV = P·dO
    return (3 * scores[0] + 2 * values[0]) * num / den, 2 * scores[1] + 2 * values[1], \
        (3 * scores[1] + 2 * values[1]) * run / of


def kernel_seconds(step: Step, size: Callable[[str], int], hw: Hardware, dtype: str) -> float:
    """The time of a step's kernel on the chip (0 for the kernel's further results): its FLOPs at the fraction
    of peak the chip's attention kernel reaches, forward or backward, with the keys a call attends over (K's
    block along T on the device: T whole, or a ring step's block; a sliding window's W where fewer)
    (:meth:`Hardware.attention_seconds`).  The one time of the kernel: the cost model's, the planner's choice
    of form, and the ring's overlap use it."""
    assert isinstance(step.fn, Attention)
    flops = attention_flops(step, size)[0]
    if not flops:
        return 0.0
    keys = next(d for d in step.operands[1].dims if d.name == step.fn.key)
    block = piece(((size(keys.name), math.prod(size(a) for a in keys.axes)),))
    # The rates are measured of causal calls by length L (shardc.kernel_rates: FlashAttention's published
    # figures), a query seeing at most L keys; under a window each sees at most W.  The causal call of length W
    # has as many partly masked blocks a row for its keys (one over W/2 on average; the window's two over W)
    # and shorter rows, so its rate is one the windowed kernel reaches at least: W, not T, where W < T
    seen = block if step.fn.window is None else min(block, step.fn.window)
    return hw.attention_seconds(float(flops), float(seen), step.fn.part != "out", dtype)


def kernel_traffic(step: Step, nbytes: Sizer) -> tuple[tuple[float, ...], float]:
    """A kernel reads its operands once; its further results (the logsumexp, the other gradients) are
    written, nothing read again."""
    assert isinstance(step.fn, Attention)
    if step.fn.kernel:
        return tuple(nbytes(o) for o in step.operands), nbytes(step.dst)
    return tuple(0.0 for _ in step.operands), nbytes(step.dst)


def further_result(step: Step) -> bool:
    """A further result of the kernel (the logsumexp, dK, dV): its write is the kernel's, inside the calls its
    measured rate times, so it counts with the kernel's bytes against its FLOPs
    (:func:`shardc.fusion.memory_traffic`)."""
    assert isinstance(step.fn, Attention)
    return not step.fn.kernel
