"""``shardc.cost(plan)``: the figures of a plan on a chip, as a report with text and JSON forms.

Per phase (forward, backward) and for the whole training step (``step``, both):

* ``compute_s``: per-device einsum FLOPs over C.
* ``comm_s``: the collectives' times (bandwidth term, bounded below by latency),
  split into ``critical_s`` and ``ahead_s`` (``Step.ahead``: weight gathers and
  weight-gradient reductions can be issued off the critical path).
* ``bound``: ``"communication"`` iff comm_s > compute_s, all collectives assumed
  to overlap compute, as the book draws it; ``step_s`` is the time under that
  overlap (:mod:`shardc.timing`: ``max(compute_s, comm_s)`` a phase, forward plus
  backward for the step; the planner minimises exactly this figure),
  ``step_ahead_only_s = max(compute_s, ahead_s) + critical_s`` (a phase) the time
  when only ahead-of-time collectives overlap.
* ``mfu``: model FLOPs / (devices * C * step_s); with ``mfu=0.4``,
  ``step_at_mfu_s`` = model FLOPs / (devices * C * 0.4), the book's estimate.

Everything is multiplied by the layer count (``layers`` in the spec).  Every
figure also comes as a formula (bandwidth terms; ``*_expr`` in JSON).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

from shardc.collectives import NCCL_BASE_S, NCCL_NET_STEP_S, NCCL_NVLINK_STEP_S, Layout
from shardc.costmodel.cost_text import render
from shardc.costmodel.formulas import HardwareSymbols, PhaseFormula, hardware_symbols, phase_formula
from shardc.costmodel.memory import ACCOUNTINGS, Memory, memory
from shardc.costmodel.pipeline_cost import PipelineCost, pipeline_cost
from shardc.costmodel.thresholds import Threshold, derive
from shardc.errors import ShardcError
from shardc.hardware import Hardware, check_spans
from shardc.ir.plan import Plan, Step
from shardc.ir.spec import Mesh, Network
from shardc.timing import (
    StepCost,
    bound_of,
    cost_step,
    phase_seconds,
    plan_chip,
    plan_links,
    plan_sizes,
    resolve_layers,
    step_seconds,
)
from shardc.topology import AxisLinks

__all__ = ["PhaseCost", "CostReport", "cost", "resolve_sizes", "resolve_layers", "missing_sizes"]


@dataclass(frozen=True)
class PhaseCost:
    """The totals of one phase (or of the step), for all layers."""

    name: str
    rows: tuple[StepCost, ...]
    layers: int
    devices: int
    hardware: Hardware
    formula: PhaseFormula
    mfu_assumed: float | None = None
    parts: tuple[PhaseCost, ...] = ()  # the step: its phases, which run one after the other

    def _sum(self, attr: str, only: bool | None = None) -> float:
        rows = [r for r in self.rows if only is None or (r.is_collective and r.ahead is only)]
        return math.fsum(getattr(r, attr) * (1 if r.once else self.layers) for r in rows)

    @property
    def compute_flops(self) -> float:
        """Per-device einsum FLOPs."""
        return self._sum("flops")

    @property
    def model_flops(self) -> float:
        """FLOPs of the whole einsums, all devices."""
        return self._sum("model_flops")

    @property
    def compute_s(self) -> float:
        """Compute time."""
        return self._sum("compute_s")

    @property
    def comm_bytes(self) -> float:
        """Weighted volume (AllReduce x2, AllToAll x1/4)."""
        return self._sum("weighted")

    @property
    def comm_s(self) -> float:
        """Collective time, each bounded below by its latency."""
        return self._sum("comm_s")

    @property
    def comm_bandwidth_s(self) -> float:
        """Collective time, bandwidth terms only (what the formulas give)."""
        return self._sum("bandwidth_s")

    @property
    def critical_s(self) -> float:
        """Collectives on the critical path."""
        return self._sum("comm_s", only=False)

    @property
    def ahead_s(self) -> float:
        """Collectives that can be issued ahead."""
        return self._sum("comm_s", only=True)

    @property
    def bound(self) -> str:
        return bound_of(self.compute_s, self.comm_s)

    @property
    def step_s(self) -> float:
        if self.parts:
            return step_seconds(*(p.step_s for p in self.parts))
        return phase_seconds(self.compute_s, self.comm_s)

    @property
    def step_ahead_only_s(self) -> float:
        if self.parts:
            return step_seconds(*(p.step_ahead_only_s for p in self.parts))
        return max(self.compute_s, self.ahead_s) + self.critical_s

    @property
    def mfu(self) -> float:
        peak = self.devices * self.hardware.flops * self.step_s
        return self.model_flops / peak if peak else 0.0

    @property
    def step_at_mfu_s(self) -> float | None:
        if self.mfu_assumed is None:
            return None
        return self.model_flops / (self.devices * self.hardware.flops * self.mfu_assumed)

    def exprs(self) -> dict[str, str]:
        return self.formula.exprs()

    def to_json(self, rows: bool = True) -> dict[str, object]:
        data: dict[str, object] = {
            "comm_bytes": self.comm_bytes, "comm_s": self.comm_s,
            "comm_bandwidth_s": self.comm_bandwidth_s, "critical_s": self.critical_s,
            "ahead_s": self.ahead_s, "compute_flops": self.compute_flops,
            "model_flops": self.model_flops, "compute_s": self.compute_s, "step_s": self.step_s,
            "step_ahead_only_s": self.step_ahead_only_s, "bound": self.bound, "mfu": self.mfu,
            "step_at_mfu_s": self.step_at_mfu_s,
        }
        data.update(self.exprs())
        if rows:
            data["rows"] = [r.to_json() for r in self.rows]
        return data


@dataclass(frozen=True)
class CostReport:
    """What :func:`cost` returns; ``str()`` is the table ``shardc cost`` prints."""

    plan: Plan
    hardware: Hardware
    sizes: dict[str, int]
    layers: int
    forward: PhaseCost
    backward: PhaseCost
    step: PhaseCost
    memory: Memory
    thresholds: tuple[Threshold, ...]
    notes: tuple[str, ...] = field(default=())
    pipeline: PipelineCost | None = None  # with a `pipeline` mesh axis (shardc.costmodel.pipeline_cost)
    optimizer: PhaseCost | None = None  # ZeRO-1/2's optimizer phase (no rows without a `zero 1|2` line)

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "file": self.plan.spec.filename,
            "hardware": hardware_json(self.hardware, self.step.formula.hw),
            "sizes": self.sizes, "layers": self.layers, "devices": self.step.devices,
            "save": self.plan.save, "recompute": self.plan.recompute,
            "zero": _zero_json(self.plan),
            "forward": self.forward.to_json(), "backward": self.backward.to_json(),
            **({"optimizer": self.optimizer.to_json()} if self.optimizer is not None else {}),
            "step": self.step.to_json(rows=False), "memory": self.memory.to_json(),
            "thresholds": [t.sentence for t in self.thresholds],
            "threshold_details": [t.to_json() for t in self.thresholds],
            "notes": list(self.notes),
        }
        if self.pipeline is not None:
            data["pipeline"] = self.pipeline.to_json()
        return data

    def json_text(self) -> str:
        return json.dumps(self.to_json(), indent=2, allow_nan=False)  # strict JSON: a NaN is a bug

    def render(self) -> str:
        return render(self)

    def __str__(self) -> str:
        return self.render()


def _zero_json(plan: Plan) -> dict[str, object] | None:
    zero = plan.spec.zero
    return None if zero is None else {"stage": zero.stage, "axes": list(zero.axes)}


def hardware_json(hw: Hardware, names: HardwareSymbols) -> dict[str, object]:
    """The chip's figures in JSON, and the symbols the formulas write them with."""
    return {"name": hw.name, "C": hw.flops, "W_ici": hw.w_ici, "W_dcn": hw.w_dcn, "hbm_bytes": hw.hbm_bytes,
            "hop_latency": hw.hop_latency,
            "symbols": dict(zip(("C", "W_ici", "W_dcn"), names.names(), strict=True))}


def cost(plan: Plan, hardware: str | Hardware | None = None, sizes: dict[str, int] | None = None,
         mfu: float | None = None, optimizer: str = "adam10", hardware_file: str | None = None,
         spans: dict[str, int] | None = None, **options: object) -> CostReport:
    """Cost ``plan`` on a chip (a preset name, a :class:`Hardware`; default the chip it was planned for).

    ``spans`` maps a mesh axis to the physical ICI axes it is laid over (the book's
    M_X; default 1): its collectives get that many times the bandwidth.
    """
    if options:
        raise ShardcError(f"unknown cost option(s) {', '.join(sorted(options))}",
                          fix="use hardware=, sizes=, mfu=, optimizer=, hardware_file=, spans=")
    if mfu is not None and not 0 < mfu <= 1:
        raise ShardcError(f"--mfu must be in (0, 1], got {mfu}", fix="write e.g. --mfu 0.4")
    if optimizer not in ACCOUNTINGS:
        raise ShardcError(f"unknown optimizer accounting {optimizer!r}", fix="use " + ", ".join(ACCOUNTINGS))
    hw = plan_chip(plan, hardware, hardware_file)
    check_spans(plan.spec.mesh, spans)
    values = resolve_sizes(plan, sizes)
    links, link_notes = plan_links(plan, hw, values, spans)
    layers, layer_symbol = resolve_layers(plan, values)
    mesh = plan.spec.mesh
    devices = math.prod(values[a] for a in mesh.names)
    pipe = pipeline_cost(plan, hw, values, links, optimizer)
    if pipe is not None:  # the tables are one stage's: its layers and devices, the whole batch at once
        devices //= pipe.pipeline.stages  # (resolve_layers gave the slowest stage's layers)
    count = layer_symbol if layer_symbol is not None else layers
    names = symbols_of(plan)
    again = frozenset(range(1, len(plan.recomputed) + 1))
    fwd, bwd, opt = (PhaseCost(name, _rows(steps, mesh, values, hw, links, again if name == "backward" else
                                           frozenset()), layers, devices, hw,
                               phase_formula(steps, mesh, count, links, names, values), mfu)
                     for name, steps in phase_steps(plan))
    step = PhaseCost("step", fwd.rows + bwd.rows + opt.rows, layers, devices, hw,
                     fwd.formula + bwd.formula + opt.formula, mfu, (fwd, bwd, opt))
    phases = (fwd, bwd, opt, step) if opt.rows else (fwd, bwd, step)
    mem = memory(plan, values, layers, hw.hbm_bytes, optimizer)
    tokens = token_dims(plan)
    found = [t for p in phases for t in derive(p.name, p.formula, hw, frozenset(mesh.names), tokens, values)]
    notes = _notes(plan, hw, values, links) + renamed_note(names) + link_notes + tuple(
        f"mesh axis {a} ({values[a]} chips) spans {len(k.rings)} physical ICI axes: {len(k.rings)}x the "
        f"bandwidth, the book's M_{a} (--spans {a}=1 to cost it as one)"
        for a, k in links.items() if hw.book and len(k.rings) > 1)
    return CostReport(plan, hw, values, layers, fwd, bwd, step, mem, tuple(found), notes, pipe, opt)


def latency_note(hw: Hardware, links: Layout) -> str:
    """How latency enters the times: a bound per hop on a torus, NCCL's base and steps on a GPU cluster."""
    if any(isinstance(k, AxisLinks) and k.nodes for k in links.values()):
        return ("formulas and thresholds use bandwidth terms; times add NCCL's latency to each collective "
                f"({NCCL_BASE_S * 1e6:g} us, and {NCCL_NVLINK_STEP_S * 1e6:g} us a ring step over NVLink, "
                f"{NCCL_NET_STEP_S * 1e6:g} us over InfiniBand)")
    return ("formulas and thresholds use bandwidth terms; times also bound each collective "
            f"below by latency ({hw.hop_latency:g} s a hop)")


def phase_steps(plan: Plan) -> tuple[tuple[str, tuple[Step, ...]], ...]:
    """The phases as costed: forward; backward with the forward steps it recomputes first; optimizer."""
    return (("forward", plan.forward), ("backward", plan.recomputed + plan.backward),
            ("optimizer", plan.optimizer))


def _rows(steps: tuple[Step, ...], mesh: Mesh, values: dict[str, int], hw: Hardware,
          spans: Layout, again: frozenset[int] = frozenset()) -> tuple[StepCost, ...]:
    """The rows of a phase; the steps numbered in ``again`` are recomputed forward steps, and say so."""
    rows = (cost_step(i, s, mesh, values, hw, spans) for i, s in enumerate(steps, 1))
    return tuple(replace(r, text=f"(recomputed) {r.text}") if r.index in again else r for r in rows)


def used_dims(plan: Plan) -> set[str]:
    """Every dim the plan's tensors and steps have."""
    used = {d.name for info in plan.tensors for d in info.ref.dims}
    for phase in (plan.forward, plan.backward):
        used.update(d.name for s in phase for ref in (s.dst, *s.operands) for d in ref.dims)
    return used


def used_names(plan: Plan) -> set[str]:
    """Every dim and mesh axis name the plan's formulas can contain."""
    return used_dims(plan) | set(plan.spec.mesh.names) | set(plan.spec.sizes)


def missing_sizes(plan: Plan, sizes: dict[str, int]) -> list[str]:
    """The dims (and a named layer count) that ``sizes`` lacks, sorted."""
    needed = used_dims(plan) | ({plan.spec.layers} if isinstance(plan.spec.layers, str) else set())
    return sorted(needed - set(sizes))


def symbols_of(plan: Plan) -> HardwareSymbols:
    """The hardware symbols of this plan's formulas, renamed where a dim or axis has the book's name."""
    return hardware_symbols(used_names(plan))


def renamed_note(names: HardwareSymbols) -> tuple[str, ...]:
    """Say which hardware symbols were renamed because the spec uses the book's names."""
    pairs = [f"{book} is written {ours}" for book, ours in zip(HardwareSymbols().names(), names.names(),
                                                               strict=True) if book != ours]
    if not pairs:
        return ()
    return (f"the spec names a dim or axis like a hardware symbol: in the formulas the chip's "
            f"{', '.join(pairs)}",)


def resolve_sizes(plan: Plan, sizes: dict[str, int] | None) -> dict[str, int]:
    """Dims and mesh sizes: the plan's, then the spec's, then ``sizes`` over them."""
    values = plan_sizes(plan)
    values.update(sizes or {})
    missing = [m for m in missing_sizes(plan, values) if m != plan.spec.layers]  # resolve_layers says it
    if missing:
        raise ShardcError("costs need the size of every dim; missing " + ", ".join(missing),
                          fix="add them to the `dims` line, or pass --set " +
                          " ".join(f"{m}=..." for m in missing) +
                          " (shardc.costmodel.symbolic.cost_formulas gives the formulas without them)")
    return values


def token_dims(plan: Plan) -> dict[str, tuple[str, ...]]:
    """Indices no param has (the batch/token dims, B), each with the axes sharding it where declared."""
    model = {d.name for info in plan.tensors if info.role == "param" for d in info.ref.dims}
    out: dict[str, tuple[str, ...]] = {}
    for info in sorted(plan.tensors, key=lambda i: i.role != "input"):  # inputs first
        for dim in info.ref.dims:
            if dim.name not in model:
                out.setdefault(dim.name, dim.axes)
    return out


def _notes(plan: Plan, hw: Hardware, sizes: dict[str, int], links: Layout) -> tuple[str, ...]:
    notes = [f"residual policy: save={plan.save!r} (the plan's; `shardc plan --save` changes it)",
             *plan.notes]
    if plan.strategy == "search" and plan.hardware != hw.name:
        notes.append(f"the plan was chosen for {plan.hardware}, costed here on {hw.name}: "
                     f"`shardc plan --hardware {hw.name}` may find a faster one")
    notes.append(latency_note(hw, links))
    ici = [a.name for a in plan.spec.mesh.axes if a.network is not Network.DCN]
    group = math.prod(sizes[a] for a in ici)
    nodes = any(isinstance(k, AxisLinks) and k.nodes for k in links.values())
    if hw.ici_domain is not None and group > hw.ici_domain and not nodes:
        notes.append(f"{hw.name}: the ICI/NVLink axes {', '.join(ici)} span {group} chips but a node "
                     f"has {hw.ici_domain}; mark the axes that cross nodes `over dcn`")
    return tuple(notes)
