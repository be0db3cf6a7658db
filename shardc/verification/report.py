"""What ``shardc verify`` found: rows of values and collectives, the report, its tables.

A planned collective is paired with a compiled-HLO one of the same kind, axes and
bytes; a planned one left unpaired, or an HLO one the plan does not have, is a
mismatch row, so the report lists every difference rather than the first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from shardc.ir.plan import Op, Plan, Step
from shardc.ir.precision import ARRAY_DTYPE
from shardc.ir.spec import DType, Spec
from shardc.lowering.sizes import devices_to_check
from shardc.planner.plan_text import step_label
from shardc.verification.hlo import Collective
from shardc.verification.memory_check import MemoryCheck, render_memory
from shardc.verification.pipeline_memory import StageMemoryCheck, render_stage_memory
from shardc.verification.ring_hlo import ring_sends

__all__ = ["ValueRow", "CollectiveRow", "Report", "match_collectives", "render_report", "axes_text", "compare_values",
           "Planned", "planned_collective", "unplanned_row", "hlo_axes", "plan_row_key", "STORAGE_DTYPE", "TOLERANCE",
           "POWER", "cut_note", "gemm_note", "gather_note"]

STORAGE_DTYPE = {"f8": ARRAY_DTYPE[DType.F8]}  # inputs are rounded to this first
# (rtol, atol) of max|lowered - reference| <= atol + rtol * max(magnitude), per compute dtype,
# where the magnitude (reference.magnitudes) sums the absolute values of the terms behind each
# value, so cancellation does not shrink the bound below the rounding it must admit.  Over every
# example run in each dtype (benchmarks/verify_dtypes.py) the worst error is 4.9e-3 of it in
# bfloat16 (unit roundoff 2**-9) and 6e-4 in float16 (2**-10): rtol is 5x and 7x that, far
# below the error of a wrong plan (a missing or doubled reduction is of the order of the value).
# A check must fail an error of this fraction of a value (a statistic off by a constant, a 10%
# scale on an activation): a row whose bound passes more is checked again in float32.
POWER = 0.05
TOLERANCE = {"float32": (2e-5, 1e-5), "bfloat16": (2.5e-2, 1e-3), "float16": (4e-3, 1e-4)}


def gemm_note(spec: Spec) -> list[str]:
    """What verify checks of a spec's ``gemm T`` lines (:meth:`shardc.ir.spec.Spec.gemm_lines`)."""
    if not spec.gemm_lines():
        return []
    return [f"{'; '.join(spec.gemm_lines())}: each of those GEMMs (forward, Dgrad, Wgrad) reads its operands rounded "
            "to its type (f8: E4M3's 3 mantissa bits, each element at a power-of-two scale of its own, none under "
            "2**-11; XLA:CPU runs an FP8 dot by converting up, so the module casts to FP8 and back) in the module "
            "and in the reference alike, so values pass at the compute type's tolerance; a GEMM that skipped its "
            "rounding errs by up to 2**-4 of each operand, E4M3's half step, and an operand the module and the "
            "reference round to neighbouring E4M3 values (their inputs differ by the compute type's rounding) "
            "errs by one step there"]


def gather_note(spec: Spec) -> list[str]:
    """What verify checks of a spec's ``param_gather ... in T``: the module gathers each param in its own type."""
    kind = spec.param_gather_dtype
    if kind is None:
        return []
    return [f"param_gather in {kind}: the lowered module gathers each param in its own type, not cast to {kind} "
            "and back (the values checked are the uncast params'); a param's all-gather row counts its elements at "
            f"{kind.nbytes} byte{'s' if kind.nbytes > 1 else ''} each, as the plan and the cost move them, where the "
            "module's moved its own type's"]


@dataclass(frozen=True)
class ValueRow:
    phase: str
    tensor: str
    max_error: float
    max_reference: float
    tolerance: float
    ok: bool
    note: str = ""

    @property
    def catches(self) -> float:
        """The least error, as a fraction of the largest reference value, that this row fails."""
        return self.tolerance / self.max_reference if self.max_reference > 0 else math.nan


@dataclass(frozen=True)
class CollectiveRow:
    phase: str
    step: str  # the plan's step, or "" for a collective the plan does not have
    kind: str
    plan_axes: str
    plan_bytes: int | None
    hlo_op: str
    hlo_axes: str
    hlo_bytes: int | None
    ok: bool
    note: str = ""


@dataclass
class Report:
    file: str
    mesh: dict[str, int]
    sizes: dict[str, int]
    dtype: str
    compute_dtype: str
    tolerance: tuple[float, float]
    values: list[ValueRow] = field(default_factory=list)
    collectives: list[CollectiveRow] = field(default_factory=list)
    input_scale: float = 1.0  # inputs are standard normal times this, times their own scale
    input_scales: dict[str, float] = field(default_factory=dict)  # each input's (shardc.verification.scales)
    notes: list[str] = field(default_factory=list)
    memory_check: MemoryCheck | StageMemoryCheck | None = None  # per-device memory against XLA's (not part of ``ok``)

    @property
    def ok(self) -> bool:
        return bool(self.values) and all(r.ok for r in self.values) and all(r.ok for r in self.collectives)

    def to_json(self) -> dict[str, Any]:
        """Strict JSON data: a value that is not a finite number is null."""
        data = _finite(asdict(self))
        for row, value in zip(data["values"], self.values, strict=True):
            row["catches"] = _finite(value.catches)
        data["memory_check"] = self.memory_check.to_json() if self.memory_check is not None else None
        data["ok"] = self.ok
        return data  # type: ignore[no-any-return]


def _finite(data: Any) -> Any:
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [_finite(v) for v in data]
    return data


def axes_text(axes: tuple[str, ...]) -> str:
    return ",".join(axes) or "-"


def plan_row_key(step: Step, mesh: dict[str, int]) -> tuple[Op, tuple[str, ...]]:
    axes = tuple(a for a in step.axes if mesh[a] > 1)
    return step.op, tuple(sorted(axes)) if step.op is Op.ALL_REDUCE else axes


@dataclass(frozen=True)
class Planned:
    """A planned collective as the HLO is searched for it: its row's label, its kind, its axes of size
    > 1 (sorted for an AllReduce, whose group has no order) and its bytes."""

    label: str
    op: Op
    axes: tuple[str, ...]
    want: int | None


def planned_collective(phase: str, step: Step, mesh: dict[str, int], sizes: dict[str, int],
                       cut: tuple[str, ...]) -> Planned | CollectiveRow:
    """A planned collective to look for in the HLO, or its row already when there is none to look for:
    over an axis the run cut to 1 to fit the devices (it fails: not run), or over size-1 axes only."""
    want = int(step.volume.evaluate(sizes)) if step.volume is not None else None
    op, axes = plan_row_key(step, mesh)
    label = f"{step_label(step)} {step.src} -> {step.dst}"
    skipped = [a for a in step.axes if a in cut]
    if skipped:
        return CollectiveRow(phase, label, step.op.title, axes_text(step.axes), want, "-", "-", None, False,
                             f"not run: {'axis' if len(skipped) == 1 else 'axes'} {','.join(skipped)} cut to 1 "
                             "to fit the devices (raise --devices)")
    if not axes:
        return CollectiveRow(phase, label, step.op.title, axes_text(step.axes), want, "-", "-", None, True,
                             "size-1 axes: nothing to move")
    return Planned(label, op, axes, want)


def unplanned_row(phase: str, c: Collective, nbytes: int) -> CollectiveRow:
    """A collective of the HLO that no planned one matched: it fails."""
    return CollectiveRow(phase, "", c.kind.title if c.kind else c.hlo_op, "-", None, c.hlo_op, axes_text(c.axes),
                         c.bytes(nbytes), False, "not in the plan")


def match_collectives(phase: str, steps: tuple[Step, ...], found: list[Collective],
                      sizes: dict[str, int], nbytes: int, cut: tuple[str, ...] = (),
                      element: Callable[[Step], int] | None = None) -> list[CollectiveRow]:
    """Pair each planned collective with an HLO one of the same kind, axes and bytes.

    A floating HLO element is priced at ``nbytes`` (the spec's dtype's), or where ``element`` is given
    at the bytes the planned step moves (:meth:`shardc.ir.plan.Plan.moved_nbytes`: a `dtype T` line's type, a
    param's gather type).

    ``cut`` lists axes the run shrank to 1 though the spec's are larger: a step over
    one of them was not (or only partly) run, so its row fails.
    """
    mesh = {a: sizes[a] for s in steps for a in s.axes}
    left = [c for c in found if c.axes]  # a group of one device moves nothing
    rows: list[CollectiveRow] = []
    for step in (s for s in steps if s.is_collective):
        p = planned_collective(phase, step, mesh, sizes, cut)
        if isinstance(p, CollectiveRow):
            rows.append(p)
            continue
        same = [c for c in left if c.kind is p.op and hlo_axes(c) == p.axes]
        size = nbytes if element is None else element(step)
        exact = [c for c in same if c.bytes(size) == p.want]
        if not same:
            rows.append(CollectiveRow(phase, p.label, step.op.title, axes_text(p.axes), p.want, "-", "-",
                                      None, False, "not in the compiled HLO: XLA found it unneeded"))
            continue
        chosen = (exact or same)[0]
        left.remove(chosen)
        got = chosen.bytes(size)
        rows.append(CollectiveRow(phase, p.label, step.op.title, axes_text(p.axes), p.want, chosen.hlo_op,
                                  axes_text(chosen.axes), got, got == p.want,
                                  "" if got == p.want else "bytes differ"))
    return rows + ring_rows(phase, steps, left, sizes, nbytes) + [unplanned_row(phase, c, nbytes) for c in left]


def ring_rows(phase: str, steps: tuple[Step, ...], left: list[Collective], sizes: dict[str, int],
              nbytes: int) -> list[CollectiveRow]:
    """A ring kernel's collective-permutes (:mod:`shardc.verification.ring_hlo`), each group found by its
    count of permutes of its elements over the ring's axes; those found leave ``left``."""
    rows = []
    for sends in ring_sends(steps, sizes):
        mine = [c for c in left if c.hlo_op == "collective-permute" and c.elements == sends.elements
                and c.axes == sends.axes][:sends.count]
        for c in mine:
            left.remove(c)
        ok = len(mine) == sends.count
        rows.append(CollectiveRow(phase, f"{step_label(sends.step)} {sends.step.dst}: {sends.count} sends around the "
                                  "ring", "CollectivePermute", axes_text(sends.axes), sends.elements * nbytes,
                                  f"collective-permute x {len(mine)}", axes_text(sends.axes),
                                  sends.elements * nbytes if mine else None, ok,
                                  "" if ok else f"{len(mine)} of {sends.count} permutes of those elements found"))
    return rows


def hlo_axes(c: Collective) -> tuple[str, ...]:
    return tuple(sorted(c.axes)) if c.kind is Op.ALL_REDUCE else c.axes


def render_report(report: Report) -> str:
    """The verification as two tables, values then collectives."""
    sizes = ", ".join(f"{k}={v}" for k, v in report.sizes.items() if k not in report.mesh)
    mesh = ", ".join(f"{k}={v}" for k, v in report.mesh.items())
    rtol, atol = report.tolerance
    storage = STORAGE_DTYPE.get(report.dtype)
    rounded = f", inputs rounded to {storage}" if storage else ""
    lines = [f"# verify {report.file}: mesh {mesh} ({math.prod(report.mesh.values())} devices), {sizes}",
             f"# computed in {report.compute_dtype} (spec dtype {report.dtype}{rounded}), inputs standard normal "
             f"times {report.input_scale:g} and their own scales{_scales(report.input_scales)}; values pass "
             f"when max|err| <= {atol:g} + {rtol:g}*max|terms| (column catches: the least error failed, "
             f"of max|ref|; a row that would pass {POWER:.0%} is checked again in float32); "
             f"HLO bytes priced in {report.dtype} (integers, the token ids, at their own width)"]
    lines += [f"# note: {note}" for note in report.notes]
    lines += ["", "values"]
    lines += _table(["phase", "tensor", "max|err|", "max|ref|", "bound", "catches", ""],
                    [[r.phase, r.tensor, _float(r.max_error, ".2e"), _float(r.max_reference, ".3g"),
                      _float(r.tolerance, ".2e"), _percent(r.catches), _status(r.ok, r.note)]
                     for r in report.values])
    lines += ["", "collectives (plan vs compiled HLO)"]
    lines += _table(["phase", "plan step", "axes", "bytes", "HLO", "axes", "bytes", ""],
                    [[r.phase, r.step or "-", r.plan_axes, _num(r.plan_bytes), r.hlo_op, r.hlo_axes,
                      _num(r.hlo_bytes), _status(r.ok, r.note)]
                     for r in report.collectives])
    check = report.memory_check
    if check is not None:
        text = render_memory(check) if isinstance(check, MemoryCheck) else render_stage_memory(check)
        lines += ["", text.rstrip("\n")]
    verdict = "verified: values and collectives match" if report.ok else "verification FAILED"
    lines += ["", verdict + ("; the notes above list what was not compared" if report.notes else "")]
    return "\n".join(lines) + "\n"


def _scales(scales: dict[str, float]) -> str:
    shown = [f"{k} {v:.3g}" for k, v in scales.items() if v != 1.0]
    return f" ({', '.join(shown)})" if shown else ""


def _percent(x: float) -> str:
    return f"{x * 100:.2g}%" if math.isfinite(x) else "-"


def _float(x: float, spec: str) -> str:
    return format(x, spec) if math.isfinite(x) else "-"


def _status(ok: bool, note: str) -> str:
    return ("ok" if ok else "MISMATCH") + (f" ({note})" if note else "")


def _num(n: int | None) -> str:
    return "-" if n is None else str(n)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    if not rows:
        return ["  (none)"]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    return ["  " + "  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip()
            for row in [header, *rows]]


def cut_note(cut: tuple[str, ...], devices: int, plan: Plan) -> str:
    """Why a report over a mesh with axes cut to 1 is not a pass, and the devices that would make it one."""
    return (f"axes {', '.join(cut)} cut to 1 to fit {devices} devices: their collectives "
            f"are not run (use --devices {devices_to_check(plan)})")


def compare_values(phase: str, pairs: list[tuple[str, Any, np.ndarray, np.ndarray]], tol: tuple[float, float],
                   limit: float) -> list[ValueRow]:
    """One row per (tensor, lowered value, reference, magnitude), passing within ``tol`` (rtol, atol
    of the magnitude); anything not compared fails: NaN or inf in the value, a reference beyond
    ``limit`` or not finite, a wrong shape.  Where the reference is -inf (a causal mask) the value
    must be -inf too."""
    rows = []
    for name, got, ref, magnitude in pairs:
        value = np.asarray(got).astype(np.float64)
        masked = np.isneginf(ref)  # causal's -inf: the lowered value must be -inf there too
        if masked.any() and value.shape == ref.shape and np.array_equal(np.isneginf(value), masked):
            ref, value = np.where(masked, 0.0, ref), np.where(masked, 0.0, value)
        scale = float(np.max(np.abs(ref))) if ref.size else 0.0
        terms = float(np.max(magnitude)) if ref.size else 0.0
        note = ""
        if value.shape != ref.shape:
            note = f"shape {value.shape}, reference {ref.shape}: not compared"
        elif not np.all(np.isfinite(ref)) or scale > limit:
            note = "reference out of the dtype's range: not compared"
        elif not np.all(np.isfinite(value)):
            note = "NaN or inf in the lowered value"
        if note:
            rows.append(ValueRow(phase, name, math.nan, scale, math.nan, False, note))
            continue
        err = float(np.max(np.abs(value - ref))) if ref.size else 0.0
        bound = tol[1] + tol[0] * terms
        rows.append(ValueRow(phase, name, err, scale, bound, err <= bound))
    return rows
