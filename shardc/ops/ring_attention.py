"""Ring attention, the attention family's third context-parallel form: its layouts and its sends.

Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context"): the queries S and the keys T are both sharded over the sequence's mesh axes; each device
keeps its block of queries while the blocks of K and V travel around the ring of those axes, one
``jax.lax.ppermute`` to the next device a step, and each step's block of attention is folded into the
online softmax (the running row max and sum of exponentials).  The n steps' compute hides the n - 1
sends of the next block when a block's attention takes longer than its transfer over one link: the
block (tokens a device) at least the chip's FLOPs over the link's bytes a second, up to the constants
(:func:`shardc.steptime.ring_time`).  The backward passes K and V around again, and with them the
blocks' dK and dV accumulators, which come home after n hops: dK and dV leave the kernel whole over the
ring, with no ReduceScatter.

Causal load balancing (zig-zag, as the LLaMA 3 paper's context parallelism does, Dubey et al. 2024,
section 3.3.2: the sequence cut into 2n chunks, device i holding chunks i and 2n - 1 - i): every device and every ring
step then computes half of its blocks, the average, where the contiguous blocks leave the last device
(2n - 1) / 2n of them and the others waiting.  The kernel takes its blocks contiguous, as every other
step of the plan holds them, and reorders them on the way in and out (two sends of half a block an
array, before and after the ring, exposed); the planner weighs both forms.

A sliding window (``causal, window W``) has no ring form, for the values and for the cost alike.  The ring
passes every block of K and V to every device, n - 1 sends each; under a window a device's queries need only
the keys of the W positions before its block and its own, ceil(W / c) blocks of c tokens, so past those the
ring's steps send blocks no query attends to: the windowed form of context parallelism is a halo exchange of
the blocks before each device's, not a ring, and shardc does not plan one (nor does the ring's kernel mask
a window).  Such a kernel plans its all-gather and Ulysses forms, and the plan says so
(:func:`window_ring_notes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from shardc.collectives import piece
from shardc.ir.localops import Attention
from shardc.ir.plan import Step
from shardc.ir.spec import TensorRef
from shardc.steptime import RingTransfer, Send

__all__ = ["LSE_BYTES", "transfers", "ring_layouts", "window_ring_notes"]

LSE_BYTES = 4  # the row logsumexp is kept in float32 whatever the spec's dtype, as the kernels keep it


def ring_layouts(axes: dict[str, tuple[str, ...]], seq: str, key: str, sizes: Callable[[str], int] | None,
                 causal: bool) -> list[tuple[str, dict[str, tuple[str, ...]], bool]]:
    """The ring forms of a kernel whose queries ``seq`` are sharded: (text, each index's axes with the keys
    sharded as the queries, zig-zag); the zig-zag form only where causal with S and T of one length that
    2n chunks divide (``sizes`` None: unsized, no zig-zag)."""
    ring = axes[seq]
    where = "".join(ring)
    kernel = {**axes, key: ring}
    forms = [(f"{seq} and {key} over {where}, K and V passed around the ring (ring attention)", kernel, False)]
    if causal and sizes is not None:
        n = math.prod(sizes(a) for a in ring)
        if sizes(seq) == sizes(key) and sizes(seq) % (2 * n) == 0:
            forms.append((f"{seq} and {key} over {where} in 2x{n} zig-zag chunks, K and V around the ring "
                          "(ring attention, balanced)", kernel, True))
    return forms


def transfers(step: Step, size: Callable[[str], Any], nbytes: int) -> RingTransfer | None:
    """The sends of a ring kernel's step (its kernel's: the output's, or the first gradient's), None for
    any other: K and V each of the n - 1 steps but the last; in the backward also the dK and dV
    accumulators (float32 at least), the last of their n hops (home) after the compute; with zig-zag, each
    array the kernel reads or makes reordered in two halves before and after the ring, unless the plan holds
    the sequence in zig-zag order (``held``).  ``size`` gives a
    dim's or an axis's size: numbers, or the dims as formulas (:mod:`shardc.costmodel.formulas`; the ring's
    axes then numbers, which the count of the zig-zag's sends depends on)."""
    fn = step.fn
    assert isinstance(fn, Attention)
    if not fn.ring or not fn.kernel:
        return None
    n = math.prod(size(a) for a in fn.ring)

    def elements(ref: TensorRef) -> Any:
        return piece((size(d.name), math.prod((size(a) for a in d.axes), start=1)) for d in ref.dims)

    q, k, v = step.operands[:3]
    rows = elements(q) / size(q.dims[-1].name)  # the row logsumexp: Q's elements less its head dim
    keys = piece([(size(d.name), math.prod(size(a) for a in d.axes)) for d in k.dims if d.name == fn.key])
    sends = [Send(elements(k), nbytes, n - 1), Send(elements(v), nbytes, n - 1)]
    reordered: list[tuple[Any, int]]
    if fn.part in ("out", "lse"):
        reordered = [(elements(q), nbytes), (elements(k), nbytes), (elements(v), nbytes),
                     (elements(step.dst), nbytes), (rows, LSE_BYTES)]
    else:
        wide = max(nbytes, 4)
        sends += [Send(elements(k), wide, n - 1), Send(elements(v), wide, n - 1),
                  Send(elements(k), wide, 1, hidden=False), Send(elements(v), wide, 1, hidden=False)]
        o = step.operands[3]
        reordered = [(elements(q), nbytes), (elements(k), nbytes), (elements(v), nbytes), (elements(o), nbytes),
                     (rows, LSE_BYTES), (elements(o), nbytes), (elements(q), nbytes), (elements(k), nbytes),
                     (elements(v), nbytes)]  # in: Q, K, V, O, lse, dO; out: dQ, dK, dV
    if fn.zigzag and not fn.held:  # two halves each way (of two devices' first halves, none moves: chunks 0, 1 stay)
        sends += [Send(count / 2, width, 1 if n == 2 else 2, hidden=False) for count, width in reordered]
    return RingTransfer(fn.ring, n, keys, tuple(sends))


def window_ring_notes(steps: tuple[Step, ...]) -> tuple[str, ...]:
    """One note a windowed fused attention whose query sequence the plan shards: no ring form was weighed
    (the module's docstring says why)."""
    sharded = {d.name for s in steps for ref in (s.dst, *s.operands) for d in ref.dims if d.axes}
    notes = {f"{s.dst.name} = attention(... window {s.fn.window}) with {s.fn.query} sharded: ring attention is "
             f"not a candidate (a ring passes every key block to every device, where each device's queries need "
             f"only the keys of the {s.fn.window} positions up to its block: a halo exchange, not planned); the "
             "all-gather and Ulysses forms were weighed": None
             for s in steps if isinstance(s.fn, Attention) and s.fn.kernel and s.fn.part == "out"
             and s.fn.window is not None and s.fn.query in sharded}
    return tuple(notes)
