"""``shardc verify`` of a pipelined spec: its schedule's program against numpy, and its HLO.

One verifier for every schedule and for a block alone or inside a whole model: the
module's :class:`~shardc.lowering.pipeline_runtime.Pipeline` runs the tick table once
(forward and backward in one program), and its results and gradients are compared with
a float64 numpy reference of the spec's meaning: the statements before the block (if
any) once on the whole batch, the block L times (layer l with the l-th slice of each
stacked param), the statements after it (if any) once; the backward runs them in
reverse, each part's input gradient the cotangent of the part before.

Values are computed in float64 (a stack of 2P quadratic layers amplifies float32's
rounding to about 1e-4 relative, as numpy's own float32 shows) and compared within 100
times the one-block float64 bound (a real mistake is off by order 1); HLO bytes are
priced in the spec's dtype.  The mesh shrinks to fit the devices as a block's does,
every axis kept at 2 or more while possible, the stage axis last (P=4, X=64, Y=4 runs as
P=4, X=2, Y=2 on 16 devices and P=2, X=2, Y=2 on 8); an axis cut to 1 fails the
collectives over it, which did not run.  The block is stacked 2P layers deep and cut
into 2P microbatches (at most the spec's).  Params are scaled by 1/sqrt(their
contracted size), and each layer's last one so that its output has unit RMS, so a deep
stack of products neither vanishes nor overflows; token ids are uniform over their
vocabulary.

The compiled HLO is checked by :mod:`shardc.verification.pipeline_hlo`: the loop and its
permutes between stages, and every planned collective by kind, axes and bytes.  With
statements around the block, the three parts' collectives must also be the collectives
of the whole model's plan, the one ``shardc cost`` priced, so what ran is what was costed.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np

from shardc.errors import ShardcError
from shardc.ir.plan import Plan
from shardc.ir.spec import Contract, Mesh, Spec
from shardc.lowering import reference as numpy_reference
from shardc.lowering.pipeline_lowering import PipelineLowered, lower_pipeline
from shardc.lowering.row_code import id_inputs
from shardc.lowering.sizes import collapsed_axes, shrink_mesh, small_sizes
from shardc.pipeline.boundary import microbatch_dim
from shardc.spec.functions import ID_DTYPE, layer_key
from shardc.spec.stages import pipeline_of, stage_spec
from shardc.spec.walk import leaves
from shardc.verification.pipeline_hlo import loop_rows
from shardc.verification.report import TOLERANCE, CollectiveRow, Report, ValueRow, cut_note

__all__ = ["verify_pipeline", "run_sizes", "draw_inputs", "draw_cotangent", "reference"]

Arrays = dict[str, np.ndarray]


def run_sizes(plan: Plan, devices: int) -> tuple[dict[str, int], int, int]:
    """Mesh and dims for the run (the whole batch's), the layer count and the microbatches."""
    pipe = pipeline_of(plan.spec)
    assert pipe is not None
    if devices < 2:
        raise ShardcError("a pipeline's stages need 2 devices or more",
                          fix="run with more devices (--devices) or a smaller pipeline axis")
    mesh = dict(shrink_mesh([(a.name, a.size) for a in plan.spec.mesh.axes], devices, pipe.axis))
    stages = mesh.pop(pipe.axis)
    axes = Mesh(tuple(replace(a, size=mesh[a.name]) for a in plan.spec.mesh.axes if not a.pipeline))
    dims = small_sizes(replace(plan, spec=replace(stage_spec(plan.spec), mesh=axes)), None)
    micro = min(pipe.microbatches, 2 * stages)
    dims[microbatch_dim(plan)] *= micro
    return {**dims, **mesh, pipe.axis: stages}, 2 * stages, micro


def _parts(lowered: PipelineLowered) -> tuple[Spec | None, Spec, Spec | None]:
    """The specs before the block, of the block (one layer), after it."""
    ends = lowered.ends
    if ends is None:
        return None, stage_spec(lowered.plan.spec), None
    return ends.pre.spec, stage_spec(ends.block.spec), ends.post.spec


def _contracted(spec: Spec, param: str, sizes: dict[str, int]) -> int:
    """The size a param's einsum sums over (its indices the result lacks)."""
    for statement in spec.statements:
        for ref in leaves(statement.expr):
            if ref.name == param:
                gone = set(ref.indices) - set(statement.result.indices)
                return max(1, math.prod(sizes[i] for i in gone))
    return 1


def _key(lowered: PipelineLowered, key: int, layer: int) -> int:
    return layer_key(key, layer, lowered.pipeline.layers)


def draw_inputs(lowered: PipelineLowered, seed: int, key: int) -> Arrays:
    """The run's inputs at the whole batch's sizes: data standard normal (token ids uniform over
    their vocabulary), params scaled as the module doc says, the block's stacked [layers, ...]."""
    ns, sizes = lowered.namespace, dict(lowered.sizes)
    pre, block, post = _parts(lowered)
    sizes[microbatch_dim(lowered.plan)] = lowered.batch
    vocab = {name: v for part in (pre, post) if part is not None for name, v in id_inputs(part).items()}
    rng = np.random.default_rng(seed)
    values: Arrays = {}
    for info in lowered.plan.tensors:
        shape = [sizes[d.name] for d in info.ref.dims]
        if info.name in vocab:
            values[info.name] = rng.integers(0, sizes[vocab[info.name]], shape).astype(ID_DTYPE)
        elif info.name == ns.BLOCK_INPUT and pre is None:
            values[info.name] = rng.standard_normal(shape)
        elif info.role == "param" and info.name in ns.PARAMS:
            scale = 1 / math.sqrt(_contracted(block, info.name, sizes))
            values[info.name] = rng.standard_normal([lowered.pipeline.layers, *shape]) * scale
        elif info.role == "param":
            part = pre if pre is not None and info.name in ns.PRE_PARAMS else post
            assert part is not None
            values[info.name] = rng.standard_normal(shape) / math.sqrt(_contracted(part, info.name, sizes))
    x = values[ns.BLOCK_INPUT] if pre is None else numpy_reference.forward(pre, values)[ns.PRE_RESULT]
    _calibrate(lowered, block, values, x, key)
    return values


def _calibrate(lowered: PipelineLowered, spec: Spec, values: Arrays, x: np.ndarray, key: int) -> None:
    """Scale each layer's last param so its output has unit RMS (a deep product of einsums
    otherwise vanishes or overflows; layer norms do this in a real model)."""
    ns = lowered.namespace
    last = next((s for s in spec.statements if s.result.name == ns.BLOCK_OUTPUT), None)
    if last is None or not isinstance(last.expr, Contract):  # the output is linear in its operands
        return
    linear = [r.name for r in leaves(last.expr) if r.name in ns.PARAMS]
    if not linear:
        return
    for layer in range(lowered.pipeline.layers):
        layer_values = {ns.BLOCK_INPUT: x, **{p: values[p][layer] for p in ns.PARAMS}}
        out = numpy_reference.forward(spec, layer_values, sizes=dict(lowered.sizes),
                                      key=_key(lowered, key, layer))[ns.BLOCK_OUTPUT]
        rms = float(np.sqrt(np.mean(out ** 2))) or 1.0
        values[linear[0]][layer] /= rms
        x = out / rms


def draw_cotangent(lowered: PipelineLowered, inputs: Arrays, seed: int) -> Arrays:
    """The cotangent of the pipeline's result: the block output's (its shape), or the loss's."""
    ends = lowered.namespace.PIPELINE.ends
    rng = np.random.default_rng(seed + 1)
    if lowered.ends is None:
        return {ends.output_cotangent: rng.standard_normal(inputs[ends.block_input].shape)}
    return {ends.result_cotangent: np.asarray(rng.standard_normal())}


def reference(lowered: PipelineLowered, inputs: Arrays, cotangent: Arrays, key: int) -> tuple[Arrays, Arrays]:
    """The spec's meaning in float64: the pipeline's results and every gradient, keyed as the module
    keys them."""
    ns = lowered.namespace
    pre, block, post = _parts(lowered)
    f64 = {k: v if v.dtype.kind in "iu" else v.astype(np.float64) for k, v in inputs.items()}
    sizes = dict(lowered.sizes)  # the dims no input has (a route's capacity); the inputs' shapes win
    pre_in = {k: f64[k] for k in ns.PRE_FORWARD_IN} if pre is not None else {}
    x = numpy_reference.forward(pre, pre_in)[ns.PRE_RESULT] if pre is not None else f64[ns.BLOCK_INPUT]
    kept = []
    for layer in range(lowered.pipeline.layers):
        values = {ns.BLOCK_INPUT: x, **{p: f64[p][layer] for p in ns.PARAMS}}
        kept.append(values)
        x = numpy_reference.forward(block, values, sizes=sizes, key=_key(lowered, key, layer))[ns.BLOCK_OUTPUT]
    grads: Arrays = {}
    if post is None:
        results = {ns.BLOCK_OUTPUT: x}
        g = cotangent[ns.PIPELINE.ends.output_cotangent].astype(np.float64)
    else:
        post_in = {k: x if k == ns.BLOCK_OUTPUT else f64[k] for k in ns.POST_FORWARD_IN}
        results = {ns.LOSS: np.asarray(numpy_reference.forward(post, post_in)[ns.LOSS])}
        d_loss = cotangent[ns.PIPELINE.ends.result_cotangent]
        got = numpy_reference.backward(post, post_in, {ns.LOSS: np.asarray(d_loss)})
        grads.update({ns.POST_GRADS[p]: got[p] for p in ns.POST_PARAMS})
        g = got[ns.BLOCK_OUTPUT]
    layers: dict[str, list[np.ndarray]] = {p: [] for p in ns.PARAMS}
    for layer in reversed(range(len(kept))):
        back = numpy_reference.backward(block, kept[layer], {ns.BLOCK_OUTPUT: g}, sizes=sizes,
                                        key=_key(lowered, key, layer))
        for p in ns.PARAMS:
            layers[p].insert(0, back[p])
        g = back[ns.BLOCK_INPUT]
    if pre is None:
        grads[ns.GRADS[ns.BLOCK_INPUT]] = g
    else:
        got = numpy_reference.backward(pre, pre_in, {ns.PRE_RESULT: g})
        grads.update({ns.PRE_GRADS[p]: got[p] for p in ns.PRE_PARAMS})
    grads.update({ns.GRADS[p]: np.stack(v) for p, v in layers.items()})
    return results, grads


def verify_pipeline(plan: Plan, devices: int = 8, seed: int = 0, key: int = 0) -> Report:
    """Lower the pipeline small, run its schedule once, check values and the compiled program (see the
    module doc); ``key`` is the dropout key, layer l's masks drawn under :func:`layer_key` of it."""
    import jax

    sizes, layers, micro = run_sizes(plan, devices)
    lowered = lower_pipeline(plan, sizes=sizes, layers=layers, microbatches=micro)
    ns = lowered.namespace
    tol = (100 * TOLERANCE["float64"][0], 100 * TOLERANCE["float64"][1])  # 2P layers deep: rounding x ~10
    mesh = dict(ns.PIPE_MESH_AXES)
    report = Report(plan.spec.filename or "<spec>", mesh, {**lowered.sizes, "layers": layers,
                                                           "microbatches": micro}, str(plan.spec.dtype),
                    "float64", tol)
    inputs = draw_inputs(lowered, seed, key)
    cotangent = draw_cotangent(lowered, inputs, seed)
    want_out, want_grads = reference(lowered, inputs, cotangent, key)
    cut = collapsed_axes(plan, {**mesh})
    if cut:
        report.notes.append(cut_note(cut, devices, plan))
    parts = None if lowered.ends is None else (lowered.ends.pre, lowered.ends.block, lowered.ends.post)
    if parts is not None:
        report.collectives += _as_costed(plan, parts)
    with jax.enable_x64(True):  # a deep stack of products: float32's rounding grows past any fair bound
        text, got_out, got_grads = _run(lowered, inputs, cotangent, key)
    report.values += [_row("forward", k, got_out[k], v, tol) for k, v in want_out.items()]
    report.values += [_row("backward", k, got_grads[k], v, tol) for k, v in want_grads.items()]
    report.collectives += loop_rows(lowered, text, parts, cut)
    return report


def _run(lowered: PipelineLowered, inputs: Arrays, cotangent: Arrays, key: int) -> tuple[str, Arrays, Arrays]:
    """The schedule's program compiled once: its HLO text, the results, the gradients."""
    pipeline = lowered.namespace.PIPELINE
    args = pipeline.arguments(inputs, pipeline.ends.cotangent(pipeline, inputs, cotangent), key)
    compiled = pipeline.program()[1].lower(*args).compile()
    results, grads = pipeline.read(*compiled(*args))
    return (compiled.as_text(), {k: np.asarray(v) for k, v in results.items()},
            {k: np.asarray(v) for k, v in grads.items()})


def _collectives(plans: tuple[Plan, ...]) -> Counter[tuple[str, str, str, str, str]]:
    return Counter((phase, s.op.title, ",".join(s.axes), str(s.src), str(s.dst)) for p in plans
                   for phase, steps in (("forward", p.forward), ("backward", p.backward))
                   for s in steps if s.is_collective)


def _as_costed(plan: Plan, parts: tuple[Plan, ...]) -> list[CollectiveRow]:
    """The lowered parts' collectives against the whole model's plan (the one costed), step for step.

    The parts are planned apart, each keeping the block's declared boundary shardings;
    a difference would mean the program runs other collectives than the cost priced.
    """
    costed, lowered = _collectives((plan,)), _collectives(parts)
    if costed == lowered:
        n = sum(costed.values())
        return [CollectiveRow("plan", f"the {n} collectives the cost priced, each lowered", "-", "-", None,
                              f"{n} lowered", "-", None, True)]
    rows = []
    for extra, note in ((costed - lowered, "priced but not lowered"), (lowered - costed, "lowered but not priced")):
        for (phase, op, axes, src, dst), n in extra.items():
            rows.append(CollectiveRow("plan", f"{op} {src} -> {dst} ({phase}) x {n}", op, axes, None, "-", "-",
                                      None, False, note))
    return rows


def _row(phase: str, name: str, got: Any, want: np.ndarray, tol: tuple[float, float]) -> ValueRow:
    got, want = np.asarray(got), np.asarray(want)
    scale = float(np.max(np.abs(want)))
    ok_shape = got.shape == want.shape
    err = float(np.max(np.abs(got.astype(np.float64) - want))) if ok_shape else math.inf
    bound = tol[1] + tol[0] * scale
    return ValueRow(phase, name, err, scale, bound, err <= bound, "" if ok_shape else "shapes differ")
