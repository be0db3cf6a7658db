"""The microbatch count a candidate layout runs: the spec's microbatch size held, as frameworks hold it.

Frameworks are given the size of a microbatch on a data-parallel rank and the global batch, not the
count: Megatron-LM's ``--micro-batch-size`` and ``--global-batch-size``, its count
``global_batch_size // (micro_batch_size * data_parallel_size)``
(``megatron/core/num_microbatches_calculator.py``, ``ConstantNumMicroBatchesCalculator``); DeepSpeed's
``train_micro_batch_size_per_gpu`` and ``train_batch_size``, the gradient accumulation steps derived
from them; torchtitan's ``local_batch_size`` and ``pipeline_parallel_microbatch_size``.  So a
layout with another data-parallel size runs the spec's microbatch size, the spec's batch divided by
(its microbatch count x its data-parallel size), at another count: a spec written for 32-way data
parallelism with 144 microbatches of one sequence runs 72 of one at 64-way.  The spec's own layout
keeps its count.  Where the held size does not divide a candidate's batch share, the count is the
nearest one that does (the planner refuses a microbatch a device would run part of:
:func:`shardc.pipeline.boundary.splits`), and the row says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from fractions import Fraction
from functools import lru_cache

from shardc.errors import ShardcError
from shardc.ir.spec import Spec
from shardc.pipeline.boundary import batch_axes, splits
from shardc.planner.contexts import tensor_infos
from shardc.planner.graph import build_graph
from shardc.spec.validate import validate

__all__ = ["Held", "held_of", "microbatch_size"]


@dataclass(frozen=True)
class Held:
    """A pipelined spec's microbatch size, held over its candidate layouts."""

    dim: str  # the batch dim microbatches cut
    batch: int  # its size
    axes: tuple[str, ...]  # the data-parallel axes: those sharding it where a stage sends it on
    count: int  # the spec's own microbatch count
    own: tuple[tuple[str, int], ...]  # the spec's own mesh sizes

    @property
    def size(self) -> Fraction:
        """The microbatch size on a data-parallel device: the batch / (microbatches x data-parallel devices)."""
        return Fraction(self.batch, self.count * math.prod(dict(self.own)[a] for a in self.axes))

    def at(self, sizes: Mapping[str, int]) -> tuple[int, str]:
        """The count a layout at ``sizes`` runs, and a note saying which and why: the spec's own at its own
        layout, else the count that holds the microbatch size, else the nearest count the batch splits into."""
        if all(sizes.get(a, n) == n for a, n in self.own):
            return self.count, f"microbatches {self.count}: the spec's own, at its own layout"
        devices = math.prod(sizes.get(a, dict(self.own)[a]) for a in self.axes)
        target = Fraction(self.batch) / (self.size * devices)
        where = f"{self.dim}={self.batch} over {devices} data-parallel devices ({', '.join(self.axes) or 'none'})"
        if target.denominator == 1 and splits(self.batch, int(target), devices):
            return int(target), (f"microbatches {target}: the spec's microbatch size held ({self.size} of {self.dim} a "
                                 f"device), {where}")
        near = sorted(_divisors(self.batch), key=lambda m: (abs(m - target), -m))
        count = next(m for m in near if splits(self.batch, m, devices))  # 1 always splits
        return count, (f"microbatches {count}: the nearest count to {float(target):g}, which would hold the spec's "
                       f"microbatch size ({self.size} of {self.dim} a device) but does not split {where}")

    def apply(self, candidate: Spec) -> tuple[Spec, str | None]:
        """``candidate`` (the spec at other mesh sizes) at the count :meth:`at` gives it, and the note; at the
        spec's own count where its schedule refuses that one (interleaved's multiple of the stages).  No note
        with the pipeline switched off."""
        if candidate.mesh.pipeline_axis is None:
            return candidate, None
        count, why = self.at({a.name: a.size for a in candidate.mesh.axes})
        if count == candidate.microbatches:
            return candidate, why
        derived = replace(candidate, microbatches=count)
        try:
            validate(derived)
        except ShardcError as err:
            refusal = err.message.splitlines()[0]
            return candidate, f"microbatches {candidate.microbatches}: the spec's own, as {refusal} ({why})"
        return derived, why


@lru_cache(maxsize=16)  # a search prepares each of its specs at every candidate's sizes
def held_of(spec: Spec) -> Held | None:
    """``spec``'s microbatch size to hold, where it has a pipeline axis, a ``microbatches`` line and a size for
    the batch dim (else None: a spec without the line runs its default count, one a stage)."""
    if spec.microbatches is None or not any(a.pipeline for a in spec.mesh.axes):
        return None
    found = _batch_axes(spec.filename, spec.statements, spec)
    batch = dict(spec.dims).get(found[0]) if found is not None else None
    own = tuple((a.name, a.size) for a in spec.mesh.axes)
    return None if found is None or batch is None else Held(found[0], batch, found[1], spec.microbatches, own)


def microbatch_size(spec: Spec) -> Fraction | None:
    """A pipelined ``spec``'s microbatch size on a data-parallel device, its batch / (microbatches x data-parallel
    devices), as its mesh sizes give it (None: no pipeline, or no size for its batch dim)."""
    pipe = spec.mesh.pipeline_axis
    found = _batch_axes(spec.filename, spec.statements, spec) if pipe is not None else None
    batch = dict(spec.dims).get(found[0]) if found is not None else None
    if pipe is None or found is None or batch is None:
        return None
    devices = math.prod(spec.mesh.axis(a).size for a in found[1])
    return Fraction(batch, (spec.microbatches or pipe.size) * devices)


# (label, statements) -> the batch dim and its data-parallel axes: the same for every candidate of a spec (its
# statements set them, not its sizes), asked for each candidate's template key
_BATCH: dict[tuple[object, ...], tuple[str, tuple[str, ...]] | None] = {}
_KEPT = 64  # specs whose batch axes are kept (a search has one a --with spec)


def _batch_axes(label: str | None, statements: tuple[object, ...], spec: Spec) -> tuple[str, tuple[str, ...]] | None:
    """The batch dim of ``spec`` and its data-parallel axes (:func:`shardc.pipeline.boundary.batch_axes`); None
    without a batch dim (the planner says so, candidate by candidate)."""
    key = (label, statements)
    if key not in _BATCH:
        if len(_BATCH) >= _KEPT:
            _BATCH.clear()
        try:
            graph = build_graph(spec)
            dim, axes = batch_axes(spec, tensor_infos(graph, dict(graph.declared)))
            _BATCH[key] = (dim, tuple(axes))
        except ShardcError:
            _BATCH[key] = None
    return _BATCH[key]


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})
