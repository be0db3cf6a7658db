"""Memory per device: weights and optimizer state, residual activations, gathered weights.

The training state is counted by one of the accountings of
:data:`shardc.accountings.ACCOUNTINGS` (``adam10``, ``adam16``, ``mixed18``, ``mixed14``, ``bf16opt20``).

Each byte is sharded as its param is declared; under ``zero N over X``
(:mod:`shardc.planner.zero`) the optimizer state (N >= 1) and the gradient (N >= 2)
of a param not sharded over X are counted on its ZeRO shard, and at N = 3 the
param is declared sharded.  With ``adam16`` (the paper's K = 12) that is the ZeRO
paper's 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and 16Ψ/N bytes a device (:func:`state_formula`
gives them as formulas).  Residuals are the forward values the backward reads
from memory under the plan's save policy and recompute mode (:func:`residual_table`:
``plan.residuals`` the backward does not recompute, and the block's inputs, each
with why), each at its local size and its element bytes (the spec's dtype; 4 for token
ids, int32); a value the backward reads for its shape only (``Step.shapes``) is none.  Where the framework
runs its own kernels (``fusion none``, ``statement``) autograd keeps what their backward reads besides: the
row statistics a norm's kernel saves (:func:`shardc.fusion.saved_statistics`; float32), which the program
XLA runs makes again from X.
``layers`` multiplies the per-layer state and residuals; the gathered weights (and
unreduced weight gradients) alive at once are counted for one layer, since layers run
one at a time, and so are the buffers a ring's sends arrive in (:func:`ring_buffers`: ring attention's K
and V blocks in flight, a collective matmul's double buffer).  Other transient activations of the running
layer are not counted in the step's total;
:func:`shardc.costmodel.phase_memory.phase_memory` models them per phase of the program (arguments,
outputs and the most temporaries alive at one step), the figures ``shardc verify`` checks against
XLA's buffer assignment.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import symengine as se

from shardc.accountings import ACCOUNTINGS, described
from shardc.collectives import piece
from shardc.costmodel.formulas import ZERO, Expr, number, product, symbol, text
from shardc.device_pieces import local_elements
from shardc.errors import ShardcError
from shardc.fusion import saved_statistics
from shardc.ir.localops import ALIAS
from shardc.ir.plan import Plan, Step
from shardc.ir.precision import TILE, Precision, quantized_bytes
from shardc.ir.spec import Dim, TensorRef
from shardc.layer_counts import block_counts, resolve_layers, runs
from shardc.planner.recompute import block_outputs, checkpoints, keeps_layer_inputs
from shardc.planner.zero import zero_params
from shardc.quantize import quantized_weights
from shardc.ring_sends import ring_of, shared_rings
from shardc.spec.functions import ID_DTYPE
from shardc.spec.walk import block_reads, id_names, layer_inputs
from shardc.step_cost import describe

__all__ = ["ACCOUNTINGS", "Memory", "memory", "step_memory", "state_refs", "state_formula", "residual_values",
           "residual_sizes", "residual_table", "residual_formula", "value_bytes", "kept_once", "ring_buffers",
           "value_blocks"]


@dataclass(frozen=True)
class Memory:
    accounting: str
    accounting_text: str
    params: float  # parameter count on one device (after sharding), all layers
    params_total: float  # parameter count of the model, all layers
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    residual_bytes: float
    gathered_bytes: float
    residuals: tuple[tuple[str, float], ...]  # (value, bytes for one layer)
    hbm_bytes: float
    zero: str = ""  # the spec's `zero N over X` line, "" without one
    recompute: str = "none"  # the plan's --recompute mode
    whys: tuple[str, ...] = ()  # why each residual is kept, in the order of ``residuals``
    recomputed: tuple[tuple[str, float], ...] = ()  # forward values made again in the backward, bytes a layer
    # the residuals of one layer as a formula (:func:`residual_formula`), written when first read (a layout
    # search's rows read none)
    residual_expr_of: Callable[[], str] = field(default=str, compare=False, repr=False)
    host_bytes: float = 0.0  # held in the host's memory instead (shardc.costmodel.offload)
    ring_bytes: float = 0.0  # the ring buffers in flight at once, one step of one layer (:func:`ring_buffers`)
    grads: float = 0.0  # gradient elements on one device (sharded as the param, or on its ZeRO shard), all layers
    # of param_bytes, the held weights' copies in their GEMMs' narrower type (`gemm f8`), kept all step
    # (shardc.quantize.quantized_weights)
    quantized_weight_bytes: float = 0.0
    # of residual_bytes, the checkpoints' (:func:`checkpoint_refs`): kept by every plan of the spec and policy
    checkpoint_bytes: float = 0.0

    @cached_property
    def residual_bytes_expr(self) -> str:
        return self.residual_expr_of()

    @property
    def total_bytes(self) -> float:
        return (self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.residual_bytes
                + self.gathered_bytes + self.ring_bytes)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.hbm_bytes

    def to_json(self) -> dict[str, object]:
        return {"accounting": self.accounting, "accounting_text": self.accounting_text, "zero": self.zero or None,
                "params_per_device": self.params, "params_total": self.params_total,
                "param_bytes": self.param_bytes, "grad_bytes": self.grad_bytes,
                "optimizer_bytes": self.optimizer_bytes, "residual_bytes": self.residual_bytes,
                "gathered_bytes": self.gathered_bytes, "ring_bytes": self.ring_bytes,
                "total_bytes": self.total_bytes,
                "hbm_bytes": self.hbm_bytes, "fits": self.fits, "host_bytes": self.host_bytes,
                "recompute": self.recompute, "residual_bytes_per_layer_expr": self.residual_bytes_expr,
                "residuals": [{"value": v, "bytes_per_layer": b, "why": w}
                              for (v, b), w in zip(self.residuals, self.whys or ("",) * len(self.residuals),
                                                   strict=True)],
                "recomputed": [{"value": v, "bytes_per_layer": b} for v, b in self.recomputed],
                **({"quantized_weight_bytes": self.quantized_weight_bytes} if self.quantized_weight_bytes else {})}


def memory(plan: Plan, sizes: dict[str, int], layers: int, hbm_bytes: float,
           accounting: str = "adam10", outside: frozenset[str] | None = None,
           model_layers: tuple[int, ...] | None = None, more_layers: tuple[int, ...] = (),
           native: bool = False) -> Memory:
    """The per-device memory of a training step of ``plan`` (see the module docstring).

    ``outside`` names the tensors outside a ``layers L { ... }`` block that this device holds
    (a pipeline stage: the first holds the embedding's, the last the loss's); None: all of them.
    ``more_layers`` the later ``layers`` blocks' counts; ``model_layers``: the whole model's layers of
    each block, for its parameter count, where those are one pipeline stage's (None: the same); ``native``: the
    framework runs its own kernels (``fusion none``, ``statement``), whose saved statistics are residuals too
    (:func:`shardc.fusion.saved_statistics`)."""
    if accounting not in ACCOUNTINGS:
        raise ShardcError(f"unknown optimizer accounting {accounting!r}",
                          fix="use " + " or ".join(ACCOUNTINGS))
    per_param, per_grad, per_opt, _ = ACCOUNTINGS[accounting]
    label = described(accounting, plan.spec.dtype.value)  # fp16 where the spec's params are
    params = [info for info in plan.tensors if info.role == "param"]
    repeated = block_reads(plan.spec)
    blocks = value_blocks(plan)
    counts = (layers, *more_layers)

    def count(name: str, once: bool) -> int:  # a `layers` block's tensors: its L; the others once, where held
        if not once:
            return runs(False, blocks.get(name, 0), counts)
        return 1 if outside is None or name in outside else 0

    times = {p.name: count(p.name, p.name not in repeated) for p in params}
    local = sum(float(local_elements(p.ref, sizes)) * times[p.name] for p in params)
    every = (layers, *more_layers) if model_layers is None else model_layers  # the model's: all its layers
    total = sum(float(_global_elements(p.ref, sizes)) * (runs(False, repeated[p.name], every)
                                                          if p.name in repeated else times[p.name])
                for p in params)
    grad_local, opt_local = (sum(float(local_elements(r, sizes)) * times[r.name] for r in refs)
                             for refs in state_refs(plan))
    stats = saved_statistics(plan) if native else ()
    outer = kept_once(plan, [ref for ref, _ in stats]) if plan.spec.block is not None else set()
    saved = tuple((ref, f"a row statistic the framework's kernel saves for its backward, {n} bytes an element"
                   + (", outside the layers block, kept once (not once a layer)" if ref in outer else ""))
                  for ref, n in stats)
    table = residual_table(plan) + saved
    widths = dict(stats)
    sized = residual_sizes(plan, sizes, native)  # each kept value's bytes, the one count of them
    kept = tuple((str(ref), sized[ref]) for ref, _ in table)
    once = kept_once(plan, [ref for ref, _ in table])
    kept_counts = [count(ref.name, ref in once) for ref, _ in table]
    marks = checkpoint_refs(plan)
    again = tuple((str(s.dst), value_bytes(plan, s.dst, sizes)) for s in plan.recomputed
                  if s.dst in set(plan.residuals))
    names = {p.name for p in params if times[p.name]} | {plan.grad_name(p.name) for p in params if times[p.name]}
    gathered = max(peak_weights(plan, plan.forward, names, sizes), peak_weights(plan, plan.backward, names, sizes))
    rings = max(ring_buffers(steps, sizes, plan.precision)
                for steps in (plan.forward, plan.recomputed + plan.backward))
    copies = math.fsum(quantized_bytes(float(local_elements(plan.tensor(name).ref, sizes)), kind, TILE * TILE)
                       * times[name] for name, kind in quantized_weights(plan).items())
    weights = local * per_param + copies if copies else local * per_param  # (an int where it was one)
    return Memory(accounting, label, local, total, weights, grad_local * per_grad,
                  opt_local * per_opt,
                  sum(b * n for (_, b), n in zip(kept, kept_counts, strict=True)), gathered, kept, hbm_bytes,
                  str(plan.spec.zero) if plan.spec.zero is not None else "", plan.recompute,
                  tuple(why for _, why in table), again, lambda: text(residual_formula(plan, table, widths)),
                  ring_bytes=rings, grads=grad_local, quantized_weight_bytes=copies,
                  checkpoint_bytes=sum(b * n for (ref, _), (_, b), n in zip(table, kept, kept_counts, strict=True)
                                       if ref in marks))


def step_memory(plan: Plan, sizes: dict[str, int], hbm_bytes: float, accounting: str = "adam10",
                model_layers: tuple[int, ...] | None = None, native: bool = False) -> Memory:
    """:func:`memory` of the step as ``shardc cost``'s memory section counts it: the plan's layers of each
    block at ``sizes`` (a pipeline's: one stage's, the whole batch at once; ``model_layers`` the model's;
    ``native``: the framework's own kernels run it)."""
    return memory(plan, sizes, resolve_layers(plan, sizes)[0], hbm_bytes, accounting, model_layers=model_layers,
                  more_layers=block_counts(plan, sizes)[1:], native=native)


def ring_buffers(steps: tuple[Step, ...], sizes: dict[str, int], nbytes: int | Precision) -> float:
    """The most bytes of ring buffers in flight at one step of a phase (``nbytes``: an element's bytes, or
    the tensors' types, :func:`shardc.ring_sends.ring_bytes`): a step sending blocks around a ring while it
    computes (ring attention's K and V blocks, with dK's and dV's accumulators in the backward; a
    collective matmul's block) holds the block it computes with
    and the next one arriving beside what the plan counts (its own block), a double buffer: two of a ring
    step's sends (:attr:`~shardc.steptime.RingTransfer.step_bytes`), one where the ring has two devices.
    Collective matmuls reading one gathered operand share one chain of sends (:func:`shardc.ring_sends.shared_rings`),
    whose n - 1 received blocks stay alive until the last of them has read them."""
    later = {s.collective for s, shared in zip(steps, shared_rings(steps), strict=True) if shared}
    peak = 0.0
    for step in steps:
        ring = ring_of(step, sizes, nbytes)
        if ring is None:
            continue
        blocks = ring.steps - 1 if step.collective in later else min(2, ring.steps - 1)
        peak = max(peak, blocks * ring.step_bytes)
    return peak


def value_blocks(plan: Plan) -> dict[str, int]:
    """The ``layers`` block of each tensor a block repeats: the block of the step that makes it, else of
    the block reading it (:func:`shardc.spec.walk.block_reads`)."""
    return block_reads(plan.spec) | {s.dst.name: s.block for s in plan.forward if not s.once}


def kept_once(plan: Plan, refs: list[TensorRef]) -> set[TensorRef]:
    """The residuals among ``refs`` kept once a step, not once a layer: a value a step outside the
    ``layers L { ... }`` block made, or an input no repeated statement reads.  Under full
    recomputation the block's input stands for every layer's input, each layer's checkpoint,
    so it is kept once a layer; the last layer's output, which the statements after the block
    read (:func:`shardc.planner.recompute.block_outputs`), is kept once."""
    repeated = block_reads(plan.spec)
    made = {s.dst: s.once for s in plan.forward}
    checkpoints = set(layer_inputs(plan.spec)) if keeps_layer_inputs(plan.recompute) else set()
    last = block_outputs(plan.forward) if keeps_layer_inputs(plan.recompute) else set()
    return {ref for ref in refs if ref.name not in checkpoints
            and (ref in last or made.get(ref, ref.name not in repeated))}


def checkpoint_refs(plan: Plan) -> frozenset[TensorRef]:
    """The values every plan of the spec and its policy keeps at their declared shardings: under ``full`` and
    ``dots`` what recomputation starts from (:func:`shardc.planner.recompute.checkpoints`: the inputs and each
    layer's input).  Under ``none`` and ``selective`` none: there a plan keeps what its own backward reads, which
    may be an input's local slice rather than the declared value, so no value's bytes bound every plan's."""
    if not keeps_layer_inputs(plan.recompute):
        return frozenset()
    names = set(checkpoints([i.name for i in plan.tensors if i.role == "input"], plan.spec, plan.recompute))
    return frozenset(i.ref for i in plan.tensors if i.name in names)


def state_refs(plan: Plan) -> tuple[list[TensorRef], list[TensorRef]]:
    """Each param's gradient and optimizer state as one device holds them: sharded as the param,
    or on its ZeRO shard (the gradient from stage 2, the optimizer state from stage 1)."""
    declared = {info.name: info.ref for info in plan.tensors}
    params = [info.ref for info in plan.tensors if info.role == "param"]
    zero = plan.spec.zero
    shards = zero_params(plan.spec, frozenset(r.name for r in params), declared) if zero is not None else {}

    def on_shard(ref: TensorRef) -> TensorRef:
        layout = shards.get(ref.name)
        if layout is None:
            return ref
        return TensorRef(ref.name, tuple(Dim(d.name, a) for d, a in zip(ref.dims, layout, strict=True)))

    stage = zero.stage if zero is not None else 0
    return ([on_shard(r) if stage >= 2 else r for r in params], [on_shard(r) for r in params])


def state_formula(plan: Plan, accounting: str = "adam16",
                  layers: int | str | tuple[int | str, ...] = 1) -> tuple[Expr, Expr, Expr]:
    """(param, gradient, optimizer state) bytes a device as exact formulas in the dims and mesh axes;
    ``layers`` one count, or every ``layers`` block's."""
    per_param, per_grad, per_opt, _ = ACCOUNTINGS[accounting]
    grads, states = state_refs(plan)
    params = [info.ref for info in plan.tensors if info.role == "param"]
    each = layers if isinstance(layers, tuple) else (layers,)
    counts = [symbol(n) if isinstance(n, str) else number(n) for n in each]
    repeated = block_reads(plan.spec)  # a `layers` block's params: its L times; the others once

    def times(name: str) -> Expr:
        return counts[repeated[name]] if name in repeated else number(1)

    def total(refs: list[TensorRef], nbytes: int) -> Expr:
        return se.expand(nbytes * sum((times(r.name) * _elements(r) for r in refs), ZERO))

    return total(params, per_param), total(grads, per_grad), total(states, per_opt)


def value_bytes(plan: Plan, ref: TensorRef, sizes: dict[str, int]) -> float:
    """Bytes of one device's piece of ``ref``: its padded local elements times its element bytes
    (:meth:`Plan.nbytes`: 4 for token ids, else the spec's dtype's)."""
    return float(local_elements(ref, sizes)) * plan.nbytes(ref.name)


def residual_formula(plan: Plan, table: Sequence[tuple[TensorRef, str]] | None = None,
                     widths: dict[TensorRef, int] | None = None) -> Expr:
    """The bytes the backward keeps for one layer (:func:`residual_table`, or ``table`` where it is made
    already, ``widths`` the element bytes of those not of the plan's), as an exact formula.

    Per value its local elements (each dim over its axes' product, unpadded) times its
    element bytes (:meth:`Plan.nbytes`): the form Korthikanti et al. (2022) write, e.g. ``34*B*D*S/Y``.
    """
    kept = residual_table(plan) if table is None else table
    width = widths or {}
    return se.expand(sum((width.get(ref, plan.nbytes(ref.name)) * _elements(ref) for ref, _ in kept), ZERO))


def _elements(ref: TensorRef) -> Expr:
    """One device's piece of ``ref`` as a formula (:func:`shardc.collectives.piece`, unpadded)."""
    return piece((symbol(d.name), product(d.axes)) for d in ref.dims)


def residual_values(plan: Plan, native: bool = False) -> list[TensorRef]:
    """Forward values the backward reads from memory, each once, in the order first read; with ``native``, the
    statistics the framework's kernels save after them (:func:`shardc.fusion.saved_statistics`)."""
    return [ref for ref, _ in residual_table(plan)] + [ref for ref, _ in saved_statistics(plan) if native]


def residual_sizes(plan: Plan, sizes: dict[str, int], native: bool = False) -> dict[TensorRef, float]:
    """Each of :func:`residual_values` with the bytes of one device's piece: :func:`value_bytes`, a saved
    statistic's at its own element bytes."""
    widths = dict(saved_statistics(plan)) if native else {}
    return {ref: _kept_bytes(plan, ref, sizes, widths) for ref in residual_values(plan, native)}


def _kept_bytes(plan: Plan, ref: TensorRef, sizes: dict[str, int], widths: dict[TensorRef, int]) -> float:
    """:func:`value_bytes`, or ``ref``'s local elements at its width in ``widths`` (a saved statistic's)."""
    return float(local_elements(ref, sizes)) * widths[ref] if ref in widths else value_bytes(plan, ref, sizes)


# the last plans' tables, by identity (each entry holds its plan, so no other plan takes its id): one pipelined
# report reads a frozen plan's table eight times (the step's memory and each stage's, each device's kept values,
# each section's working set), and a layout search costs hundreds of reports
_TABLES: dict[int, tuple[Plan, tuple[tuple[TensorRef, str], ...]]] = {}
_KEPT_TABLES = 16


def residual_table(plan: Plan) -> tuple[tuple[TensorRef, str], ...]:
    """:func:`_residual_table` of ``plan``, made once for the last plans asked."""
    hit = _TABLES.get(id(plan))
    if hit is not None and hit[0] is plan:
        return hit[1]
    table = _residual_table(plan)
    if len(_TABLES) >= _KEPT_TABLES:
        del _TABLES[next(iter(_TABLES))]
    _TABLES[id(plan)] = (plan, table)
    return table


def _residual_table(plan: Plan) -> tuple[tuple[TensorRef, str], ...]:
    """What the backward keeps from the forward, each value once, with why.

    The values the recomputed forward steps (``plan.recomputed``) and then the
    backward read for their data (:attr:`Step.operands` and sources, not
    :attr:`Step.shapes`) that neither makes: the plan's residuals first, then the
    layer's inputs.  Each says the first step that reads it, what it is (token ids,
    a layer input, or a value a forward collective made, kept rather than moved
    again) and, under ``selective``, that it lies outside the attention-score region.
    A rename's value (an alias step, :data:`shardc.ir.localops.ALIAS`) is its
    source's array under another name: it is kept as that source, once.
    """
    aliases = {s.dst: s.operands[0] for s in plan.forward if s.fn == ALIAS}

    def root(ref: TensorRef) -> TensorRef:
        while ref in aliases:
            ref = aliases[ref]
        return ref

    steps = (*(("the recomputed forward", s) for s in plan.recomputed),
             *((f"backward step {k}", s) for k, s in enumerate(plan.backward, 1)))
    made = {s.dst for _, s in steps}
    declared = {info.ref: info.role for info in plan.tensors}
    skip = made | set(plan.cotangents) | {r for r, role in declared.items() if role == "param"}
    first: dict[TensorRef, str] = {}
    for where, step in steps:
        for ref in step.reads:
            if ref not in skip and root(ref) not in first:
                first[root(ref)] = f"read by {where}: {describe(step)}"
    residuals = [root(r) for r in plan.residuals]
    order = [r for r in residuals if r in first] + [r for r in first if r not in residuals]
    moved: dict[TensorRef, str] = {}
    for k, step in enumerate(plan.forward, 1):
        if step.is_collective and step.dst not in declared:
            moved.setdefault(step.dst, f"made by forward step {k} ({step.op.title}_{''.join(step.axes)} "
                                       f"{describe(step)}), kept rather than moved again (--save {plan.save})")
    refs = list(dict.fromkeys(order))
    once = kept_once(plan, refs) if plan.spec.block is not None else set()
    return tuple((ref, _why(plan, ref, first[ref], declared, moved, ref in once)) for ref in refs)


def _why(plan: Plan, ref: TensorRef, reader: str, declared: dict[TensorRef, str], moved: dict[TensorRef, str],
         once: bool) -> str:
    size = dict(plan.element_bytes).get(ref.name)  # set where an element is not of the spec's dtype
    parts = [] if size is None else [f"token ids, {size} bytes an element ({ID_DTYPE})"] \
        if ref.name in id_names(plan.spec) else [f"{size} byte{'s' if size > 1 else ''} an element"]
    if declared.get(ref) == "input":
        parts.append("input" if once else "layer input")
    elif ref in moved:
        parts.append(moved[ref])
    if once:
        parts.append("outside the layers block, kept once (not once a layer)")
    elif keeps_layer_inputs(plan.recompute) and ref.name in layer_inputs(plan.spec):
        parts.append("the layer's input, kept once a layer (the checkpoint the layer is recomputed from)")
    if plan.recompute == "selective" and declared.get(ref) != "input":
        parts.append("kept (outside the attention-score region)")
    return ", ".join([*parts, reader])


def peak_weights(plan: Plan, steps: tuple[Step, ...], weights: set[str], sizes: dict[str, int]) -> float:
    """Most bytes of gathered weights / unreduced weight gradients alive at one step of a phase.

    ``weights`` names the params and their gradients (:meth:`Plan.grad_name`)."""
    born: dict[TensorRef, int] = {}
    last: dict[TensorRef, int] = {}
    width: dict[TensorRef, int] = {}  # each value's element bytes, as the step that made it moved them
    for i, step in enumerate(steps):
        for ref in step.reads:
            if ref in born:
                last[ref] = i
        if step.tensor in weights and (step.is_collective or step.dst.unreduced):
            born.setdefault(step.dst, i)
            last.setdefault(step.dst, i)
            width.setdefault(step.dst, plan.moved_nbytes(step))
    # one sweep over the births and last reads: at each birth (what is alive at a step is alive at the latest
    # birth before it), the values born by then and read at or after it; each value's bytes are a whole number
    # of elements times its element's bytes, so the running sum is exact in any order
    # once a value, not once a step it is alive at; a gathered param in its gather type (`param_gather in f8`:
    # torchao's fsdp_post_all_gather hands the float8 data itself to the GEMM), a gradient in its own
    nbytes = {r: float(local_elements(r, sizes)) * width[r] for r in born}
    events: dict[int, tuple[list[TensorRef], list[TensorRef]]] = {}
    for ref in born:
        events.setdefault(born[ref], ([], []))[0].append(ref)
        events.setdefault(last[ref], ([], []))[1].append(ref)
    alive, peak = 0.0, 0.0
    for i in sorted(events):
        starts, ends = events[i]
        for ref in starts:
            alive += nbytes[ref]
        if starts:
            peak = max(peak, alive)
        for ref in ends:
            alive -= nbytes[ref]
    return peak


def _global_elements(ref: TensorRef, sizes: dict[str, int]) -> int:
    count = 1
    for dim in ref.dims:
        count *= sizes[dim.name]
    return count
