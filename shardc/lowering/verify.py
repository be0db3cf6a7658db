"""``shardc verify``: run a lowered plan and check it by value and by compiled HLO.

The plan is made at the spec's own sizes (so cost-based choices are the real
ones) and lowered at small sizes that fit the devices present: the mesh shrunk
to at most ``devices`` (largest axis first), each dim the least common multiple
of the shard counts it meets times a small distinct factor.  Values are
computed in float32 (XLA on CPU runs bf16 collectives in f32 anyway) and
compared with the float64 numpy reference; HLO volumes are priced in the
spec's dtype, as the plan's are.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from shardc.lowering import reference
from shardc.lowering.hlo import Collective, collectives
from shardc.lowering.sizes import small_sizes
from shardc.planner.ir import Op, Plan, Step
from shardc.planner.render import step_label
from shardc.spec.ir import Spec

if TYPE_CHECKING:
    from shardc.lowering.api import Lowered

__all__ = ["ValueRow", "CollectiveRow", "Report", "verify", "match_collectives",
           "TOLERANCE"]

# (rtol, atol) of max|lowered - reference| <= atol + rtol * max|reference|, per compute dtype
_F32_MAX = 1e30  # references larger than this are not compared (float32 overflows nearby)
TOLERANCE = {"float32": (2e-5, 1e-5), "float64": (1e-12, 1e-12)}


@dataclass(frozen=True)
class ValueRow:
    phase: str
    tensor: str
    max_error: float
    max_reference: float
    tolerance: float
    ok: bool
    note: str = ""


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

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.values) and all(r.ok for r in self.collectives)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        return data


def _axes_text(axes: tuple[str, ...]) -> str:
    return ",".join(axes) or "-"


def _plan_row_key(step: Step, mesh: dict[str, int]) -> tuple[Op, tuple[str, ...]]:
    axes = tuple(a for a in step.axes if mesh[a] > 1)
    return step.op, tuple(sorted(axes)) if step.op is Op.ALL_REDUCE else axes


def match_collectives(phase: str, steps: tuple[Step, ...], found: list[Collective],
                      sizes: dict[str, int], nbytes: int) -> list[CollectiveRow]:
    """Pair each planned collective with an HLO one of the same kind, axes and bytes."""
    mesh = {a: sizes[a] for s in steps for a in s.axes}
    left = [c for c in found if c.axes]  # a group of one device moves nothing
    rows: list[CollectiveRow] = []
    for step in (s for s in steps if s.is_collective):
        want = int(step.volume.evaluate(sizes)) if step.volume is not None else None
        op, axes = _plan_row_key(step, mesh)
        label = f"{step_label(step)} {step.src} -> {step.dst}"
        if not axes:
            rows.append(CollectiveRow(phase, label, step.op.title, _axes_text(step.axes), want, "-", "-",
                                      None, True, "size-1 axes: nothing to move"))
            continue
        same = [c for c in left if c.kind is op and _hlo_axes(c) == axes]
        exact = [c for c in same if c.bytes(nbytes) == want]
        if not same:
            rows.append(CollectiveRow(phase, label, step.op.title, _axes_text(axes), want, "-", "-",
                                      None, False, "not in the compiled HLO: XLA found it unneeded"))
            continue
        chosen = (exact or same)[0]
        left.remove(chosen)
        got = chosen.bytes(nbytes)
        rows.append(CollectiveRow(phase, label, step.op.title, _axes_text(axes), want, chosen.hlo_op,
                                  _axes_text(chosen.axes), got, got == want,
                                  "" if got == want else "bytes differ"))
    for c in left:
        rows.append(CollectiveRow(phase, "", c.kind.title if c.kind else c.hlo_op, "-", None, c.hlo_op,
                                  _axes_text(c.axes), c.bytes(nbytes), False, "not in the plan"))
    return rows


def _hlo_axes(c: Collective) -> tuple[str, ...]:
    return tuple(sorted(c.axes)) if c.kind is Op.ALL_REDUCE else c.axes


def _compare(phase: str, got: dict[str, Any], want: dict[str, np.ndarray], names: list[str],
             tol: tuple[float, float]) -> list[ValueRow]:
    rows = []
    for name in names:
        value, ref = np.asarray(got[name], np.float64), want[name]
        scale = float(np.max(np.abs(ref))) if ref.size else 0.0
        if not scale <= _F32_MAX:  # exp of a long sum: float32 cannot hold the true value
            rows.append(ValueRow(phase, name, math.nan, scale, math.nan, True,
                                 "beyond float32 range: not compared"))
            continue
        err = float(np.max(np.abs(value - ref))) if ref.size and value.shape == ref.shape else math.inf
        bound = tol[1] + tol[0] * scale
        rows.append(ValueRow(phase, name, err, scale, bound, err <= bound))
    return rows


def _unplanned(plan: Plan, ref_grads: dict[str, np.ndarray]) -> list[ValueRow]:
    """A mismatch for each input with a gradient the plan does not make (only `const` ones may lack one)."""
    planned = {g.name for g in plan.grads}
    const = set(plan.spec.const)
    return [ValueRow("backward", name, math.nan, math.nan, math.nan, False, "the plan makes no such gradient")
            for name in ref_grads if name not in planned and plan.primal(name) not in const]


def reference_inputs(lowered: Lowered, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inputs as the unsharded reference reads them: in float64, partial sums summed."""
    stacked = lowered.namespace.STACKED_INPUTS  # the module's own list: one source of truth
    return {k: (v.sum(axis=0) if k in stacked else v).astype(np.float64) for k, v in inputs.items()}


def verify(plan_or_spec: Plan | Spec, devices: int = 8, sizes: dict[str, int] | None = None,
           seed: int = 0, save: str = "default") -> Report:
    """Lower at small sizes, run forward and backward, check values and HLO collectives."""
    from shardc.lowering.api import lower
    from shardc.planner.planner import plan as make_plan

    plan = plan_or_spec if isinstance(plan_or_spec, Plan) else make_plan(plan_or_spec, save=save)
    if plan.spec.mesh.pipeline_axis is not None:  # GPipe over the stage axis: its own module
        from shardc.lowering.pipeline_verify import verify_pipeline

        return verify_pipeline(plan, devices, seed)
    small = {**small_sizes(plan, devices), **(sizes or {})}
    lowered = lower(plan, sizes=small)
    mesh = dict(lowered.module.mesh)
    tol = TOLERANCE["float32"]
    report = Report(plan.spec.filename or "<spec>", mesh, dict(lowered.sizes or {}),
                    str(plan.spec.dtype), "float32", tol)
    inputs = lowered.random_inputs(seed)
    cotangents = lowered.random_cotangents(seed + 1)
    wide = reference_inputs(lowered, inputs)
    ref_out = reference.forward(plan.spec, wide)
    report.values += _compare("forward", lowered.forward(inputs), ref_out, list(ref_out), tol)
    by_output = {plan.primal(k): v.astype(np.float64) for k, v in cotangents.items()}
    ref_grads = {plan.grad_name(k): v for k, v in reference.backward(plan.spec, wide, by_output).items()}
    grads = lowered.grad(inputs, cotangents)
    report.values += _compare("backward", grads, ref_grads, [g.name for g in plan.grads], tol)
    report.values += _unplanned(plan, ref_grads)
    nbytes = plan.spec.dtype.nbytes
    for phase, steps in (("forward", plan.forward), ("backward", plan.backward)):
        found = collectives(lowered.compiled_text(phase), lowered.module.mesh)
        report.collectives += match_collectives(phase, steps, found, report.sizes, nbytes)
    return report


def render_report(report: Report) -> str:
    """The verification as two tables, values then collectives."""
    sizes = ", ".join(f"{k}={v}" for k, v in report.sizes.items() if k not in report.mesh)
    mesh = ", ".join(f"{k}={v}" for k, v in report.mesh.items())
    rtol, atol = report.tolerance
    lines = [f"# verify {report.file}: mesh {mesh} ({math.prod(report.mesh.values())} devices), {sizes}",
             f"# computed in {report.compute_dtype} (spec dtype {report.dtype}); values pass when "
             f"max|err| <= {atol:g} + {rtol:g}*max|ref|; HLO bytes priced in {report.dtype}",
             "", "values"]
    lines += _table(["phase", "tensor", "max|err|", "max|ref|", "bound", ""],
                    [[r.phase, r.tensor, f"{r.max_error:.2e}", f"{r.max_reference:.3g}",
                      f"{r.tolerance:.2e}", _status(r.ok, r.note)] for r in report.values])
    lines += ["", "collectives (plan vs compiled HLO)"]
    lines += _table(["phase", "plan step", "axes", "bytes", "HLO", "axes", "bytes", ""],
                    [[r.phase, r.step or "-", r.plan_axes, _num(r.plan_bytes), r.hlo_op, r.hlo_axes,
                      _num(r.hlo_bytes), _status(r.ok, r.note)]
                     for r in report.collectives])
    lines += ["", "verified: values and collectives match" if report.ok else "verification FAILED"]
    return "\n".join(lines) + "\n"


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
