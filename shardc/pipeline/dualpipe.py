"""DualPipe's device orders (DeepSeek-AI 2024, arXiv 2412.19437, section 3.2.1 and figure 5).

Microbatches enter the pipeline from both ends: the first half (direction 0) runs model
stages 0..p-1 on devices 0..p-1, the second half (direction 1) the same stages on devices
p-1..0.  Device d therefore holds model stage d and model stage p-1-d (two copies of the
parameters, each stage on two devices); in the simulation's numbering chunk c < p is
direction 0's stage c on device c, chunk c >= p direction 1's stage c-p on device 2p-1-c.

Each device runs the eight steps of ``DualPipe.step`` in the public deepseek-ai/DualPipe
repository (``dualpipe/dualpipe.py``), with its ``half_rank`` min(d, p-1-d):

1. 2(p/2 - h - 1) forwards of the device's own direction ("phase 0");
2. h + 1 pairs of forwards, one a direction;
3. p/2 - h - 1 times: an input-gradient backward of the other direction (its weight gradient
   deferred), that weight gradient, a forward of the other direction;
4. m/2 - p + h + 1 times two overlapped forward-backward pairs: F of phase 0 with B of phase 1,
   then F of phase 1 with B of phase 0 (the middle two devices run their first pair apart);
5. p/2 - h - 1 times a backward of phase 1, then an overlapped F of phase 1 with B of phase 0;
6. h + 1 pairs of backwards (from the middle one on, their weight gradients deferred);
7. p/2 - h - 1 times a deferred weight gradient, then a backward of phase 0 deferring its own;
8. the h + 1 deferred weight gradients left.

An entry of the order is a group of ops the device runs as one unit: one op; a whole
backward (B then its W, not deferred); or an overlapped pair (an F of one microbatch with the
whole backward of another), whose outputs are sent when the pair ends, as the repository's
``_forward_backward_chunk`` sends them.

DualPipeV (the repository's ``dualpipev.py``) is this order cut in half: on p devices with m
microbatches each device runs what device d of DualPipe over 2p devices and 2m microbatches
runs (half rank d, the middle device p-1), its "phase 0" the V's way down (chunk d of 2p) and
its "phase 1" the way back (chunk 2p-1-d), both for the same microbatches.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from shardc.errors import ShardcError
from shardc.spec.stages import Pipeline, check_dualpipe

__all__ = ["dualpipe_orders", "TWO_WAY", "end_chunks", "device_layers", "Group"]

TWO_WAY = frozenset({"dualpipe"})  # microbatches enter at both ends: two whole stages a device

Key = tuple[str, int, int]  # (kind, microbatch, chunk)
Group = tuple[Key, ...]  # ops a device runs as one unit: one op, a whole backward (B, W), an F&B pair


def dualpipe_orders(stages: int, microbatches: int, v: bool = False) -> list[list[Group]]:
    """Each device's order of groups (see the module docstring); ``v``: DualPipeV's."""
    check_dualpipe("dualpipev" if v else "dualpipe", stages, microbatches)
    if v:  # DualPipe over 2p devices and 2m microbatches, its first half
        return [_device_order(d, 2 * stages, 2 * microbatches, v) for d in range(stages)]
    return [_device_order(d, stages, microbatches) for d in range(stages)]


def end_chunks(name: str, p: int, n: int) -> tuple[frozenset[int], frozenset[int]]:
    """The chunks that run the statements before the block, and those after it: the first and the
    last; DualPipe's first and last of each direction (chunks 0 and p, p-1 and 2p-1)."""
    if name in TWO_WAY:
        return frozenset({0, p}), frozenset({p - 1, n - 1})
    return frozenset({0}), frozenset({n - 1})


def device_layers(pipe: Pipeline) -> tuple[int, ...]:
    """Layers each device holds: its stage's; under DualPipe its two stages', d and p-1-d."""
    split = pipe.stage_layers
    if pipe.schedule.name in TWO_WAY:
        return tuple(n + split[-1 - d] for d, n in enumerate(split))
    return split


def _device_order(d: int, p: int, m: int, v: bool = False) -> list[Group]:
    half, n = p // 2, m // 2
    h = min(d, p - 1 - d)
    second = int(d >= half)  # the second half of the devices see the directions swapped
    middle = d in (half - 1, half)
    made = {"F": [0, 0], "B": [0, 0]}  # ops of each kind made so far in each direction
    deferred: deque[Key] = deque()

    def key(kind: str, phase: int) -> Key:
        direction = phase ^ second
        k = made[kind][direction]
        made[kind][direction] += 1
        if v:  # the two legs of the V: the same microbatch, chunk d down, chunk p-1-d (of p) back
            return kind, k, d if direction == 0 else p - 1 - d
        return kind, k + direction * n, d if direction == 0 else 2 * p - 1 - d

    def forward(phase: int) -> Group:
        return (key("F", phase),)

    def backward(phase: int, zb: bool = False) -> Group:
        _, j, c = b = key("B", phase)
        if zb:
            deferred.append(("W", j, c))
            return (b,)
        return b, ("W", j, c)

    def weight() -> Group:
        return (deferred.popleft(),)

    out: list[Group] = [forward(0) for _ in range(2 * (half - h - 1))]
    for _ in range(h + 1):
        out += [forward(0), forward(1)]
    for _ in range(half - h - 1):
        out += [backward(1, True), weight(), forward(1)]
    for i in range(n - p + h + 1):
        if i == 0 and middle:  # the repository runs these two apart "to further reduce bubble size"
            out += [forward(0), backward(1)]
        else:
            out.append(forward(0) + backward(1))
        out.append(forward(1) + backward(0))
    for _ in range(half - h - 1):
        out += [backward(1), forward(1) + backward(0)]
    out += _drain(h, half, backward, weight)
    if deferred:
        raise ShardcError("dualpipe's order left weight gradients undone (a bug in its order)")
    return out


def _drain(h: int, half: int, backward: Callable[[int, bool], Group], weight: Callable[[], Group]) -> list[Group]:
    """Steps 6 to 8: the last backwards, their weight gradients deferred from the middle one on."""
    out: list[Group] = []
    zb = False
    for i in range(h + 1):
        if i == (h + 1) // 2 and h % 2 == 1:
            zb = True
        out.append(backward(1, zb))
        if i == (h + 1) // 2 and h % 2 == 0:
            zb = True
        out.append(backward(0, zb))
    for _ in range(half - h - 1):
        out += [weight(), backward(0, True)]
    return out + [weight() for _ in range(h + 1)]
