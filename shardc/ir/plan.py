"""The plan IR: the steps of each phase, and the volumes they move.

A plan is data: a tuple of :class:`Step` per phase.  Each step turns sharded
values (``TensorRef`` with a layout and unreduced axes) into other sharded
values, so every pass after planning (cost, lowering, verification) reads the
same steps.  Volumes are :class:`Monomial` formulas in the dims and the mesh
sizes; they evaluate to bytes once sizes are known.  (A monomial is all a
single collective's volume ever is; sums and thresholds are the cost pass's job,
in :mod:`shardc.costmodel.formulas` and :mod:`shardc.costmodel.thresholds`.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TypeVar

from shardc.collectives import COLLECTIVES, FACTOR, Op
from shardc.errors import InternalError
from shardc.hardware import DEFAULT, PRESETS, Hardware
from shardc.ir.localops import DropoutMask, LocalOp
from shardc.ir.precision import Precision
from shardc.ir.spec import DType, Spec, TensorRef
from shardc.spec.walk import gather_nbytes_of, nbytes_of

__all__ = [
    "Op", "Monomial", "sum_formula", "Step", "Alternative", "Choice", "MemoryChoice", "TensorInfo", "Plan",
    "model_dims", "COLLECTIVES", "uses_dropout", "Sections", "Section", "SECTIONS", "unfused", "backward_program",
]


@dataclass(frozen=True, order=True)
class Monomial:
    """``coeff * prod(symbol ** power)``, e.g. ``2*D*F/Y``.

    >>> m = Monomial.of(2, num=("D", "F"), den=("Y",))
    >>> str(m), m.evaluate({"D": 8, "F": 4, "Y": 2})
    ('2*D*F/Y', Fraction(32, 1))
    """

    coeff: Fraction
    powers: tuple[tuple[str, int], ...] = ()

    @staticmethod
    def of(coeff: int | Fraction, num: tuple[str, ...] = (), den: tuple[str, ...] = ()) -> Monomial:
        powers: dict[str, int] = {}
        for s in num:
            powers[s] = powers.get(s, 0) + 1
        for s in den:
            powers[s] = powers.get(s, 0) - 1
        return Monomial(Fraction(coeff), tuple(sorted((k, v) for k, v in powers.items() if v)))

    def __mul__(self, other: Monomial) -> Monomial:
        powers = dict(self.powers)
        for k, v in other.powers:
            powers[k] = powers.get(k, 0) + v
        items = tuple(sorted((k, v) for k, v in powers.items() if v))
        return Monomial(self.coeff * other.coeff, items)

    def scale(self, factor: int | Fraction) -> Monomial:
        return Monomial(self.coeff * Fraction(factor), self.powers)

    def evaluate(self, sizes: dict[str, int]) -> Fraction:
        value = Fraction(self.coeff)
        for name, power in self.powers:
            value *= Fraction(sizes[name]) ** power
        return value

    def value(self, sizes: dict[str, float]) -> float:
        """``evaluate`` in floating point: the planner's hot path."""
        result = self.coeff.numerator / self.coeff.denominator
        for name, power in self.powers:
            result *= sizes[name] ** power
        return result

    def symbols(self) -> frozenset[str]:
        return frozenset(k for k, _ in self.powers)

    def __str__(self) -> str:
        num = [_power(k, v) for k, v in self.powers if v > 0]
        den = [_power(k, -v) for k, v in self.powers if v < 0]
        coeff_num, coeff_den = self.coeff.numerator, self.coeff.denominator
        if coeff_num != 1 or not num:
            num.insert(0, str(coeff_num))
        if coeff_den != 1:
            den.insert(0, str(coeff_den))
        text = "*".join(num)
        if len(den) == 1:
            text += "/" + den[0]
        elif den:
            text += "/(" + "*".join(den) + ")"
        return text


def _power(name: str, power: int) -> str:
    return name if power == 1 else f"{name}**{power}"


def sum_formula(terms: Iterable[Monomial]) -> str:
    """Like terms combined: ``2*D*F + 2*D*F`` -> ``4*D*F``; ``0`` for no terms."""
    combined: dict[tuple[tuple[str, int], ...], Fraction] = {}
    for term in terms:
        combined[term.powers] = combined.get(term.powers, Fraction(0)) + term.coeff
    parts = [str(Monomial(c, p)) for p, c in sorted(combined.items()) if c]
    return " + ".join(parts) if parts else "0"


@dataclass(frozen=True)
class Step:
    """One step of a phase.

    For a collective: ``src`` is the value before, ``dst`` after, ``axes`` the
    mesh axes it runs over and ``dim`` the tensor dim it gathers from (AllGather),
    scatters onto (ReduceScatter), or splits (AllToAll, whose concatenated dim is
    ``dim2``).  For an einsum: ``operands`` are the local operand values and
    ``dst`` the local result (unreduced over the sharded contracted axes).  For an
    elementwise step: ``fn`` (:mod:`shardc.ir.localops`) is applied to the operands.

    ``operands`` are read for their data; ``shapes`` only for their shape (a sum's gradient
    spreads dS along I, whose length it takes from the input; the embedding's gradient is
    the table's shape).  XLA keeps no data for a shape, so a value read only so is no
    residual, is never recomputed and is not counted in memory.
    """

    op: Op
    tensor: str
    dst: TensorRef
    src: TensorRef | None = None
    axes: tuple[str, ...] = ()
    operands: tuple[TensorRef, ...] = ()
    dim: int | None = None
    dim2: int | None = None
    fn: LocalOp | None = None  # the local operation (shardc.ir.localops); an AllReduce's combiner
    volume: Monomial | None = None  # V: bytes a device would hold unsharded over the axes; None for local steps
    ahead: bool = False  # can be issued ahead of / off the critical path
    note: str = ""
    once: bool = False  # outside a `layers L { ... }` block: runs once a step, not once a layer
    block: int = 0  # not once: the `layers` block it repeats in (0 the first, 1 the next: Spec.block_of)
    shapes: tuple[TensorRef, ...] = ()  # values read for their shape only (see above)
    # an einsum run as a collective matmul (shardc.planner.collective_matmul): the AllGather of one of its
    # operands, or the ReduceScatter of its result, over one axis, that it runs as a ring of permutes
    # interleaved with its block matmuls; its operands are then the gather's source, or its result the
    # scatter's destination
    collective: Step | None = None
    # an AllToAll moving the slots of a node-limited routing: its (k, limit, groups), which bound the
    # copies of a token that cross nodes (shardc.collectives._routed_terms)
    routed: tuple[int, int, int] | None = None

    @property
    def region(self) -> int | None:
        """The ``layers`` block the step repeats in (:attr:`block`); None where it runs once."""
        return None if self.once else self.block

    @property
    def is_collective(self) -> bool:
        return self.op in COLLECTIVES

    @property
    def reads(self) -> tuple[TensorRef, ...]:
        """The values the step reads the data of: its operands, and a collective's source."""
        return (*self.operands, *((self.src,) if self.src is not None else ()))

    @property
    def reads_with_shapes(self) -> tuple[TensorRef, ...]:
        """:attr:`reads` and the values it reads only the shape of (``shapes``), in the order operands,
        shapes, source."""
        return (*self.operands, *self.shapes, *((self.src,) if self.src is not None else ()))

    def weighted_volume(self) -> Monomial | None:
        """V with AllReduce counted twice and AllToAll a quarter (the book's "bytes")."""
        if self.volume is None:
            return None
        return self.volume.scale(FACTOR.get(self.op, Fraction(1)))


@dataclass(frozen=True)
class Alternative:
    """One way an einsum could have been done, as ``--explain`` lists it."""

    description: str
    time: float | None  # seconds (the search's objective on the plan's hardware), None without sizes
    volume: str  # weighted volume formula
    collectives: int
    chosen: bool


@dataclass(frozen=True)
class Choice:
    phase: str
    statement: str
    alternatives: tuple[Alternative, ...]
    reason: str
    # the choice as its alternatives are priced where the plan holds the sequence in zig-zag order (a zig-zag
    # ring attention form then does not reorder its blocks: shardc.planner.zigzag_order), None where no
    # alternative's price depends on it
    held: Choice | None = None


@dataclass(frozen=True)
class MemoryChoice:
    """A plan the planner weighed by its memory (:mod:`shardc.planner.memory_fit`): what it is, its
    step time as the planner times it, its bytes a device as ``shardc cost`` counts them."""

    label: str
    step_s: float
    memory_bytes: float
    chosen: bool


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of the spec: its declared (or chosen) sharding and its role."""

    name: str
    ref: TensorRef
    role: str  # "param", "input", "activation"
    is_output: bool = False


def model_dims(tensors: tuple[TensorInfo, ...]) -> frozenset[str]:
    """:attr:`Plan.model_dims` of these tensors (a spec's, before it is planned)."""
    return frozenset(d.name for info in tensors if info.role == "param" for d in info.ref.dims)


T = TypeVar("T")

# A `layers L { ... }` block's plan in three: the statements before the block, the block (one layer,
# run L times), the statements after it.
SECTIONS = ("before", "block", "after")


@dataclass(frozen=True)
class Section:
    """One section's steps, each phase's in its order."""

    forward: tuple[Step, ...]
    backward: tuple[Step, ...]
    recomputed: tuple[Step, ...]


@dataclass(frozen=True)
class Sections:
    """Where a plan's sections lie in each phase: two cut points a phase, ``(i, j)``.

    The forward (and what the backward recomputes, a forward run again) runs the statements
    before the block, the block, those after it: ``steps[:i]``, ``steps[i:j]``, ``steps[j:]``.
    The backward runs them in reverse: ``steps[:i]`` is after the block's backward, ``steps[i:j]``
    the block's, ``steps[j:]`` before it.  Without a block every step is the block's.
    """

    forward: tuple[int, int]
    backward: tuple[int, int]
    recomputed: tuple[int, int]

    @staticmethod
    def of(forward: tuple[Step, ...], backward: tuple[Step, ...], recomputed: tuple[Step, ...]) -> Sections | None:
        """The cut of phases whose steps outside the block are marked ``once``; None where a phase's
        ``once`` steps sit among the block's, so that it does not cut (an input read both before the block
        and in it: its gradient's parts are summed among the block's steps)."""
        cuts = (_cut(forward), _cut(backward), _cut(recomputed))
        if cuts[0] is None or cuts[1] is None or cuts[2] is None:
            return None
        return Sections(cuts[0], cuts[1], cuts[2])

    def runs(self, phase: str, items: Sequence[T]) -> tuple[Sequence[T], Sequence[T], Sequence[T]]:
        """``items`` (one a step of ``phase``: the steps, or their costs) in the phase's three runs, in
        the order it runs them: before, block, after; for the backward after, block, before."""
        i, j = getattr(self, phase)
        return items[:i], items[i:j], items[j:]

    def steps(self, phase: str, steps: tuple[Step, ...], section: str) -> tuple[Step, ...]:
        """The steps of ``section`` (one of :data:`SECTIONS`) among ``phase``'s ``steps``."""
        order = SECTIONS[::-1] if phase == "backward" else SECTIONS
        return tuple(self.runs(phase, steps)[order.index(section)])


def _cut(steps: tuple[Step, ...]) -> tuple[int, int] | None:
    """The two cut points of a phase: its block's steps are the run of those not marked ``once`` (None
    when a ``once`` step sits among them).

    A phase with no step of the block (no gradient crosses it) runs its ``once`` steps on the side
    nearest its start: a forward's before the block, a backward's after it (the head's, run first).
    """
    inside = [k for k, s in enumerate(steps) if not s.once]
    if not inside:
        return (len(steps), len(steps))
    lo, hi = inside[0], inside[-1] + 1
    if any(s.once for s in steps[lo:hi]):
        return None
    return (lo, hi)


@dataclass(frozen=True)
class Plan:
    spec: Spec
    forward: tuple[Step, ...]
    backward: tuple[Step, ...]
    save: str = "default"
    sizes: tuple[tuple[str, int], ...] | None = None  # dims and mesh sizes; None without dims
    tensors: tuple[TensorInfo, ...] = ()
    residuals: tuple[TensorRef, ...] = ()  # forward values the backward reads
    cotangents: tuple[TensorRef, ...] = ()  # the gradient of each output, sharded like it
    grads: tuple[TensorRef, ...] = ()  # the gradient of each input not declared `const`
    strategy: str = "rules"  # "search" (least step time) or "rules" (the book's)
    choices: tuple[Choice, ...] = field(default=(), compare=False)
    # tensor -> its gradient's name (shardc.names.gradient_names): never a name of the spec
    gradient_names: tuple[tuple[str, str], ...] = ()
    hardware: str = "tpu-v5p"  # the name of the chip the plan was chosen for
    # that chip, resolved once by the planner; every later pass costs on it (:func:`shardc.timing.plan_chip`)
    chip: Hardware = field(default=PRESETS[DEFAULT], compare=False)
    spans: tuple[tuple[str, int], ...] = ()  # spans given to the planner over the chip's defaults
    topology: tuple[int, ...] | None = None  # the slice or cluster given (spec line or flag); None: the usual one
    notes: tuple[str, ...] = ()  # facts the listing states (e.g. padded uneven dims)
    # where memory changed the planner's choice (or nothing fits): the fastest plan and the one chosen
    # (or the least memory), for `shardc plan --explain` (shardc.planner.memory_fit)
    memory_choices: tuple[MemoryChoice, ...] = field(default=(), compare=False)
    # ZeRO-1/2 (`zero 1 over X`): the third phase, after the backward: gradients reduce-scattered onto
    # the optimizer state's shard, the update, the updated params all-gathered (shardc.planner.zero)
    optimizer: tuple[Step, ...] = ()
    # `--recompute none|selective|full` (shardc.planner.recompute): the forward steps the backward runs again
    recompute: str = "none"
    recomputed: tuple[Step, ...] = ()
    # tensor -> bytes an element, where not the spec's dtype: token ids 4 (int32), a dropout's
    # keep-mask 1 (shardc.planner.graph.Graph.element_bytes decides); read through :meth:`nbytes`
    # wherever bytes are counted
    element_bytes: tuple[tuple[str, int], ...] = ()
    # param -> bytes an element its AllGathers move, where a `param_gather ... in T` line casts it before
    # gathering (shardc.planner.graph.Graph.gathered_bytes); read through :meth:`moved_nbytes`
    gathered_bytes: tuple[tuple[str, int], ...] = ()
    # tensor -> its element type, where a `dtype T` line makes it other than the spec's
    # (shardc.planner.graph.Graph.dtypes); an einsum's rate is its operands' (:attr:`precision`)
    dtypes: tuple[tuple[str, DType], ...] = ()
    # a contraction's result -> the type its GEMMs (forward and backward) quantize their inputs to, where a
    # `gemm T` line says (shardc.planner.graph.Graph.gemms; :meth:`shardc.ir.precision.Precision.step`)
    gemms: tuple[tuple[str, DType], ...] = ()
    # a `layers L { ... }` block's sections (:class:`Sections`), cut once by the planner; None: every
    # step is the block's (a spec without a block, or a Plan built by hand), or a block that does not cut
    sections: Sections | None = None

    @property
    def cut(self) -> Sections:
        """:attr:`sections`, or without a block every step the block's."""
        if self.sections is not None:
            return self.sections
        phases = (self.forward, self.backward, self.recomputed)
        if any(s.once for p in phases for s in p):  # a block whose phases do not cut (Sections.of)
            raise InternalError("a step outside the `layers` block sits among the block's steps",
                                fix="this is a planner bug: report the spec")
        return Sections(*((0, len(p)) for p in phases))

    def section(self, name: str) -> Section:
        """The steps of section ``name`` (:data:`SECTIONS`): the same steps as the phases', cut."""
        if name not in SECTIONS:
            raise KeyError(name)
        cut = self.cut
        return Section(cut.steps("forward", self.forward, name), cut.steps("backward", self.backward, name),
                       cut.steps("recomputed", self.recomputed, name))

    def nbytes(self, tensor: str) -> int:
        """Bytes an element of ``tensor`` (:func:`shardc.spec.walk.nbytes_of`)."""
        return nbytes_of(tensor, dict(self.element_bytes), self.spec.dtype)

    def moved_nbytes(self, step: Step) -> int:
        """Bytes an element of what ``step`` moves, and of the value it makes: a param's gather type for its
        AllGather over the ZeRO axes (:func:`shardc.spec.walk.gather_nbytes_of`), else :meth:`nbytes`."""
        own = self.nbytes(step.tensor)
        if step.op is not Op.ALL_GATHER or not self.gathered_bytes:
            return own
        over = self.spec.zero.axes if self.spec.zero is not None else ()
        return gather_nbytes_of(step.axes, dict(self.gathered_bytes).get(step.tensor), over, own) or own

    def fixed_bytes(self) -> dict[str, int]:
        """:attr:`element_bytes` of the tensors whose elements are not floating-point (token ids, keep-masks):
        the sizes that stay where every float is counted at one width (the memory check's float32), as a
        tensor a ``dtype`` line names (:attr:`dtypes`, every one a float type) does not."""
        floats = dict(self.dtypes)
        return {t: n for t, n in self.element_bytes if t not in floats}

    @property
    def precision(self) -> Precision:
        """Every tensor's element type: the spec's dtype but where :attr:`dtypes` says."""
        return Precision(self.spec.dtype, dict(self.dtypes), dict(self.gemms),
                         {grad: primal for primal, grad in self.gradient_names} if self.gemms else {})

    @property
    def model_dims(self) -> frozenset[str]:
        """The dims some param has (the model's: D, F, V); a dim no param has is a batch or token dim (the one
        microbatches cut, the step's tokens)."""
        return model_dims(self.tensors)

    def tensor(self, name: str) -> TensorInfo:
        for info in self.tensors:
            if info.name == name:
                return info
        raise KeyError(name)

    def grad_name(self, tensor: str) -> str:
        """The name of ``tensor``'s gradient (``dW`` for ``W`` unless the spec uses that name)."""
        for primal, grad in self.gradient_names:
            if primal == tensor:
                return grad
        raise KeyError(tensor)

    def primal(self, grad: str) -> str:
        """The tensor whose gradient is named ``grad`` (the inverse of :meth:`grad_name`)."""
        for primal, name in self.gradient_names:
            if name == grad:
                return primal
        raise KeyError(grad)

    @property
    def size_map(self) -> dict[str, int] | None:
        return None if self.sizes is None else dict(self.sizes)


def uses_dropout(steps: Iterable[Step]) -> bool:
    """Whether ``steps`` draw a dropout keep-mask (a lowered module then takes a dropout key)."""
    return any(isinstance(s.fn, DropoutMask) for s in steps)


def backward_program(plan: Plan) -> tuple[Step, ...]:
    """The backward as the lowered program runs it: the forward steps the recompute policy makes again
    (``plan.recomputed``), then the backward's own, so the forward hands on only what is kept.  Where a
    recomputed step draws a dropout keep-mask the backward, which takes no dropout key, reads the forward's
    values instead (the same values; the module then keeps what the memory count has recomputed)."""
    if not plan.recomputed or uses_dropout(plan.recomputed):
        return plan.backward
    return plan.recomputed + plan.backward


def unfused(step: Step) -> tuple[Step, ...]:
    """A collective matmul (:attr:`Step.collective`) as the two steps it replaces, in the order they would
    run: the AllGather then the einsum of the gathered operand, or the einsum of the partial result then its
    ReduceScatter; any other step alone."""
    c = step.collective
    if c is None:
        return (step,)
    assert c.src is not None
    if c.op is Op.ALL_GATHER:
        k = step.operands.index(c.src)
        return c, Step(step.op, step.tensor, step.dst, operands=step.operands[:k] + (c.dst,) + step.operands[k + 1:],
                       once=step.once, block=step.block)
    return Step(step.op, step.tensor, c.src, operands=step.operands, once=step.once, block=step.block), c
