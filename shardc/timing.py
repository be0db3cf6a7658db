"""The time of a plan on a chip: the one objective the planner minimises and ``shardc cost`` reports.

Each step is a row (:func:`shardc.step_cost.cost_step`: a collective's time from the table of
collectives, an einsum's FLOPs at the rate the chip reaches or its bytes where they take longer, a
memory-bound step's HBM bytes after fusion); a phase's rows sum into its time by :mod:`shardc.phase_time`'s
rule (the collectives' overlap and buckets), in the phases :mod:`shardc.stage_phases` runs them in (forward,
backward, a pipeline's once-a-step gradient reductions, ZeRO-1/2's optimizer phase), each as often as it
runs there (once a microbatch under a pipeline).  All are multiplied by the layer count.

The optimizer's update reads the param, its gradient and the optimizer state and
writes the param and the state (:func:`update_seconds`), once a step, after the
backward.  Uneven dims use the padded per-device size (``ceil(D / devices)``), as
XLA pads them.

The book's model (``Hardware.book``, ``--model book``): every matmul at peak,
memory-bound steps and the update free, every collective overlapping its phase's
compute (``max(compute, comm)`` a phase) with no buckets.

:func:`plan_time` is that step time; ``shardc cost`` reports it as ``step_s`` and
the planner returns, of the plans it builds, the one it makes least.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from shardc.accountings import ACCOUNTINGS, chosen, update_bytes
from shardc.chip_choice import chip_for
from shardc.collectives import Layout
from shardc.device_pieces import local_elements
from shardc.fusion import kept_values, memory_traffic, named_values
from shardc.gather_scales import scale_seconds
from shardc.hardware import Hardware
from shardc.ir.localops import Update
from shardc.ir.plan import Plan, Step
from shardc.ir.precision import Precision
from shardc.ir.spec import TensorRef
from shardc.layer_counts import block_counts, runs, step_count
from shardc.overlap import gathered_before
from shardc.phase_time import PhaseTime, phase_ends, phase_time, step_seconds
from shardc.quantize import quantize_traffic, weight_quantize_bytes
from shardc.ring_sends import shared_rings
from shardc.spec.walk import block_reads
from shardc.stage_phases import microbatched, reductions_exposed, stage_phases, zero_reductions
from shardc.step_cost import StepCost, cost_step, step_dtype
from shardc.topology import AxisLinks, resolve_links

__all__ = ["PlanTime", "plan_time", "plan_chip", "plan_sizes", "plan_links", "update_seconds", "plan_dtype",
           "phase_rows", "local_bytes_of"]


def plan_dtype(plan: Plan) -> Precision:
    """Every tensor's element type (:attr:`shardc.ir.plan.Plan.precision`): an einsum runs in its operands'
    (:func:`shardc.step_cost.step_dtype`)."""
    return plan.precision


@dataclass(frozen=True)
class PlanTime:
    """A plan's times on a chip, all layers: per phase compute and communication, the update, the step."""

    forward: PhaseTime
    backward: PhaseTime  # with the recomputed forward steps
    optimizer: PhaseTime = PhaseTime()
    update_s: float = 0.0  # the optimizer's update of the params (memory-bound), once a step
    # a pipeline's stage: its gradient reductions, once a step on the microbatches' sums, and what of them
    # the last microbatch's backward does not hide (shardc.overlap.reduced_after, as the pipeline's cost)
    reduce: PhaseTime = PhaseTime()
    reduce_exposed_s: float = 0.0
    # what of the optimizer phase the step counts: under `param_gather overlapped` what its all-gathers add beside
    # the next step's first forward (shardc.overlap.gathered_before); None: all of it
    optimizer_exposed_s: float | None = None

    @property
    def forward_compute_s(self) -> float:
        return self.forward.compute_s

    @property
    def forward_comm_s(self) -> float:
        return self.forward.comm_s

    @property
    def backward_compute_s(self) -> float:
        return self.backward.compute_s

    @property
    def backward_comm_s(self) -> float:
        return self.backward.comm_s

    @property
    def forward_s(self) -> float:
        return self.forward.seconds

    @property
    def backward_s(self) -> float:
        return self.backward.seconds

    @property
    def optimizer_s(self) -> float:
        return self.optimizer.seconds

    @property
    def step_s(self) -> float:
        opt = self.optimizer_s if self.optimizer_exposed_s is None else self.optimizer_exposed_s
        return step_seconds(self.forward_s, self.backward_s, self.reduce_exposed_s, opt, self.update_s)

    @property
    def comm_s(self) -> float:
        return self.forward.comm_s + self.backward.comm_s + self.reduce.comm_s + self.optimizer.comm_s

    def key(self) -> tuple[float, float]:
        """What the planner compares: the step time, then less communication."""
        return (self.step_s, self.comm_s)


def plan_sizes(plan: Plan) -> dict[str, int]:
    values = {a.name: a.size for a in plan.spec.mesh.axes}
    values.update(plan.spec.sizes)
    values.update(plan.size_map or {})
    return values


def plan_chip(plan: Plan, hardware: str | Hardware | None = None, hardware_file: str | None = None) -> Hardware:
    """The chip to cost ``plan`` on: a file or chip given here (run as the spec's ``fusion`` and
    ``grad_reduce`` lines say, where it sets neither), else the one it was planned for (``Plan.chip``)."""
    if hardware is None and hardware_file is None:
        return plan.chip
    return chip_for(plan.spec, hardware, hardware_file)


def plan_links(plan: Plan, hw: Hardware, sizes: Mapping[str, int],
               spans: Mapping[str, int] | None = None) -> tuple[dict[str, AxisLinks], tuple[str, ...]]:
    """Each mesh axis's links at these sizes on the plan's topology (:func:`shardc.topology.resolve_links`),
    the spans the plan was made with on this chip and ``spans`` over them; and the notes that say so."""
    given = dict(plan.spans) if plan.hardware == hw.name else {}
    given.update(spans or {})
    return resolve_links(plan.spec.mesh, sizes, hw, plan.topology, given)


def plan_time(plan: Plan, hardware: str | Hardware | None = None, sizes: Mapping[str, int] | None = None,
              spans: Mapping[str, int] | None = None, memo: dict[tuple[object, ...], StepCost] | None = None,
              optimizer: str | None = None) -> PlanTime:
    """The step time of ``plan`` on a chip (by default the one it was planned for), all layers.

    ``memo`` keeps each step's cost across calls: pass one dict only to calls on
    plans of the same spec, chip, sizes and spans (the planner's candidates).  ``optimizer``: the accounting
    the update is costed under (None: the spec's ``optimizer`` line's, else adam10).
    """
    hw = plan_chip(plan, hardware)
    values = dict(sizes) if sizes is not None else plan_sizes(plan)
    counts = block_counts(plan, values)
    links = plan_links(plan, hw, values, spans)[0]
    mesh, dtype = plan.spec.mesh, plan_dtype(plan)
    seen = {} if memo is None else memo  # layers repeat the same steps
    update = update_seconds(plan, values, hw, counts, chosen(plan.spec.optimizer, optimizer), links)
    values, repeats = microbatched(plan, values, hw.book)
    traffic = phase_traffic(plan, values, hw)

    def row(step: Step, moved: float, shared: bool, quantized: float) -> StepCost:
        key = (step.op, step.fn, step.axes, step.volume, tuple(r.dims for r in (step.dst, *step.operands)),
               step.src.dims if step.src is not None else None, moved, step.ahead, step.collective, shared,
               step_dtype(step, dtype), quantized)
        hit = seen.get(key)
        if hit is None:
            hit = seen[key] = cost_step(0, step, mesh, values, hw, links, dtype, moved, text="", shared=shared,
                                        quantize_bytes=quantized)
        return hit

    def rows_of(steps: tuple[Step, ...]) -> list[StepCost]:
        moved = traffic(steps)
        quantized = quantize_traffic(plan, steps, values, hw.fuses) if not hw.book else [0.0] * len(steps)
        return [row(s, b, shared, q) for s, b, shared, q in zip(steps, moved, shared_rings(steps), quantized,
                                                                strict=True)]

    def phase(steps: tuple[Step, ...], times: int, rows: list[StepCost] | None = None) -> PhaseTime:
        rows = rows_of(steps) if rows is None else rows
        return phase_time(((r, step_count(s, counts) * times) for s, r in zip(steps, rows, strict=True)), hw,
                          phase_ends(plan, hw, steps, rows))

    forward, backward, after = stage_phases(plan, repeats)
    rest = len(plan.optimizer) - len(zero_reductions(plan))  # the optimizer's steps left in its phase
    once, opt = after[:len(after) - rest], after[len(after) - rest:]
    back_rows = rows_of(backward)
    reduce = phase(once, 1)
    exposed = reductions_exposed(reduce, phase(backward, 1, back_rows).seconds, hw)
    fwd, gathers = phase(forward, repeats), phase(opt, 1)
    shown = gathered_before(fwd.busy_s / repeats, gathers.seconds, hw.overlap_share, hw.gathers_under_forward)
    return PlanTime(fwd, phase(backward, repeats, back_rows), gathers, update, reduce, exposed, shown)


def phase_rows(plan: Plan, steps: tuple[Step, ...], values: dict[str, int], hw: Hardware,
               spans: Layout, again: frozenset[int] = frozenset()) -> tuple[StepCost, ...]:
    """The rows of a phase; the steps numbered in ``again`` are recomputed forward steps, and say so."""
    moved = phase_traffic(plan, values, hw)(steps)
    dtype = plan_dtype(plan)
    quantized = quantize_traffic(plan, steps, values, hw.fuses) if not hw.book else [0.0] * len(steps)
    rows = (cost_step(i, s, plan.spec.mesh, values, hw, spans, dtype, b, shared=shared, quantize_bytes=q)
            for i, (s, b, shared, q) in enumerate(zip(steps, moved, shared_rings(steps), quantized, strict=True), 1))
    return tuple(replace(r, text=f"(recomputed) {r.text}", recomputed=True) if r.index in again else r for r in rows)


def phase_traffic(plan: Plan, sizes: Mapping[str, int], hw: Hardware) -> Callable[[tuple[Step, ...]], list[float]]:
    """The HBM bytes of each step of a phase of ``plan`` at ``sizes`` as ``hw``'s framework runs them
    (:func:`shardc.fusion.memory_traffic`); none under the book's model."""
    nbytes, kept = local_bytes_of(plan, sizes), kept_values(plan)
    named = named_values(plan) if hw.fuses_statements else None

    def traffic(steps: tuple[Step, ...]) -> list[float]:
        if hw.book:
            return [0.0] * len(steps)
        return memory_traffic(steps, nbytes, kept, hw.fuses, named, lambda ref: float(local_elements(ref, sizes)))

    return traffic


def local_bytes_of(plan: Plan, sizes: Mapping[str, int]) -> Callable[[TensorRef], float]:
    """Bytes of one device's piece of a value of ``plan`` (padded elements times its element bytes)."""
    cache: dict[TensorRef, float] = {}

    def size(ref: TensorRef) -> float:
        hit = cache.get(ref)
        if hit is None:
            hit = cache[ref] = float(local_elements(ref, sizes)) * plan.nbytes(ref.name)
        return hit

    return size


def update_seconds(plan: Plan, sizes: Mapping[str, int], hw: Hardware, counts: Sequence[int],
                   optimizer: str = "adam10", links: Layout | None = None) -> float:
    """The optimizer's update, memory-bound: per element of the state a device updates, it reads the
    param, the gradient (in the param's dtype where the accounting keeps none) and the optimizer state,
    and writes the param and the state (``optimizer`` names the accounting, :mod:`shardc.accountings`), in
    one kernel; under ``fusion none`` in PyTorch AdamW's kernels, one a pass
    (:func:`shardc.accountings.update_bytes`).
    The elements are the ZeRO shard's where the plan updates a shard (its ``update`` steps), else the
    param's piece; a block's params count once a layer.  Then the weights ``gemm f8`` GEMMs read as held
    are quantized, once a step (:func:`shardc.quantize.weight_quantize_bytes`), and the scales of params
    gathered in float8 all-reduced (:func:`shardc.gather_scales.scale_seconds`, on ``links``).  0 under the
    book's model."""
    if hw.book or optimizer not in ACCOUNTINGS:
        return 0.0
    per_param = ACCOUNTINGS[optimizer][0]
    per_element = update_bytes(optimizer, hw.fuses)
    shards = {s.operands[0].name: s.dst for s in plan.optimizer if isinstance(s.fn, Update) and s.operands}
    repeated = block_reads(plan.spec)
    elements = math.fsum(float(local_elements(shards.get(info.name, info.ref), sizes))
                         * runs(info.name not in repeated, repeated.get(info.name, 0), counts)
                         for info in plan.tensors if info.role == "param")
    quantized = weight_quantize_bytes(plan, sizes, counts, per_param)
    return hw.memory_seconds(elements * per_element + quantized) + scale_seconds(plan, sizes, hw, counts, links)
