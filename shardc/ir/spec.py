"""The spec IR: small frozen dataclasses that print as spec text.

``str()`` of every node is valid spec syntax, and ``parse(str(spec)) == spec``.
Source spans are kept for error messages but never compared.

>>> d = Dim("B", ("X", "Y"))
>>> str(d)
'B_XY'
>>> str(TensorRef("W_in", (Dim("D", ("X",)), Dim("F")), unreduced=("Y",)))
'W_in[D_X, F]{U_Y}'
>>> TensorRef("T", (), unreduced=("Y", "X")) == TensorRef("T", (), unreduced=("X", "Y"))
True
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shardc.errors import Span
from shardc.ir.mesh import Mesh, MeshAxis, Network, format_axes, parse_topology

__all__ = ["DType", "Network", "MeshAxis", "Mesh", "Dim", "TensorRef", "Contract", "Add", "Call", "Expr", "Statement",
           "Spec", "format_axes", "SCHEDULES", "FUSIONS", "GRAD_REDUCES", "ATTENTION_KERNELS", "Schedule", "Zero",
           "parse_topology", "PARAM_GATHERS"]


class DType(enum.Enum):
    """Element types a spec can name, with their size in bytes."""

    BF16 = "bf16"
    F32 = "f32"
    F16 = "f16"
    F8 = "f8"

    @property
    def nbytes(self) -> int:
        return {"bf16": 2, "f32": 4, "f16": 2, "f8": 1}[self.value]

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Dim:
    """One dimension of a tensor reference: an index name and the mesh axes sharding it."""

    name: str
    axes: tuple[str, ...] = ()
    span: Span | None = field(default=None, compare=False, hash=False, repr=False)

    def __str__(self) -> str:
        if not self.axes:
            return self.name
        return f"{self.name}_{format_axes(self.axes)}"


@dataclass(frozen=True)
class TensorRef:
    """``Name[dim, ...]`` with an optional ``{U_axes}`` unreduced suffix.

    The unreduced axes are a set (a partial sum over X then Y is one over Y then X), kept
    sorted from construction on, so ``{U_YX}`` and ``{U_XY}`` are one value everywhere.
    A repeated axis is kept, for :func:`shardc.spec.validate.validate` to report.
    """

    name: str
    dims: tuple[Dim, ...]
    unreduced: tuple[str, ...] = ()
    span: Span | None = field(default=None, compare=False, hash=False, repr=False)
    unreduced_span: Span | None = field(default=None, compare=False, hash=False, repr=False)  # the {U_..}

    def __post_init__(self) -> None:
        normal = tuple(sorted(self.unreduced))
        if normal != self.unreduced:
            object.__setattr__(self, "unreduced", normal)

    def __hash__(self) -> int:
        # The planner keys dicts and sets by refs many thousand times a plan: hash the fields once.
        cached: int | None = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.name, self.dims, self.unreduced))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, object]:
        # The caches stay behind: a string's hash differs between processes.
        return {k: v for k, v in self.__dict__.items() if k not in ("_hash", "_layout", "_str")}

    @property
    def indices(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    @property
    def layout(self) -> tuple[tuple[str, ...], ...]:
        """The axes of each dim, in dim order."""
        cached: tuple[tuple[str, ...], ...] | None = self.__dict__.get("_layout")
        if cached is None:
            cached = tuple(d.axes for d in self.dims)
            object.__setattr__(self, "_layout", cached)
        return cached

    def sharding_text(self) -> str:
        """The bracketed part and suffix, without the name: ``[B_X, D]{U_Y}``."""
        text = "[" + ", ".join(str(d) for d in self.dims) + "]"
        if self.unreduced:
            text += "{U_" + format_axes(self.unreduced) + "}"
        return text

    def __str__(self) -> str:
        # The cost model and the planner's labels write refs many thousand times a search: write each once.
        cached: str | None = self.__dict__.get("_str")
        if cached is None:
            cached = self.name + self.sharding_text()
            object.__setattr__(self, "_str", cached)
        return cached


@dataclass(frozen=True)
class Contract:
    """Operands joined by a contraction operator (all of ``·`` ``@`` ``*`` ``×`` mean the same)."""

    operands: tuple[Expr, ...]
    op: str = field(default="·", compare=False, hash=False)
    span: Span | None = field(default=None, compare=False, hash=False, repr=False)

    def __str__(self) -> str:
        # A nested Contract or a sum is a parenthesised group: print the parentheses back.
        return f" {self.op} ".join(f"({o})" if isinstance(o, Contract | Add) else str(o) for o in self.operands)


@dataclass(frozen=True)
class Add:
    """Terms joined by ``+`` and ``-``: elementwise, a term may broadcast over a subset of indices.

    ``signs`` holds ``+1`` or ``-1`` per term (the first term's is ``+1``).

    >>> a, b = TensorRef("X", (Dim("B"), Dim("D"))), TensorRef("Bias", (Dim("D"),))
    >>> str(Add((a, b), (1, -1)))
    'X[B, D] - Bias[D]'
    """

    terms: tuple[Expr, ...]
    signs: tuple[int, ...]
    span: Span | None = field(default=None, compare=False, hash=False, repr=False)

    def __str__(self) -> str:
        parts = []
        for k, (term, sign) in enumerate(zip(self.terms, self.signs, strict=True)):
            text = f"({term})" if isinstance(term, Add) else str(term)  # a nested sum was a group
            parts.append(text if k == 0 else f"{'+' if sign > 0 else '-'} {text}")
        return " ".join(parts)


@dataclass(frozen=True)
class Call:
    """A function of an expression: ``gelu(X)``, ``softmax(Sc over T)``, ``causal(Sc, S, T)``,
    ``dropout(X, 0.1)``, ``embed(Tok, W_emb)``, ``cross_entropy(Logits, Tok)``.

    ``arg`` is the first tensor argument, ``more`` the further ones, ``names`` the index arguments, ``numbers``
    the numeric ones and ``over`` the index a reduction runs over (:mod:`shardc.spec.functions`: who takes what).

    >>> x = TensorRef("Sc", (Dim("S"), Dim("T")))
    >>> str(Call("softmax", x, over="T")), str(Call("causal", x, names=("S", "T")))
    ('softmax(Sc[S, T] over T)', 'causal(Sc[S, T], S, T)')
    >>> str(Call("dropout", x, numbers=(0.1,)))
    'dropout(Sc[S, T], 0.1)'
    """

    func: str
    arg: Expr
    span: Span | None = field(default=None, compare=False, hash=False, repr=False)
    more: tuple[Expr, ...] = ()
    names: tuple[str, ...] = ()
    numbers: tuple[float, ...] = ()
    over: str | None = None
    window: int | None = None  # a causal mask's sliding window, in keys: ``causal(Sc, S, T, window 4096)``

    @property
    def args(self) -> tuple[Expr, ...]:
        """Every tensor argument, in order."""
        return (self.arg, *self.more)

    def __str__(self) -> str:
        parts = [str(a) for a in self.args] + list(self.names) + [_number(n) for n in self.numbers]
        parts += [f"window {self.window}"] if self.window is not None else []
        over = f" over {self.over}" if self.over is not None else ""
        return f"{self.func}({', '.join(parts)}{over})"


def _number(value: float) -> str:
    """A numeric argument as written back: ``0.1``, ``2`` (a whole number prints without ``.0``)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


Expr = TensorRef | Contract | Call | Add

# Pipeline schedules, as the `schedule` line names them (the pipeline package simulates each).
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipe", "dualpipev")

# How the framework runs the program, as the `fusion` and `grad_reduce` lines name it (the first is the
# default).  `fusion xla`: elementwise chains and epilogues fused as XLA fuses them; `fusion none`: one
# kernel an op, each reading its operands from HBM and writing its result (PyTorch eager); `fusion
# statement`: one hand-fused kernel a statement, no epilogue (PyTorch eager with fused kernels, as
# Megatron-LM's; shardc/fusion.py says the rule).
# `grad_reduce overlapped`: gradient reductions issued under the backward as each bucket fills (PyTorch
# DDP, FSDP); `grad_reduce after-backward`: issued once the backward is done, exposed (`... over dcn`: their DCN phase).
FUSIONS = ("xla", "none", "statement")
GRAD_REDUCES = ("overlapped", "after-backward", "after-backward over dcn")
# The fused attention kernel the framework runs (`attention_kernel flash2`): FlashAttention-2, -3, -4, each
# at the rates its paper or benchmark measured on the chip (shardc/hardware.py); default: the chip's best.
ATTENTION_KERNELS = ("flash2", "flash3", "flash4")
# When the params ZeRO-1/2 updated as shards are gathered back (`param_gather overlapped`): after the step,
# exposed (the default: DeepSpeed's ZeRO-1/2 step, Megatron-LM's distributed optimizer by default), or under the
# next step's forward (Megatron-LM's --overlap-param-gather, `overlap_param_gather` of
# megatron/core/distributed/distributed_data_parallel_config.py, False by default).
PARAM_GATHERS = ("exposed", "overlapped")
# How a pipeline's point-to-point sends run (`schedule 1f1b sends paired`): each beside the compute, delaying only
# its reader (the default); blocking, one transfer at a time holding both its devices (DeepSpeed's pipeline engine:
# shardc.pipeline.blocking_sends); paired, a step's send and receive with one neighbour together, both devices
# waiting for the exchange (Megatron-LM's 1F1B: shardc.pipeline.paired_sends).
SENDS = ("async", "blocking", "paired")


@dataclass(frozen=True)
class Schedule:
    """``schedule NAME [V] [sends HOW]``: a pipeline schedule; only ``interleaved`` takes V, its virtual
    stages; ``sends`` one of ``SENDS`` (``blocking`` and ``paired`` under 1F1B only: DeepSpeed's pipeline engine,
    :mod:`shardc.pipeline.blocking_sends`; Megatron-LM's, :mod:`shardc.pipeline.paired_sends`)."""

    name: str = "1f1b"
    virtual: int = 1
    span: Span | None = field(default=None, compare=False, hash=False, repr=False)
    sends: str = "async"

    def __str__(self) -> str:
        name = f"{self.name} {self.virtual}" if self.name == "interleaved" else self.name
        return name if self.sends == "async" else f"{name} sends {self.sends}"


@dataclass(frozen=True)
class Zero:
    """``zero STAGE over AXES``: ZeRO (Rajbhandari et al. 2020) over mesh axes.

    Stage 1 shards the optimizer state over ``axes``, stage 2 the gradients too,
    stage 3 the params too (FSDP); axes in the order written, major to minor.
    """

    stage: int
    axes: tuple[str, ...]
    span: Span | None = field(default=None, compare=False, hash=False, repr=False)

    def __str__(self) -> str:
        return f"zero {self.stage} over {', '.join(self.axes)}"


@dataclass(frozen=True)
class Statement:
    """``result = expr`` (statement form) or ``expr -> result`` (chain form)."""

    result: TensorRef
    expr: Expr
    arrow: bool = False  # printed in chain form; the meaning is the same
    span: Span | None = field(default=None, compare=False, hash=False, repr=False)

    def __str__(self) -> str:
        if self.arrow:
            return f"{self.expr} -> {self.result}"
        return f"{self.result} = {self.expr}"


@dataclass(frozen=True)
class Spec:
    """A whole ``.shard`` file."""

    mesh: Mesh
    statements: tuple[Statement, ...]
    dims: tuple[tuple[str, int], ...] = ()
    dtype: DType = DType.BF16
    params: tuple[str, ...] | None = None  # None: names starting with W
    const: tuple[str, ...] = ()  # inputs without a gradient (token ids, masks)
    hardware: str | None = None
    topology: tuple[int, ...] | None = None  # `topology 4x4x4`: the slice (TPU) or NODESxGPUS (GPU)
    layers: int | str | None = None  # a count, or the name of a dim that holds it
    # `layers L { ... }`: the statements [first, end) repeat L times, the others run once;
    # None: with `layers`, the whole spec repeats
    block: tuple[int, int] | None = None
    # further `layers M { ... }` blocks after the first: (first, end, layers) each, in order; a pipeline
    # cuts only a spec with one
    more_blocks: tuple[tuple[int, int, int | str], ...] = ()
    # Pipeline parallelism (with a `pipeline` mesh axis): microbatches a step, and the schedule.
    microbatches: int | None = None
    stage_layers: tuple[int, ...] | None = None  # the layers each stage holds; None: the even split
    schedule: Schedule | None = None  # None: the default, 1f1b
    zero: Zero | None = None  # ZeRO stage and axes (`zero 1 over X`); None: the state is sharded as the params
    fusion: str | None = None  # `fusion none` (FUSIONS); None: the chip's, by default XLA's fusion
    grad_reduce: str | None = None  # `grad_reduce after-backward [over dcn]` (GRAD_REDUCES); None: overlapped
    # `grad_reduce ... in f32`: the type the params' gradients are reduced in; None: the `optimizer` accounting's
    # (shardc.accountings.reduce_dtype), else each param's own
    grad_reduce_dtype: DType | None = None
    attention_kernel: str | None = None  # `attention_kernel flash2` (ATTENTION_KERNELS); None: the chip's best
    param_gather: str | None = None  # `param_gather overlapped` (PARAM_GATHERS); None: exposed
    # `param_gather ... in f8`: the type the params' AllGathers over the zero axes move (torchao's float8 all-gather,
    # Megatron-LM's --fp8-param-gather); None: each param's own (shardc.planner.graph.Graph.gathered_bytes)
    param_gather_dtype: DType | None = None
    optimizer: str | None = None  # `optimizer bf16opt20` (shardc.accountings.ACCOUNTINGS); None: the cost's default
    # `recompute rmsnorm, W_uq, A`: what the backward makes again rather than keeps, beside the recompute
    # policy (shardc.planner.recompute.named_values): functions, params (their products) and tensors
    recompute: tuple[str, ...] = ()
    # `dtype bf16 Sc, Pr`: tensors whose elements are not of ``dtype`` (each once, kept sorted by name);
    # :meth:`dtype_of` reads them, and the planner gives a tensor's gradient and the intermediates of its
    # statement its type (shardc.planner.graph.Graph.dtypes)
    tensor_dtypes: tuple[tuple[str, DType], ...] = ()
    # `gemm f8`: the type every contraction's GEMMs (forward, and the backward's two) quantize their inputs
    # to, whatever the operands are stored in; None: an einsum runs in its operands' type
    # (shardc.ir.precision.matmul_dtype).  `gemm bf16 Lg, Gate`: the statements whose GEMMs run in another
    # (each once, kept sorted by name).  :meth:`gemm_of` reads both.
    gemm: DType | None = None
    gemm_tensors: tuple[tuple[str, DType], ...] = ()
    filename: str | None = field(default=None, compare=False, hash=False)
    # Where header items were written, for error messages: keys "mesh", "dims", "dtype",
    # "param", "const", "hardware", "layers", "zero" (the keyword), "dim:B", "param:W_in",
    # "const:Mask", "recompute:W_uq", "dtype:Sc" and "gemm:Lg" (one entry each).
    header_spans: tuple[tuple[str, Span], ...] = field(default=(), compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        normal = tuple(sorted(self.tensor_dtypes, key=lambda item: item[0]))
        if normal != self.tensor_dtypes:  # a set of declarations: the order written means nothing
            object.__setattr__(self, "tensor_dtypes", normal)
        gemms = tuple(sorted(self.gemm_tensors, key=lambda item: item[0]))
        if gemms != self.gemm_tensors:
            object.__setattr__(self, "gemm_tensors", gemms)

    def span_of(self, key: str) -> Span | None:
        """The span recorded for a header item (see ``header_spans``), if any."""
        for name, span in self.header_spans:
            if name == key:
                return span
        return None

    def repeats(self, k: int) -> bool:
        """Whether statement ``k`` runs once a layer (inside a block, or any with no block)."""
        return self.block_of(k) is not None

    def block_of(self, k: int) -> int | None:
        """The block statement ``k`` repeats in (0 the first, 1 the next, ...); None: it runs once.
        With ``layers`` and no block every statement is block 0's."""
        for i, (first, end, _) in enumerate(self.blocks()):
            if first <= k < end:
                return i
        return 0 if self.block is None else None

    def blocks(self) -> tuple[tuple[int, int, int | str], ...]:
        """Every ``layers N { ... }`` block as (first statement, end, layers), in order."""
        if self.block is None or self.layers is None:
            return ()
        return ((*self.block, self.layers), *self.more_blocks)

    def layer_counts(self) -> tuple[int | str, ...]:
        """Every block's layer count as written (a number or a dim), by :meth:`block_of`; without a block
        the whole spec's ``layers`` (1 without one)."""
        return tuple(layers for _, _, layers in self.blocks()) or (self.layers if self.layers is not None else 1,)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.dims)

    def dtype_of(self, tensor: str) -> DType:
        """The element type ``tensor`` is declared in: its ``dtype T tensor`` line's, else ``dtype``."""
        return dict(self.tensor_dtypes).get(tensor, self.dtype)

    def dtype_lines(self) -> list[str]:
        """``dtype T a, b`` for each type some tensor is declared in (the names in order, as kept)."""
        return _grouped("dtype", self.tensor_dtypes)

    def gemm_of(self, result: str) -> DType | None:
        """The type the GEMMs of the statement computing ``result`` quantize their inputs to: its ``gemm T
        result`` line's, else the spec's ``gemm T``; None: its operands' (no ``gemm`` line names it)."""
        return dict(self.gemm_tensors).get(result, self.gemm)

    @property
    def mfu_dtype(self) -> DType:
        """The type whose peak MFU is reported against: the ``gemm T`` line's (the type the GEMMs, nearly all
        of a step's FLOPs, run in) where one is given, else ``dtype``."""
        return self.dtype if self.gemm is None else self.gemm

    def gemm_lines(self) -> list[str]:
        """``gemm T`` and ``gemm T a, b`` as written (the names in order, as kept)."""
        return ([f"gemm {self.gemm}"] if self.gemm is not None else []) + _grouped("gemm", self.gemm_tensors)

    def __str__(self) -> str:
        lines = [str(self.mesh)]
        if self.dims:
            lines.append("dims " + ", ".join(f"{k}={v}" for k, v in self.dims))
        if self.dtype is not DType.BF16:
            lines.append(f"dtype {self.dtype}")
        lines += self.dtype_lines() + self.gemm_lines()
        if self.params is not None:
            lines.append("param " + ", ".join(self.params))
        if self.const:
            lines.append("const " + ", ".join(self.const))
        if self.hardware is not None:
            lines.append(f"hardware {self.hardware}")
        if self.topology is not None:
            lines.append("topology " + "x".join(map(str, self.topology)))
        if self.layers is not None and self.block is None:
            lines.append(f"layers {self.layers}")
        if self.microbatches is not None:
            lines.append(f"microbatches {self.microbatches}")
        if self.stage_layers is not None:
            lines.append("stage_layers " + ", ".join(map(str, self.stage_layers)))
        if self.schedule is not None:
            lines.append(f"schedule {self.schedule}")
        if self.zero is not None:
            lines.append(str(self.zero))
        if self.fusion is not None:
            lines.append(f"fusion {self.fusion}")
        if self.grad_reduce is not None or self.grad_reduce_dtype is not None:
            typed = () if self.grad_reduce_dtype is None else ("in", str(self.grad_reduce_dtype))
            lines.append(" ".join(("grad_reduce", *filter(None, (self.grad_reduce,)), *typed)))
        if self.attention_kernel is not None:
            lines.append(f"attention_kernel {self.attention_kernel}")
        if self.param_gather is not None or self.param_gather_dtype is not None:
            typed = () if self.param_gather_dtype is None else ("in", str(self.param_gather_dtype))
            lines.append(" ".join(("param_gather", *filter(None, (self.param_gather,)), *typed)))
        if self.optimizer is not None:
            lines.append(f"optimizer {self.optimizer}")
        if self.recompute:
            lines.append("recompute " + ", ".join(self.recompute))
        for k, statement in enumerate(self.statements):
            for first, _end, layers in self.blocks():
                if k == first:
                    lines.append(f"layers {layers} {{")
            inside = self.block is not None and self.block_of(k) is not None
            lines.append(("  " if inside else "") + str(statement))
            if any(k == end - 1 for _, end, _ in self.blocks()):
                lines.append("}")
        return "\n".join(lines) + "\n"


def _grouped(keyword: str, declared: tuple[tuple[str, DType], ...]) -> list[str]:
    """``keyword T a, b`` for each type the names are declared in, in the order kept."""
    grouped: dict[DType, list[str]] = {}
    for name, kind in declared:
        grouped.setdefault(kind, []).append(name)
    return [f"{keyword} {kind} " + ", ".join(names) for kind, names in grouped.items()]
