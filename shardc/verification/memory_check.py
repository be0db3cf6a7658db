"""shardc's memory per device against the compiler's: each phase of the lowered step compiled by
XLA and its buffer assignment (``compiled.memory_analysis()``) set beside
:func:`shardc.costmodel.phase_memory.phase_memory`.

XLA reports, per compiled program and per device (the SPMD-partitioned module is one device's),
the bytes of its entry parameters (``argument_size_in_bytes``), of the buffers it may return
(``output_size_in_bytes``, with the output tuple's table of one pointer a result), of the
preallocated temporaries, packed by its heap simulator so that buffers not alive at once share
bytes (``temp_size_in_bytes``), and of outputs that reuse a donated parameter
(``alias_size_in_bytes``); the program needs argument + output + temp - alias bytes.  The lowered
module donates nothing, so alias is 0 and the categories compare one to one: arguments, outputs,
temporaries, and their sum.

Each phase is compiled in float32 at verify's sizes: XLA's CPU backend has no bf16 or f16 dot and
converts each such operand to f32 (and the product back), temporaries a TPU or GPU does not make,
so both sides count a floating-point element at 4 bytes.  Token ids are int32 and dropout masks
bool, as the forward makes them, on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from shardc.costmodel.phase_memory import Buffers, PhaseMemory, phase_memory
from shardc.errors import ShardcError
from shardc.ir.plan import Plan
from shardc.lowering.api import lower
from shardc.lowering.replan import unlowered_optimizer
from shardc.lowering.row_code import id_inputs
from shardc.lowering.sizes import small_sizes
from shardc.spec.functions import ID_DTYPE
from shardc.units import fmt_bytes
from shardc.verification.route_load import overflowing

if TYPE_CHECKING:
    from shardc.lowering.api import Lowered

__all__ = ["MemoryRow", "MemoryCheck", "check_memory", "check_plan_memory", "render_memory", "MEMORY_DTYPE",
           "TARGET", "XLA_CPU", "XLA_OPTIONS"]

MEMORY_DTYPE = "float32"
TARGET = 0.10  # the model is meant to be within 10% of the compiler's total
# the fewest elements an elementwise op or reduction needs to join a YNNPACK fusion on XLA's CPU backend
# (kMinElements in IsInstructionPreferredByYnn, xla/backends/cpu/ynn_support.cc)
YNN_MIN_ELEMENTS = 4096
# XLA's CPU options that change its buffer assignment, at XLA's defaults, passed to each compile the check
# makes (compiler_options override XLA_FLAGS for that compile), so that the check reads the assignment a
# user's `shardc verify` gets whatever XLA_FLAGS the process has: the tests' (tests/conftest.py) turn the
# fusion emitters off to compile faster, and XLA's older emitter runs a scatter as a while loop over its
# updates with buffers of its own (vocab_parallel.shard's backward at verify's sizes: the embedding
# gradient's scatter, 1376 B of temporaries against 1028 B with the emitters on).
XLA_OPTIONS: dict[str, str | bool] = {"xla_cpu_use_fusion_emitters": True}
# What XLA's CPU backend does that a TPU or GPU does not, counted for the comparison only (shardc
# cost counts none of it), each seen in the buffer assignment of the compiled examples
# (XLA_FLAGS=--xla_dump_to=DIR writes *-buffer-assignment.txt):
# - every preallocated temporary starts on a 64-byte boundary (the cache line): at verify's sizes,
#   arrays of tens to hundreds of bytes, that is up to 3x a buffer; at real sizes nothing;
# - an AllToAll is decomposed into one slice of the operand a device and one received piece a
#   device, concatenated after: two buffers of the operand's size a TPU or GPU does not make; the
#   concatenation writes the result as it is laid out, so a result split along a dim other than its
#   first is not transposed after (moe_dispatch.shard's In: 8 slices, 8 pieces, concatenated);
# - its scheduler runs every copy that reads only the program's parameters (a residual or weight
#   transposed for a dot) before the others, then every computation that reads only them (a weight
#   gradient's dot of a saved activation and a cotangent) one after another, so a copy only those read
#   dies before the next is made (the live-range dump, *-live-range.txt, lists them first: fsdp.shard's
#   dW_out, tests/specs/llama2_13b_fsdp.shard's dW_k and dW_v, alive with the gathered weights;
#   moe_layer.shard's backward: Comb's copy for dEx's dot freed before dComb = dOut * Ex is made);
# - its fusion makes a routing mask again for each dot that reads it (the mask is cheap to make
#   from the route's counts and large to read), in that dot's layout and a buffer of its own, beside
#   the mask the forward returns (moe_layer.shard at 16x its sizes: Disp as [G, E*C, S] and Comb as
#   [G, S, E*C], 604 MB each);
# - the attention kernel is the lowered loop over key blocks (shardc.lowering.runtime.attention), not
#   FlashAttention-2: with no SRAM or VMEM its running state and each block's scores are buffers in
#   memory, the output's last division is made again for the dot reading it (the accumulator alive to
#   that dot), and its backward copies Q and dO transposed for each dot of a block that reads them
#   (llama_layer_flash.shard at 16x its sizes: four copies of 5.3 GB), where FlashAttention-2 would
#   write dK and dV for each query head of a group instead.
# - it runs a collective matmul's unrolled ring with nothing to hide: the other operands' blocks are
#   sliced into buffers as soon as the operand is there, and every block matmul runs before the products
#   are added up or sent around (tp.shard's backward at 16x its sizes: 86 kB of temporaries, four 12 kB
#   products of dTmp's ring beside W_in's four 6 kB blocks); each block is a dynamic-slice fusion's result
#   in a buffer of its own, sliced one after another, so an operand the ring reads last (a gathered weight)
#   is alive beside all its blocks at the last slice (fsdp_tp.shard's backward at 16x its sizes: the
#   gathered W_in, 24 kB, beside its four 6 kB blocks at XLA's peak);
#   two rings gathering one value over the same axes share their received blocks (its CSE merges the identical
#   collective-permutes) and run block by block together, so the earlier ring's result, written block by block,
#   and two of its block products are alive beside the later ring's blocks and products (fsdp_tp.shard's
#   backward at verify's sizes: dW_out's sums, 96 B, and two 24 B products beside dTmp's ring and W_out's
#   blocks at XLA's peak; tp.shard's backward, the same buffers at its peak), and a ring summing its block
#   products (its result keeps no ring index) makes its result after the last of them, by one fusion reading
#   them all, not beside them (tp.shard's dTmp: add_add_fusion where its four products die);
#   a collective's result over a minor dim that only loop fusions read (a ring's slices, maps) is gathered with
#   that dim major and copied into place inside each reader (fsdp_tp.shard's W_out: no copy written);
# - a cumulative sum (a routing's slots, counted along the tokens) is a reduce-window its reduce-window
#   rewriter runs as a scan in blocks of 16 elements, the dim padded up to a multiple of 16: the counts
#   copied into the blocks and the blocks' running sums, beside the counts (moe_dispatch.shard at
#   verify's sizes: 24 tokens padded to 32; at 16x its sizes, 384 tokens in 24 blocks);
# - its fusion makes a product (one multiply an element) read by several steps once for the first and
#   again inside each later reader's fusion, so the product's operands live to its last reader
#   (vocab_parallel.shard's backward at 16x its sizes: dN to the fusion making dE, beside dN * W_norm);
# - its fusion makes a softmax's last division again inside a product reading it after another step, so
#   the exponentials live to that product (moe_layer.shard's forward at verify's sizes: the gates'
#   exponentials, 4.6 kB, alive to the combine weights Gate * Disp and their copy for the combine's dot);
# - its buffer assignment puts a route's arrays that die before the mask is written (the scan's blocks;
#   route_by_choice's running sums too, the mask being made from the slot they add up to) in the buffer of
#   an output made after them (moe_layer.shard's forward: the blocks in Comb's; route_by_choice's blocks
#   and sums, k times the gates' int32 each, in Disp's and Comb's);
# - its scheduler makes the copy into place of a weight gathered over several dims at once (the pieces land
#   along a new major dim) right after the gathers, each gathered weight dying into its copy, in the order
#   its dot reads it (tests/specs/llama2_13b_fsdp.shard's backward at verify's sizes: W_q, W_k, W_v
#   gathered over X and Z copied as [H, N, D], the cotangents' copies from the start, W_o's beside its
#   gather);
# - its dot decomposer rewrites a dot one of whose operands has other than one contracted dim, more than
#   one free dim or its batch dims not first: the operands copied into (batch, free, contracted) and
#   (batch, contracted, free), the contracted dims in their einsum letters' order (moe_layer.shard's
#   backward at 16x its sizes: Comb as [G, E*C, S] and Disp as [G, S, C*E], 604 MB each; dQ, dK and dVal
#   of tests/specs/llama2_13b_fsdp.shard as [B, H, N]), whichever library (YNNPACK, Eigen) runs it;
# - its YNNPACK fusion makes a dot read only by a dot with no free dims (a multiply and a reduce) inside
#   that reader, never written, from 4096 elements (moe_layer.shard's dComb at 16x its sizes, 604 MB);
# - its fusion makes a transcendental derivative (gelu's tanh) once, in a buffer of its own from the
#   start, where the gradient it is in is made again inside the copies two dots make of it
#   (moe_dispatch.shard's backward at 16x its sizes: gelu's derivative of H_t1, 176 MB);
# - its common-subexpression elimination merges the routings the index-based dispatch steps each run from the
#   same gates into one, run before the first, its indices (a choice's batch row, expert and slot) kept to
#   the last (moe_dispatch.shard's backward at verify's sizes: one top-k and one scan for dEx, dGate, dX_2);
# - a dot's result jnp.einsum transposes after the dot (its product not in the result's order; jnp.einsum
#   puts its second operand on the left unless the product is then in order, so moe_transformer.shard's
#   At = P · Vl copies P as [B, G, T, R, S]) is transposed when the dot is done and the operands' copies it
#   read last are freed (moe_transformer.shard's backward: dAt's copies freed at dP's dot before dP's
#   transpose, 1.17 -> 0.95 of XLA's temporaries), each later dot takes a copy of its own of the
#   product, one a distinct order, made at once and alive to that dot, run right after where its other
#   operands are there (llama_layer_fsdp_tp.shard's forward: C's copy for W_o's dot beside C's transpose,
#   0.90 -> 1.01), and the value is made in its own layout only where other than a dot reads it or the
#   phase returns it (gpt_layer_tp_sp.shard's backward: dV's two copies, no dV) (shardc.costmodel.dot_results);
# - its fusion makes a softmax's last division again inside the copy a dot takes of the softmax for its
#   layout, where the softmax is written too (returned or read elsewhere): the exponentials live to that
#   dot (moe_transformer.shard's forward: P's exponentials beside P's copy for At's dot, XLA's peak; 0.77
#   -> 1.00 of its temporaries with the rule above);
# - a phase returning two or more values returns them in a tuple, an output allocation of its own holding
#   one pointer a value, 8 bytes on the 64-bit host (partial_input.shard's forward at verify's sizes: Out,
#   16 bytes, In's sum, 40, and their tuple, 16: XLA's outputs 72 bytes);
# - its loop fusion makes a product of fewer than YNN_MIN_ELEMENTS elements read only by maps and reductions
#   inside each of them, never written (vocab_parallel.shard's backward at verify's sizes: dN * W_norm inside
#   dN_t1_dot's reduction and dE's map; 1.15 -> 0.93 of XLA's temporaries); from that many elements up the
#   product joins a YNNPACK fusion and is written once (the rule above, at 16x its sizes);
# - a GEMM under a `gemm` line reads its operands cast elementwise (the module's gemm_input) at the float's
#   width, where a chip holds FP8 copies with their scales (shardc.costmodel.gemm_buffers).
XLA_CPU = Buffers(align=64, all_to_all_pieces=True, arguments_first=True, masks_per_dot=True,
                  attention_loop=True, ring_blocks_first=True, scan_block=16, products_again=True,
                  scan_in_outputs=True, dots_canonical=True, dot_sums=YNN_MIN_ELEMENTS, gemm_casts=True,
                  routing_once=True, results_turned=True, pointer=8,
                  duplicated=YNN_MIN_ELEMENTS)
_CATEGORIES = (("arguments", "argument_size_in_bytes"), ("outputs", "output_size_in_bytes"),
               ("temporaries", "temp_size_in_bytes"))
_WHY = {
    "arguments": "params and inputs (forward); cotangents, residuals and params (backward)",
    "outputs": "results and kept residuals (forward); gradients (backward); and the tuple they are "
               "returned in, a table of 8 bytes a result (two or more)",
    "temporaries": "values neither taken nor returned, the most alive at one step; XLA also makes "
                   "layout copies (transposes before a dot, after a collective) and pads each "
                   "buffer to its alignment, and fuses maps shardc counts apart",
}


@dataclass(frozen=True)
class MemoryRow:
    phase: str
    category: str  # arguments, outputs, temporaries, total
    shardc_bytes: float
    xla_bytes: float
    parts: tuple[tuple[str, float], ...] = ()  # shardc's bytes by what they hold (params, inputs, ...)

    @property
    def ratio(self) -> float | None:
        return self.shardc_bytes / self.xla_bytes if self.xla_bytes else None

    def to_json(self) -> dict[str, object]:
        return {"phase": self.phase, "category": self.category, "shardc_bytes": self.shardc_bytes,
                "xla_bytes": self.xla_bytes, "ratio": self.ratio, "shardc_parts": dict(self.parts)}


@dataclass
class MemoryCheck:
    """Per phase and category the two figures; the headline is the phase XLA needs most for."""

    rows: list[MemoryRow]
    phase: str
    notes: list[str] = field(default_factory=list)

    @property
    def headline(self) -> MemoryRow:
        return next(r for r in self.rows if r.phase == self.phase and r.category == "total")

    @property
    def within_target(self) -> bool:
        ratio = self.headline.ratio
        return ratio is not None and abs(ratio - 1.0) <= TARGET

    def to_json(self) -> dict[str, object]:
        top = self.headline
        return {"phase": self.phase, "shardc_bytes": top.shardc_bytes, "xla_bytes": top.xla_bytes,
                "ratio": top.ratio, "target": TARGET, "within_target": self.within_target,
                "dtype": MEMORY_DTYPE, "rows": [r.to_json() for r in self.rows],
                "categories": dict(_WHY), "notes": list(self.notes)}


def check_memory(lowered: Lowered) -> MemoryCheck:
    """Compile the forward and the backward of ``lowered`` (float32, its sizes) and compare each
    category of XLA's memory analysis with shardc's :func:`phase_memory`."""
    model = {m.phase: m for m in phase_memory(lowered.plan, dict(lowered.sizes or {}), np.dtype(MEMORY_DTYPE).itemsize,
                                              XLA_CPU)}
    rows: list[MemoryRow] = []
    totals: dict[str, float] = {}
    notes: list[str] = []
    for phase in ("forward", "backward"):
        stats = _compiled(lowered, phase).memory_analysis()
        rows += _rows(model[phase], stats)
        totals[phase] = rows[-1].xla_bytes
        if stats.alias_size_in_bytes:
            notes.append(f"{phase}: XLA aliases {fmt_bytes(stats.alias_size_in_bytes)} of outputs to arguments")
    if lowered.namespace.KEYED:
        notes.append("the forward also takes the dropout key (4 bytes), not a value of the plan")
    notes.append("the lowered step keeps no optimizer state (its update is plain SGD): shardc cost's "
                 "optimizer_bytes and the accounting's extra bytes a param have no counterpart here")
    if lowered.module.optimizer is not None:
        notes.append("the ZeRO optimizer phase is not compared (shardc models it as state, not as a program)")
    return MemoryCheck(rows, max(totals, key=lambda p: totals[p]), notes)


def check_plan_memory(plan: Plan, devices: int) -> MemoryCheck:
    """:func:`check_memory` of ``plan`` lowered as ``shardc verify`` lowers it on ``devices`` devices."""
    if plan.spec.mesh.pipeline_axis is not None:
        raise ShardcError("the memory check compiles an unpipelined step; this spec has a pipeline axis",
                          fix="check the spec without its pipeline axis")
    zero = plan if plan.optimizer else None
    plain, _ = unlowered_optimizer(plan)
    sizes, _ = overflowing(plain, small_sizes(zero or plain, devices), {})
    return check_memory(lower(zero or plain, sizes=sizes))


def _rows(model: PhaseMemory, stats: Any) -> list[MemoryRow]:
    mine = {"arguments": model.arguments, "outputs": model.outputs, "temporaries": model.temporaries}
    rows = [MemoryRow(model.phase, name, mine[name], float(getattr(stats, attr)),
                      tuple((what, n) for category, what, n in model.parts if category == name))
            for name, attr in _CATEGORIES]
    xla_total = sum(r.xla_bytes for r in rows) - float(stats.alias_size_in_bytes)
    return rows + [MemoryRow(model.phase, "total", model.total, xla_total)]


def _compiled(lowered: Lowered, phase: str) -> Any:
    """One phase's ``jit(shard_map)`` compiled for the arrays the step passes it: floats in
    MEMORY_DTYPE (those declared f8 too), token ids in ID_DTYPE, one-byte values (dropout masks) as bool."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mesh, forward, backward = lowered.namespace.programs()
    ns = lowered.namespace
    program, boundaries, table = ((forward, lowered.module.forward.inputs, ns.FORWARD_IN) if phase == "forward"
                                  else (backward, lowered.module.backward.inputs, ns.BACKWARD_IN))
    ids = id_inputs(lowered.plan.spec)
    one_byte = {name for name, size in lowered.plan.fixed_bytes().items() if size == 1}  # an f8 tensor is a float

    def dtype(name: str) -> Any:
        return ID_DTYPE if name in ids else np.bool_ if name in one_byte else MEMORY_DTYPE

    args = [jax.ShapeDtypeStruct(lowered.global_shape(b.ref), dtype(b.ref.name),
                                 sharding=NamedSharding(mesh, table[b.key])) for b in boundaries]
    if phase == "forward" and ns.KEYED:
        args.append(jax.ShapeDtypeStruct((), np.uint32, sharding=NamedSharding(mesh, PartitionSpec())))
    return program.lower(*args).compile(compiler_options=XLA_OPTIONS)


def render_memory(check: MemoryCheck) -> str:
    """The table ``shardc verify`` prints: per phase and category both figures and their ratio."""
    lines = [f"memory per device ({MEMORY_DTYPE}), shardc against XLA's buffer assignment:",
             f"  {'phase':<9} {'category':<12} {'shardc':>10} {'XLA':>10} {'ratio':>6}"]
    for r in check.rows:
        ratio = f"{r.ratio:.2f}" if r.ratio is not None else "-"
        parts = ", ".join(f"{what} {fmt_bytes(n)}" for what, n in r.parts if n)
        lines.append(f"  {r.phase:<9} {r.category:<12} {fmt_bytes(r.shardc_bytes):>10} "
                     f"{fmt_bytes(r.xla_bytes):>10} {ratio:>6}" + (f"  ({parts})" if parts else ""))
    top = check.headline
    verdict = "within" if check.within_target else "outside"
    lines.append(f"  the {check.phase} needs most: shardc {fmt_bytes(top.shardc_bytes)}, XLA "
                 f"{fmt_bytes(top.xla_bytes)} ({verdict} {TARGET:.0%})")
    lines += [f"  {name}: {why}" for name, why in _WHY.items()]
    lines += [f"  note: {n}" for n in check.notes]
    return "\n".join(lines) + "\n"
