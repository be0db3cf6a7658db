"""``shardc verify`` of a pipelined spec: the GPipe or 1F1B module against numpy, and its HLO.

Values are computed in float64 (a stack of 2P quadratic layers amplifies float32's
rounding to about 1e-4 relative, as numpy's own float32 shows) and compared with the
float64 numpy reference, within 100 times the one-block float64 bound (a real mistake
is off by order 1); HLO bytes are priced in the spec's dtype.  The mesh shrinks to fit
the devices as a block's does, every axis kept at 2 or more while possible, the stage
axis last (P=4, X=64, Y=4 runs as P=4, X=2, Y=2 on 16 devices and P=2, X=2, Y=2 on 8);
an axis cut to 1 fails the collectives over it, which did not run.  The block is
stacked 2P layers deep and cut into 2P microbatches (at most the spec's).  The numpy
reference runs the layers one after the other on the whole batch, and its backward runs
them in reverse, each layer's input gradient the cotangent of the layer before.  Params
are scaled by 1/sqrt(their contracted size), and each layer's last one so that its
output has unit RMS, so a deep stack of products neither vanishes nor overflows.

The compiled HLO is checked by :mod:`shardc.lowering.pipeline_hlo`: the permutes
between stages, and every planned collective by kind, axes and bytes.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from shardc.errors import ShardcError
from shardc.lowering import reference
from shardc.lowering.pipeline import PipelineLowered, lower_pipeline
from shardc.lowering.pipeline_hlo import gpipe_rows, one_f_one_b_rows
from shardc.lowering.report import TOLERANCE, Report, ValueRow, cut_note
from shardc.lowering.sizes import collapsed_axes, shrink_mesh, small_sizes
from shardc.pipeline.boundary import microbatch_dim
from shardc.pipeline.stages import pipeline_of, stage_spec
from shardc.planner.ir import Plan
from shardc.spec.functions import layer_key
from shardc.spec.ir import Contract, Mesh, Spec
from shardc.spec.walk import leaves

__all__ = ["verify_pipeline"]

def _sizes(plan: Plan, devices: int) -> tuple[dict[str, int], int, int]:
    """Mesh and dims for the run, the layer count and the microbatches."""
    pipe = pipeline_of(plan.spec)
    assert pipe is not None
    if devices < 2:
        raise _error("a pipeline's stages need 2 devices or more")
    mesh = dict(shrink_mesh([(a.name, a.size) for a in plan.spec.mesh.axes], devices, pipe.axis))
    stages = mesh.pop(pipe.axis)
    stage = replace(plan, spec=replace(stage_spec(plan.spec), mesh=_mesh(plan.spec, mesh)))
    dims = small_sizes(stage, None)
    micro = min(pipe.microbatches, 2 * stages)
    dim = microbatch_dim(plan)
    dims[dim] *= micro
    return {**dims, **mesh, pipe.axis: stages}, 2 * stages, micro


def _mesh(spec: Spec, sizes: dict[str, int]) -> Any:
    return Mesh(tuple(replace(a, size=sizes[a.name]) for a in spec.mesh.axes if not a.pipeline))


def _error(message: str) -> Exception:
    return ShardcError(message, fix="run with more devices (--devices) or a smaller pipeline axis")


def _inputs(lowered: PipelineLowered, seed: int, key: int) -> dict[str, np.ndarray]:
    spec, sizes = stage_spec(lowered.plan.spec), {**lowered.sizes}
    first = next(i.ref for i in lowered.plan.tensors if i.role == "input")
    sizes_full = dict(sizes)
    dim = microbatch_dim(lowered.plan)
    sizes_full[dim] = lowered.batch
    rng = np.random.default_rng(seed)
    values = {first.name: rng.standard_normal([sizes_full[d.name] for d in first.dims])}
    for info in lowered.plan.tensors:
        if info.role == "param":
            shape = [sizes[d.name] for d in info.ref.dims]
            scale = 1 / math.sqrt(_contracted(spec, info.name, sizes))
            values[info.name] = rng.standard_normal([lowered.pipeline.layers, *shape]) * scale
    _calibrate(lowered, spec, values, key)
    return values


def _calibrate(lowered: PipelineLowered, spec: Spec, values: dict[str, np.ndarray], key: int) -> None:
    """Scale each layer's last param so its output has unit RMS (a deep product of einsums
    otherwise vanishes or overflows; layer norms do this in a real model)."""
    ns = lowered.namespace
    last = next((s for s in spec.statements if s.result.name == ns.BLOCK_OUTPUT), None)
    if last is None or not isinstance(last.expr, Contract):  # the output is linear in its operands
        return
    linear = [r.name for r in leaves(last.expr) if r.name in ns.PARAMS]
    if not linear:
        return
    x = values[ns.BLOCK_INPUT]
    for layer in range(lowered.pipeline.layers):
        layer_values = {ns.BLOCK_INPUT: x, **{p: values[p][layer] for p in ns.PARAMS}}
        out = reference.forward(spec, layer_values, sizes=dict(lowered.sizes),
                                key=_key(lowered, key, layer))[ns.BLOCK_OUTPUT]
        rms = float(np.sqrt(np.mean(out ** 2))) or 1.0
        values[linear[0]][layer] /= rms
        x = out / rms


def _contracted(spec: Spec, param: str, sizes: dict[str, int]) -> int:
    """The size a param's einsum sums over (its indices the result lacks)."""
    for statement in spec.statements:
        refs = list(leaves(statement.expr))
        for ref in refs:
            if ref.name == param:
                gone = set(ref.indices) - set(statement.result.indices)
                return max(1, math.prod(sizes[i] for i in gone))
    return 1


def _key(lowered: PipelineLowered, key: int, layer: int) -> int:
    return layer_key(key, layer, lowered.pipeline.layers)


def _reference(lowered: PipelineLowered, inputs: dict[str, np.ndarray], d_out: np.ndarray,
               key: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    ns = lowered.namespace
    spec = stage_spec(lowered.plan.spec)
    params = list(ns.PARAMS)
    sizes = dict(lowered.sizes)  # the dims no input has (a route's capacity); the inputs' shapes win
    x = inputs[ns.BLOCK_INPUT].astype(np.float64)
    kept = []
    for layer in range(lowered.pipeline.layers):
        values = {ns.BLOCK_INPUT: x, **{p: inputs[p][layer].astype(np.float64) for p in params}}
        kept.append(values)
        x = reference.forward(spec, values, sizes=sizes, key=_key(lowered, key, layer))[ns.BLOCK_OUTPUT]
    grads: dict[str, list[np.ndarray]] = {p: [] for p in params}
    g = d_out.astype(np.float64)
    for layer in reversed(range(len(kept))):  # keyed by the tensors' names
        got = reference.backward(spec, kept[layer], {ns.BLOCK_OUTPUT: g}, sizes=sizes,
                                 key=_key(lowered, key, layer))
        for p in params:
            grads[p].insert(0, got[p])
        g = got[ns.BLOCK_INPUT]
    return x, {"d" + ns.BLOCK_INPUT: g, **{"d" + p: np.stack(v) for p, v in grads.items()}}


def verify_pipeline(plan: Plan, devices: int = 8, seed: int = 0, key: int = 0) -> Report:
    """Lower the pipeline small, run it, check values and the compiled permutes (see the module doc);
    ``key`` is the dropout key, layer l's masks drawn under :func:`layer_key` of it.  A ``layers L
    { ... }`` block with statements around it is verified as the whole model
    (:func:`shardc.lowering.pipeline_ends_verify.verify_model`, which :func:`shardc.lowering.verify.verify`
    calls for it)."""
    if plan.spec.block is not None:
        raise ShardcError("a layers block with statements around it is verified as the whole model",
                          fix="verify it with shardc.lowering.verify.verify (or verify_model)")
    sizes, layers, micro = _sizes(plan, devices)
    lowered = lower_pipeline(plan, sizes=sizes, layers=layers, microbatches=micro)
    ns = lowered.namespace
    tol = (100 * TOLERANCE["float64"][0], 100 * TOLERANCE["float64"][1])  # 2P layers deep: rounding x ~10
    mesh = dict(ns.PIPE_MESH_AXES)
    report = Report(plan.spec.filename or "<spec>", mesh, {**lowered.sizes, "layers": layers,
                                                           "microbatches": micro}, str(plan.spec.dtype),
                    "float64", tol)
    inputs = _inputs(lowered, seed, key)
    out_shape = inputs[ns.BLOCK_INPUT].shape
    d_out = np.random.default_rng(seed + 1).standard_normal(out_shape)
    want_out, want_grads = _reference(lowered, inputs, d_out, key)
    import jax

    one_f_one_b = lowered.pipeline.schedule.name == "1f1b"
    with jax.enable_x64(True):  # a deep stack of products: float32's rounding grows past any fair bound
        if one_f_one_b:
            text, got_out, got_grads = _run_1f1b(lowered, inputs, d_out, key)
        else:
            fwd_text, got_out, bwd_text, got_grads = _run(lowered, inputs, d_out, key)
    report.values.append(_row("forward", ns.BLOCK_OUTPUT, got_out, want_out, tol))
    report.values += [_row("backward", k, got_grads[k], v, tol) for k, v in want_grads.items()]
    cut = collapsed_axes(plan, {**mesh})
    if cut:
        report.notes.append(cut_note(cut, devices, plan))
    report.collectives += one_f_one_b_rows(lowered, text, cut=cut) if one_f_one_b else gpipe_rows(
        lowered, fwd_text, bwd_text, cut=cut)
    return report


def _run_1f1b(lowered: PipelineLowered, inputs: dict[str, np.ndarray], d_out: np.ndarray,
              key: int) -> tuple[str, np.ndarray, dict[str, np.ndarray]]:
    """The 1F1B step (forward and backward in one program): HLO text, output, gradients."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    ns = lowered.namespace
    mesh, step = ns.one_f_one_b_program()
    args = ns._args(inputs, key)
    d_last = ns._split(d_out, ns.MICRO_DIM[1])
    d_outs = jnp.zeros((ns.STAGES,) + d_last.shape, d_last.dtype).at[-1].set(d_last)
    d_outs = jax.device_put(d_outs, NamedSharding(mesh, ns.PIPE_OUT))
    compiled = step.lower(*args[:2], d_outs, *args[2:]).compile()
    outs, dxs, *dws = compiled(*args[:2], d_outs, *args[2:])
    got = {"d" + ns.BLOCK_INPUT: np.asarray(ns._join(dxs[0], ns.MICRO_DIM[0]))}
    got.update({"d" + p: np.asarray(g) for p, g in zip(ns.PARAMS, dws, strict=True)})
    return compiled.as_text(), np.asarray(ns._join(outs[-1], ns.MICRO_DIM[1])), got


def _run(lowered: PipelineLowered, inputs: dict[str, np.ndarray], d_out: np.ndarray,
         key: int) -> tuple[str, np.ndarray, str, dict[str, np.ndarray]]:
    """Compile each program once, read its HLO, run it."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    ns = lowered.namespace
    mesh, fwd, bwd = ns.pipeline_programs()
    args = ns._args(inputs, key)
    fwd_c = fwd.lower(*args).compile()
    outs = fwd_c(*args)
    d_last = ns._split(d_out, ns.MICRO_DIM[1])
    d_outs = jnp.zeros((ns.STAGES,) + d_last.shape, d_last.dtype).at[-1].set(d_last)
    d_outs = jax.device_put(d_outs, NamedSharding(mesh, ns.PIPE_OUT))
    bwd_c = bwd.lower(d_outs, *args).compile()
    grads = bwd_c(d_outs, *args)
    got = {"d" + ns.BLOCK_INPUT: np.asarray(ns._join(grads[0][0], ns.MICRO_DIM[0]))}
    got.update({"d" + p: np.asarray(g) for p, g in zip(ns.PARAMS, grads[1:], strict=True)})
    return fwd_c.as_text(), np.asarray(ns._join(outs[-1], ns.MICRO_DIM[1])), bwd_c.as_text(), got


def _row(phase: str, name: str, got: np.ndarray, want: np.ndarray, tol: tuple[float, float]) -> ValueRow:
    scale = float(np.max(np.abs(want)))
    ok_shape = got.shape == want.shape
    err = float(np.max(np.abs(got.astype(np.float64) - want))) if ok_shape else math.inf
    bound = tol[1] + tol[0] * scale
    return ValueRow(phase, name, err, scale, bound, err <= bound, "" if ok_shape else "shapes differ")
