"""The bytes one device holds while each phase of the step runs, as its program sees them.

:func:`phase_memory` sets the forward's and the backward's arguments, outputs and the most
temporaries alive at one step beside each other, the figures ``shardc verify`` checks against
XLA's buffer assignment (:mod:`shardc.verification.memory_check`); :class:`Buffers` says what a
backend's buffer assignment adds beyond the plan's values (a TPU's or GPU's by default).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod

from shardc.collectives import Op
from shardc.costmodel.dot_results import DotResult, is_dot
from shardc.costmodel.fusion_buffers import derivatives, exponentials, summed_into
from shardc.costmodel.gemm_buffers import gemm_buffers
from shardc.costmodel.heap import Span, outside_outputs, packed
from shardc.costmodel.kernel_memory import flash_workspace, loop_state
from shardc.costmodel.layout_copies import blocked as _blocked
from shardc.costmodel.layout_copies import layout_copies as _layout_copies
from shardc.costmodel.layout_copies import written_into_place
from shardc.costmodel.memory import residual_table
from shardc.costmodel.ring_blocks import matmul_ring_buffers as _ring_buffers
from shardc.costmodel.ring_blocks import ring_slices as _ring_slices
from shardc.costmodel.ring_blocks import rings_together, sums_blocks
from shardc.costmodel.route_memory import route_arrays, routed_once
from shardc.costmodel.step_order import combined, lifetimes, made_at, prelude
from shardc.device_pieces import local_elements
from shardc.fusion import fusible, is_product, kept_values
from shardc.ir.localops import ALIAS, Attention, Dispatch, Route, key_block
from shardc.ir.plan import Plan, Step, backward_program
from shardc.ir.spec import Dim, TensorRef
from shardc.spec.attention_call import roles

__all__ = ["PhaseMemory", "Buffers", "phase_memory"]


@dataclass(frozen=True)
class PhaseMemory:
    """The bytes one device holds while a phase of the step runs, as its program sees them.

    ``arguments``: what the phase takes (the forward: params and inputs; the backward: the
    cotangents and every value it reads and does not make: residuals and params).
    ``outputs``: what it returns (the forward: every statement's result and the residuals it
    keeps for the backward; the backward: the gradients).  ``temporaries``: the most bytes of
    the values it makes and neither returns nor fuses away, alive at one step (from the step
    that makes a value to the last that reads it)."""

    phase: str
    arguments: float
    outputs: float
    temporaries: float
    parts: tuple[tuple[str, str, float], ...] = ()  # (arguments or outputs, what, bytes): params, inputs, ...
    # of the temporaries: the copies of arguments made before any other step (Buffers.arguments_first)
    argument_copies: float = 0.0

    @property
    def total(self) -> float:
        return self.arguments + self.outputs + self.temporaries


@dataclass(frozen=True)
class Buffers:
    """What a backend's buffer assignment does beyond the values of the plan, where backends differ.

    The defaults are a TPU's or GPU's: buffers at their own size, a 2-D dot reads either operand
    transposed in place (the MXU's and cuBLAS's transposed operands), an AllToAll sends from its operand and
    receives into its result.  ``align``: each temporary rounded up to a multiple of it, the boundary the
    allocator starts buffers on (it matters only for buffers of a few hundred bytes).  ``all_to_all_pieces``:
    an AllToAll over n devices is run as n slices of its operand, sent, and n pieces received, concatenated
    into its result: both sets are buffers of their own (each piece aligned) for the step, the slices in
    place of the operand; the slices are cut along the split dim and the pieces concatenated along the
    other, so the result is written as it is laid out, with no transpose of its own (a native AllToAll over
    a dim other than the first sends along the major one and transposes its result into place).
    ``arguments_first``: a copy of a value the phase takes (a param, a residual, a cotangent), and
    any step that reads only such values (a weight gradient of a saved activation and a cotangent),
    is made before any other step, as a scheduler that runs first what reads only the arguments
    does: the copies at the start, each alive to its last reader, then those steps one after another
    (:func:`shardc.costmodel.step_order.prelude`).  So is the copy into place of a value gathered over
    several dims at once from an argument (it reads only the gathered argument): the copies are made one
    after another after those steps, each value dying into its copy, one beside its source at once.
    ``masks_per_dot``: a routing mask (a route's result, or a product with one) that a dot reads is
    made again for that dot, in a buffer of its own alive from the route to the dot, as a fusion
    that recomputes a cheap producer for each consumer does.
    ``attention_loop``: a fused attention kernel is the lowered module's loop over key blocks, its
    on-chip state held in memory as a backend with no scratchpad (SRAM, VMEM) runs it
    (:func:`shardc.costmodel.kernel_memory.loop_state`), not FlashAttention-2
    (:func:`shardc.costmodel.kernel_memory.flash_workspace`).  ``ring_blocks_first``: a collective
    matmul's ring, unrolled, has its block matmuls made before they are combined and its operands'
    blocks sliced into buffers of their own, as a scheduler with no latency to hide runs them
    (:func:`shardc.costmodel.ring_blocks.matmul_ring_buffers`); two rings gathering one value over the same
    axes run block by block together, the earlier's result and working set alive to the later's step
    (:func:`shardc.costmodel.ring_blocks.rings_together`), and a ring summing its block products makes its result
    after them (:func:`shardc.costmodel.ring_blocks.sums_blocks`).  ``scan_block``: a cumulative sum (a
    routing's slots) runs as a scan in blocks of this many elements along its dim, padded up to a multiple
    of it: the counts copied into the blocks and each block's running sums, two arrays of the padded shape
    beside the counts, where a chip's scan holds the counts and the sums (0).  ``products_again``: a
    product read by several steps is made again by each later reader's fusion, so its operands live to
    its last reader
    (:func:`shardc.costmodel.step_order.lifetimes`),
    a softmax a product reads after another reader keeps its exponentials to that product, and a
    transcendental derivative, which the fusion makes once, has a buffer of its own
    (:mod:`shardc.costmodel.fusion_buffers`).  ``scan_in_outputs``: a route's arrays that die before its
    mask is written (the scan's blocks; by choice the running sums too, the slot being what the mask reads) sit in
    the buffer of an output made then or after, as XLA's buffer assignment puts a temporary in an output's
    allocation it fits when their lives do not overlap (``BufferAssigner::MaybeAssignBuffer``).
    ``dots_canonical``: a dot whose operands are not one contracted and at most one free index after the
    batch copies them into (batch, free, contracted) and (batch, contracted, free) first, as XLA's dot
    decomposer rewrites it (:func:`shardc.costmodel.layout_copies.decomposed`), where a TPU's or GPU's reads
    them in place; the copy into place of a value gathered over several dims at once is written so.
    ``dot_sums``: a dot of at least this many elements read only by a dot with no free index is made inside
    that reader's fusion, with no buffer (:func:`shardc.costmodel.fusion_buffers.summed_into`).  ``routing_once``: the
    index-based dispatch steps routing the same gates run the routing once, at the first, its indices kept to
    the last (:func:`shardc.costmodel.route_memory.routed_once`), where each step runs it again.
    ``results_turned``: a dot's result transposed after the dot is made after it, from its product, and each
    later dot takes a copy of the product (:mod:`shardc.costmodel.dot_results`), where a TPU's or GPU's
    dot writes the result in its layout.  ``pointer``: a phase returning more than one value returns a tuple,
    whose allocation is a table of one pointer of this many bytes a value beside the values' own (XLA's
    buffer assignment: ``output shape is |(f32[2,2], f32[2,5])|``, 16 bytes, in partial_input.shard's
    forward), counted among the outputs; so is an AllReduce that combines several
    (:func:`shardc.costmodel.step_order.combined`), a temporary; 0: the values alone.  ``duplicated``: a product
    of fewer elements than this read by several steps, each a map or a reduction, is made inside each reader's
    fusion, no buffer of its own (:func:`_duplicated`)."""

    align: int = 1
    all_to_all_pieces: bool = False
    arguments_first: bool = False
    masks_per_dot: bool = False
    attention_loop: bool = False
    ring_blocks_first: bool = False
    scan_block: int = 0
    products_again: bool = False
    ring_slices: bool = False
    scan_in_outputs: bool = False
    dots_canonical: bool = False
    dot_sums: int = 0
    gemm_casts: bool = False  # GEMMs read casts of their operands, not FP8 copies (shardc.costmodel.gemm_buffers)
    routing_once: bool = False
    results_turned: bool = False
    pointer: int = 0
    duplicated: int = 0

    def rounded(self, n: float) -> float:
        return float(-(-int(n) // self.align) * self.align)


def phase_memory(plan: Plan, sizes: dict[str, int], element: int | None = None,
                 buffers: Buffers = Buffers(), section: str | None = None) -> list[PhaseMemory]:
    """The forward's and the backward's :class:`PhaseMemory` at ``sizes``; ``element``: the bytes of a
    float, a ``dtype`` line's too (None: their own; ids and masks keep theirs, :meth:`Plan.fixed_bytes`);
    ``buffers``: the backend's rules (:class:`Buffers`; the default a TPU's or GPU's).  Arguments
    and outputs are at their own size; the temporaries as ``buffers`` lays them out, of the whole
    phase or, with ``section`` (``before``, ``block``, ``after``), of that section's steps run alone
    (one stage's part of a pipelined step)."""
    own = dict(plan.element_bytes) if element is None else plan.fixed_bytes()

    def nbytes(ref: TensorRef) -> float:
        size = own.get(ref.name, element if element is not None else plan.spec.dtype.nbytes)
        return float(local_elements(ref, sizes)) * size

    declared = {info.ref: info.role for info in plan.tensors}
    results = [ref for ref, role in declared.items() if role == "activation"]
    kept = [ref for ref, _ in residual_table(plan) if declared.get(ref, "activation") == "activation"]
    program = backward_program(plan)  # the recomputed forward steps, then the backward's
    made = {s.dst for s in program}
    read = [ref for s in program for ref in s.reads if ref not in made]
    params = {ref for ref, role in declared.items() if role == "param"}
    forward = {"arguments": {"params": [r for r in declared if r in params],
                             "inputs": [r for r, role in declared.items() if role == "input"]},
               "outputs": {"results": results, "residuals": [r for r in kept if r not in results]}}
    backward = {"arguments": {"cotangents": list(plan.cotangents),
                              "residuals": [r for r in read if r not in params and r not in plan.cotangents],
                              "params": [r for r in read if r in params]},
                "outputs": {"gradients": list(plan.grads)}}
    out = []
    for name, steps, groups in (("forward", plan.forward, forward), ("backward", program, backward)):
        args, outs = ([r for refs in groups[c].values() for r in refs] for c in ("arguments", "outputs"))
        table = _table(outs, buffers.pointer)
        parts = tuple((c, label, _total(refs, nbytes)) for c in ("arguments", "outputs")
                      for label, refs in groups[c].items()) + ((("outputs", "tuple", table),) if table else ())
        run = steps if section is None else _section(plan, name, section)
        sliced = set(groups["arguments"].get("residuals", ())) if buffers.ring_slices else set()
        heap, first = gemm_buffers(plan, run, sizes, buffers, outs, args, nbytes)
        temporaries, early = _temporaries(run, set(args), set(outs), kept_values(plan), nbytes,
                                          _Copies(buffers, sizes, nbytes), sliced, heap)
        out.append(PhaseMemory(name, _total(args, nbytes), _total(outs, nbytes) + table, temporaries, parts,
                               early + first))
    return out


def _section(plan: Plan, phase: str, section: str) -> tuple[Step, ...]:
    """The steps of one section (``before``, ``block`` or ``after`` a ``layers`` block) of a phase as the
    program runs it: the backward's recomputed forward steps of the section, then its own."""
    cut = plan.cut
    if phase == "forward":
        return cut.steps("forward", plan.forward, section)
    again = cut.steps("recomputed", plan.recomputed, section) if backward_program(plan) != plan.backward else ()
    return again + cut.steps("backward", plan.backward, section)


def _total(refs: list[TensorRef], nbytes: Callable[[TensorRef], float]) -> float:
    return sum(nbytes(ref) for ref in dict.fromkeys(refs))


def _table(outs: list[TensorRef], pointer: int) -> float:
    """The bytes of the tuple a phase returns its values in (:attr:`Buffers.pointer`): a pointer a value,
    where there are two or more (one value is returned as it is)."""
    n = len(dict.fromkeys(outs))
    return float(n * pointer) if n > 1 else 0.0


def _temporaries(steps: tuple[Step, ...], args: set[TensorRef], outs: set[TensorRef], kept: frozenset[TensorRef],
                 nbytes: Callable[[TensorRef], float], copies: _Copies, sliced: set[TensorRef] | None = None,
                 more: list[Span] | None = None) -> tuple[float, float]:
    """The bytes of made values the phase needs beyond its ``args`` and ``outs``, and of them the copies
    of arguments made first (:attr:`Buffers.arguments_first`): the heap they pack into, each at an offset
    of its own among those alive with it (:func:`shardc.costmodel.heap.packed`; at least the most alive
    at one of ``steps``), an output counted from the step that makes it (before, the buffer of one a
    reduction or a gather makes holds others, :func:`shardc.costmodel.heap.outside_outputs`), less the
    outputs; ``sliced``: the residuals read out of a ring's slot (:attr:`Buffers.ring_slices`); ``more``: others.

    A value lives from the step that makes it to the last that reads it.  A rename makes none; a
    map or product read only by the map right after it is fused into it (as
    :func:`shardc.fusion.memory_traffic` prices it); a map's result takes the buffer of an operand
    of its size that no later step reads, as XLA's heap simulator shares an elementwise operand's
    buffer with its user, unless the buffer of a collective's output holds either first.  Copies a
    step makes for its layout (:func:`_layout_copies`) live for that step only.  An AllReduce issued
    off the critical path runs at the end (:func:`shardc.costmodel.step_order.lifetimes`).
    An AllGather of an argument (an FSDP param, a sequence-parallel input) is issued at the phase's
    start, its result alive from there: a latency-hiding scheduler starts a collective as soon as its
    operand is ready to overlap it with the compute before its reader, and FSDP gathers a unit's params
    together before the unit runs (Zhao et al. 2023, PyTorch FSDP, prefetching)."""
    readers, last = lifetimes(steps, copies.buffers.products_again)
    together = rings_together(steps) if copies.buffers.ring_blocks_first else {}
    last |= {steps[k].dst: max(last.get(steps[k].dst, k), j) for k, j in together.items()}
    start = made_at(steps)
    deferred = {s.dst for s in steps if s.src is not None and last.get(s.src) == len(steps) and s.ahead}
    buffers: dict[TensorRef, list[float]] = {}  # value -> [first step, last step, bytes]
    spans: list[Span] = []
    made_outs: dict[TensorRef, int] = {}
    early: dict[TensorRef, Span] = {}
    hosted: list[Span] = []
    shared: dict[TensorRef, TensorRef] = {}  # a map's result -> the dying operand whose buffer it takes
    laid: list[float] = []
    laid_out = {s.dst for s in steps if s.op is Op.ALL_GATHER and s.dim is None}  # gathered, copied into place
    # a dot reads these as they are made for it: a mask made again for it, an attention output divided again
    # for it (_remade_masks, _remade_outputs), a gather copied into place (dots_canonical)
    remade = set(_masks(steps) if copies.buffers.masks_per_dot else ()) | {
        s.dst for s in steps if copies.buffers.attention_loop and isinstance(s.fn, Attention) and s.fn.part == "out"
        or copies.buffers.dots_canonical and s.op is Op.ALL_GATHER and s.dim != 0}
    into = summed_into(steps, copies.sizes, copies.buffers.dot_sums)  # a dot made inside its reader's fusion
    last |= {ref: max(last[ref], k) for j, k in into.items() for ref in steps[j].reads}
    run_first = prelude(steps, args) if copies.buffers.arguments_first else {}  # run first, in this order
    ahead = dict(run_first)  # and the dots run right after a transposed result's copy (dot_results)
    dots = DotResult(steps, args, outs) if copies.buffers.results_turned else None
    again, routings = routed_once(steps, copies.sizes) if copies.buffers.routing_once else (set(), [])
    end = len(steps)  # a combined reduction's tuple (step_order.combined), while it runs
    spans += routings + [(end, end, float(n * copies.buffers.pointer)) for n in combined(steps, last, outs)
                         if copies.buffers.pointer]
    for k, step in enumerate(steps):
        held, aside = copies.routing(step) if k not in again else ([], [])
        hosted += [(k, k, n) for n in aside]
        # an index-based dispatch routes before it moves a row: its routing's arrays are freed before its result
        spans += [(k - 0.5 if isinstance(step.fn, Dispatch) else k,) * 2 + (n,) for n in held]
        for ref, size in copies.of(step):
            if step.op is Op.EINSUM and ref in remade:
                continue
            if step.is_collective and not written_into_place(step, readers.get(step.dst, []), outs):
                continue  # copied into place inside each reader's fusion (layout_copies.written_into_place)
            if dots is not None and is_dot(step) and ref in dots.turned:  # a later dot's copy: made at the dot
                spans += _turned(k, ref, size, dots, ahead) if ref == step.dst else []
                continue
            if ref is not None and ref in args and copies.buffers.arguments_first:
                # one copy, shared by the steps that read it so, dying at the last (before step 1 where it runs first)
                early[ref] = (0, ahead.get(into.get(k, k), into.get(k, k)), size)
            elif ref in laid_out and step.src in args and copies.buffers.arguments_first:
                laid.append(size)  # a prefetched gather laid out at the start, dying into its copy
            else:
                spans.append((into.get(k, k), into.get(k, k), size))
        if step.collective is not None:
            since = {ref: 0 for ref in args} | {ref: int(b[0]) for ref, b in buffers.items()}
            spans += _ring_buffers(k, step, since, {ref for ref in buffers if last.get(ref) == k}, copies,
                                   together.get(k))
        after = steps[k + 1] if k + 1 < len(steps) else None
        read = readers.get(step.dst, [])
        fused = step.dst not in kept and len(read) == 1 and (
            k in into or read[0].op is Op.SLICE  # a slice is pushed into the step making its operand
            or (after is not None and fusible(step) and fusible(after) and step.dst in after.operands)) \
            or _duplicated(step, read, kept, copies)
        if step.dst in outs and step.dst not in made_outs:  # a deferred reduction's, at the end
            made_outs[step.dst] = len(steps) if step.dst in deferred else start[k]
        if step.fn == ALIAS or step.dst in args or step.dst in outs or fused or step.dst in buffers:
            continue
        end = last.get(step.dst, k)
        dead = [ref for ref in step.operands if ref in buffers and ref not in shared and last.get(ref) == k
                and buffers[ref][2] == nbytes(step.dst)] if fusible(step) else []
        if dead:  # its buffer, unless an output's holds it first (heap.outside_outputs)
            shared[step.dst] = dead[0]
            buffers[step.dst] = [k, end, nbytes(step.dst)]
        else:
            prefetched = step.op is Op.ALL_GATHER and step.src in args
            first = copies.buffers.arguments_first and all(ref in args for ref in step.reads)
            when = ahead.get(k, 0 if prefetched or first else start[k])
            if copies.buffers.ring_blocks_first and sums_blocks(step):
                when = k + 0.5  # made from its ring's block products after the last (ring_blocks.sums_blocks)
            buffers[step.dst] = [when, max(end, when), nbytes(step.dst)]
    early |= _ring_slices(steps, sliced or set(), last, early, copies)
    # the gathers' copies into place are made after the computations run first, beside all of them
    laid_at = max(run_first.values(), default=0.0)
    spans += _slot_rows(steps, copies) + ([(laid_at, laid_at, max(laid))] if laid else [])
    if copies.buffers.products_again:
        early_args = args if copies.buffers.arguments_first else set()
        copied = lambda s: _layout_copies(s, copies.buffers.dots_canonical)  # noqa: E731
        spans += exponentials(steps, readers, last, nbytes, copied, outs, copies.sizes, copies.buffers.dot_sums) \
            + derivatives(steps, copied, early_args, nbytes)
    if copies.buffers.masks_per_dot:
        spans += _remade_masks(steps, copies)
    if copies.buffers.attention_loop:
        spans += _remade_outputs(steps, copies)
    at = {ref: len(spans) + j for j, ref in enumerate(ref for ref, b in buffers.items() if b[2])}
    spans += [(a, b, n) for a, b, n in buffers.values() if n] + list(early.values()) + (more or [])
    hosts = (Op.ALL_REDUCE, Op.REDUCE_SCATTER, Op.ALL_GATHER)  # their outputs hold others before
    hosting = {s.dst for s in steps if s.op in hosts}
    # a routing's arrays that die before its mask is written fit the buffer of any output made after them,
    # the mask's own included (Buffers.scan_in_outputs): an output made at the route's step counts as made after
    spans += outside_outputs(hosted, [(k + 1, nbytes(ref)) for ref, k in made_outs.items()])
    pairs = [(at[ref], at[user]) for user, ref in shared.items()]
    heap = outside_outputs(spans, [(k, nbytes(ref)) for ref, k in made_outs.items() if ref in hosting], pairs)
    return packed(heap, copies.buffers.align), sum(n for _, _, n in early.values())


def _turned(k: int, ref: TensorRef, size: float, dots: DotResult, ahead: dict[int, float]) -> list[Span]:
    """The buffers of a dot's result ``ref`` transposed after its dot at step ``k``
    (:mod:`shardc.costmodel.dot_results`), after the dot's operands are freed, beside the product (``ref``'s
    own buffer, from the dot): the transpose, unless only dots read it, and each later dot's copy of the
    product, alive to the last dot reading it (those ready at once run right after, ``ahead``)."""
    for j in dots.run_soon(ref):
        ahead[j] = k + 0.75
    own = [] if dots.only_dots(ref) else [(k + 0.5, k + 0.5, size)]
    return own + [(k + 0.5, max(ahead.get(j, j) for j in group), size) for group in dots.copies(ref)]


def _duplicated(step: Step, read: list[Step], kept: frozenset[TensorRef], copies: _Copies) -> bool:
    """Whether a product read by several steps, each a map or a reduction, is made inside each reader's fusion
    and never written: one of fewer than :attr:`Buffers.duplicated` elements, as XLA's loop fusion duplicates a
    cheap producer into every consumer (a product of more joins a YNNPACK fusion, written once)."""
    return (step.dst not in kept and len(read) > 1 and is_product(step) and all(fusible(r) for r in read)
            and local_elements(step.dst, copies.sizes) < copies.buffers.duplicated)


def _slot_rows(steps: tuple[Step, ...], copies: _Copies) -> list[Span]:
    """Per index-based step writing expert rows (a dispatch, the expert outputs' gradient), the zeroed
    rows it scatters into, with one more slot where dropped choices land, before it slices off that
    slot (:func:`shardc.lowering.runtime.expert_dispatch`): its result's bytes by (C + 1) / C, from
    the step, or from the phase's start where the backend runs first what reads no value made in the
    phase (the zeros read none)."""
    spans: list[Span] = []
    for k, step in enumerate(steps):
        if not isinstance(step.fn, Dispatch) or step.fn.part not in ("dispatch", "combine_vjp"):
            continue
        (slots,) = (d for d in step.dst.dims if d.name == step.fn.slots)
        c = _local(slots, copies.sizes)
        rows = copies.nbytes(step.dst) * (c + 1) / c
        spans.append((0 if copies.buffers.arguments_first else k, k, rows))
    return spans


def _masks(steps: tuple[Step, ...]) -> dict[TensorRef, int]:
    """Each routing mask (a route's result, or a product with one) and the step of its route."""
    routes = {s.dst: k for k, s in enumerate(steps) if isinstance(s.fn, Route)}
    return dict(routes) | {s.dst: min(routes[r] for r in s.operands if r in routes)
                           for s in steps if is_product(s) and any(r in routes for r in s.operands)}


def _remade_masks(steps: tuple[Step, ...], copies: _Copies) -> list[Span]:
    """Per dot reading a routing mask, the mask made again for it (laid out for it), from the route's step."""
    masks = _masks(steps)
    return [(masks[ref], k, copies.nbytes(ref))
            for k, s in enumerate(steps) if s.op is Op.EINSUM and not is_product(s)
            for ref in s.operands if ref in masks]


def _remade_outputs(steps: tuple[Step, ...], copies: _Copies) -> list[Span]:
    """The attention output's last division (the accumulator by the row sums), which the lowered kernel
    runs after its loop and the fusion makes again for each dot that reads the output, in a buffer of
    its own: the accumulator and the row sums (float32) live from the kernel to the last such dot."""
    spans: list[Span] = []
    for k, step in enumerate(steps):
        if not isinstance(step.fn, Attention) or step.fn.part != "out":
            continue
        rows, head, _ = _kernel_dims(step, copies.sizes)
        dots = [j for j, s in enumerate(steps) if j > k and s.op is Op.EINSUM and not is_product(s)
                and step.dst in s.operands]
        spans.append((k, max(dots, default=k), copies.buffers.rounded(float(rows * head) * 4)
                      + copies.buffers.rounded(float(rows) * 4)))
        spans += [(j, j, copies.nbytes(step.dst)) for j in dots]
    return spans


@dataclass(frozen=True)
class _Copies:
    """The buffers a backend (:class:`Buffers`) makes for one step beyond its operands and result."""

    buffers: Buffers
    sizes: dict[str, int]
    nbytes: Callable[[TensorRef], float]  # a value's own bytes, unrounded

    def of(self, step: Step) -> list[tuple[TensorRef | None, float]]:
        """Each copy: the value it lays out (None: an AllToAll's pieces, a kernel's workspace) and its bytes."""
        pieces = self._pieces(step) if self.buffers.all_to_all_pieces and step.op is Op.ALL_TO_ALL else []
        # the pieces are sliced along the split dim and concatenated along the other: no transpose
        laid = [] if pieces else _layout_copies(step, self.buffers.dots_canonical)
        return [(ref, self.nbytes(ref)) for ref in laid] + [(None, n) for n in pieces + self._kernel(step)]

    def _kernel(self, step: Step) -> list[float]:
        """An attention kernel's buffers in memory while it runs, beyond its operands and results:
        FlashAttention-2's (:func:`shardc.costmodel.kernel_memory.flash_workspace`), or the lowered loop's
        where the backend runs that (:func:`shardc.costmodel.kernel_memory.loop_state`)."""
        if not isinstance(step.fn, Attention) or not step.fn.kernel:
            return []
        rows, head, block = _kernel_dims(step, self.sizes)
        element = self.nbytes(step.dst) / local_elements(step.dst, self.sizes)
        q, k, v = step.operands[:3]
        if self.buffers.attention_loop:
            batch = [d.name for d in q.dims if d in k.dims]
            blocked = _blocked([d.name for d in q.dims], batch, [d.name for d in q.dims[:-1] if d not in k.dims])
            joined = self._joined(k, step.fn.part, rows, head, element) if step.fn.rope else []
            return loop_state(step.fn.part, rows, head, block, element, blocked) + joined
        q_, k_, v_ = (tuple(d.name for d in ref.dims) for ref in (q, k, v))
        r = roles(q_, k_, v_, step.fn.key)
        group = prod(_local(d, self.sizes) for d in q.dims if d.name in r.queries[1:])
        return flash_workspace(step.fn.part, rows, head, element, int(local_elements(k, self.sizes)) * group
                                if group > 1 else 0)

    def _joined(self, k: TensorRef, part: str, rows: int, head: int, element: float) -> list[float]:
        """With a second (query, key) pair, the lowered kernel's concatenated heads
        (:func:`shardc.lowering.runtime.attention_rope`): ``[Q, Qr]`` and ``[K, Kr]`` (Kr broadcast over K's
        heads), and in the backward also their gradients, made whole before they are split."""
        keys = float(local_elements(k, self.sizes)) / _local(k.dims[-1], self.sizes) * head
        return [float(rows * head) * element, keys * element] * (1 if part == "out" else 2)

    def routing(self, step: Step) -> tuple[list[float], list[float]]:
        """A routing's arrays (:func:`shardc.costmodel.route_memory.route_arrays`): those in the heap, and
        those in the buffer of an output made after them (:attr:`Buffers.scan_in_outputs`)."""
        hosting = self.buffers.scan_in_outputs and isinstance(step.fn, Route)
        return route_arrays(step, self.sizes, self.buffers.scan_block, hosting)

    def _pieces(self, step: Step) -> list[float]:
        n = 1
        for axis in step.axes:
            n *= self.sizes[axis]
        sent = step.src if step.src is not None else step.dst
        slices, received = (n * self.buffers.rounded(self.nbytes(ref) / n) for ref in (sent, step.dst))
        # the operand dies into its slices (it is read by nothing else): only their padding is new
        return [max(0.0, slices - self.buffers.rounded(self.nbytes(sent))) + received]


def _kernel_dims(step: Step, sizes: dict[str, int]) -> tuple[int, int, int]:
    """An attention step's rows (Q's elements by its head dim), head dim (with a second pair, the concatenated
    heads' H + J) and key block on one device."""
    assert isinstance(step.fn, Attention)
    q, k = step.operands[:2]
    head = _local(q.dims[-1], sizes)
    key = next(d for d in k.dims if d.name == step.fn.key)
    joined = head + (_local(step.operands[3].dims[-1], sizes) if step.fn.rope else 0)
    return int(local_elements(q, sizes)) // head, joined, key_block(_local(key, sizes))


def _local(dim: Dim, sizes: dict[str, int]) -> int:
    return int(local_elements(TensorRef("", (dim,)), sizes))

