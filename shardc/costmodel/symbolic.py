"""``shardc cost`` without dims: the same table as formulas, with the numbers left to the sizes.

The book's table (bytes a collective moves, the time of each step, the
thresholds) is made of formulas in the dims, the mesh sizes and the chip's
figures; only the numbers need the dims.  :func:`cost_formulas` gives, per
phase, each step's bytes and time as formulas in the hardware symbols, the
totals, and the threshold sentences (their chip figures are numbers: the chip is
known), and says which sizes the numbers need.  Memory is the training state and the
residuals of a layer, as formulas (padding of uneven dims needs the sizes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from shardc.collectives import Layout
from shardc.costmodel.cost_report import (
    accounting_of,
    hardware_json,
    latency_note,
    missing_sizes,
    phase_steps,
    renamed_note,
    symbols_of,
    token_dims,
)
from shardc.costmodel.cost_text import hardware_line
from shardc.costmodel.formulas import (
    HardwareSymbols,
    PhaseFormula,
    monomial,
    over,
    phase_formula,
    step_formula,
    text,
)
from shardc.costmodel.memory import residual_formula, state_formula
from shardc.costmodel.thresholds import Threshold, derive
from shardc.hardware import Hardware, check_spans
from shardc.ir.plan import Op, Plan, Step
from shardc.ir.precision import Precision
from shardc.ir.spec import Mesh
from shardc.ring_sends import shared_rings
from shardc.step_cost import describe
from shardc.timing import plan_chip, plan_links

__all__ = ["FormulaRow", "FormulaPhase", "FormulaReport", "cost_formulas"]


@dataclass(frozen=True)
class FormulaRow:
    """One step: its bytes (collectives) or FLOPs (einsums) and its time, as formulas."""

    index: int
    op: Op
    axes: tuple[str, ...]
    text: str
    amount: str  # V in bytes, or per-device FLOPs; "" for local steps
    time: str  # seconds, in the hardware symbols; "" for local steps
    ahead: bool
    compute: bool = False  # FLOPs: an einsum, or a fused kernel's matmuls (attention's)

    def to_json(self) -> dict[str, object]:
        key = "flops_expr" if self.compute else "volume_bytes_expr"
        row: dict[str, object] = {"index": self.index, "op": self.op.value, "text": self.text}
        if self.amount:
            row.update({key: self.amount, "time_s_expr": self.time})
        if not self.compute and self.amount:
            row.update(axes=list(self.axes), path="ahead" if self.ahead else "critical")
        return row


@dataclass(frozen=True)
class FormulaPhase:
    name: str
    rows: tuple[FormulaRow, ...]
    formula: PhaseFormula

    def to_json(self, rows: bool = True) -> dict[str, object]:
        data: dict[str, object] = dict(self.formula.exprs())
        if rows:
            data["rows"] = [r.to_json() for r in self.rows]
        return data


@dataclass(frozen=True)
class FormulaReport:
    """What :func:`cost_formulas` returns; ``str()`` is the text ``shardc cost`` prints without dims."""

    plan: Plan
    hardware: Hardware
    missing: tuple[str, ...]
    layers: int | str  # a count, or the dim that names it
    forward: FormulaPhase
    backward: FormulaPhase
    step: FormulaPhase
    thresholds: tuple[Threshold, ...]
    notes: tuple[str, ...]
    optimizer: FormulaPhase | None = None  # ZeRO-1/2's optimizer phase
    # the training state a device holds, (accounting, param, gradient, optimizer-state bytes) as formulas
    state: tuple[str, str, str, str] = ("adam10", "", "", "")
    residuals: str = ""  # what the backward keeps for one layer, bytes, as a formula

    def to_json(self) -> dict[str, object]:
        return {
            "file": self.plan.spec.filename, "formulas_only": True, "missing_sizes": list(self.missing),
            "hardware": hardware_json(self.hardware, self.step.formula.hw),
            "mesh": {a.name: a.size for a in self.plan.spec.mesh.axes}, "layers": self.layers,
            "save": self.plan.save,
            "recompute": self.plan.recompute,
            "forward": self.forward.to_json(), "backward": self.backward.to_json(),
            **({"optimizer": self.optimizer.to_json()} if self.optimizer is not None else {}),
            "step": self.step.to_json(rows=False),
            "thresholds": [t.sentence for t in self.thresholds],
            "threshold_details": [t.to_json() for t in self.thresholds],
            "memory": {"accounting": self.state[0], "zero": None if self.plan.spec.zero is None else
                       str(self.plan.spec.zero), "param_bytes_expr": self.state[1],
                       "grad_bytes_expr": self.state[2], "optimizer_bytes_expr": self.state[3],
                       "recompute": self.plan.recompute, "residual_bytes_per_layer_expr": self.residuals},
            "notes": list(self.notes),
        }

    def json_text(self) -> str:
        return json.dumps(self.to_json(), indent=2, allow_nan=False)

    def render(self) -> str:
        spec = self.plan.spec
        mesh = ", ".join(f"{a.name}={a.size}" for a in spec.mesh.axes)
        lines = [hardware_line(spec.filename, self.hardware, self.step.formula.hw),
                 f"formulas only: numbers need the size of {', '.join(self.missing)}; mesh {mesh}; "
                 f"layers {self.layers}", ""]
        for phase in (self.forward, self.backward, *((self.optimizer,) if self.optimizer is not None else ())):
            lines += [phase.name, f"  {'#':>3}  {'op':<13} {'axes':<6} {'V bytes / FLOPs':<18}  "
                                  f"{'time':<22}  {'path':<8}  what"]
            lines += [_row(r) for r in phase.rows] or ["  (no steps)"]
            lines += _totals(phase.formula) + [""]
        title = "forward + backward" + (" + optimizer" if self.optimizer is not None else "")
        lines += [f"step ({title})", *_totals(self.step.formula), ""]
        accounting, params, grads, state = self.state
        zero = f", {self.plan.spec.zero}" if self.plan.spec.zero is not None else ""
        lines += [f"memory per device ({accounting}{zero}): params {params}, grads {grads}, optimizer {state} "
                  f"bytes; kept for the backward (--recompute {self.plan.recompute}) {self.residuals} bytes a layer",
                  "", "thresholds"]
        lines += [f"  {t.sentence}" for t in self.thresholds] or ["  (no communication)"]
        lines += ["", "notes"] + [f"  {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        return self.render()


def _row(r: FormulaRow) -> str:
    path = ("ahead" if r.ahead else "critical") if not r.compute else "compute"
    if not r.amount:
        path = "local"
    return (f"  {r.index:>3}  {r.op.title:<13} {','.join(r.axes):<6} {r.amount:<18}  {r.time:<22}  "
            f"{path:<8}  {r.text}")


def _totals(f: PhaseFormula) -> list[str]:
    return [f"  compute {text(f.flops)} FLOPs a device",
            f"  comm    {text(f.comm_bytes)} bytes (AllReduce counted twice, AllToAll a quarter)",
            f"  time    = {f.compute_s_text()} vs {f.comm_s_text()}"]


def _formula_row(index: int, step: Step, mesh: Mesh, names: HardwareSymbols,
                 spans: Layout, sizes: dict[str, int], nbytes: Precision, shared: bool) -> FormulaRow:
    one = step_formula(step, mesh, spans, sizes, nbytes, shared)
    if step.op is Op.EINSUM or one.flops != 0:  # an einsum, or a kernel's matmuls
        return FormulaRow(index, step.op, (), describe(step), text(one.flops), over(one.flops, names.flops),
                          False, compute=True)
    if step.is_collective and step.volume is not None:
        parts = [over(q, w) for q, w in ((one.q_ici, names.ici), (one.q_dcn, names.dcn)) if q != 0]
        return FormulaRow(index, step.op, step.axes, describe(step), text(monomial(step.volume)),
                          " + ".join(parts) or "0", step.ahead)
    return FormulaRow(index, step.op, step.axes, describe(step), "", "", False)


def cost_formulas(plan: Plan, hardware: str | Hardware | None = None, hardware_file: str | None = None,
                  spans: dict[str, int] | None = None, optimizer: str | None = None) -> FormulaReport:
    """The cost report as formulas, for a plan whose dims have no sizes (or only some).

    Memory is the training state alone (:func:`shardc.costmodel.memory.state_formula`
    under the ``optimizer`` accounting, else the spec's): activations need the sizes.
    """
    optimizer = accounting_of(plan, optimizer)
    hw = plan_chip(plan, hardware, hardware_file)
    check_spans(plan.spec.mesh, spans)
    mesh = plan.spec.mesh
    sizes = {a.name: a.size for a in mesh.axes} | dict(plan.spec.sizes)
    all_spans, link_notes = plan_links(plan, hw, sizes, spans)
    names = symbols_of(plan)
    count = plan.spec.layer_counts()
    nbytes = plan.precision  # each ring kernel's sends at its type's bytes
    phases = [FormulaPhase(name, tuple(_formula_row(i, s, mesh, names, all_spans, sizes, nbytes, shared)
                                       for i, (s, shared) in enumerate(zip(steps, shared_rings(steps), strict=True),
                                                                       1)),
                           phase_formula(steps, mesh, count, all_spans, names, sizes, nbytes))
              for name, steps in phase_steps(plan) if steps or name != "optimizer"]
    total = phases[0].formula
    for phase in phases[1:]:
        total = total + phase.formula
    step = FormulaPhase("step", (), total)
    tokens = token_dims(plan)
    found = tuple(t for p in (*phases, step)
                  for t in derive(p.name, p.formula, hw, frozenset(mesh.names), tokens, sizes))
    missing = tuple(missing_sizes(plan, sizes))
    notes = (f"numbers need sizes: add `dims {', '.join(f'{m}=...' for m in missing)}` "
             f"or pass --set {' '.join(f'{m}=...' for m in missing)}",
             f"residual policy: save={plan.save!r} (the plan's; `shardc plan --save` changes it)",
             latency_note(hw, all_spans)) + link_notes + renamed_note(names)
    optimizer_phase = phases[2] if len(phases) > 2 else None
    params, grads, states = state_formula(plan, optimizer, count)
    return FormulaReport(plan, hw, missing, count[0], phases[0], phases[1], step, found, notes, optimizer_phase,
                         (optimizer, text(params), text(grads), text(states)), text(residual_formula(plan)))
