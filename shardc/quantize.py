"""The quantize passes of GEMMs that run in a narrower type than their operands are stored in (``gemm f8``).

FP8 training keeps activations and weights in BF16 (or FP32) and quantizes each GEMM's inputs just
before it (DeepSeek-V3, arXiv 2412.19437, section 3.3.2 and Figure 6; NVIDIA Transformer Engine's
``fp8_autocast``): a memory-bound pass that reads the stored operand and writes its FP8 copy and one
FP32 scale a tile (1 x 128 elements for activations and gradients, 128 x 128 for weights: section
3.3.2's fine-grained quantization).  The rule priced here:

* an operand already stored in the GEMM's type (``dtype f8 A``, an activation the report caches in FP8,
  section 3.3.4) needs no pass where its tiles run along the index the GEMM contracts (1 x 128 along its
  last index, the features: the forward's and Dgrad's); a GEMM contracting it the other way (Wgrad, along
  the tokens) dequantizes, transposes and requantizes it first (section 3.3.4 and Figure 6): a pass that
  reads its FP8 values and scales and writes them again;
* a weight the GEMM reads as it is held (not gathered) is quantized once a step, after the update, and
  the one 128 x 128-block copy serves the forward and the Dgrad (a block's scale holds for its transpose):
  :func:`weight_quantize_bytes`, beside the optimizer's update; a gathered weight (FSDP, ZeRO-3) is
  quantized at each use, like an activation;
* an activation or gradient is quantized (or transposed) once a phase for each way GEMMs contract it (its
  1 x 128 tiles run along the contracted index: the forward's and Dgrad's along the features, Wgrad's
  along the tokens, so a cotangent read by both its GEMMs is quantized twice, as the report's kernels do);
* the pass fuses into its producer where :mod:`shardc.fusion`'s rule fuses a map there (the step just
  before made it: a matmul's epilogue, or a map or reduction in the same loop): it then does not read
  the operand back, and writes only the FP8 copy and its scales.

Each pass's bytes are :func:`shardc.ir.precision.pass_bytes`, which the planner's search prices too
(:meth:`shardc.sharding.layout.CostContext.quantize_seconds`).  Each pass's copy (its FP8 values and
scales, :func:`shardc.ir.precision.copy_bytes`) is a transient buffer from the pass to the last GEMM reading
it (:func:`quantized_copies`), counted in the temporaries of the phase
(:func:`shardc.costmodel.phase_memory.phase_memory`).

:mod:`shardc.timing` adds these bytes, over HBM, to each GEMM's row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardc.collectives import Op
from shardc.device_pieces import local_elements
from shardc.fusion import fusible, is_product
from shardc.ir.plan import Plan, Step
from shardc.ir.precision import TILE, Precision, copy_bytes, pass_bytes, quantized_bytes, tiled_along
from shardc.ir.spec import DType, TensorRef
from shardc.layer_counts import runs
from shardc.spec.walk import block_reads

__all__ = ["fuses_into", "quantize_traffic", "quantized_weights", "weight_quantize_bytes", "step_gemm", "QuantizePass",
           "gemm_reads", "quantize_passes", "quantized_copies"]


def step_gemm(step: Step, precision: Precision) -> DType | None:
    """The type a GEMM step (an einsum that sums an index) quantizes its inputs to
    (:meth:`shardc.ir.precision.Precision.gemm`); None for any other step, and for a GEMM no ``gemm`` line
    names.  Cost's rate (:func:`shardc.step_cost.step_dtype`), these passes and the lowered module's casts
    all read it."""
    if step.op is not Op.EINSUM or not precision.gemms or is_product(step):
        return None
    return precision.gemm(step.tensor, [r.name for r in step.operands])


def fuses_into(step: Step) -> bool:
    """Whether a quantize pass of the value ``step`` makes fuses into it, run right after it: a matmul's
    epilogue, or a map or reduction (:func:`shardc.fusion.fusible`)."""
    return step.op is Op.EINSUM or fusible(step)


def _held(plan: Plan, ref: TensorRef) -> bool:
    """Whether ``ref`` is a param as the device holds it (not gathered for this GEMM)."""
    params = {info.name: info.ref for info in plan.tensors if info.role == "param"}
    return ref.name in params and ref.dims == params[ref.name].dims


@dataclass(frozen=True)
class QuantizePass:
    """One quantize pass of a phase: before its GEMM at ``step`` (in the epilogue of the step before, which
    made ``ref``, where ``fused``), ``ref`` quantized to ``kind`` with its tiles along ``along``, the indices
    the GEMM contracts; ``tiled``: whether ``ref`` is held so already (:func:`shardc.ir.precision.tiled_along`);
    ``last``: the last GEMM of the phase reading that copy."""

    step: int
    ref: TensorRef
    along: frozenset[str]
    kind: DType
    fused: bool
    tiled: bool
    last: int


def gemm_reads(plan: Plan, steps: Sequence[Step]) -> list[tuple[int, TensorRef, frozenset[str], DType]]:
    """Per GEMM step of ``steps`` (:func:`step_gemm`) and operand: (the step, the operand, the indices it
    contracts, the type it quantizes to)."""
    reads = []
    for k, step in enumerate(steps):
        kind = step_gemm(step, plan.precision)
        reads += [(k, ref, frozenset(i for i in ref.indices if i not in step.dst.indices), kind)
                  for ref in step.operands if kind is not None]
    return reads


def quantize_passes(plan: Plan, steps: Sequence[Step], fuse: bool = True) -> list[QuantizePass]:
    """The quantize passes ``steps`` (one phase, in program order) run by the module's rule: one per operand,
    contraction and type, none for a param read as held; a param gathered in its GEMM's type
    (``param_gather in f8``) is cast on its shard instead, before the gather (:func:`_gathered_shards`)."""
    params = {info.name for info in plan.tensors if info.role == "param"}
    shards = _gathered_shards(plan, steps)
    reads = [(k, shards.get((ref, kind), ref), along, kind) for k, ref, along, kind in gemm_reads(plan, steps)
             if not _held(plan, ref)]
    last = {(ref, along, kind): k for k, ref, along, kind in reads}
    out: dict[tuple[TensorRef, frozenset[str], DType], QuantizePass] = {}
    for k, ref, along, kind in reads:
        if (ref, along, kind) in out:
            continue
        before = steps[k - 1] if k > 0 and steps[k - 1].region == steps[k].region else None
        fused = fuse and before is not None and before.dst == ref and fuses_into(before)
        out[(ref, along, kind)] = QuantizePass(k, ref, along, kind, fused,
                                               tiled_along(ref.indices, along, ref.name in params),
                                               last[(ref, along, kind)])
    return list(out.values())


def _gathered_shards(plan: Plan, steps: Sequence[Step]) -> dict[tuple[TensorRef, DType], TensorRef]:
    """Each value of a param gathered in a narrower type (:meth:`Plan.moved_nbytes`) with that type -> the
    shard it was gathered from: torchao's float8 all-gather casts the shard before the gather
    (``fsdp_pre_all_gather``) and hands the gathered float8 data to the GEMM, so the GEMM's quantize pass
    runs on the shard, once a gather."""
    kind = plan.spec.param_gather_dtype
    found: dict[tuple[TensorRef, DType], TensorRef] = {}
    for step in steps:
        if kind is not None and step.src is not None and plan.moved_nbytes(step) < plan.nbytes(step.tensor):
            found[(step.dst, kind)] = found.get((step.src, kind), step.src)  # a second gather: the first's shard
    return found


def quantize_traffic(plan: Plan, steps: Sequence[Step], sizes: Mapping[str, int], fuse: bool = True) -> list[float]:
    """The HBM bytes of the quantize passes each of ``steps`` (one phase, in program order) runs before its
    GEMM (:func:`quantize_passes`, each :func:`shardc.ir.precision.pass_bytes`); 0 for every other step."""
    out = [0.0] * len(steps)
    for p in quantize_passes(plan, steps, fuse):
        out[p.step] += pass_bytes(float(local_elements(p.ref, sizes)), plan.precision.of(p.ref.name),
                                  plan.nbytes(p.ref.name), p.kind, p.tiled, p.fused)
    return out


def quantized_copies(plan: Plan, steps: Sequence[Step], sizes: Mapping[str, int]) -> list[tuple[float, float, float]]:
    """The copies the quantize passes of ``steps`` write, as a chip holds them: (the step the pass runs at,
    the last GEMM reading the copy, its bytes, :func:`shardc.ir.precision.copy_bytes`), each alive while the
    GEMMs reading it run; none where a GEMM reads its operand as held."""
    spans = [(p.step - 1 if p.fused else p.step, p.last, copy_bytes(float(local_elements(p.ref, sizes)),
                                                   plan.precision.of(p.ref.name), p.kind, p.tiled))
             for p in quantize_passes(plan, steps)]
    return [span for span in spans if span[2]]


def quantized_weights(plan: Plan) -> dict[str, DType]:
    """The params a GEMM reads as held (not gathered) in a narrower type than they are stored in: each
    quantized once a step, its copy kept all step (:func:`weight_quantize_bytes`)."""
    found: dict[str, DType] = {}
    for step in plan.forward:
        kind = step_gemm(step, plan.precision)
        for ref in step.operands if kind is not None else ():
            if kind is not None and _held(plan, ref) and plan.precision.of(ref.name) is not kind:
                found[ref.name] = kind
    return found


def weight_quantize_bytes(plan: Plan, sizes: Mapping[str, int], counts: Sequence[int],
                          param_bytes: int | None = None) -> float:
    """HBM bytes of quantizing the held weights once a step (:func:`quantized_weights`): each read at
    ``param_bytes`` (the optimizer accounting's param bytes; None: its stored type's) and written in its
    GEMMs' type with a scale a 128 x 128 block; a block's params count once a layer."""
    repeated = block_reads(plan.spec)
    total = []
    for name, kind in quantized_weights(plan).items():
        elements = float(local_elements(plan.tensor(name).ref, sizes))
        read = plan.nbytes(name) if param_bytes is None else param_bytes
        layers = runs(name not in repeated, repeated.get(name, 0), counts)
        total.append(layers * (elements * read + quantized_bytes(elements, kind, TILE * TILE)))
    return math.fsum(total)
