"""Attention's all-gather form balanced in zig-zag chunks, as LLaMA 3 runs its context parallelism.

LLaMA 3's context parallelism (Dubey et al. 2024, section 3.3.2) gathers K and V along the keys T and
has each device run its queries against every key, the sequence cut into 2n chunks for the n devices
along S's axes, device i holding chunks i and 2n - 1 - i.  Under a causal mask chunk i sees i + 1/2
chunks of keys and chunk 2n - 1 - i sees 2n - i - 1/2: 2n chunks' worth on every device, half of its
S x T share, where contiguous blocks leave the last device (2n - 1) / 2n of its share and the others
waiting on it.  shardc offers the form where the plan holds the sequence in that order
(:mod:`shardc.planner.zigzag_order`: the tokens loaded in it, every step that ignores positions run on
it as it is, as the paper's data loader hands them out): each device's block of Q is then its two
chunks, and K and V gathered along T arrive in the order held, so the kernel is the all-gather form's
with its causal mask comparing the true positions of the places held
(:func:`shardc.lowering.runtime_ring.zigzag_positions`).  Its moves are the all-gather form's (K and V
gathered, dK and dV reduce-scattered onto their sharding along T), its compute the balanced half
(:class:`shardc.ir.localops.Attention`'s ``zigzag``, which the attention family's FLOPs count as the
zig-zag ring's).  In a plan that keeps the sequence in its own order the form is not offered: its
queries would be reordered in and its output out at every call, the sends the zig-zag ring's held
order saves.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["balanced_gather"]


def balanced_gather(axes: dict[str, tuple[str, ...]], seq: str, key: str, sizes: Callable[[str], int] | None,
                    causal: bool) -> list[tuple[str, dict[str, tuple[str, ...]]]]:
    """The balanced all-gather form of a kernel whose queries ``seq`` are sharded over ``axes[seq]``: (its
    text, each index's axes, the all-gather form's), where causal with S and T of one length that 2n chunks
    divide (``sizes`` None: unsized, none)."""
    if not causal or sizes is None or not axes[seq]:
        return []
    n = math.prod(sizes(a) for a in axes[seq])
    if sizes(seq) != sizes(key) or sizes(seq) % (2 * n):
        return []
    return [(f"{seq} over {''.join(axes[seq])} in 2x{n} zig-zag chunks, K and V gathered along {key} "
             "(all-gather, balanced)", axes)]
