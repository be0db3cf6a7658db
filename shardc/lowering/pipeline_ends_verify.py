"""``shardc verify`` of a pipelined ``layers L { ... }`` block with its ends: the whole model's loss
and every param's gradient against numpy, and the compiled programs' permutes.

The reference is the spec's meaning in float64: the statements before the block run
once on the whole batch, the block L times (layer l with the l-th slice of each
stacked param), the statements after it once; the backward runs them in reverse, each
part's input gradient the cotangent of the part before.  Inputs are drawn as for a
block alone (:mod:`shardc.lowering.pipeline_verify`), token ids uniform over their
vocabulary.  The HLO is checked as a block alone's is
(:mod:`shardc.lowering.pipeline_hlo`), against the three parts' plans; and those parts'
collectives must be the collectives of the whole model's plan, the one ``shardc cost``
priced, so what ran is what was costed.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

from shardc.lowering import reference
from shardc.lowering.pipeline import PipelineLowered, lower_pipeline
from shardc.lowering.pipeline_hlo import gpipe_rows, one_f_one_b_rows
from shardc.lowering.pipeline_verify import _calibrate, _contracted, _key, _row, _sizes
from shardc.lowering.report import TOLERANCE, CollectiveRow, Report, cut_note
from shardc.lowering.rows import id_inputs
from shardc.lowering.sizes import collapsed_axes
from shardc.pipeline.boundary import microbatch_dim
from shardc.pipeline.stages import stage_spec
from shardc.planner.ir import Plan
from shardc.spec.functions import ID_DTYPE
from shardc.spec.ir import Spec

__all__ = ["verify_model"]


def _specs(lowered: PipelineLowered) -> tuple[Spec, Spec, Spec]:
    ends = lowered.ends
    assert ends is not None
    return ends.pre.spec, stage_spec(ends.block.spec), ends.post.spec


def _inputs(lowered: PipelineLowered, seed: int, key: int) -> dict[str, np.ndarray]:
    ns, sizes = lowered.namespace, dict(lowered.sizes)
    pre, block, post = _specs(lowered)
    assert lowered.ends is not None
    sizes[microbatch_dim(lowered.ends.block)] = lowered.batch
    rng = np.random.default_rng(seed)
    values: dict[str, np.ndarray] = {}
    vocab = {name: v for part in (pre, post) for name, v in _vocab(part).items()}
    for info in lowered.plan.tensors:
        shape = [sizes[d.name] for d in info.ref.dims]
        if info.name in vocab:
            values[info.name] = rng.integers(0, sizes[vocab[info.name]], shape).astype(ID_DTYPE)
        elif info.role == "param" and info.name in ns.PARAMS:
            scale = 1 / math.sqrt(_contracted(block, info.name, sizes))
            values[info.name] = rng.standard_normal([lowered.pipeline.layers, *shape]) * scale
        elif info.role == "param":
            part = pre if info.name in ns.PRE_PARAMS else post
            values[info.name] = rng.standard_normal(shape) / math.sqrt(_contracted(part, info.name, sizes))
    values[ns.BLOCK_INPUT] = reference.forward(pre, values)[ns.PRE_RESULT]
    _calibrate(lowered, block, values, key)
    del values[ns.BLOCK_INPUT]
    return values


def _vocab(spec: Spec) -> dict[str, str]:
    """Token-id inputs and the vocabulary dim they index."""
    return dict(id_inputs(spec))


def _reference(lowered: PipelineLowered, inputs: dict[str, np.ndarray], d_loss: float,
               key: int) -> tuple[float, dict[str, np.ndarray]]:
    ns = lowered.namespace
    pre, block, post = _specs(lowered)
    f64 = {k: v if v.dtype.kind in "iu" else v.astype(np.float64) for k, v in inputs.items()}
    pre_in = {k: f64[k] for k in ns.PRE_FORWARD_IN}
    x = reference.forward(pre, pre_in)[ns.PRE_RESULT]
    sizes = dict(lowered.sizes)  # the dims no input has (a route's capacity); the inputs' shapes win
    kept = []
    for layer in range(lowered.pipeline.layers):
        values = {ns.BLOCK_INPUT: x, **{p: f64[p][layer] for p in ns.PARAMS}}
        kept.append(values)
        x = reference.forward(block, values, sizes=sizes, key=_key(lowered, key, layer))[ns.BLOCK_OUTPUT]
    post_in = {k: x if k == ns.BLOCK_OUTPUT else f64[k] for k in ns.POST_FORWARD_IN}
    loss = float(reference.forward(post, post_in)[ns.LOSS])
    got = reference.backward(post, post_in, {ns.LOSS: np.asarray(d_loss)})
    grads = {ns.POST_GRADS[p]: got[p] for p in ns.POST_PARAMS}
    g = got[ns.BLOCK_OUTPUT]
    layers: dict[str, list[np.ndarray]] = {p: [] for p in ns.PARAMS}
    for layer in reversed(range(len(kept))):
        back = reference.backward(block, kept[layer], {ns.BLOCK_OUTPUT: g}, sizes=sizes,
                                  key=_key(lowered, key, layer))
        for p in ns.PARAMS:
            layers[p].insert(0, back[p])
        g = back[ns.BLOCK_INPUT]
    got = reference.backward(pre, pre_in, {ns.PRE_RESULT: g})
    grads.update({ns.PRE_GRADS[p]: got[p] for p in ns.PRE_PARAMS})
    grads.update({ns.GRADS[p]: np.stack(v) for p, v in layers.items()})
    return loss, grads


def verify_model(plan: Plan, devices: int = 8, seed: int = 0, key: int = 0) -> Report:
    """Lower the whole pipelined model small, run it, check the loss, the gradients and the HLO."""
    sizes, layers, micro = _sizes(plan, devices)
    lowered = lower_pipeline(plan, sizes=sizes, layers=layers, microbatches=micro)
    ns = lowered.namespace
    tol = (100 * TOLERANCE["float64"][0], 100 * TOLERANCE["float64"][1])  # as a block alone's
    report = Report(plan.spec.filename or "<spec>", dict(ns.PIPE_MESH_AXES),
                    {**lowered.sizes, "layers": layers, "microbatches": micro}, str(plan.spec.dtype), "float64", tol)
    inputs = _inputs(lowered, seed, key)
    d_loss = float(np.random.default_rng(seed + 1).standard_normal())
    want_loss, want_grads = _reference(lowered, inputs, d_loss, key)
    import jax

    assert lowered.ends is not None
    parts = (lowered.ends.pre, lowered.ends.block, lowered.ends.post)
    cut = collapsed_axes(plan, dict(ns.PIPE_MESH_AXES))
    if cut:
        report.notes.append(cut_note(cut, devices, plan))
    report.collectives += _as_costed(plan, parts)
    with jax.enable_x64(True):
        if lowered.pipeline.schedule.name == "1f1b":
            text, loss, grads = _run_1f1b(ns, inputs, d_loss, key)
            report.collectives += one_f_one_b_rows(lowered, text, parts, cut)
        else:
            fwd_text, loss, bwd_text, grads = _run(ns, inputs, d_loss, key)
            report.collectives += gpipe_rows(lowered, fwd_text, bwd_text, parts, cut)
    report.values.append(_row("forward", ns.LOSS, np.asarray(loss), np.asarray(want_loss), tol))
    report.values += [_row("backward", k, np.asarray(grads[k]), v, tol) for k, v in want_grads.items()]
    return report


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


def _run(ns: Any, inputs: dict[str, np.ndarray], d_loss: float,
         key: int) -> tuple[str, float, str, dict[str, np.ndarray]]:
    """GPipe: compile each program once, read its HLO, run it."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    mesh, fwd, bwd = ns.model_programs()
    args = ns._model_args(inputs, key)
    fwd_c = fwd.lower(*args).compile()
    loss = float(jnp.mean(fwd_c(*args)[-1]))
    d = jnp.zeros((ns.STAGES, ns.MICROBATCHES)).at[-1].set(d_loss / ns.MICROBATCHES)
    d = jax.device_put(d, NamedSharding(mesh, ns.MODEL_OUT))
    bwd_c = bwd.lower(d, *args).compile()
    grads = ns._model_grads(bwd_c(d, *args))
    return fwd_c.as_text(), loss, bwd_c.as_text(), {k: np.asarray(v) for k, v in grads.items()}


def _run_1f1b(ns: Any, inputs: dict[str, np.ndarray], d_loss: float,
              key: int) -> tuple[str, float, dict[str, np.ndarray]]:
    """1F1B: the step in one program; its HLO, the loss, the gradients."""
    mesh, step = ns.model_1f1b_program()
    args = ns._model_args(inputs, key)
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    d = jax.device_put(jnp.asarray(d_loss / ns.MICROBATCHES), NamedSharding(mesh, ns.P()))
    compiled = step.lower(args[0], d, *args[1:]).compile()
    losses, *grads = compiled(args[0], d, *args[1:])
    got = ns._model_grads(grads)
    return compiled.as_text(), float(np.mean(np.asarray(losses)[-1])), {k: np.asarray(v) for k, v in got.items()}
