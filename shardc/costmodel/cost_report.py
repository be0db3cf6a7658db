"""``shardc.cost(plan)``: the figures of a plan on a chip, as a report with text and JSON forms.

Per phase (forward, backward, ZeRO's optimizer) and for the whole training step (``step``, all of them
and the update), a :class:`~shardc.costmodel.phase_cost.PhaseCost` (its compute, memory-bound and
collective times, the step time the planner minimises, the bound, MFU); beside them the memory a device
holds, the thresholds, and with a pipeline axis the pipeline's figures
(:mod:`shardc.costmodel.pipeline_cost`), with ``--offload`` what the host holds
(:mod:`shardc.costmodel.offload`).

Everything is multiplied by the layer count (``layers`` in the spec).  Every
figure also comes as a formula (bandwidth terms; ``*_expr`` in JSON).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from shardc.accountings import ACCOUNTINGS, chosen, reduce_dtype
from shardc.collectives import NCCL_BASE_S, NCCL_NET_STEP_S, NCCL_NVLINK_STEP_S, Layout
from shardc.costmodel.context_parallel import with_thresholds
from shardc.costmodel.cost_text import render
from shardc.costmodel.formulas import HardwareSymbols, PhaseFormula, hardware_symbols, phase_formula
from shardc.costmodel.memory import Memory, step_memory
from shardc.costmodel.offload import Offload, check_offload, offload_cost, pipeline_offload
from shardc.costmodel.phase_cost import PhaseCost
from shardc.costmodel.pipeline_cost import pipeline_cost
from shardc.costmodel.pipeline_figures import PipelineCost
from shardc.costmodel.thresholds import Threshold, derive
from shardc.errors import ShardcError
from shardc.gather_scales import scale_reduction
from shardc.hardware import Hardware, check_spans
from shardc.ir.localops import Attention
from shardc.ir.plan import Plan, Step
from shardc.ir.spec import Network, Spec
from shardc.layer_counts import block_counts, resolve_layers
from shardc.phase_time import phase_ends
from shardc.spec.walk import id_names
from shardc.stage_phases import microbatched, stage_phases, zero_reductions
from shardc.timing import phase_rows, plan_chip, plan_links, plan_sizes, update_seconds
from shardc.topology import AxisLinks

__all__ = ["CostReport", "cost", "accounting_of", "resolve_sizes", "missing_sizes", "step_tokens"]


@dataclass(frozen=True)
class CostReport:
    """What :func:`cost` returns; ``str()`` is the table ``shardc cost`` prints."""

    plan: Plan
    hardware: Hardware
    sizes: dict[str, int]
    layers: int
    forward: PhaseCost
    backward: PhaseCost
    step: PhaseCost
    memory: Memory
    notes: tuple[str, ...] = field(default=())
    pipeline: PipelineCost | None = None  # with a `pipeline` mesh axis (shardc.costmodel.pipeline_cost)
    optimizer: PhaseCost | None = None  # ZeRO-1/2's optimizer phase (no rows without a `zero 1|2` line)
    offload: Offload | None = None  # what goes to the host's memory (--offload), None without

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "file": self.plan.spec.filename,
            "hardware": hardware_json(self.hardware, self.step.formula.hw),
            "sizes": self.sizes, "layers": self.layers, "devices": self.step.devices,
            "save": self.plan.save, "recompute": self.plan.recompute,
            "zero": _zero_json(self.plan),
            "grad_reduce_dtype": reduction_dtype(self.plan.spec, self.memory.accounting),
            "param_gather_dtype": None if (kind := self.plan.spec.param_gather_dtype) is None else kind.value,
            "forward": self.forward.to_json(), "backward": self.backward.to_json(),
            **({"optimizer": self.optimizer.to_json()} if self.optimizer is not None else {}),
            "step": {**self.step.to_json(rows=False), "step_at_mfu_s": self.step_at_mfu_s},
            "memory": self.memory.to_json(),
            "thresholds": [t.sentence for t in self.thresholds],
            "threshold_details": [t.to_json() for t in self.thresholds],
            "notes": list(self.notes),
            "offload": self.offload.to_json() if self.offload is not None else None,
        }
        if self.pipeline is not None:  # the memory above is a stage's with the whole batch; the stages' is what fits
            data["pipeline"] = self.pipeline.to_json()
            data["memory"] = {**self.memory.to_json(), "whole_batch_fits": self.memory.fits,
                              "fits": self.pipeline.fullest.fits}
        return data

    @cached_property
    def thresholds(self) -> tuple[Threshold, ...]:
        """Where each phase (and the step) turns compute-bound, solved from its formulas (:func:`derive`); found
        when first read, as the formulas are built: a layout search's rows read neither."""
        opt = (self.optimizer,) if self.optimizer is not None and self.optimizer.rows else ()
        axes, tokens = frozenset(self.plan.spec.mesh.names), token_dims(self.plan)
        return tuple(t for p in (self.forward, self.backward, *opt, self.step)
                     for t in derive(p.name, p.formula, self.hardware, axes, tokens, self.sizes))

    @property
    def step_at_mfu_s(self) -> float | None:
        """The step at ``--mfu``'s MFU: a pipeline's over the whole pipelined step's chips, else the tables'."""
        return self.pipeline.at_mfu_s if self.pipeline is not None else self.step.step_at_mfu_s

    def json_text(self) -> str:
        return json.dumps(self.to_json(), indent=2, allow_nan=False)  # strict JSON: a NaN is a bug

    def render(self) -> str:
        return render(self)

    def __str__(self) -> str:
        return self.render()


def _reduction_note(spec: Spec, accounting: str) -> tuple[str, ...]:
    """Where the gradients are reduced in a type of the framework's own: which, and who says so."""
    kind = reduction_dtype(spec, accounting)
    if kind is None or kind == spec.dtype.value and not spec.tensor_dtypes:
        return ()
    said = (f"`grad_reduce ... in {kind}` or --grad-reduce-dtype" if spec.grad_reduce_dtype is not None
            else f"optimizer {accounting}'s default")
    return (f"gradient reductions in {kind} ({said}): the params' gradients' AllReduces and ReduceScatters move "
            f"{kind} elements, not the params' {spec.dtype.value}",)


def _gather_note(plan: Plan, counts: Sequence[int]) -> tuple[str, ...]:
    """Where the params are gathered in a type of their own (``param_gather ... in T``): what moves, the
    scales' AllReduce, what the lowered program does instead."""
    kind = plan.spec.param_gather_dtype
    if kind is None:
        return ()
    gathers = sum(1 for s in plan.forward + plan.backward + plan.optimizer
                  if plan.moved_nbytes(s) != plan.nbytes(s.tensor))
    if not gathers:
        return (f"param_gather in {kind}: no all-gather of a param over the ZeRO axes moves fewer bytes here (no "
                f"`zero` line, no param gathered over its axes, or its own type is {kind})",)
    nbytes, axes = scale_reduction(plan, counts)
    scales = (f"; their scales' amaxes ({nbytes:g} bytes, a float32 a weight) all-reduced over {','.join(axes)} "
              "once a step after the update (torchao's precompute_float8_dynamic_scale_for_fsdp), in update_s"
              if axes else "")
    return (f"param_gather in {kind} (the line or --param-gather-dtype): {gathers} all-gathers of params move {kind} "
            "elements and the gathered weights are held in it, not the params' own type (torchao's float8 "
            f"all-gather under FSDP2 casts each shard before the gather){scales}; `shardc lower` still gathers them "
            "in the params' type",)


def _zero_json(plan: Plan) -> dict[str, object] | None:
    zero = plan.spec.zero
    return None if zero is None else {"stage": zero.stage, "axes": list(zero.axes)}


def hardware_json(hw: Hardware, names: HardwareSymbols) -> dict[str, object]:
    """The chip's figures in JSON, and the symbols the formulas write them with."""
    return {"name": hw.name, "C": hw.flops, "W_ici": hw.w_ici, "W_dcn": hw.w_dcn, "hbm_bytes": hw.hbm_bytes,
            "hop_latency": hw.hop_latency, "flops_f8": hw.flops_f8,
            "hbm_bandwidth": hw.hbm_bandwidth if math.isfinite(hw.hbm_bandwidth) else None,
            "model": "book" if hw.book else "chip", "bucket_bytes": hw.bucket_bytes,
            "fusion": "statement" if hw.fuses_statements else "xla" if hw.fuses else "none",
            "grad_reduce": hw.grad_reduce if hw.reduces_after_backward or hw.reduces_dcn_after_backward
            else "overlapped",
            "attention_kernel": hw.attention_kernel,
            "symbols": dict(zip(("C", "W_ici", "W_dcn"), names.names(), strict=True))}


def accounting_of(plan: Plan, optimizer: str | None) -> str:
    """The accounting ``optimizer`` names, else the spec's ``optimizer`` line's (:func:`shardc.accountings.chosen`);
    one under which the gradients are reduced in another type than the plan's is refused: the plan's reduction
    volumes were made with the spec's (:func:`reduction_dtype`)."""
    name = chosen(plan.spec.optimizer, optimizer)
    if name not in ACCOUNTINGS:
        raise ShardcError(f"unknown optimizer accounting {name!r}", fix="use " + ", ".join(ACCOUNTINGS))
    written = chosen(plan.spec.optimizer)
    if reduction_dtype(plan.spec, name) != reduction_dtype(plan.spec, written):
        raise ShardcError(f"optimizer {name} reduces the gradients in other bytes than the {written} the plan was "
                          "made under", fix=f"plan the spec with an `optimizer {name}` line (or `shardc cost "
                          f"--optimizer {name}`), which sizes its gradient reductions")
    return name


def reduction_dtype(spec: Spec, accounting: str | None) -> str | None:
    """The type the plan's gradient reductions move: the spec's ``grad_reduce ... in T``, else the accounting's
    (:func:`shardc.accountings.reduce_dtype`); None: each param's own (the spec's dtype but where a ``dtype``
    line gives another)."""
    written = spec.grad_reduce_dtype
    return reduce_dtype(None if written is None else written.value, accounting)


def cost(plan: Plan, hardware: str | Hardware | None = None, sizes: dict[str, int] | None = None,
         mfu: float | None = None, optimizer: str | None = None, hardware_file: str | None = None,
         spans: dict[str, int] | None = None, model: str | None = None, bucket_mb: float | None = None,
         offload: str = "none", offload_delayed: bool = False, **options: object) -> CostReport:
    """Cost ``plan`` on a chip (a preset name, a :class:`Hardware`; default the chip it was planned for).

    ``spans`` maps a mesh axis to the physical ICI axes it is laid over (the book's
    M_X; default 1): its collectives get that many times the bandwidth.  ``model``:
    ``"book"`` costs with the book's assumptions (matmuls at peak, memory-bound steps
    free, every collective overlapped), ``"chip"`` at the rates the chip reaches (None:
    the plan's chip's own); ``bucket_mb`` the gradient buckets' size (25 MiB); ``offload`` what the
    host's memory holds (:data:`~shardc.costmodel.offload.OFFLOADS`), ``offload_delayed`` whether the host's
    update of an offloaded optimizer runs a step late, beside the next step (ZeRO-Offload's delayed update).
    """
    if options:
        raise ShardcError(f"unknown cost option(s) {', '.join(sorted(options))}",
                          fix="use hardware=, sizes=, mfu=, optimizer=, hardware_file=, spans=, model=, bucket_mb=, "
                          "offload=, offload_delayed=")
    if mfu is not None and not 0 < mfu <= 1:
        raise ShardcError(f"--mfu must be in (0, 1], got {mfu}", fix="write e.g. --mfu 0.4")
    optimizer = accounting_of(plan, optimizer)
    if model is None and plan.chip.book:  # another chip given for a plan made under the book's model keeps it
        model = "book"
    hw = plan_chip(plan, hardware, hardware_file).configured(model, bucket_mb)
    check_spans(plan.spec.mesh, spans)
    offload = check_offload(offload, hw)
    values = resolve_sizes(plan, sizes)
    links, link_notes = plan_links(plan, hw, values, spans)
    layers, layer_symbol = resolve_layers(plan, values)
    mesh = plan.spec.mesh
    devices = math.prod(values[a] for a in mesh.names)
    all_devices = devices
    pipe = pipeline_cost(plan, hw, values, links, optimizer)
    if pipe is not None:  # the tables are one stage's: its layers and devices, the whole batch (M microbatches)
        devices //= pipe.pipeline.stages  # (resolve_layers gave the slowest stage's layers)
    count = layer_symbol if layer_symbol is not None else layers
    counts = block_counts(plan, values)
    more = counts[1:]  # the later blocks': their symbols in the formulas where a dim names them
    # the formulas' counts: a pipelined stage's are numbers (its layers of each block), else as written
    symbolic = counts if pipe is not None else (count, *plan.spec.layer_counts()[1:])
    names = symbols_of(plan)
    again = frozenset(range(1, len(plan.recomputed) + 1))
    dtype = plan.spec.mfu_dtype.value  # MFU's peak: the GEMMs' type (`gemm f8`), else the spec's dtype
    micro, repeats = microbatched(plan, values, hw.book)  # a pipelined stage's rows: a microbatch's, M times

    def phase(name: str, steps: tuple[Step, ...], under: PhaseCost | None = None) -> PhaseCost:
        times = repeats if name != "optimizer" else 1
        at = micro if times > 1 else values
        rows = with_thresholds(steps, phase_rows(plan, steps, at, hw, links,
                                                 again if name == "backward" else frozenset()), at)
        def formula() -> PhaseFormula:
            return phase_formula(steps, mesh, symbolic, links, names, values, plan.precision)

        left = len(plan.optimizer) - len(zero_reductions(plan))  # the optimizer's steps after the reductions
        reduced = len(steps) - left if under is not None and repeats > 1 else 0
        under_s = replace(under, repeats=1).step_s if under is not None and reduced else 0.0  # one microbatch's
        return PhaseCost(name, rows, layers, devices, hw, formula, mfu, dtype=dtype, repeats=times, more_layers=more,
                         ends_s=phase_ends(plan, hw, steps, rows), reduced=reduced, under_s=under_s)

    (_, forward), (_, backward), (_, after) = phase_steps(plan, repeats)
    fwd, bwd = phase("forward", forward), phase("backward", backward)
    opt = phase("optimizer", after, bwd)  # a pipeline's reductions once a step, under the last microbatch's backward
    if hw.gathers_under_forward:  # `param_gather overlapped`: under the next step's first forward, one microbatch's
        opt = replace(opt, gather_under_s=(fwd.compute_s + fwd.memory_s) / repeats)
    step = PhaseCost("step", fwd.rows + bwd.rows + opt.rows, layers, devices, hw,
                     lambda: fwd.formula + bwd.formula + opt.formula, mfu, (fwd, bwd, opt),
                     update_seconds(plan, values, hw, counts, optimizer, links), step_tokens(plan, values), dtype,
                     more_layers=more)
    # the tables are one stage's, but the parameter count is the whole model's
    whole = (pipe.pipeline.blocks or (pipe.pipeline.layers,)) if pipe is not None else None  # each block's, all stages
    mem = step_memory(plan, values, hw.hbm_bytes, optimizer, whole, hw.native_kernels)
    moved: Offload | None = None
    if pipe is None:
        moved, mem = offload_cost(offload, mem, fwd.step_s, bwd.step_s, hw, optimizer, offload_delayed)
        if moved is not None:  # where the optimizer is offloaded the host updates, not the device
            fwd, bwd, step = _host_bound(moved, fwd, bwd, step)
            step = replace(step, offload_s=moved.exposed_s,
                           update_s=0.0 if offload in ("optimizer", "both") else step.update_s)
    notes = _notes(plan, hw, values, links) + renamed_note(names) + link_notes + tuple(
        f"mesh axis {a} ({values[a]} chips) spans {len(k.rings)} physical ICI axes: {len(k.rings)}x the "
        f"bandwidth, the book's M_{a} (--spans {a}=1 to cost it as one)"
        for a, k in links.items() if hw.book and len(k.rings) > 1) + _reduction_note(plan.spec, optimizer) \
        + _gather_note(plan, counts)
    if pipe is not None and whole is not None:  # the whole model's FLOPs: each block's a layer times its layers, the
        counted = [(r, p.repeats) for p in step.parts for r in p.rows if not r.recomputed]  # ends once
        block = math.fsum(math.fsum(r.model_flops * n for r, n in counted if not r.once and r.block == b) * count
                          for b, count in enumerate(whole))
        pipe = replace(pipe, model_flops=block + math.fsum(r.model_flops * n for r, n in counted if r.once),
                       devices=all_devices, peak=hw.peak(dtype), peak_dtype=dtype,
                       update_s=step.update_s, mfu_assumed=mfu)
        pipe, moved = pipeline_offload(offload, pipe, hw, optimizer, offload_delayed)
        if moved is not None:  # the phases' verdicts: the slowest stage's copies
            fwd, bwd, step = _host_bound(moved, fwd, bwd, step)
    return CostReport(plan, hw, values, layers, fwd, bwd, step, mem, notes, pipe, opt, moved)


def _host_bound(moved: Offload, fwd: PhaseCost, bwd: PhaseCost,
                step: PhaseCost) -> tuple[PhaseCost, PhaseCost, PhaseCost]:
    """The forward, backward and step marked ``host`` where the host link (or the host's update) outlasts the
    compute beside it: the copies out past the forward, in past the backward, any exposed in the step."""
    fwd, bwd = replace(fwd, host=moved.forward_host), replace(bwd, host=moved.backward_host)
    parts = tuple(fwd if p.name == "forward" else bwd if p.name == "backward" else p for p in step.parts)
    return fwd, bwd, replace(step, parts=parts, host=moved.host_bound)


def latency_note(hw: Hardware, links: Layout) -> str:
    """How latency enters the times: a bound per hop on a torus, NCCL's base and steps on a GPU cluster."""
    if any(isinstance(k, AxisLinks) and k.nodes for k in links.values()):
        return ("formulas and thresholds use bandwidth terms; times add NCCL's latency to each collective "
                f"({NCCL_BASE_S * 1e6:g} us, and {NCCL_NVLINK_STEP_S * 1e6:g} us a ring step over NVLink, "
                f"{NCCL_NET_STEP_S * 1e6:g} us over InfiniBand)")
    return ("formulas and thresholds use bandwidth terms; times also bound each collective "
            f"below by latency ({hw.hop_latency:g} s a hop)")


def phase_steps(plan: Plan, repeats: int = 1) -> tuple[tuple[str, tuple[Step, ...]], ...]:
    """The phases as costed: forward; backward with the forward steps it recomputes first; optimizer, with,
    under a pipeline of ``repeats`` microbatches, the gradient reductions run once a step before it
    (:func:`shardc.stage_phases.stage_phases`)."""
    return tuple(zip(("forward", "backward", "optimizer"), stage_phases(plan, repeats), strict=True))


def step_tokens(plan: Plan, sizes: dict[str, int]) -> float:
    """Tokens a step processes: every dim of the token ids the model reads (``Tok[B, S]``: B x S, even where
    a param has S too, as a learned positional table ``W_pos[S, D]`` does); without token ids, the product of
    the model input's dims that no param has (the first input that has such dims is the model's input)."""
    ids = id_names(plan.spec)
    for info in plan.tensors:
        if info.role == "input" and info.name in ids:
            return float(math.prod(sizes[d.name] for d in info.ref.dims))
    model = plan.model_dims
    for info in plan.tensors:
        if info.role == "input":
            dims = [d.name for d in info.ref.dims if d.name not in model]
            if dims:
                return float(math.prod(sizes[d] for d in dims))
    return 0.0


def used_dims(plan: Plan) -> set[str]:
    """Every dim the plan's tensors and steps have."""
    used = {d.name for info in plan.tensors for d in info.ref.dims}
    for phase in (plan.forward, plan.backward):
        used.update(d.name for s in phase for ref in (s.dst, *s.operands) for d in ref.dims)
    return used


def used_names(plan: Plan) -> set[str]:
    """Every dim and mesh axis name the plan's formulas can contain."""
    return used_dims(plan) | set(plan.spec.mesh.names) | set(plan.spec.sizes)


def missing_sizes(plan: Plan, sizes: dict[str, int]) -> list[str]:
    """The dims (and a named layer count) that ``sizes`` lacks, sorted."""
    needed = used_dims(plan) | ({plan.spec.layers} if isinstance(plan.spec.layers, str) else set())
    return sorted(needed - set(sizes))


def symbols_of(plan: Plan) -> HardwareSymbols:
    """The hardware symbols of this plan's formulas, renamed where a dim or axis has the book's name."""
    return hardware_symbols(used_names(plan))


def renamed_note(names: HardwareSymbols) -> tuple[str, ...]:
    """Say which hardware symbols were renamed because the spec uses the book's names."""
    pairs = [f"{book} is written {ours}" for book, ours in zip(HardwareSymbols().names(), names.names(),
                                                               strict=True) if book != ours]
    if not pairs:
        return ()
    return (f"the spec names a dim or axis like a hardware symbol: in the formulas the chip's "
            f"{', '.join(pairs)}",)


def resolve_sizes(plan: Plan, sizes: dict[str, int] | None) -> dict[str, int]:
    """Dims and mesh sizes: the plan's, then the spec's, then ``sizes`` over them."""
    values = plan_sizes(plan)
    values.update(sizes or {})
    missing = [m for m in missing_sizes(plan, values) if m != plan.spec.layers]  # resolve_layers says it
    if missing:
        raise ShardcError("costs need the size of every dim; missing " + ", ".join(missing),
                          fix="add them to the `dims` line, or pass --set " +
                          " ".join(f"{m}=..." for m in missing) +
                          " (shardc.costmodel.symbolic.cost_formulas gives the formulas without them)")
    return values


def token_dims(plan: Plan) -> dict[str, tuple[str, ...]]:
    """Indices no param has (the batch/token dims, B), each with the axes sharding it where declared."""
    model = plan.model_dims
    out: dict[str, tuple[str, ...]] = {}
    for info in sorted(plan.tensors, key=lambda i: i.role != "input"):  # inputs first
        for dim in info.ref.dims:
            if dim.name not in model:
                out.setdefault(dim.name, dim.axes)
    return out


# what each way of sending that holds the stages says of them (`schedule 1f1b sends ...`)
_SENDS_NOTES = {
    "blocking": "sends blocking: each point-to-point transfer holds its sender and its receiver, no compute under it "
                "(DeepSpeed's pipeline engine's p2p.send/recv)",
    "paired": "sends paired: a steady step's send and receive with one neighbour go as one exchange that holds "
              "both stages, the warm-up's and the cool-down's transfers one at a time, no compute under them "
              "(Megatron-LM's p2p_communication._communicate: batch_isend_irecv, waited on)"}


def _notes(plan: Plan, hw: Hardware, sizes: dict[str, int], links: Layout) -> tuple[str, ...]:
    notes = [f"residual policy: save={plan.save!r} (the plan's; `shardc plan --save` changes it)",
             *plan.notes]
    if plan.strategy == "search" and plan.hardware != hw.name:
        notes.append(f"the plan was chosen for {plan.hardware}, costed here on {hw.name}: "
                     f"`shardc plan --hardware {hw.name}` may find a faster one")
    notes.append(latency_note(hw, links))
    if not hw.fuses and not hw.book:
        notes.append("fusion none: each memory-bound step is its own kernel, reading its operands from HBM and "
                     "writing its result (PyTorch eager)")
    if hw.fuses_statements and not hw.book:
        notes.append("fusion statement: each statement's memory-bound steps are one kernel (hand-fused, as "
                     "Megatron-LM's), which reads what the spec names from HBM and writes its result; no matmul "
                     "epilogue")
    if hw.attention_kernel is not None and not hw.book:
        fused = any(isinstance(s.fn, Attention) for s in plan.forward)
        notes.append(f"attention_kernel {hw.attention_kernel}: fused attention at the rates measured of it on "
                     f"{hw.chip or hw.name}" if fused else
                     f"attention_kernel {hw.attention_kernel}: changes nothing here, the spec has no fused "
                     "`attention(Q, K, V over T, causal)` call (its scores are written out, each step costed as such)")
    if hw.gathers_under_forward and plan.optimizer:
        notes.append("param_gather overlapped: the optimizer's all-gathers run under the next step's first forward "
                     "(Megatron-LM's --overlap-param-gather); the step counts what of them that forward does not hide")
    if hw.reduces_after_backward:
        notes.append("grad_reduce after-backward: the gradient reductions run once the backward is done, "
                     "exposed (no compute hides them)")
    sends = "async" if plan.spec.schedule is None else plan.spec.schedule.sends
    if sends != "async":
        notes.append(_SENDS_NOTES[sends])
    ici = [a.name for a in plan.spec.mesh.axes if a.network is not Network.DCN]
    if hw.reduces_dcn_after_backward:
        notes.append("grad_reduce after-backward over dcn: the gradient reductions' phase over the `over dcn` axes "
                     "(and the gathers over them of the same gradients) runs once the backward is done, exposed "
                     "(`critical ... of it ... after the backward`); their ICI phase overlaps the backward"
                     + ("" if len(ici) < len(plan.spec.mesh.axes) else
                        "; this mesh has no `over dcn` axis, so all of them overlap it"))
    group = math.prod(sizes[a] for a in ici)
    nodes = any(isinstance(k, AxisLinks) and k.nodes for k in links.values())
    if hw.ici_domain is not None and group > hw.ici_domain and not nodes:
        notes.append(f"{hw.name}: the ICI/NVLink axes {', '.join(ici)} span {group} chips but a node "
                     f"has {hw.ici_domain}; mark the axes that cross nodes `over dcn`")
    return tuple(notes)
