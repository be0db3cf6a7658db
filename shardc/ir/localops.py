"""The local operation of a plan step: what a device computes on its own blocks.

A step that is not a collective nor an einsum applies one of these to its local
operands (:attr:`shardc.ir.plan.Step.fn`); an AllReduce names its combiner with
:data:`Combine.MAX` (a sum names none).  Each is a small frozen value whose fields
are the operation's parameters, so the passes after planning (cost, lowering,
verification) read those fields and never parse text.  ``str`` renders the
operation as ``shardc plan`` lists it (``route(S,E,C,2)``, ``dropout_mask(0.1,7)``,
``add+-``): that text is for reading and nothing parses it back.

>>> str(Route("S", "E", "C", 2)), str(Add((1, -1))), str(DropoutMask(0.1, 7)), str(Row.SOFTMAX_APPLY)
('route(S,E,C,2)', 'add+-', 'dropout_mask(0.1,7)', 'softmax_apply')
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Map", "MapVjp", "Affine", "AffineVjp", "Add", "Neg", "Alias", "Update", "Causal", "CausalVjp", "Rotary",
           "Dropout", "DropoutMask", "DropoutVjp", "Route", "Attention", "ATTENTION_PARTS", "key_block", "Dispatch",
           "Row", "Vocab", "Combine", "LocalOp", "NEG", "ALIAS", "UPDATE", "MASK_OPS", "add_op"]


@dataclass(frozen=True)
class Map:
    """An elementwise function of the spec (``gelu``, ``identity``), applied to each element."""

    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class MapVjp:
    """The gradient of :class:`Map` ``name``: operands (its input, the cotangent)."""

    name: str

    def __str__(self) -> str:
        return f"{self.name}_vjp"


@dataclass(frozen=True)
class Affine:
    """A constant scale or shift of the spec (``scale(X, a)``, ``shift(X, b)``): x * scale + shift."""

    scale: float = 1.0
    shift: float = 0.0

    def __str__(self) -> str:
        return f"shift({self.shift!r})" if self.scale == 1.0 else f"scale({self.scale!r})"


@dataclass(frozen=True)
class AffineVjp:
    """The gradient of :class:`Affine`: the cotangent times its scale (its argument is not read)."""

    scale: float = 1.0

    def __str__(self) -> str:
        return f"scale_vjp({self.scale!r})"


@dataclass(frozen=True)
class Add:
    """A sum of the operands, each with its sign (+1 or -1), broadcast to the result's indices."""

    signs: tuple[int, ...]

    def __str__(self) -> str:
        if all(s > 0 for s in self.signs):
            return "add"
        return "add" + "".join("+" if s > 0 else "-" for s in self.signs)


def add_op(count: int) -> Add:
    """The sum of ``count`` operands, every one added."""
    return Add((1,) * count)


@dataclass(frozen=True)
class Neg:
    """The operand negated (a ``-`` term's gradient)."""

    def __str__(self) -> str:
        return "neg"


@dataclass(frozen=True)
class Alias:
    """A new name for the same local array (a rename, a sum's cotangent): no computation."""

    def __str__(self) -> str:
        return "alias"


@dataclass(frozen=True)
class Update:
    """The optimizer's step on a param's shard: operands (the param, its gradient)."""

    def __str__(self) -> str:
        return "update"


NEG = Neg()
ALIAS = Alias()
UPDATE = Update()


@dataclass(frozen=True)
class Causal:
    """-inf where the key position (index ``key``) is after the query position (``query``), by global
    position, or ``window`` or more before it (a sliding window: query s sees keys s - window < t <= s)."""

    query: str
    key: str
    window: int | None = None

    def __str__(self) -> str:
        return f"causal({self.query},{self.key}{_window(self.window)})"


@dataclass(frozen=True)
class CausalVjp:
    """The gradient of :class:`Causal`: the cotangent where not masked, 0 where masked."""

    query: str
    key: str
    window: int | None = None

    def __str__(self) -> str:
        return f"causal_vjp({self.query},{self.key}{_window(self.window)})"


@dataclass(frozen=True)
class Rotary:
    """A rotary position embedding of the head dim ``head`` by the global position along ``position`` at the
    frequency base ``theta`` (:mod:`shardc.ops.rotary`); ``inverse``: the rotation back, its gradient."""

    position: str
    head: str
    theta: float = 10000.0
    inverse: bool = False

    def __str__(self) -> str:
        return f"rotary{'_vjp' * self.inverse}({self.position},{self.head},{self.theta:g})"


def _window(window: int | None) -> str:
    """A causal mask's sliding window as its text shows it (none: "")."""
    return "" if window is None else f",window {window}"


@dataclass(frozen=True)
class DropoutMask:
    """The keep-mask of a dropout of rate ``rate``: 1 with probability 1 - rate, drawn by a
    counter-based hash of each element's global position and ``salt``."""

    rate: float
    salt: int

    def __str__(self) -> str:
        return f"dropout_mask({self.rate!r},{self.salt})"


@dataclass(frozen=True)
class Dropout:
    """A dropout applied: operands (the keep-mask, x); x / (1 - rate) where kept, else 0."""

    rate: float

    def __str__(self) -> str:
        return f"dropout({self.rate!r})"


@dataclass(frozen=True)
class DropoutVjp:
    """A dropout's gradient: operands (the keep-mask, the cotangent), the same map as :class:`Dropout`."""

    rate: float

    def __str__(self) -> str:
        return f"dropout_vjp({self.rate!r})"


MASK_OPS = (Causal, CausalVjp, DropoutMask, Dropout, DropoutVjp)


@dataclass(frozen=True)
class Route:
    """Top-k routing with capacity: tokens in order of index ``order`` to ``k`` of the experts along
    ``experts``, a slot each along the new capacity index ``slots`` (``by_choice``: all tokens' first
    choices take their slots before any second choice, ``route_by_choice``)."""

    order: str
    experts: str
    slots: str
    k: int
    by_choice: bool = False

    def __str__(self) -> str:
        name = "route_by_choice" if self.by_choice else "route"
        return f"{name}({self.order},{self.experts},{self.slots},{self.k})"


ATTENTION_PARTS = ("out", "lse", "dq", "dk", "dv", "dqr", "dkr")


def key_block(n: int) -> int:
    """The keys a step of an attention kernel's loop takes: the largest divisor of ``n`` up to min(512, n / 2)
    (two blocks or more where ``n`` allows, so the online softmax combines blocks)."""
    return next(b for b in range(max(min(512, n // 2), 1), 0, -1) if n % b == 0)


@dataclass(frozen=True)
class Attention:
    """Blockwise attention on local blocks (operands Q, K, V, and with ``rope`` a second (query, key) pair Qr, Kr
    whose scores add to Q·K; a gradient's also O, the row logsumexp and dO): ``part`` is what the step makes, the
    output, the row logsumexp or one of dQ, dK, dV, dQr, dKr (one of :data:`ATTENTION_PARTS`); ``key`` is the key
    index T; ``query`` the query position a causal mask compares it with (None: not causal), ``window`` its sliding
    window (None: none); ``kernel``: the step that runs the kernel (its FLOPs, its reads), the others being its
    further results; ``ring``: the mesh axes K and V travel around, a block a step, while each device keeps its
    queries (ring attention; empty: K and V whole on the device); ``zigzag``: the ring's sequence cut into 2n
    chunks, device i computing chunks i and 2n - 1 - i (causal load balancing; without a ring, the all-gather
    form's queries in those chunks over S's axes, K and V gathered in that order,
    :mod:`shardc.ops.balanced_gather`); ``held``: the plan holds the sequence in that order throughout
    (:mod:`shardc.planner.zigzag_order`), so the kernel does not reorder its blocks; ``order``: the mesh axes of
    that order's chunks where the kernel's queries are whole (Ulysses moved S's axes onto the heads: its causal
    mask compares the true positions of the sequence as held)."""

    part: str
    key: str
    query: str | None = None
    kernel: bool = True
    ring: tuple[str, ...] = ()
    zigzag: bool = False
    held: bool = False
    rope: bool = False
    order: tuple[str, ...] = ()
    window: int | None = None

    @property
    def inputs(self) -> int:
        """How many of a step's operands are the call's tensors (Q, K, V, and Qr, Kr with ``rope``)."""
        return 5 if self.rope else 3

    def __str__(self) -> str:
        causal = f",causal({self.query},{self.key}{_window(self.window)})" if self.query is not None else ""
        causal += ",rope" if self.rope else ""
        order = (f",zigzag({''.join(self.order)})" if self.order else ",zigzag" if self.zigzag else "")
        order += ",held" if self.held else ""
        ring = f",ring({''.join(self.ring)}{order})" if self.ring else order
        return f"attention_{self.part}(over {self.key}{causal}{ring})"
@dataclass(frozen=True)
class Dispatch:
    """Index-based expert dispatch (:mod:`shardc.ops.dispatch`): the routing of ``route`` (tokens in
    order of ``order`` to ``k`` of the experts along ``experts``, a slot each along ``slots``) held as
    indices, and one of its data movements, ``part``: ``dispatch`` (tokens gathered into their experts'
    slots), ``combine`` (each token's k expert outputs, gate-weighted, summed), or a gradient of one
    (``dispatch_vjp``: of the tokens; ``combine_vjp``: of the expert outputs; ``combine_gate_vjp``: of
    the gates), or ``collect`` (each token's k expert outputs summed, unweighted) and its gradient
    ``collect_vjp`` (``dY``'s rows into the slots).  ``each``: the dispatched tensor carries the expert
    index too, a value per token and expert (the gates themselves), and each slot gets its own expert's.
    ``limit`` of ``groups`` (0: unlimited): node-limited routing (DeepSeek-V3's), the experts
    in ``groups`` contiguous groups (a node's each) and each token's k taken from the ``limit`` groups of
    highest score (:func:`shardc.ops.route_code.node_limited`)."""

    part: str
    order: str
    experts: str
    slots: str
    k: int
    limit: int = 0
    groups: int = 0
    each: bool = False

    def __str__(self) -> str:
        nodes = f",{self.limit}of{self.groups}" if self.limit else ""
        each = ",each" if self.each else ""
        return f"{self.part}({self.order},{self.experts},{self.slots},{self.k}{nodes}{each})"


class _Named(Enum):
    """A local map named by its value, as a plan's listing and the generated code write it (``softmax``),
    in ``str()`` and in an f-string alike."""

    def __str__(self) -> str:
        return str(self.value)


class Row(_Named):
    """The local maps of a reduction over an index: forward, finishing maps and gradients.

    Each computes in its step's frame with the reduced index at ``Step.dim``
    (:func:`shardc.sharding.rowwise.frame_of`).
    """

    SOFTMAX = "softmax"
    LOGSUMEXP = "logsumexp"
    ROW_MAX = "row_max"
    ROW_DOT = "row_dot"
    ROW_SUMEXP = "row_sumexp"
    ROW_SUM = "row_sum"
    ROW_MEAN = "row_mean"
    ROW_MEANSQ = "row_meansq"
    ROW_MEANDEV = "row_meandev"
    ROW_MEANDOT = "row_meandot"
    SOFTMAX_APPLY = "softmax_apply"
    LSE_APPLY = "lse_apply"
    RMSNORM_APPLY = "rmsnorm_apply"
    LAYERNORM_APPLY = "layernorm_apply"
    SOFTMAX_VJP = "softmax_vjp"
    SOFTMAX_VJP_APPLY = "softmax_vjp_apply"
    LOGSUMEXP_VJP = "logsumexp_vjp"
    MAX_VJP = "max_vjp"
    SUM_VJP = "sum_vjp"
    MEAN_VJP = "mean_vjp"
    RMSNORM_VJP = "rmsnorm_vjp"
    LAYERNORM_VJP = "layernorm_vjp"
    SORT = "sort"
    SORT_VJP = "sort_vjp"


class Vocab(_Named):
    """The local maps of the vocabulary ops (:mod:`shardc.ops.vocab_plans`)."""

    EMBED = "embed"
    EMBED_VJP = "embed_vjp"
    VOCAB_PICK = "vocab_pick"
    CE_APPLY = "ce_apply"
    CE_VJP = "ce_vjp"


class Combine(_Named):
    """An AllReduce's combiner where it is not a sum (a sum's step names none)."""

    MAX = "max"


LocalOp = (Map | MapVjp | Affine | AffineVjp | Add | Neg | Alias | Update | Causal | CausalVjp | Rotary | DropoutMask
           | Dropout | DropoutVjp | Route | Attention | Dispatch | Row | Vocab | Combine)
