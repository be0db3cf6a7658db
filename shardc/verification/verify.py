"""``shardc verify``: run a lowered plan and check it by value and by compiled HLO.

The plan is the one ``shardc plan`` prints (made at the spec's own sizes, so
cost-based choices are the real ones), checked by the plan checker, then lowered
at small sizes that fit the devices: the mesh shrunk to at most ``devices``
(largest axis halved first, every axis kept at 2 or more while the devices
allow), each dim the least common multiple of the shard counts it meets times a
small distinct factor; a sliding window shrinks with its keys, so that it still masks
(:mod:`shardc.lowering.run_windows`).  Values are computed in the spec's dtype (inputs rounded
to it, the reference in float64 from those same rounded inputs) and pass within
a tolerance per dtype.  Each input has its own scale, at which every op of the
spec matters (:mod:`shardc.verification.scales`), shrunk as a whole only until every
reference value fits the dtype with room to spare (then, float16's narrow range having moved the
inputs off those scales, every value is checked again in float32 at them).  A row whose bound would
pass an error of ``POWER`` (5%) of its value is checked again in float32 against the
unsharded program's own error; a spec with dropout runs under two keys.  A value
that cannot be compared (out of range, NaN or inf on either side, a wrong shape)
fails, and so does a collective over an axis the run had to cut to 1: nothing is
reported verified that was not run.
HLO volumes are priced in the spec's dtype, as the plan's are.  Each phase's memory per device is
set beside XLA's buffer assignment (:mod:`shardc.verification.memory_check`), reported, not judged.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from shardc.arguments import check_instance, check_verify_args
from shardc.errors import ShardcError
from shardc.ir.plan import Plan, backward_program
from shardc.ir.precision import gradient_dtype
from shardc.ir.spec import Call, Spec
from shardc.lowering import reference
from shardc.lowering.api import lower
from shardc.lowering.optimizer import LEARNING_RATE
from shardc.lowering.replan import unlowered_optimizer
from shardc.lowering.row_code import id_inputs
from shardc.lowering.run_windows import window_notes, windows_at
from shardc.lowering.sizes import MAX_DEVICES, collapsed_axes, devices_to_check, small_sizes
from shardc.ops.registry import of_call
from shardc.planner.check import require_sound
from shardc.planner.planner import plan as make_plan
from shardc.spec.stages import stage_spec
from shardc.verification.domains import outside_notes
from shardc.verification.gemm_flips import downstream, straddles, unrounded
from shardc.verification.hlo import collectives
from shardc.verification.memory_check import check_memory
from shardc.verification.module_check import given_source, module_sizes, running, use_module
from shardc.verification.pipeline_verify import verify_pipeline
from shardc.verification.power import DROPOUT_KEYS
from shardc.verification.power import differential as _differential
from shardc.verification.power import failed as _failed
from shardc.verification.power import phase as _phase
from shardc.verification.power import weak as _weak
from shardc.verification.progress import step
from shardc.verification.report import (
    POWER,
    STORAGE_DTYPE,
    TOLERANCE,
    CollectiveRow,
    Report,
    ValueRow,
    compare_values,
    cut_note,
    gather_note,
    gemm_note,
    match_collectives,
    render_report,
)
from shardc.verification.route_load import overflowing
from shardc.verification.scales import input_scales

if TYPE_CHECKING:
    from shardc.lowering.api import Lowered

__all__ = ["ValueRow", "CollectiveRow", "Report", "verify", "match_collectives", "compute_dtype",
           "check_device_count", "render_report", "differential_rows", "TOLERANCE"]

# f8 values are rounded to float8_e4m3fn and computed in bfloat16: FP8 training recipes
# (NVIDIA Transformer Engine, the FP8 formats paper of Micikevicius et al. 2022) accumulate
# and emit matmuls in a wider type, and every intermediate rounded to e4m3's 3 mantissa
# bits errs by up to 30% on the examples, the size of the errors this check must catch.
COMPUTE_DTYPE = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f8": "bfloat16"}
_HEADROOM = 64.0  # every reference value stays this far below the dtype's largest
_SCALE_TRIES = 16  # inputs are divided by 4 at most this many times


def _unplanned(plan: Plan, lowered: Lowered, run: _Run) -> list[ValueRow]:
    """A mismatch for each input with a gradient the plan does not make (only `const` ones may lack one)."""
    const = set(plan.spec.const)
    return [ValueRow("backward", plan.grad_name(name), math.nan, math.nan, math.nan, False,
                     "the plan makes no such gradient")
            for name in run.grads if name not in lowered.module.grads and name not in const]


def reference_inputs(lowered: Lowered, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inputs as the unsharded reference reads them: in float64, partial sums summed."""
    stacked = lowered.namespace.STACKED_INPUTS  # the module's own list: one source of truth
    return {k: (v.astype(np.float64).sum(axis=0) if k in stacked else v.astype(np.float64))
            for k, v in inputs.items()}


def _dtype(name: str) -> np.dtype[Any]:
    import ml_dtypes  # a jax dependency: numpy's bfloat16 and float8 types

    return np.dtype(getattr(ml_dtypes, name) if hasattr(ml_dtypes, name) else name)


def compute_dtype(spec: Spec) -> np.dtype[Any]:
    """The dtype the run computes in: the spec's own, bfloat16 for f8 (see STORAGE_DTYPE); with tensors
    of other types (`dtype bf16 Sc`) the one all of them compute in, else float32 (bf16 beside f16)."""
    kinds = {COMPUTE_DTYPE[str(kind)] for kind in (spec.dtype, *(k for _, k in spec.tensor_dtypes))}
    return _dtype(kinds.pop() if len(kinds) == 1 else "float32")


def _rounded(x: np.ndarray, spec: Spec, dtype: np.dtype[Any], name: str, gradient: bool = False) -> np.ndarray:
    """``x`` rounded to the type tensor ``name`` is declared in (f8: float8_e4m3fn), or its gradient's
    (``gradient``: :func:`shardc.ir.precision.gradient_dtype`), then in the run's ``dtype``: the lowered
    program and the reference read the same rounded values."""
    declared = spec.dtype_of(name)
    kind = str(gradient_dtype(declared, spec.dtype) if gradient else declared)
    return x.astype(_dtype(STORAGE_DTYPE.get(kind) or COMPUTE_DTYPE[kind])).astype(dtype)


@dataclass
class _Run:
    """Inputs and cotangents in the compute dtype, and the reference from the same values."""

    inputs: dict[str, np.ndarray]
    cotangents: dict[str, np.ndarray]
    forward: dict[str, np.ndarray]
    grads: dict[str, np.ndarray]
    magnitude: dict[str, np.ndarray]  # reference.magnitudes: the bound's scale per value
    scale: float  # the common factor the inputs were shrunk by to fit the dtype
    fits: bool
    scales: dict[str, float]  # each input's own scale (shardc.verification.scales)
    key: int = 0  # the dropout key the reference drew its masks with


def _reference_run(lowered: Lowered, dtype: np.dtype[Any], seed: int) -> _Run:
    """Random inputs at the scales where every op matters, divided by 4 as a whole only until the
    reference fits ``dtype`` with headroom.

    Rounded to the dtype first, so the reference sees exactly what the lowered program does.
    """
    import ml_dtypes

    spec = lowered.plan.spec
    limit = float(ml_dtypes.finfo(dtype).max) / _HEADROOM
    raw = lowered.random_inputs(seed, np.float64)
    ids = id_inputs(spec)  # token ids stay integers
    raw_cot = lowered.random_cotangents(seed + 1, np.float64)
    outs = lowered.module.cotangents  # cotangent name -> output name: a cotangent is of its output's gradient's type
    own = input_scales(spec, reference_inputs(lowered, raw), set(ids), dict(lowered.sizes or {}))
    run: _Run | None = None
    for k in range(_SCALE_TRIES):
        scale = 4.0 ** -k
        inputs = {n: v if n in ids else _rounded(v * own[n] * scale, spec, dtype, n) for n, v in raw.items()}
        cot = {n: _rounded(v * scale, spec, dtype, outs[n], gradient=True) for n, v in raw_cot.items()}
        run = _keyed(lowered, _Run(inputs, cot, {}, {}, {}, scale, False, own), 0)
        run.fits = all(_fits(v, limit) for v in [*run.forward.values(), *run.grads.values(),
                                                  *run.magnitude.values()])
        if run.fits:
            break
    assert run is not None
    return run


def _keyed(lowered: Lowered, run: _Run, key: int) -> _Run:
    """``run`` with the reference (values, gradients, magnitudes) drawn under dropout ``key``."""
    spec = lowered.plan.spec
    wide = reference_inputs(lowered, run.inputs)
    outs = lowered.module.cotangents  # cotangent name -> output name
    wide_cot = {outs[n]: v.astype(np.float64) for n, v in run.cotangents.items()}
    sizes = dict(lowered.sizes or {})
    with np.errstate(all="ignore"):  # overflow is what the caller looks for
        forward = reference.forward(spec, wide, sizes=sizes, key=key)
        grads = reference.backward(spec, wide, wide_cot, sizes=sizes, key=key)
        magnitude = reference.magnitudes(spec, wide, wide_cot, sizes, key=key)
    return replace(run, forward=forward, grads=grads, magnitude=magnitude, key=key)


def _fits(v: np.ndarray, limit: float) -> bool:
    """Finite and within ``limit``, -inf (a causal mask's) aside."""
    v = np.where(np.isneginf(v), 0.0, v)
    return bool(np.all(np.isfinite(v)) and (not v.size or np.max(np.abs(v)) <= limit))


def _value_rows(lowered: Lowered, run: _Run, tol: tuple[float, float], dtype: np.dtype[Any]) -> list[ValueRow]:
    """Every result and every gradient the module returns, against the reference."""
    import ml_dtypes

    limit = float(ml_dtypes.finfo(dtype).max) / (_HEADROOM if run.fits else 1.0)
    got = lowered.forward(run.inputs, run.key)
    rows = compare_values(_phase("forward", run.key), [(n, got[n], ref, run.magnitude[n])
                                                       for n, ref in run.forward.items()], tol, limit)
    grads = lowered.grad(run.inputs, run.cotangents, run.key)
    pairs = []
    for primal, name in lowered.module.grads.items():
        # an input no output depends on has a zero gradient, which the reference leaves out
        zero = np.zeros(np.shape(grads[name]))
        pairs.append((name, grads[name], run.grads.get(primal, zero), run.magnitude.get(primal, zero)))
    return rows + compare_values(_phase("backward", run.key), pairs, tol, limit)


def _optimizer_rows(lowered: Lowered, tol: tuple[float, float], dtype: np.dtype[Any], seed: int) -> list[ValueRow]:
    """ZeRO-1/2's ``optimizer_step`` against numpy: random params and gradients (random partial sums
    where the ZeRO backward leaves partial sums), each param updated to W - LEARNING_RATE * (sum)."""
    phase = lowered.module.optimizer
    if phase is None or lowered.zero is None:
        return []
    rng = np.random.default_rng(seed + 7)
    given = {b.key: rng.standard_normal(lowered.global_shape(b.ref)).astype(dtype) for b in phase.inputs}
    summed = {b.key: given[b.key].astype(np.float64).sum(axis=0) if b.stacked else given[b.key].astype(np.float64)
              for b in phase.inputs}
    params = {b.key for b in phase.outputs}
    got = lowered.optimizer_step({k: v for k, v in given.items() if k in params},
                                 {k: v for k, v in given.items() if k not in params})
    pairs = []
    for name in params:
        grad = summed[lowered.zero.grad_name(name)]
        reference = summed[name] - LEARNING_RATE * grad
        pairs.append((name, got[name], reference, np.abs(summed[name]) + LEARNING_RATE * np.abs(grad)))
    return compare_values("optimizer", pairs, tol, math.inf)


def verify(plan_or_spec: Plan | Spec, devices: int | None = None, sizes: dict[str, int] | None = None,
           seed: int = 0, save: str = "default", module: str | os.PathLike[str] | None = None) -> Report:
    """Lower the plan at small sizes, run forward and backward, check values and HLO collectives.

    ``devices`` None: enough for every mesh axis to run at size 2 or more, within the
    devices jax has.  A Spec is planned exactly as ``shardc plan`` plans it.  ``module``: a
    lowered module (a path, or its text) run instead of verify's own lowering and judged the
    same way (:mod:`shardc.verification.module_check`); one that cannot run raises ModuleRejected.
    """
    import jax

    check_instance(plan_or_spec, Plan | Spec, "plan_or_spec", "a Plan or a Spec")
    check_verify_args(sizes, seed, save)
    plan = plan_or_spec if isinstance(plan_or_spec, Plan) else make_plan(plan_or_spec, save=save)
    require_sound(plan)
    zero = plan if plan.optimizer else None
    plan, zero_note = unlowered_optimizer(plan)  # ZeRO-1/2: forward and grad without the zero line
    devices = devices_to_check(plan, jax.device_count()) if devices is None else devices
    check_device_count(devices)
    given = given_source(module) if module is not None else None
    if plan.spec.mesh.pipeline_axis is not None:  # a pipeline over the stage axis: its own module
        report = verify_pipeline(plan, devices, seed, module=given)
        if zero is not None and zero_note is not None:
            _stage_optimizer(report, zero, zero_note, devices, seed)
        return report
    base = small_sizes(zero or plan, devices)
    fixed = module_sizes(plan, base) if given is not None else {}
    # a route's token index long enough that experts overflow: dropping past capacity is checked
    grown, notes = overflowing(plan, {**base, **fixed}, fixed)
    small = {**grown, **(sizes or {})}
    step("lowering the plan at " + ", ".join(f"{k}={v}" for k, v in small.items()))
    # a sliding window shrinks with the keys, so that it still masks; a given module's are in its code
    notes += window_notes(plan, small, given is not None)
    lowered = lower(zero or plan if given is not None else windows_at(zero or plan, small), sizes=small)
    if given is not None:
        lowered, used = use_module(lowered, *given)
        notes[:0] = used
    with running(given[1] if given is not None else None):
        report = _checked(plan, (zero, zero_note), lowered, devices, seed)
    report.notes[:0] = notes
    return report


def _checked(plan: Plan, zero_plan: tuple[Plan | None, str | None], lowered: Lowered, devices: int,
             seed: int) -> Report:
    """Values and HLO collectives of ``lowered`` (the plan's module at small sizes) against the plan;
    ``zero_plan``: a ZeRO-1/2 plan and its note, or Nones."""
    zero, zero_note = zero_plan
    mesh = dict(lowered.module.mesh)
    dtype = compute_dtype(plan.spec)
    tol = TOLERANCE[dtype.name]
    report = Report(plan.spec.filename or "<spec>", mesh, dict(lowered.sizes or {}),
                    str(plan.spec.dtype), dtype.name, tol)
    if plan.spec.tensor_dtypes:
        report.notes.append(f"{'; '.join(plan.spec.dtype_lines())}: those inputs rounded to their own type and "
                            f"cotangents to their gradients' (an f8 value's gradient is {plan.spec.dtype}), every "
                            f"value computed in {dtype.name}; values computed on the way are not "
                            "rounded to their declared type (an f8 one would err by as much as a wrong plan)")
    report.notes += gemm_note(plan.spec) + gather_note(plan.spec)
    step("running the numpy reference")
    run = _reference_run(lowered, dtype, seed)
    report.input_scale, report.input_scales = run.scale, dict(run.scales)
    report.notes += outside_notes(plan.spec, reference_inputs(lowered, run.inputs), dict(lowered.sizes or {}))
    step("compiling and running forward and backward, comparing values")
    for key in _keys(lowered):
        report.values += _value_rows(lowered, _keyed(lowered, run, key) if key else run, tol, dtype)
    report.notes += _same_masks(lowered, run)
    report.values = _recheck_weak(report, lowered, dtype, seed)
    report.values += _unplanned(plan, lowered, run)
    if zero_note is not None:
        report.notes.append(zero_note)
        report.values += _optimizer_rows(lowered, tol, dtype, seed)
    cut = collapsed_axes(plan, mesh)
    if cut:
        report.notes.append(cut_note(cut, devices, plan))
    nbytes = plan.spec.dtype.nbytes
    phases = [("forward", plan.forward), ("backward", backward_program(plan))]
    phases += [("optimizer", zero.optimizer)] if zero is not None else []
    for phase, steps in phases:
        step(f"compiling the {phase} for its HLO, comparing collectives")
        found = collectives(lowered.compiled_text(phase, dtype), lowered.module.mesh)
        report.collectives += match_collectives(phase, steps, found, report.sizes, nbytes, cut, plan.moved_nbytes)
    step("comparing memory with XLA's buffer assignment")
    report.memory_check = check_memory(lowered)
    return report


def _stage_optimizer(report: Report, zero: Plan, note: str, devices: int, seed: int) -> None:
    """A pipelined ZeRO-1/2 plan's optimizer phase, checked as an unpipelined one's: a stage's plan
    (the spec without its stage axis, every stage's optimizer alike on its own layers) lowered small on
    the devices one stage of the run had (its mesh the run's, each axis at 2 or more: on all of them
    DeepSeek-V3's Z ran at 32, 0.9 billion values drawn, 52 s of CPU), its ``optimizer_step`` against
    numpy and its compiled HLO against the plan's optimizer steps."""
    # its topology is the whole run's cluster (BLOOM's 48x8), which a stage's mesh does not fill; the lowered
    # phase runs on the run's devices, placed by none, as the ends' parts (shardc.lowering.pipeline_ends)
    stage = replace(zero, spec=replace(stage_spec(zero.spec), topology=None))
    pipe = zero.spec.mesh.pipeline_axis
    step("lowering a stage's optimizer phase (ZeRO)")
    lowered = lower(stage, sizes=small_sizes(stage, devices // report.mesh.get(pipe.name, 1) if pipe else devices))
    dtype = compute_dtype(zero.spec)
    report.notes.append(note + "; the optimizer phase is a stage's, lowered without the stage axis")
    report.values += _optimizer_rows(lowered, TOLERANCE[dtype.name], dtype, seed)
    mesh = dict(lowered.module.mesh)
    found = collectives(lowered.compiled_text("optimizer", dtype), lowered.module.mesh)
    report.collectives += match_collectives("optimizer", zero.optimizer, found, dict(lowered.sizes or {}),
                                            zero.spec.dtype.nbytes, collapsed_axes(stage, mesh), zero.moved_nbytes)


def _keys(lowered: Lowered) -> tuple[int, ...]:
    return DROPOUT_KEYS if lowered.namespace.KEYED else (0,)


def _same_masks(lowered: Lowered, run: _Run) -> list[str]:
    """A note where the dropout keys draw the same reference values: the key was not exercised."""
    if not lowered.namespace.KEYED:
        return []
    other = _keyed(lowered, run, DROPOUT_KEYS[1])
    if any(not np.array_equal(v, other.forward[n]) for n, v in run.forward.items()):
        return []
    return [f"dropout keys {DROPOUT_KEYS[0]} and {DROPOUT_KEYS[1]} draw the same masks at these sizes: "
            "the key is not checked"]


def _recheck_weak(report: Report, lowered: Lowered, dtype: np.dtype[Any], seed: int) -> list[ValueRow]:
    """Rows whose bound cannot catch a wrong plan, checked again in float32 against the
    unsharded program's own error; a row still that loose fails.

    Inputs shrunk as a whole to fit a narrow dtype (float16's 65504) leave the scales at which every
    op matters, so then every row is checked again so.

    The bound admits the worst rounding of the terms behind a value: for an ill-conditioned
    value (a softmax of large scores, a norm's gradient) it can exceed the value itself, and
    such a pass proves nothing.  The recheck runs the lowered program and the spec's unsharded
    program (the reference's statements in jax, on one device) in float32: a right plan only
    reorders sums, so its error is of the unsharded program's order (``DIFFERENTIAL`` times it,
    plus 64 float32 roundings of the value), while a wrong plan errs by the value's order.
    """
    shrunk = report.input_scale < 1.0
    weak = [r for r in report.values if _weak(r) or (shrunk and r.ok)]
    flipped = [r for r in report.values if not r.ok and r.tensor in _routed(lowered.plan.spec)]
    if not weak and not flipped:
        return report.values
    again = {(r.phase, r.tensor): r for key in _keys(lowered) for r in differential_rows(lowered, seed, key)}
    if shrunk:
        report.notes.append(f"the inputs were shrunk to {report.input_scale:g} of their own scales to fit "
                            f"{dtype.name}, where a norm's statistic or an activation's curve may barely act: "
                            "every value is checked again in float32 at the inputs' own scales (rows marked f32)")
    elif weak:
        names = ", ".join(dict.fromkeys(r.tensor for r in weak))
        report.notes.append(f"in {dtype.name} the bound of {names} would pass an error of {POWER:.0%} of the "
                            "value: checked again in float32 against the unsharded program's error (rows marked f32)")
    if flipped:  # a top-k choice between gates closer than their rounding: the unsharded program judges it
        names = ", ".join(dict.fromkeys(r.tensor for r in flipped))
        report.notes.append(f"the routing masks {names} differ from the float64 reference's choices: checked again "
                            "in float32 against the unsharded program's own choices (rows marked f32)")
    values = [replace(r, ok=True, note="judged by its f32 row") if r in flipped else r for r in report.values]
    extra = [replace(again[(r.phase, r.tensor)], phase=f"{r.phase} f32") for r in weak + flipped
             if (r.phase, r.tensor) in again]
    return values + [_failed(r) if _weak(r) and r.tensor not in _routed(lowered.plan.spec) else r for r in extra]


def _routed(spec: Spec) -> set[str]:
    """The tensors a statement computes as a discrete choice (a route's 0/1 mask of the top-k gates)."""
    return {s.result.name for s in spec.statements
            if isinstance(s.expr, Call) and (family := of_call(s.expr.func)) is not None and family.chooses}


def differential_rows(lowered: Lowered, seed: int = 0, key: int = 0) -> list[ValueRow]:
    """Every lowered value, run in float32 from inputs drawn with ``seed``, against the float64
    reference, bounded by the error of the unsharded float32 program (the reference's statements
    in jax, on one device): the recheck of a row whose bound is too loose to catch a wrong plan.
    ``key``: the dropout key of both programs and the reference.  Where the module's and the
    reference's f8 GEMM operands straddle a rounding tie, the rows that failed are judged again with
    the GEMMs unrounded (:mod:`shardc.verification.gemm_flips`)."""
    rows, straddled = _differential_run(lowered, seed, key)
    if not straddled or all(r.ok for r in rows):
        return rows
    moved = downstream(lowered.plan.spec, set(straddled))  # and every gradient: the backward reads them all
    exact = {(r.phase, r.tensor): r for r in _differential_run(unrounded(lowered), seed, key)[0]}
    note = (f"{sum(straddled.values())} element(s) of {', '.join(straddled)} straddle an E4M3 tie in the module "
            "and the reference: judged with the GEMMs unrounded")
    return [replace(exact[(r.phase, r.tensor)], note=note) if not r.ok and (r.phase, r.tensor) in exact and (
        r.tensor in moved or r.phase.startswith("backward")) else r for r in rows]


def _differential_run(lowered: Lowered, seed: int, key: int) -> tuple[list[ValueRow], dict[str, int]]:
    """:func:`differential_rows`' rows, and the forward's f8 GEMM operands with elements straddling a tie."""
    import jax
    import jax.numpy as jnp

    run = _reference_run(lowered, np.dtype("float32"), seed)
    run = _keyed(lowered, run, key) if key else run
    spec = lowered.plan.spec
    ids = id_inputs(spec)
    wide = reference_inputs(lowered, run.inputs)
    plain_in = {n: jnp.asarray(v if n in ids else v.astype(np.float32)) for n, v in wide.items()}
    outs = lowered.module.cotangents
    plain_cot = {outs[n]: jnp.asarray(v.astype(np.float32)) for n, v in run.cotangents.items()}
    sizes = dict(lowered.sizes or {})  # the dims no input has (a route's capacity), as the first run
    # one program, not op by op: jax compiles each distinct operation of an eager run apart
    plain_fwd, plain_bwd = jax.jit(lambda i, c: (reference.forward(spec, i, jnp, sizes=sizes, key=key),
                                                 reference.backward(spec, i, c, jnp, sizes=sizes, key=key)))(
        plain_in, plain_cot)
    got_fwd, got_bwd = lowered.forward(run.inputs, key), lowered.grad(run.inputs, run.cotangents, key)
    rows = []
    routed = _routed(spec)
    for name, ref in run.forward.items():
        if name in routed:  # 0/1 choices: the same as the unsharded program's, in the same precision
            rows.append(_choices(_phase("forward", key), name, got_fwd[name], plain_fwd[name]))
            continue
        rows.append(_differential(_phase("forward", key), name, got_fwd[name], ref, plain_fwd[name]))
    for primal, name in lowered.module.grads.items():
        zero = np.zeros(np.shape(got_bwd[name]))
        rows.append(_differential(_phase("backward", key), name, got_bwd[name], run.grads.get(primal, zero),
                                  plain_bwd.get(primal, zero)))
    return rows, straddles(spec, got_fwd, run.forward)


def _choices(phase: str, name: str, got: Any, plain: Any) -> ValueRow:
    """A routing mask against the unsharded float32 program's: every 0/1 choice must agree."""
    value, unsharded = np.asarray(got).astype(np.float64), np.asarray(plain).astype(np.float64)
    if value.shape != unsharded.shape or not np.all(np.isfinite(value)):
        return ValueRow(phase, name, math.nan, 0.0, math.nan, False, "shape or NaN: not compared")
    err = float(np.max(np.abs(value - unsharded))) if value.size else 0.0
    return ValueRow(phase, name, err, 1.0, 0.0, err == 0.0)


def check_device_count(devices: int) -> None:
    """A device count verification can emulate: 1 to MAX_DEVICES."""
    if isinstance(devices, bool) or not isinstance(devices, int) or not 1 <= devices <= MAX_DEVICES:
        raise ShardcError(f"--devices {devices}: verification runs on 1 to {MAX_DEVICES} devices",
                          fix="leave --devices out (enough for every mesh axis to be 2) or give e.g. --devices 8")
