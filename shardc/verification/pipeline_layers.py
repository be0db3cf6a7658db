"""The layers a pipelined run holds, where its spec has several ``layers`` blocks: each layer's block (its
spec, input, output and params) for the reference verify runs, and each block's layers in the run.

The model's layers are every layer of the first block, then the next block's; a block's params are
stacked over its own layers ([its layers, ...]), and layer k of a block reads slice k of them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from shardc.errors import ShardcError
from shardc.ir.plan import Plan
from shardc.ir.spec import Spec
from shardc.lowering.pipeline_lowering import PipelineLowered
from shardc.spec.stages import pipeline_of, stage_spec

__all__ = ["Layer", "layer_specs", "model_layers", "block_grads", "run_blocks", "at_run_blocks", "keyed"]


@dataclass(frozen=True)
class Layer:
    """One layer of the model: its block's spec (one layer), input, output and params, its place in the block."""

    spec: Spec
    input: str
    output: str
    params: tuple[str, ...]
    index: int


def layer_specs(lowered: PipelineLowered) -> list[Spec]:
    """Each layer's block's spec (one layer), the model's layers in order (the module need not be loaded)."""
    ends = lowered.ends
    specs = [stage_spec(p.spec) for p in (ends.blocks if ends is not None else (lowered.plan,))]
    return [spec for spec, n in zip(specs, lowered.blocks, strict=True) for _ in range(n)]


def model_layers(lowered: PipelineLowered) -> list[Layer]:
    """Every layer of the model in order, each block's (the first's, then each of ``MORE_BLOCKS``)."""
    ns = lowered.namespace
    ends = lowered.ends
    block = stage_spec(ends.block.spec if ends is not None else lowered.plan.spec)
    first = Layer(block, ns.BLOCK_INPUT, ns.BLOCK_OUTPUT, tuple(ns.PARAMS), 0)
    more = getattr(ns, "MORE_BLOCKS", ())
    counts = lowered.blocks
    specs = [stage_spec(plan.spec) for plan in (ends.more if ends is not None else ())]
    blocks = [first] + [Layer(spec, b["input"], b["output"], tuple(b["params"]), 0)
                        for spec, b in zip(specs, more, strict=True)]
    return [replace(block, index=k) for block, n in zip(blocks, counts, strict=True) for k in range(n)]


def block_grads(lowered: PipelineLowered) -> dict[str, str]:
    """Each pipelined param's gradient name, every block's."""
    ns = lowered.namespace
    grads = {p: ns.GRADS[p] for p in ns.PARAMS}
    for b in getattr(ns, "MORE_BLOCKS", ()):
        grads.update({p: getattr(ns, b["prefix"] + "_GRADS")[p] for p in b["params"]})
    return grads


def run_blocks(plan: Plan, layers: int) -> tuple[int, ...] | None:
    """Each ``layers`` block's layers in the run of ``layers`` (None with one block): the spec's where they
    sum to it, else each block's share of it, one or more."""
    pipe = pipeline_of(plan.spec)
    if pipe is None or not pipe.blocks:
        return None
    if sum(pipe.blocks) == layers:
        return pipe.blocks
    counts = [max(1, round(layers * n / pipe.layers)) for n in pipe.blocks]
    counts[-1] += layers - sum(counts)
    if min(counts) < 1:
        raise ShardcError(f"{layers} layers cannot hold one of each of {len(counts)} `layers` blocks",
                          fix="run on more devices")
    return tuple(counts)


def at_run_blocks(spec: Spec, sizes: dict[str, int], counts: tuple[int, ...]) -> Spec:
    """``spec`` with each ``layers`` block at its layers in the run (``counts``, in order): a count written as
    a number replaced, one written as a dim given that size in ``sizes``."""
    written = [spec.layers, *(n for _, _, n in spec.more_blocks)]
    for given, n in zip(written, counts, strict=True):
        if isinstance(given, str):
            sizes[given] = n
    kept = [given if isinstance(given, str) else n for given, n in zip(written, counts, strict=True)]
    return replace(spec, layers=kept[0], more_blocks=tuple((first, end, n) for (first, end, _), n
                                                           in zip(spec.more_blocks, kept[1:], strict=True)))


def keyed(namespace: Any) -> bool:
    """Whether a lowered pipeline module draws dropout masks: in a block (the first's or a later one's,
    ``B2_KEYED``) or in the statements around them."""
    later = tuple(b["prefix"] + "_KEYED" for b in getattr(namespace, "MORE_BLOCKS", ()))
    return any(getattr(namespace, name, False) for name in ("KEYED", "PRE_KEYED", "POST_KEYED", *later))
