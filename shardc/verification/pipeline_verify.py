"""``shardc verify`` of a pipelined spec: its schedule's program against numpy, and its HLO.

One verifier for every schedule and for a block alone or inside a whole model: the
module's :class:`~shardc.lowering.pipeline_runtime.Pipeline` runs the tick table once
(forward and backward in one program), and its results and gradients are compared with
a float64 numpy reference of the spec's meaning: the statements before the block (if
any) once on the whole batch, the block L times (layer l with the l-th slice of each
stacked param; with several blocks each block's layers in turn, :mod:`shardc.verification.pipeline_layers`),
the statements after it (if any) once; the backward runs them in
reverse, each part's input gradient the cotangent of the part before.

Values are computed in float64 (a stack of 2P quadratic layers amplifies float32's
rounding to about 1e-4 relative, as numpy's own float32 shows) and compared within a bound
the computation sets (:func:`rounding_bound`, :func:`_float64_rows`): the rounding of every
sum on the chain, plus how far the chain moves a value when its sums are reordered, as the
unsharded float64 program's own error measures it (a deep stack of norms and growing residuals
amplifies it, to 2e-8 of a gradient 32 layers deep; a real mistake is off by order 1); HLO
bytes are priced in the spec's dtype.  The mesh shrinks to fit the devices as a block's does,
every axis kept at 2 or more while possible, the stage axis last (P=4, X=64, Y=4 runs as
P=4, X=2, Y=2 on 16 devices and P=2, X=2, Y=2 on 8); an axis cut to 1 fails the
collectives over it, which did not run.  The block is stacked 2P layers deep (2P - 1
where the spec's layers split unevenly over its stages, so that an empty slot runs too)
and cut into 2P microbatches (at most the spec's).  Params are scaled by 1/sqrt(their
contracted size), then each part's and each layer's to the scales at which each of its
ops matters (:mod:`shardc.verification.scales`: a norm's statistic, an activation's
argument at unit size, a sum's terms of like size), and each layer's last one so that
its output has unit RMS, so a deep stack of products neither vanishes nor overflows;
token ids are uniform over their vocabulary.  As unpipelined verify does
(:mod:`shardc.verification.power`), a spec with dropout runs under two keys (the
program compiled once), and a row whose bound would pass an error of 5% of its value
is checked again in float32 against the unsharded program's own error.

The compiled HLO is checked by :mod:`shardc.verification.pipeline_hlo`: the loop and its
permutes between stages, and every planned collective by kind, axes and bytes.  With
statements around the block, the three parts are the sections of the whole model's plan
(:attr:`shardc.ir.plan.Plan.sections`), the one ``shardc cost`` priced, so what ran is
what was costed by construction.  The compiled schedule's memory per device is set beside
shardc's fullest stage (:mod:`shardc.verification.pipeline_memory`), reported, not judged.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from shardc.errors import ShardcError
from shardc.ir.plan import Plan
from shardc.ir.spec import Mesh, Spec
from shardc.lowering import reference as numpy_reference
from shardc.lowering.pipeline_lowering import PipelineLowered, lower_pipeline
from shardc.lowering.run_windows import window_notes, windows_at
from shardc.lowering.sizes import collapsed_axes, shrink_mesh, small_sizes
from shardc.pipeline.boundary import fed_beside, microbatch_dim, riders
from shardc.spec.stages import pipeline_of, stage_spec
from shardc.verification import power
from shardc.verification.memory_check import MEMORY_DTYPE, XLA_OPTIONS
from shardc.verification.module_check import running
from shardc.verification.pipeline_draws import Arrays, draw_cotangent, draw_inputs, layer_key_of, model_parts
from shardc.verification.pipeline_hlo import loop_rows
from shardc.verification.pipeline_layers import block_grads, keyed, layer_specs, model_layers, run_blocks
from shardc.verification.pipeline_memory import StageMemoryCheck, stage_memory_check
from shardc.verification.pipeline_module import use_pipeline_module
from shardc.verification.progress import step
from shardc.verification.report import POWER, Report, ValueRow, compare_values, cut_note, gemm_note

__all__ = ["verify_pipeline", "check_pipeline_memory", "run_sizes", "draw_inputs", "draw_cotangent",
           "reference", "rounding_bound", "differential_rows", "run_blocks"]



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
    # two layers a stage (a chunk's under interleaved); a spec split unevenly runs so too: a slot empty
    layers = max(2, pipe.chunks) * stages - (not pipe.even and pipe.chunks == 1)
    if pipe.split is not None:
        layers = sum(run_split(plan) or ())
    return {**dims, **mesh, pipe.axis: stages}, layers, micro


def run_split(plan: Plan) -> tuple[int, ...] | None:
    """The layers each stage holds in the run, where the spec gives ``stage_layers``: each stage's, at most
    two (so a stage of one layer beside stages of more stays uneven)."""
    pipe = pipeline_of(plan.spec)
    return None if pipe is None or pipe.split is None else tuple(min(n, 2) for n in pipe.split)



def reference(lowered: PipelineLowered, inputs: Arrays, cotangent: Arrays, key: int, xp: Any = None,
              dtype: Any = np.float64) -> tuple[Arrays, Arrays]:
    """The spec's meaning in float64: the pipeline's results and every gradient, keyed as the module
    keys them.  ``xp`` runs each part (numpy's by default); with :class:`_Compiled` and ``dtype``
    float32 it is the unsharded float32 program (:func:`unsharded`)."""
    ns = lowered.namespace
    pre, _, post = model_parts(lowered)
    xp = xp if xp is not None else _Direct(np)
    wide = {k: v if v.dtype.kind in "iu" else np.asarray(v, dtype) for k, v in inputs.items()}
    sizes = dict(lowered.sizes)  # the dims no input has (a route's capacity); the inputs' shapes win
    pre_in = {k: wide[k] for k in ns.PRE_FORWARD_IN} if pre is not None else {}
    made = xp.forward(pre, pre_in, key=key) if pre is not None else {ns.BLOCK_INPUT: wide[ns.BLOCK_INPUT]}
    x = made[ns.PRE_RESULT] if pre is not None else made[ns.BLOCK_INPUT]
    kept = []
    layers = model_layers(lowered)
    # the spec's meaning of a value made before the block and read in it beside its input (E beside X0): the
    # layer's output feeds both, so the first layer reads the one made before, each later one its input
    fed, riding = fed_beside(lowered.plan.spec), riders(lowered.plan.spec)  # riders: made before, read after
    for number, layer in enumerate(layers):
        beside = {n: made[n] if number == 0 else x for n in fed} if number < lowered.blocks[0] else {}
        values = {layer.input: x, **beside, **{p: wide[p][layer.index] for p in layer.params},
                  **{k: wide[k] for k in ns.PIPELINE.shared}}  # a shared input: every layer's the same
        kept.append(values)
        x = xp.forward(layer.spec, values, sizes, layer_key_of(lowered, key, number))[layer.output]
    grads: Arrays = {}
    tied: Arrays = {}  # a param read on both ends: the contribution to its gradient after the block
    d_riding: Arrays = {}
    if post is None:
        results = {ns.BLOCK_OUTPUT: x}
        g = np.asarray(cotangent[ns.PIPELINE.ends.output_cotangent], dtype)
    else:
        post_in = {k: x if k == layers[-1].output else made[k] if k in riding else wide[k] for k in ns.POST_FORWARD_IN}
        results = {ns.LOSS: np.asarray(xp.forward(post, post_in, sizes, key)[ns.LOSS])}
        d_loss = np.asarray(cotangent[ns.PIPELINE.ends.result_cotangent], dtype)
        got = xp.backward(post, post_in, {ns.LOSS: d_loss}, sizes, key)  # a routed head's C
        grads.update({ns.POST_GRADS[p]: got[p] for p in ns.PIPELINE.ends.summed(True) if p not in ns.TIED})
        tied = {p: got[p] for p in ns.TIED}
        g = got[layers[-1].output]
        d_riding = {n: got[n] for n in riding}  # their gradients, which the statements before the block take
    stacks: dict[str, list[np.ndarray]] = {p: [] for layer in layers for p in layer.params}
    for number in reversed(range(len(kept))):
        layer = layers[number]
        back = xp.backward(layer.spec, kept[number], {layer.output: g}, sizes, layer_key_of(lowered, key, number))
        for p in layer.params:
            stacks[p].insert(0, back[p])
        beside = {n: back[n] for n in fed if number < lowered.blocks[0]}
        g = back[layer.input] + sum(beside.values()) if number else back[layer.input]
    if pre is None:
        grads[ns.GRADS[ns.BLOCK_INPUT]] = g
    else:
        given: Arrays = {ns.PRE_RESULT: g}
        for n, v in [*beside.items(), *d_riding.items()]:  # a value fed, riding, or both (the result too)
            given[n] = given[n] + v if n in given else v
        got = xp.backward(pre, pre_in, given, key=key)
        finals = getattr(ns, "PRE_FINAL_GRADS", {})  # a tied param's gradient: the sum of both ends'
        grads.update({finals.get(ns.PRE_GRADS[p], ns.PRE_GRADS[p]): got[p] + tied[p] if p in tied else got[p]
                      for p in ns.PIPELINE.ends.summed(False)})
    names = block_grads(lowered)
    grads.update({names[p]: np.stack(v) for p, v in stacks.items()})
    return results, grads


def unsharded(lowered: PipelineLowered, inputs: Arrays, cotangent: Arrays, key: int,
              dtype: Any) -> tuple[Arrays, Arrays]:
    """:func:`reference` in jax.numpy and ``dtype``: the unsharded program, on one device, each part
    compiled apart (:class:`_Compiled`)."""
    return reference(lowered, inputs, cotangent, key, _Compiled(keyed(lowered.namespace)), dtype)


class _Direct:
    """The parts of the model (the statements before the blocks, a layer, those after) run op by op in
    ``xp`` (numpy, or jax.numpy)."""

    def __init__(self, xp: Any) -> None:
        self.xp = xp

    def forward(self, spec: Spec, inputs: Arrays, sizes: dict[str, int] | None = None, key: int = 0) -> Arrays:
        return self._part(numpy_reference.forward, spec, sizes, key)(inputs)

    def backward(self, spec: Spec, inputs: Arrays, cotangents: Arrays, sizes: dict[str, int] | None = None,
                 key: int = 0) -> Arrays:
        return self._part(numpy_reference.backward, spec, sizes, key)(inputs, cotangents)

    def _part(self, run: Any, spec: Spec, sizes: dict[str, int] | None, key: int) -> Any:
        return lambda *arrays: run(spec, *arrays, self.xp, sizes=sizes, key=key)


class _Compiled(_Direct):
    """Each part compiled by jax apart, once for each spec (a block's layers share one program) and
    dropout key: op by op, jax compiles each distinct operation apart (about a hundred small programs a
    pipeline); traced whole, DeepSeek-V3's 32 layers were one program of 130,000 HLO lines whose XLA
    compile took 48 s of verify's CPU.  Each part's own sums XLA still orders as it likes."""

    def __init__(self, keyed: bool) -> None:
        import jax.numpy as jnp

        super().__init__(jnp)
        self.keyed = keyed  # unkeyed, no op draws a mask: the key changes nothing (reference.keyed_salt)
        self.programs: dict[tuple[Any, ...], Any] = {}

    def _part(self, run: Any, spec: Spec, sizes: dict[str, int] | None, key: int) -> Any:
        import jax

        name = (run, id(spec), sizes is None, key if self.keyed else 0)  # sizes: one dict, the run's
        if name not in self.programs:
            self.programs[name] = jax.jit(super()._part(run, spec, sizes, key))
        return self.programs[name]


def verify_pipeline(plan: Plan, devices: int = 8, seed: int = 0, key: int = 0,
                    module: tuple[str, str] | None = None) -> Report:
    """Lower the pipeline small, run its schedule, check values and the compiled program (see the
    module doc); ``key`` is the dropout key, layer l's masks drawn under :func:`layer_key` of it, and
    a spec with dropout runs under the next key too (:data:`~shardc.verification.power.DROPOUT_KEYS`).
    ``module``: a given module's (text, label), whose functions run instead of verify's own lowering's
    (:mod:`shardc.verification.pipeline_module`).  Several ``layers`` blocks run each layer with its own
    block's functions (:mod:`shardc.lowering.pipeline_more`), :func:`run_blocks` of each."""
    sizes, layers, micro = run_sizes(plan, devices)
    blocks = run_blocks(plan, layers)
    step(f"lowering the pipeline: {layers} layers" + (f" ({' + '.join(map(str, blocks))})" if blocks else "")
         + f", {micro} microbatches, " + ", ".join(f"{k}={v}" for k, v in sizes.items()))
    # a sliding window shrinks with the keys, so that it still masks; a given module's are in its code
    notes = window_notes(plan, sizes, module is not None)
    plan = plan if module is not None else windows_at(plan, sizes)
    lowered = lower_pipeline(plan, sizes=sizes, layers=layers, microbatches=micro, split=run_split(plan),
                             blocks=blocks)
    if module is not None:
        lowered, given = use_pipeline_module(lowered, *module)
        notes += given
    with running(module[1] if module is not None else None):
        report = _checked(plan, lowered, devices, seed, key)
    report.notes[:0] = notes
    return report


def check_pipeline_memory(plan: Plan, devices: int, dtype: str = MEMORY_DTYPE,
                          options: dict[str, str] | None = None) -> StageMemoryCheck:
    """The pipeline lowered as :func:`verify_pipeline` lowers it on ``devices`` devices, its schedule
    compiled for inputs in ``dtype`` (not run; under the memory check's XLA_OPTIONS and ``options``, XLA's
    too, as ``{"xla_dump_to": DIR}``), and its memory set beside shardc's fullest stage."""
    sizes, layers, micro = run_sizes(plan, devices)
    lowered = lower_pipeline(plan, sizes=sizes, layers=layers, microbatches=micro, split=run_split(plan),
                             blocks=run_blocks(plan, layers))
    drawn = draw_inputs(lowered, 0, 0)
    inputs = {k: v if v.dtype.kind in "iu" else v.astype(dtype) for k, v in drawn.items()}
    cotangent = {k: np.asarray(v, dtype) for k, v in draw_cotangent(lowered, drawn, 0).items()}
    pipeline = lowered.namespace.PIPELINE
    args = pipeline.arguments(inputs, pipeline.ends.cotangent(pipeline, inputs, cotangent), 0)
    compiled = pipeline.program()[1].lower(*args).compile(compiler_options={**XLA_OPTIONS, **(options or {})})
    stats = compiled.memory_analysis()
    return stage_memory_check(plan, lowered, stats, np.dtype(dtype).itemsize)


def _checked(plan: Plan, lowered: PipelineLowered, devices: int, seed: int, key: int) -> Report:
    """The values and the compiled program of ``lowered``, the plan's pipeline at verify's sizes."""
    import jax

    layers, micro = lowered.pipeline.layers, lowered.pipeline.microbatches
    tol = (rounding_bound(lowered), 0.0)
    mesh = dict(lowered.namespace.PIPE_MESH_AXES)
    report = Report(plan.spec.filename or "<spec>", mesh, {**lowered.sizes, "layers": layers,
                                                           "microbatches": micro}, str(plan.spec.dtype),
                    "float64", tol)
    step("drawing the inputs, each layer's params at their scales")
    inputs = draw_inputs(lowered, seed, key, report.input_scales)
    cotangent = draw_cotangent(lowered, inputs, seed)
    keys = _keys(lowered, key)
    cut = collapsed_axes(plan, {**mesh})
    if cut:
        report.notes.append(cut_note(cut, devices, plan))
    report.notes += gemm_note(plan.spec)
    parts = None if lowered.ends is None else (lowered.ends.pre, *lowered.ends.blocks, lowered.ends.post)
    report.notes.append(f"each row's bound adds {power.DIFFERENTIAL:g} times its phase's largest relative error of "
                        "the unsharded float64 program (the reference's statements in jax, on one device) to the "
                        "rounding of the chain")
    with jax.enable_x64(True):  # a deep stack of products: float32's rounding grows past any fair bound
        text, runs, stats = _run(lowered, inputs, cotangent, keys)
        step("running the numpy reference")
        wants = {k: reference(lowered, inputs, cotangent, k) for k in keys}
        step("running the unsharded float64 program in jax, comparing values")
        report.values += _float64_rows(lowered, inputs, cotangent, runs, wants, tol[0])
    if len(keys) > 1 and all(np.array_equal(v, wants[keys[1]][0][n]) for n, v in wants[keys[0]][0].items()):
        report.notes.append(f"dropout keys {keys[0]} and {keys[1]} draw the same masks at these sizes: "
                            "the key is not checked")
    report.values = _recheck_weak(report, lowered, inputs, cotangent, keys)
    step("comparing the compiled program's collectives")
    report.collectives += loop_rows(lowered, text, parts, cut)
    step("comparing memory with XLA's buffer assignment")
    element = max(v.dtype.itemsize for v in inputs.values() if v.dtype.kind == "f")
    try:  # reported, not judged: a stage shardc cannot cost at the run's sizes leaves the values' verdict
        report.memory_check = stage_memory_check(plan, lowered, stats, element)
    except ShardcError as error:
        report.notes.append(f"memory not compared with XLA's: shardc cannot cost the run's stages ({error.message})")
    return report


def rounding_bound(lowered: PipelineLowered) -> float:
    """The float64 rounding of the chain, as a fraction of a value: a sum of n terms rounds to within
    n units of roundoff of the sum of their magnitudes (Higham, *Accuracy and Stability of Numerical
    Algorithms*, 2nd ed., section 3.1), and the roundings of the operations on the chain add: the
    statements before the block, the block once a layer, those after it, forward and backward
    (:func:`shardc.lowering.reference.sum_lengths`); the pipeline and the reference each err so.
    Cancellation can amplify it past this (a deep stack of norms and residuals): what the unsharded
    float64 program's own error measures, which each row's bound adds (:func:`_float64_rows`)."""
    sizes = dict(lowered.sizes)
    sizes[microbatch_dim(lowered.plan)] = lowered.batch  # the gradients sum over the whole batch
    pre, _, post = model_parts(lowered)
    terms = sum(sum(numpy_reference.sum_lengths(spec, sizes)) for spec in layer_specs(lowered))
    terms += sum(sum(numpy_reference.sum_lengths(part, sizes)) for part in (pre, post) if part is not None)
    return 2 * terms * float(np.finfo(np.float64).eps) / 2


def _float64_rows(lowered: PipelineLowered, inputs: Arrays, cotangent: Arrays, runs: list[tuple[Arrays, Arrays]],
                  wants: dict[int, tuple[Arrays, Arrays]], rtol: float) -> list[ValueRow]:
    """Each value against the float64 reference, within ``rtol`` of the value (:func:`rounding_bound`)
    plus ``DIFFERENTIAL`` times the phase's amplification: the largest error, as a fraction of its value,
    of the unsharded float64 program's (the reference's statements in jax, on one device) values against
    numpy's.  A right plan only reorders sums, as XLA reorders numpy's; how much the chain amplifies a
    reordering is the chain's (its values share it), one value's own error a noisy sample of it."""
    import jax.numpy as jnp

    rows = []
    for (key, (want_out, want_grads)), (got_out, got_grads) in zip(wants.items(), runs, strict=True):
        plain_out, plain_grads = unsharded(lowered, inputs, cotangent, key, jnp.float64)
        for phase, got, want, plain in (("forward", got_out, want_out, plain_out),
                                        ("backward", got_grads, want_grads, plain_grads)):
            amplified = power.DIFFERENTIAL * max(_relative(plain[n], v) for n, v in want.items())
            rows += compare_values(power.phase(phase, key), [(n, got[n], v, np.abs(v)) for n, v in want.items()],
                                   (rtol + amplified, 0.0), math.inf)
    return rows


def _relative(value: Any, ref: np.ndarray) -> float:
    """max|value - ref| / max|ref|, a causal mask's -inf aside (0 where the reference is 0)."""
    finite = ~np.isneginf(ref)
    ref = np.where(finite, ref, 0.0)
    err = np.abs(np.where(finite, np.asarray(value, np.float64), 0.0) - ref)
    peak = float(np.max(np.abs(ref))) if ref.size else 0.0
    return float(np.max(err)) / peak if peak > 0 and np.all(np.isfinite(err)) else 0.0


def _keys(lowered: PipelineLowered, key: int) -> tuple[int, ...]:
    """The dropout keys to run: ``key`` and the next, where the module draws masks."""
    if not keyed(lowered.namespace):
        return (key,)
    return tuple((key + k) % 2**32 for k in power.DROPOUT_KEYS)


def _run(lowered: PipelineLowered, inputs: Arrays, cotangent: Arrays,
         keys: tuple[int, ...]) -> tuple[str, list[tuple[Arrays, Arrays]], Any]:
    """The schedule's program compiled once: its HLO text, the results and gradients under each key, and
    XLA's memory analysis of it."""
    import jax

    pipeline = lowered.namespace.PIPELINE
    given = pipeline.ends.cotangent(pipeline, inputs, cotangent)
    step("compiling the schedule's program")
    compiled = pipeline.program()[1].lower(*pipeline.arguments(inputs, given, keys[0])).compile()
    runs = []
    step("running the schedule")
    for key in keys:
        # read in host memory: a device array sliced op by op (a microbatch, a stage, a slot) compiles
        # a program for each slice
        results, grads = pipeline.read(*jax.device_get(compiled(*pipeline.arguments(inputs, given, key))))
        runs.append(({k: np.asarray(v) for k, v in results.items()}, {k: np.asarray(v) for k, v in grads.items()}))
    return compiled.as_text(), runs, compiled.memory_analysis()


def _recheck_weak(report: Report, lowered: PipelineLowered, inputs: Arrays, cotangent: Arrays,
                  keys: tuple[int, ...]) -> list[ValueRow]:
    """Rows whose bound would pass an error of ``POWER`` of the value, checked again as the unpipelined
    verifier checks them (:mod:`shardc.verification.power`): the pipeline run in float32 against the
    float64 reference, within a few times the error of the unsharded float32 program (the reference's
    statements in jax, on one device) on the same inputs; a row still that loose fails."""
    weak = [r for r in report.values if power.weak(r)]
    if not weak:
        return report.values
    names = ", ".join(dict.fromkeys(r.tensor for r in weak))
    step(f"checking {names} again in float32")
    report.notes.append(f"in float64 the bound of {names} would pass an error of {POWER:.0%} of the value: "
                        "checked again in float32 against the unsharded program's error (rows marked f32)")
    again = {(r.phase, r.tensor): r for r in differential_rows(lowered, inputs, cotangent, keys)}
    extra = [replace(again[(r.phase, r.tensor)], phase=f"{r.phase} f32") for r in weak if (r.phase, r.tensor) in again]
    return report.values + [power.failed(r) if power.weak(r) else r for r in extra]


def differential_rows(lowered: PipelineLowered, inputs: Arrays, cotangent: Arrays,
                      keys: tuple[int, ...]) -> list[ValueRow]:
    """Every value of the pipeline run in float32 (inputs rounded to it), against the float64 reference
    from the same rounded inputs, bounded by the unsharded float32 program's own error."""
    import jax.numpy as jnp

    narrow = {k: v if v.dtype.kind in "iu" else v.astype(np.float32) for k, v in inputs.items()}
    cot = {k: np.asarray(v, np.float32) for k, v in cotangent.items()}
    _, runs, _ = _run(lowered, narrow, cot, keys)
    rows = []
    for key, (got_out, got_grads) in zip(keys, runs, strict=True):
        want_out, want_grads = reference(lowered, narrow, cot, key)
        plain_out, plain_grads = unsharded(lowered, narrow, cot, key, jnp.float32)
        rows += [power.differential(power.phase("forward", key), n, got_out[n], v, plain_out[n])
                 for n, v in want_out.items()]
        rows += [power.differential(power.phase("backward", key), n, got_grads[n], v, plain_grads[n])
                 for n, v in want_grads.items()]
    return rows
