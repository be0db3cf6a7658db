"""The inputs and cotangent a pipelined ``shardc verify`` runs on, drawn at the whole batch's sizes.

Data standard normal (token ids uniform over their vocabulary); params scaled by 1/sqrt(their
contracted size), then each part's and each layer's to the scales at which each of its ops
matters (:mod:`shardc.verification.scales`), and each layer's last one so that its output has
unit RMS, so a deep stack of products neither vanishes nor overflows
(:mod:`shardc.verification.pipeline_verify` says why).
"""

from __future__ import annotations

import math

import numpy as np

from shardc.ir.spec import Contract, Spec
from shardc.lowering import reference as numpy_reference
from shardc.lowering.api import drawn_in
from shardc.lowering.pipeline_lowering import PipelineLowered
from shardc.lowering.row_code import id_inputs
from shardc.pipeline.boundary import fed_beside, microbatch_dim, riders
from shardc.spec.functions import ID_DTYPE, layer_key
from shardc.spec.stages import stage_spec
from shardc.spec.walk import domain_reads, leaves
from shardc.verification.pipeline_layers import model_layers
from shardc.verification.scales import input_scales

__all__ = ["draw_inputs", "draw_cotangent", "model_parts", "layer_key_of"]

Arrays = dict[str, np.ndarray]


def model_parts(lowered: PipelineLowered) -> tuple[Spec | None, Spec, Spec | None]:
    """The specs before the block, of the (first) block (one layer), after it."""
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


def layer_key_of(lowered: PipelineLowered, key: int, layer: int) -> int:  # layer: the model's, counted over every block
    return int(layer_key(key, layer, lowered.pipeline.layers, np))


def draw_inputs(lowered: PipelineLowered, seed: int, key: int, scales: dict[str, float] | None = None) -> Arrays:
    """The run's inputs at the whole batch's sizes: data standard normal (token ids uniform over
    their vocabulary), params scaled as the module doc says, the block's stacked [layers, ...];
    ``scales``, when given, gets each input's own scale."""
    ns, sizes = lowered.namespace, dict(lowered.sizes)
    pre, _, post = model_parts(lowered)
    sizes[microbatch_dim(lowered.plan)] = lowered.batch
    vocab = {name: v for part in (pre, post) if part is not None for name, v in id_inputs(part).items()}
    domains = domain_reads(lowered.plan.spec)  # an input log or sqrt reads: drawn where it is defined
    layers = model_layers(lowered)
    stacked = {p: layer for layer in layers for p in layer.params}  # a pipelined param: a layer of its block
    held = {p: sum(1 for layer in layers if p in layer.params) for p in stacked}
    rng = np.random.default_rng(seed)
    whole = set(ns.PIPELINE.shared) | set(getattr(ns, "PRE_WHOLE", ())) | set(getattr(ns, "POST_WHOLE", ()))
    whole |= set(getattr(ns, "PRE_DATA", ())) | set(getattr(ns, "POST_DATA", ()))  # an end's data: a mask
    values: Arrays = {}
    for info in lowered.plan.tensors:
        shape = [sizes[d.name] for d in info.ref.dims]
        if info.name in vocab:
            values[info.name] = rng.integers(0, sizes[vocab[info.name]], shape).astype(ID_DTYPE)
        elif (info.name == ns.BLOCK_INPUT and pre is None) or info.name in whole:
            values[info.name] = drawn_in(domains.get(info.name, ""), rng.standard_normal(shape))  # data, or whole
        elif info.role == "param" and info.name in stacked:
            scale = 1 / math.sqrt(_contracted(stacked[info.name].spec, info.name, sizes))
            values[info.name] = drawn_in(domains.get(info.name, ""), rng.standard_normal([held[info.name], *shape])) \
                * scale
        elif info.role == "param":
            part = pre if pre is not None and info.name in ns.PRE_PARAMS else post
            assert part is not None
            values[info.name] = drawn_in(domains.get(info.name, ""), rng.standard_normal(shape)) \
                / math.sqrt(_contracted(part, info.name, sizes))
    own = scales if scales is not None else {}
    if pre is not None:
        _rescale(pre, values, list(ns.PRE_FORWARD_IN), set(), sizes, own)
    made = {ns.BLOCK_INPUT: values[ns.BLOCK_INPUT]} if pre is None else numpy_reference.forward(pre, values, key=key)
    x = _calibrate(lowered, values, made[ns.BLOCK_INPUT if pre is None else ns.PRE_RESULT], key, own, made)
    if post is not None:
        out = layers[-1].output  # the last block's output, which the statements after the blocks read
        riding = {n: made[n] for n in riders(lowered.plan.spec)}  # made before the blocks, read after them
        _rescale(post, {**values, out: x, **riding}, list(ns.POST_FORWARD_IN), {out, *riding}, sizes, own)
    return values


def _rescale(spec: Spec, values: Arrays, names: list[str], fixed: set[str], sizes: dict[str, int],
             scales: dict[str, float], layer: int | None = None) -> None:
    """Rescale the float inputs ``names`` of ``spec`` (but ``fixed`` ones) in place, to the scales at which
    each of its ops matters (:func:`~shardc.verification.scales.input_scales`); record them in ``scales``
    (a stacked param's per layer, as ``W[layer]``)."""
    ids = set(id_inputs(spec)) | fixed
    given = {n: values[n] if layer is None or n in fixed else values[n][layer] for n in names}
    wide = {n: v if n in ids else np.asarray(v, np.float64) for n, v in given.items()}
    for name, factor in input_scales(spec, wide, ids, sizes).items():
        target = values[name] if layer is None else values[name][layer]
        target *= factor  # in place: ``values`` may be a view of the caller's dict
        scales[name if layer is None else f"{name}[{layer}]"] = factor


def _calibrate(lowered: PipelineLowered, values: Arrays, x: np.ndarray, key: int,
               scales: dict[str, float], made: Arrays) -> np.ndarray:
    """Each layer's params at the scales where its ops matter, then its last param scaled so that its
    output has unit RMS (a deep product of einsums otherwise vanishes or overflows; layer norms do
    this in a real model); the last layer's output.  ``made``: the values before the block (those fed beside
    its input the first layer reads, :func:`shardc.pipeline.boundary.fed_beside`)."""
    sizes = dict(lowered.sizes)
    fed = fed_beside(lowered.plan.spec)
    for number, layer in enumerate(model_layers(lowered)):
        spec, k = layer.spec, layer.index
        last = next((s for s in spec.statements if s.result.name == layer.output), None)
        linear: list[str] = []
        if last is not None and isinstance(last.expr, Contract):  # the output is linear in its operands
            linear = [r.name for r in leaves(last.expr) if r.name in layer.params]
        shared = {n: values[n] for n in lowered.namespace.PIPELINE.shared}  # held whole, never rescaled
        shared |= {n: made[n] if number == 0 else x for n in fed} if number < lowered.blocks[0] else {}
        pool = {layer.input: x, **{p: values[p] for p in layer.params}, **shared}
        _rescale(spec, pool, [layer.input, *layer.params, *shared], {layer.input, *shared}, sizes, scales, k)
        layer_values = {layer.input: x, **{p: values[p][k] for p in layer.params}, **shared}
        keyed_as = layer_key_of(lowered, key, number)
        out = numpy_reference.forward(spec, layer_values, sizes=sizes, key=keyed_as)[layer.output]
        if linear:
            rms = float(np.sqrt(np.mean(out ** 2))) or 1.0
            values[linear[0]][k] /= rms
            out = out / rms
        x = out
    return x


def draw_cotangent(lowered: PipelineLowered, inputs: Arrays, seed: int) -> Arrays:
    """The cotangent of the pipeline's result: the block output's (its shape), or the loss's."""
    ends = lowered.namespace.PIPELINE.ends
    rng = np.random.default_rng(seed + 1)
    if lowered.ends is None:
        return {ends.output_cotangent: rng.standard_normal(inputs[ends.block_input].shape)}
    return {ends.result_cotangent: np.asarray(rng.standard_normal())}
