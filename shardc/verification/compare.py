"""``shardc compare``: the plan beside XLA's own partitioner for the same annotations.

XLA gets the same computation (the spec's einsums, forward, and the backward
as reverse mode over them, in jax.numpy) under ``jax.jit`` with
``NamedSharding`` in and out shardings on an ``AxisType.Auto`` mesh, and the
same phase boundaries as the lowered program: the forward maps inputs and
params to every statement result; the backward maps inputs, params, those
results and the cotangents to the gradients.  What XLA inserts in between is
its choice (GSPMD).  Volumes are V, weighted (AllReduce
twice, AllToAll a quarter), in the spec's dtype (integers, the token ids, at their own width).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from shardc.collectives import FACTOR, share
from shardc.ir.plan import Plan, unfused
from shardc.ir.spec import Spec, TensorRef
from shardc.lowering import reference
from shardc.lowering.api import Lowered, lower
from shardc.lowering.replan import unlowered_optimizer
from shardc.lowering.row_code import id_inputs
from shardc.lowering.sizes import devices_to_check, proportional_sizes, spec_sizes
from shardc.planner.check import require_sound
from shardc.planner.plan_text import step_label
from shardc.planner.planner import plan as make_plan
from shardc.spec.functions import ID_DTYPE
from shardc.verification.hlo import Collective, collectives

__all__ = ["Row", "Side", "Comparison", "compare", "render_comparison", "pair_rows", "plan_side"]

_WEIGHT = {op: float(f) for op, f in FACTOR.items()}  # the book's weighting, from the table


@dataclass(frozen=True)
class Row:
    """One collective and the tensor it moves (on XLA's side: every tensor of its per-device shape)."""

    phase: str
    tensor: str
    kind: str
    axes: str
    bytes: int


@dataclass
class Side:
    """One program pair's collectives, and weighted totals per phase."""

    rows: list[Row] = field(default_factory=list)
    weighted: dict[str, float] = field(default_factory=dict)  # phase -> weighted bytes
    seconds: float | None = None  # median wall time of forward + backward

    @property
    def total(self) -> float:
        return sum(self.weighted.values())


@dataclass
class Comparison:
    file: str
    mesh: dict[str, int]
    sizes: dict[str, int]
    dtype: str
    plan: Side
    xla: Side
    notes: list[str] = field(default_factory=list)
    counted_at: dict[str, int] = field(default_factory=dict)  # the sizes the bytes were counted at

    @property
    def volume_ratio(self) -> float | None:
        return None if self.xla.total == 0 else self.plan.total / self.xla.total

    @property
    def time_ratio(self) -> float | None:
        if self.plan.seconds is None or not self.xla.seconds:
            return None
        return self.plan.seconds / self.xla.seconds

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(volume_ratio=self.volume_ratio, time_ratio=self.time_ratio,
                    plan_total=self.plan.total, xla_total=self.xla.total)
        return data


def plan_side(plan: Plan, sizes: dict[str, int]) -> Side:
    """The plan's collectives at ``sizes``, each phase's bytes weighted as :class:`Side` keeps them: the side
    :func:`compare` sets beside XLA's partitioner's."""
    side = Side()
    for phase, steps in (("forward", plan.forward), ("backward", plan.backward)):
        side.weighted[phase] = 0.0
        # a collective matmul moves its collective's bytes as a ring: the collective counted once a phase
        for step in dict.fromkeys(part for s in steps for part in unfused(s)):
            if step.volume is None or all(sizes[a] == 1 for a in step.axes):
                continue  # local steps, and nothing moves over size-1 axes (XLA drops them too)
            v = int(step.volume.evaluate(sizes))
            side.rows.append(Row(phase, step.tensor, step_label(step), ",".join(step.axes), v))
            side.weighted[phase] += v * _WEIGHT.get(step.op, 1.0)
    return side


def _local_shape(ref: TensorRef, sizes: dict[str, int]) -> tuple[int, ...]:
    return tuple(share(sizes[d.name], math.prod(sizes[a] for a in d.axes)) for d in ref.dims)


def _shapes(plan: Plan, sizes: dict[str, int]) -> dict[tuple[int, ...], str]:
    """Per-device shapes of the plan's values -> the tensors of that shape (``A|dA`` when several)."""
    names: dict[tuple[int, ...], set[str]] = {}
    for step in plan.forward + plan.backward:
        for ref in (step.dst, *([step.src] if step.src else []), *step.operands):
            names.setdefault(_local_shape(ref, sizes), set()).add(ref.name)
    return {shape: "|".join(sorted(found)) for shape, found in names.items()}


def _xla_side(found: dict[str, list[Collective]], nbytes: int, shapes: dict[tuple[int, ...], str]) -> Side:
    side = Side()
    for phase, items in found.items():
        side.weighted[phase] = 0.0
        for c in items:
            v = c.bytes(nbytes)
            tensor = shapes.get(c.shape, "?")
            side.rows.append(Row(phase, tensor, c.kind.title if c.kind else c.hlo_op, ",".join(c.axes), v))
            side.weighted[phase] += v * _WEIGHT.get(c.kind, 1.0) if c.kind else v
    return side


def pair_rows(ours: list[Row], theirs: list[Row]) -> list[tuple[Row | None, Row | None]]:
    """Plan and XLA rows side by side: the same tensor and kind, preferring the one of the same axes and bytes among
    several; a row with no XLA row of its tensor and kind stands alone."""
    left = list(theirs)
    pairs: list[tuple[Row | None, Row | None]] = []
    for row in ours:
        same = [r for r in left if row.tensor in r.tensor.split("|") and row.kind.startswith(r.kind)]
        match = next((r for r in same if (r.axes, r.bytes) == (row.axes, row.bytes)), same[0] if same else None)
        if match is not None:
            left.remove(match)
        pairs.append((row, match))
    return pairs + [(None, r) for r in left]


class _XlaPrograms:
    """``jax.jit`` of the global computation, shardings only at the boundaries."""

    def __init__(self, plan: Plan, mesh_axes: tuple[tuple[str, int], ...], cotangents: dict[str, str],
                 grads: dict[str, str], sizes: dict[str, int] | None = None) -> None:
        import jax
        from jax.sharding import AxisType, NamedSharding
        from jax.sharding import PartitionSpec as P

        names = tuple(n for n, _ in mesh_axes)
        self.mesh = jax.make_mesh(tuple(s for _, s in mesh_axes), names,
                                  axis_types=(AxisType.Auto,) * len(names))

        def sharding(ref: TensorRef, stacked: bool = False) -> Any:
            lead = [ref.unreduced] if stacked and ref.unreduced else []  # partial sums, stacked
            return NamedSharding(self.mesh, P(*lead, *[d.axes or None for d in ref.dims]))

        self.sharding = sharding
        self.inputs = [i for i in plan.tensors if i.role in ("input", "param")]
        stacked = {i.name for i in self.inputs if i.ref.unreduced}

        def summed(args: tuple[Any, ...]) -> dict[str, Any]:
            names = [i.name for i in self.inputs]
            return {n: a.sum(axis=0) if n in stacked else a for n, a in zip(names, args, strict=True)}

        # the spec's statement results (the reference names no chain intermediate: XLA picks its own)
        made = {s.result.name for s in plan.spec.statements}
        self.results = [i for i in plan.tensors if i.role not in ("input", "param") and i.name in made]
        self.cotangents = list(plan.cotangents)
        self.grads = list(plan.grads)
        primal = {g: p for p, g in grads.items()}  # gradient name -> its tensor
        spec = plan.spec
        import jax.numpy as jnp

        def fwd(*args: Any) -> tuple[Any, ...]:
            values = reference.forward(spec, summed(args), jnp, sizes=sizes)
            return tuple(values[i.name] for i in self.results)

        def bwd(*args: Any) -> tuple[Any, ...]:
            k, r = len(self.inputs), len(self.results)
            inputs = summed(args[:k])
            given = dict(zip([i.name for i in self.results], args[k:k + r], strict=True))
            cot = dict(zip([cotangents[c.name] for c in self.cotangents], args[k + r:], strict=True))
            grads = reference.backward(spec, inputs, cot, jnp, given=given, sizes=sizes)
            return tuple(grads[primal[g.name]] for g in self.grads)

        self.fwd_in = [sharding(i.ref, stacked=True) for i in self.inputs]
        self.bwd_in = self.fwd_in + [sharding(i.ref) for i in self.results] + [
            sharding(c) for c in self.cotangents]
        self.forward = jax.jit(fwd, in_shardings=self.fwd_in,
                               out_shardings=tuple(sharding(i.ref) for i in self.results))
        self.backward = jax.jit(bwd, in_shardings=self.bwd_in,
                                out_shardings=tuple(sharding(g) for g in self.grads))


def _median_seconds(run: Any, repeats: int) -> float:
    run()  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare(plan_or_spec: Plan | Spec, devices: int | None = None, save: str = "default",
            repeats: int = 0) -> Comparison:
    """Collectives and weighted volume of the plan and of XLA's partitioner; timed if repeats > 0.

    The bytes are counted where the plan was chosen: at the spec's own dims (:func:`spec_sizes`, only the
    mesh shrunk to the devices), XLA's programs compiled from abstract arguments, so nothing that large is
    made.  Both programs run at :func:`proportional_sizes` (small, in the spec's proportions) on the same
    inputs: small dims cannot keep tokens (B·S) against a weight's rows (D), so the bytes are not counted
    there unless the spec gives no dims.  ``devices`` None: as for :func:`shardc.verification.verify.verify`.
    """
    import jax
    from jax.sharding import NamedSharding

    plan = plan_or_spec if isinstance(plan_or_spec, Plan) else make_plan(plan_or_spec, save=save)
    require_sound(plan)
    plan, zero_note = unlowered_optimizer(plan)  # ZeRO-1/2: the forward and backward are compared
    count = devices_to_check(plan, jax.device_count()) if devices is None else devices
    sizes = proportional_sizes(plan, count)
    lowered = lower(plan, sizes=sizes)
    same = dict(lowered.sizes or sizes)  # the run's sizes, one set for both sides
    xla = _XlaPrograms(plan, lowered.module.mesh, lowered.module.cotangents, lowered.module.grads, same)
    inputs = lowered.random_inputs()
    cot = lowered.random_cotangents()
    fwd_args = [jax.device_put(inputs[i.name], s) for i, s in zip(xla.inputs, xla.fwd_in, strict=True)]
    results = xla.forward(*fwd_args)
    bwd_args = fwd_args + list(results) + [jax.device_put(cot[c.name], s) for c, s in
                                           zip(xla.cotangents, xla.bwd_in[len(fwd_args) + len(results):],
                                               strict=True)]
    notes = [zero_note] if zero_note is not None else []
    real = spec_sizes(plan, count)
    if real is None:
        notes.append("the bytes are counted at the run's sizes: the spec gives no size to every dim")
        counted, found = same, {"forward": collectives(str(xla.forward.lower(*fwd_args).compile().as_text()),
                                                       lowered.module.mesh),
                                "backward": collectives(str(xla.backward.lower(*bwd_args).compile().as_text()),
                                                        lowered.module.mesh)}
    else:
        counted, found = real, _abstract_collectives(plan, lower(plan, sizes=real), lowered.module.mesh)
    ours = plan_side(plan, counted)
    theirs = _xla_side(found, plan.spec.dtype.nbytes, _shapes(plan, counted))
    if repeats:
        ns = lowered.namespace  # time the programs on arrays already laid out, as for XLA
        placed = {k: jax.device_put(v, NamedSharding(ns.programs()[0], ns.FORWARD_IN[k]))
                  for k, v in inputs.items()}
        placed_cot = {k: jax.device_put(v, NamedSharding(ns.programs()[0], ns.BACKWARD_IN[k]))
                      for k, v in cot.items()}
        ours.seconds = _median_seconds(lambda: jax.block_until_ready(
            ns.run_backward(placed, ns.run_forward(placed), placed_cot)), repeats)
        theirs.seconds = _median_seconds(lambda: jax.block_until_ready(
            xla.backward(*fwd_args, *xla.forward(*fwd_args), *bwd_args[len(fwd_args) + len(results):])),
            repeats)
    return Comparison(plan.spec.filename or "<spec>", dict(lowered.module.mesh), same, str(plan.spec.dtype),
                      ours, theirs, notes, dict(counted))


def _abstract_collectives(plan: Plan, at: Lowered, mesh: tuple[tuple[str, int], ...]) -> dict[str, list[Collective]]:
    """XLA's collectives per phase with its programs compiled at ``at``'s sizes from abstract arguments
    (``jax.ShapeDtypeStruct`` with shardings): the compile allocates no argument, whatever the sizes."""
    import jax

    xla = _XlaPrograms(plan, mesh, at.module.cotangents, at.module.grads, dict(at.sizes or {}))
    ids = id_inputs(plan.spec)

    def arg(ref: TensorRef, sharding: Any) -> Any:
        return jax.ShapeDtypeStruct(at.global_shape(ref), ID_DTYPE if ref.name in ids else np.float32,
                                    sharding=sharding)

    fwd = [arg(i.ref, s) for i, s in zip(xla.inputs, xla.fwd_in, strict=True)]
    made = jax.eval_shape(xla.forward, *fwd)  # the results' types, as the forward makes them
    rest = xla.bwd_in[len(fwd):]
    bwd = fwd + [jax.ShapeDtypeStruct(r.shape, r.dtype, sharding=s) for r, s in zip(made, rest, strict=False)]
    bwd += [arg(c, s) for c, s in zip(xla.cotangents, rest[len(made):], strict=True)]
    return {"forward": collectives(str(xla.forward.lower(*fwd).compile().as_text()), mesh),
            "backward": collectives(str(xla.backward.lower(*bwd).compile().as_text()), mesh)}


def _cell(row: Row | None) -> str:
    return "-" if row is None else f"{row.kind} {row.tensor} ({row.axes}) {row.bytes}"


def render_comparison(c: Comparison) -> str:
    """Both sides' collectives per phase, then the totals and their ratio."""
    mesh = ", ".join(f"{k}={v}" for k, v in c.mesh.items())
    run, counted = (", ".join(f"{k}={v}" for k, v in s.items() if k not in c.mesh) for s in (c.sizes, c.counted_at))
    where = "the run's sizes" if c.counted_at == c.sizes else f"the spec's sizes {counted}"
    lines = [f"# compare {c.file}: mesh {mesh}; bytes counted at {where}, in {c.dtype} (V, unsharded over "
             f"the axes); run at sizes {run} (in the spec's proportions)"]
    lines += [f"# note: {note}" for note in c.notes] + [""]
    for phase in ("forward", "backward"):
        lines.append(f"{phase}")
        pairs = pair_rows([r for r in c.plan.rows if r.phase == phase], [r for r in c.xla.rows if r.phase == phase])
        width = max([len(_cell(a)) for a, _ in pairs] + [24])
        for ours, theirs in pairs or [(None, None)]:
            lines.append(f"  plan: {_cell(ours):<{width}}  xla: {_cell(theirs)}")
        lines.append(f"  weighted bytes: plan {c.plan.weighted.get(phase, 0):g}, "
                     f"xla {c.xla.weighted.get(phase, 0):g}")
    ratio = c.volume_ratio
    lines += ["", f"total weighted bytes: plan {c.plan.total:g}, xla {c.xla.total:g}, ratio "
              + ("n/a (XLA moves nothing)" if ratio is None else f"{ratio:.3f}")]
    if c.time_ratio is not None:
        lines.append(f"median forward+backward time: plan {c.plan.seconds * 1e3:.3f} ms, "  # type: ignore[operator]
                     f"xla {c.xla.seconds * 1e3:.3f} ms, ratio {c.time_ratio:.3f}")  # type: ignore[operator]
    return "\n".join(lines) + "\n"
