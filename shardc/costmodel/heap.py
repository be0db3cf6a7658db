"""How a compiler's buffer assignment packs the temporaries of a phase: spans of steps, each a value's
bytes from the step that makes it to the last that reads it, placed in one heap and in the buffers of
the phase's outputs (:func:`shardc.costmodel.phase_memory.phase_memory`'s last step)."""

from __future__ import annotations

__all__ = ["Span", "packed", "outside_outputs"]

Span = tuple[float, float, float]  # a value's first step, last step (a step, or a moment between two) and bytes


def packed(spans: list[Span], align: int = 1) -> float:
    """The bytes of one heap holding every span (first step, last step, bytes) at an offset of its own
    among those alive with it, as XLA's heap simulator packs a program's temporaries: largest first
    (or longest-lived first, whichever packs smaller), each in the smallest gap left free by those
    already placed and alive with it that fits it (best fit), else above them (Wilson et al. 1995's
    best fit; XLA's ``GlobalDecreasingSizeBestFitHeap``, spatial and temporal orders).  A span's life
    is measured, for those orders, in the heap's own clock (:func:`_event_lives`).

    ``align``: every offset a multiple of it (the heap simulator's alignment, the allocator's boundary), so
    a span takes its bytes rounded up to it from the others, but the heap ends where the topmost span's own
    bytes end, not at its rounded end: the heap's size is the largest offset + size of its chunks
    (``HeapSimulator::Result::heap_size``; tp.shard's forward at verify's sizes: XLA's temporaries 344
    bytes, a 24-byte block at offset 320).

    Packing XLA's own buffers (their live ranges and sizes read off a compiled module's dump) gives XLA's heap
    within 0.5%: llama2_13b.shard's backward at verify's sizes, 56,880 bytes to XLA's 57,056, 5 kB above the
    most bytes alive at once (tests/test_heap_xla.py); the sorts' last tie-breaks (XLA's value ids) and the
    clock ticks of a shared buffer (``ShareWith``) are not modelled and moved no offset there."""
    def size(order: list[int]) -> float:
        placed: list[tuple[float, float, float, float]] = []  # first, last, offset, bytes (rounded)
        top = 0.0
        for a, b, own in (spans[k] for k in order):
            n = own if align <= 1 else float(-(-int(own) // align) * align)
            busy = sorted((o, o + m) for c, d, o, m in placed if not (d < a or c > b))
            gaps, at = [], 0.0
            for lo, hi in busy:
                if lo - at >= n:
                    gaps.append((lo - at, at))
                at = max(at, hi)
            offset = min(gaps)[1] if gaps else at
            placed.append((a, b, offset, n))
            top = max(top, offset + own)
        return top
    life = _event_lives(spans)
    spatial = sorted(range(len(spans)), key=lambda k: (-spans[k][2], -life[k]))
    temporal = sorted(range(len(spans)), key=lambda k: (-life[k], -spans[k][2]))
    return min(size(spatial), size(temporal))


def _event_lives(spans: list[Span]) -> list[int]:
    """Each span's life in the heap's clock, which ticks once for each buffer made or freed, not once a
    step: at each step the buffers made then (in order of their last step), then those freed.  XLA's heap
    simulator counts so (``GlobalDecreasingSizeBestFitHeap::Alloc`` and ``Free`` each advance
    ``current_time_``), so of two buffers as long in steps the one alive across more buffers' lives
    sorts first (``tests/specs/llama2_13b_fsdp_tp.shard``'s backward: with its own live ranges, best fit
    in step time packs 9.5 kB where XLA's heap is 11.2 kB, in its clock 11.0 kB, the offsets XLA's)."""
    events = sorted([(a, 0, b, k) for k, (a, b, _) in enumerate(spans)]
                    + [(b, 1, a, k) for k, (a, b, _) in enumerate(spans)])
    made, freed = [0] * len(spans), [0] * len(spans)
    for tick, (_, kind, _, k) in enumerate(events):
        (freed if kind else made)[k] = tick
    return [f - m for m, f in zip(made, freed, strict=True)]


def outside_outputs(spans: list[Span], outputs: list[tuple[int, float]],
                    shared: list[tuple[int, int]] | None = None) -> list[Span]:
    """The ``spans`` (first step, last step, bytes) that find no room in the buffer of one of ``outputs``
    (the step making it, its bytes); ``shared``: pairs of indices into ``spans`` (a dying operand's, its
    elementwise user's) that share one heap buffer, the operand's (from its first step to the user's
    last, in its place), where neither finds room in an output's.

    XLA's buffer assignment puts a value, largest first, in an allocation it fits that holds nothing
    alive at the same time: the buffer of an output a reduction (AllReduce, ReduceScatter) or an
    AllGather makes is free until the collective, which writes it whole (a reduction runs in its
    operand's buffer; in ``residual_blocks.shard``'s backward a weight gradient's unsliced dot and its
    slice sit in the buffer its AllGather fills).  XLA's own rule is wider: ``BufferAssigner::
    AssignSingleHloBuffer`` offers a value every live-out allocation made before it (the buffers sorted by
    decreasing size), the smallest first, and ``MaybeAssignBuffer`` takes one whose values' live ranges
    do not meet the value's (``LiveRangeInterferes``), whatever writes the output (jax 0.10.2:
    residual_blocks.shard's backward puts dE2 in the buffer of dIn, a dot's output; vocab_parallel.shard's
    forward the embedding's partial sum in that of N_t1).  Here only the collectives' outputs host: with
    every output hosting, forward temporaries fall below XLA's where XLA makes values shardc does not
    (vocab_parallel's N made in its dot's layout and copied into its own, 320 bytes at verify's sizes:
    0.95 -> 0.31 of XLA's; gemma2_27b's 0.98 -> 0.77 and moe_layer's 0.99 -> 0.81, not yet read buffer by
    buffer).  An elementwise result shares its dying operand's buffer only in the heap, after:
    ``BufferAssigner::AssignSingleHloBuffer`` tries an
    existing allocation (an output's) before it leaves a value to the heap simulator, which shares an
    operand's buffer with its user (the FP8 MLP's backward in ``tests/test_gemm_lowering.py``: the ReLU
    gradient sits in the buffer of dI's AllReduce output, not in the buffer of dH, its operand)."""
    left = _unhosted(spans, outputs)
    merged = {a: (spans[a][0], spans[b][1], spans[a][2]) for a, b in shared or [] if a in left and b in left}
    users = {b for a, b in shared or [] if a in merged}
    return [merged.get(k, spans[k]) for k in range(len(spans)) if k in left and k not in users]


def _unhosted(spans: list[Span], outputs: list[tuple[int, float]]) -> set[int]:
    """The indices of the ``spans`` that find no room in the buffer of one of ``outputs``
    (:func:`outside_outputs`): each placed, largest first, in the smallest that fits it."""
    hosts = sorted(outputs, key=lambda o: o[1])  # (step made, bytes), the smallest that fits first
    taken: list[list[tuple[float, float]]] = [[] for _ in hosts]
    rest = set()
    for k in sorted(range(len(spans)), key=lambda k: -spans[k][2]):
        first, last, size = spans[k]
        for h, (made, room) in enumerate(hosts):
            if size <= room and last < made and all(last < a or first > b for a, b in taken[h]):
                taken[h].append((first, last))
                break
        else:
            rest.add(k)
    return rest
