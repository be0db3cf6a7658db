"""Which layers of each ``layers`` block a pipeline's chunks and devices hold.

The model's layers, in order, are every layer of the first ``layers`` block, then the next
block's (DeepSeek-V3: 3 dense layers, then 58 MoE layers).  The stages hold contiguous runs of
that list, as the spec's split says (:attr:`~shardc.spec.stages.Pipeline.stage_layers`), so a
stage at a boundary between blocks holds layers of both.  A schedule that cuts a stage into
chunks (interleaved, zbv, dualpipev) lays the model's chunks in order, chunk c holding its
device's share of that device's layers; DualPipe's chunks c and p + c are both model stage c,
run in the two directions.  With one block every count is the chunk's or the device's layers.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardc.pipeline.dualpipe import TWO_WAY
from shardc.pipeline.schedules import device_of
from shardc.spec.stages import Pipeline

__all__ = ["block_bounds", "chunk_blocks", "device_blocks", "stage_blocks", "counted_device"]

Counts = tuple[float, ...]  # layers of each block


def block_bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Each block's run of the model's layers, [first, end), the blocks holding ``counts`` layers in order."""
    out, at = [], 0
    for n in counts:
        out.append((at, at + n))
        at += n
    return out


def _bounds(pipe: Pipeline) -> list[tuple[int, int]]:
    return block_bounds(pipe.blocks or (pipe.layers,))


def _runs(pipe: Pipeline) -> list[tuple[float, float]]:
    """Each model chunk's run of the model's layers, [first, end), in chunk order."""
    p, split = pipe.stages, pipe.stage_layers
    if pipe.schedule.name in TWO_WAY:  # chunk c and chunk p + c: model stage c, each direction
        starts = [sum(split[:s]) for s in range(p)]
        stage = [(float(a), float(a + n)) for a, n in zip(starts, split, strict=True)]
        return stage + stage
    out, at = [], 0.0
    for c in range(p * pipe.chunks):
        size = split[device_of(pipe.schedule.name, c, p)] / pipe.chunks
        out.append((at, at + size))
        at += size
    return out


def chunk_blocks(pipe: Pipeline) -> tuple[Counts, ...]:
    """Each model chunk's layers of each block (fractions where a device's chunks share its layers unevenly)."""
    bounds = _bounds(pipe)
    return tuple(tuple(max(0.0, min(end, hi) - max(start, lo)) for lo, hi in bounds) for start, end in _runs(pipe))


def device_blocks(pipe: Pipeline) -> tuple[tuple[int, ...], ...]:
    """Each device's layers of each block: those of the chunks it holds (DualPipe's two stages, d and p-1-d).
    Whole numbers: a device holds whole layers, and with several blocks each chunk does
    (:func:`shardc.spec.stages.check_pipeline`)."""
    p, chunks = pipe.stages, chunk_blocks(pipe)
    held: list[list[int]] = [[] for _ in range(p)]  # each device's chunks, in chunk order (one pass, not one a device)
    for c in range(len(chunks)):
        held[device_of(pipe.schedule.name, c, p)].append(c)
    return tuple(tuple(round(sum(chunks[c][b] for c in mine)) for b in range(len(chunks[0]))) for mine in held)


def stage_blocks(pipe: Pipeline) -> tuple[Counts, ...]:
    """Each stage's layers of each block, the runs whose times a microbatch takes through one stage: a
    device's layers, except under DualPipe, whose device holds two whole stages, each run by half the
    microbatches (model stage s's)."""
    if pipe.schedule.name in TWO_WAY:
        return chunk_blocks(pipe)[:pipe.stages]
    return tuple(tuple(float(n) for n in counts) for counts in device_blocks(pipe))


def counted_device(pipe: Pipeline) -> tuple[int, ...]:
    """The layers of each block on the device a stage's tables count: the device holding the most layers,
    among them the one holding most of the later blocks (whose layers come last, DeepSeek-V3's MoE after its
    dense ones)."""
    return max(device_blocks(pipe), key=lambda counts: (sum(counts), counts[::-1]))
