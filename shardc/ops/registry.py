"""The op families, registered once: each pass finds an op's code here, never by its name.

A family (:class:`Family`) is a set of spec functions and the typed local
operations (:mod:`shardc.ir.localops`) their plan steps carry, with what every
pass needs of them: how the planner plans the forward and the backward of one of
its graph nodes, the bytes an element of the tensors those nodes make on the way, the HBM
bytes a step reads and writes (its cost: every step of a family is memory-bound),
one line of JAX for each of its steps, and its meaning on whole arrays for the
numpy reference.  The graph builder (:mod:`shardc.planner.graph`) puts a node's family on the
node (:attr:`Node.family`), so the planner dispatches on that object; codegen looks a step's
family up by the class of its local operation (:func:`of_op`).  Each family registers itself, in its
own module, with :func:`register`; :mod:`shardc.ops` imports every family module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from shardc.hardware import Hardware
    from shardc.ir.plan import Op, Step
    from shardc.ir.spec import Call, Expr, Statement, TensorRef
    from shardc.sharding.layout import Value
    from shardc.sharding.phase import Phase
    from shardc.steptime import RingTransfer

__all__ = ["BackwardPass", "Builder", "Capacity", "Family", "Node", "Flops", "Reference", "Site", "Sizer", "Traffic",
           "all_traffic", "no_traffic", "register", "of_call", "family_of", "of_op", "of_step", "families",
           "SUM", "RENAME", "CONTRACT"]

# The forms of the language a family may claim beside its spec functions: a sum of terms
# (``A + B - C``), a rename (``Kx[B, T, D] = X[B, S, D]``) and a product or copy (``A · B``).
SUM = "+"
RENAME = "="
CONTRACT = "·"

Array = Any
Arrays = tuple[Any, ...]  # one array per operand
Namer = Callable[["TensorRef"], str]  # a value's variable in the generated code
Sizer = Callable[["TensorRef"], float]  # bytes of one device's piece of a value
# (HBM bytes read of each operand, in order, and bytes written) of one step
Traffic = Callable[["Step", Sizer], tuple[tuple[float, ...], float]]
# (per-device FLOPs, model FLOPs, hardware FLOPs) of one step on the matrix units, given a dim's or an axis's
# size (a number, or a symbol for the cost formulas): model FLOPs as MFU counts them, hardware FLOPs what all
# the devices run (HFU's)
Flops = Callable[["Step", Callable[[str], Any]], tuple[Any, Any, Any]]
# the seconds of one step's matrix-unit work on a chip, given a dim's or an axis's size and the spec's dtype
Seconds = Callable[["Step", Callable[[str], int], "Hardware", str], float]
# the sends to a neighbour a step makes while its compute runs in ring steps (ring attention), given a dim's or
# an axis's size and the spec's bytes an element (None: it makes none)
Ring = Callable[["Step", Callable[[str], Any], int], "RingTransfer | None"]


def all_traffic(step: Step, nbytes: Sizer) -> tuple[tuple[float, ...], float]:
    """A step that reads each operand whole and writes its result: an elementwise map, a reduction."""
    return tuple(nbytes(o) for o in step.operands), nbytes(step.dst)


def no_traffic(step: Step, nbytes: Sizer) -> tuple[tuple[float, ...], float]:
    """A step that moves nothing: a new name for the same array."""
    return tuple(0.0 for _ in step.operands), 0.0


class Builder(Protocol):
    """What a family may ask of the graph builder (:mod:`shardc.planner.graph`) for a node of its own
    shape: the names taken, every tensor's indices, and a call's argument computed as a tensor."""

    names: set[str]
    indices: dict[str, tuple[str, ...]]

    def argument(self, e: Expr, name: str, indices: tuple[str, ...], target: TensorRef | None = None) -> str: ...


@dataclass(frozen=True)
class Node:
    """One operation of an op family: an einsum of 1 or 2 operands, a sum, a call, as the graph builder
    (:mod:`shardc.planner.graph`) makes it from a statement and a family's rules plan it.

    ``call`` is the spec's call a node comes from (its index names, numbers and ``over``
    index), ``signs`` a sum's term signs.
    """

    family: Family = field(compare=False)  # its op family: every pass finds the node's code there
    result: str
    indices: tuple[str, ...]
    operands: tuple[str, ...]
    target: TensorRef | None  # the requested sharding; None: the planner chooses
    statement: Statement
    fn: str | None = None
    chain: int = 0  # position in a chain of intermediates (0: not in one)
    call: Call | None = None  # the call this node computes (non-elementwise functions)
    signs: tuple[int, ...] = ()  # +1 / -1 per operand of a sum
    # a term of a sum, or a value one linear node alone reads (Family.linear): may stay partial sums (reduced once)
    partial: bool = False
    # the one linear node a partial node's result is handed on to (graph.handed_on): an einsum's search prices
    # each option's result moved as asked or moved after that reader, the cheaper (shardc.sharding.einsum.Reader);
    # on a sum or mean declared with an axis, the one that reads it, priced after it (the einsum's reader's reader)
    reader: Node | None = field(default=None, compare=False, repr=False)
    aux: tuple[str, ...] = ()  # tensors the node makes on the way (row statistics, a dropout's keep-mask)


class BackwardPass(Protocol):
    """What a family's backward rule may ask of the backward pass (:mod:`shardc.planner.backward`): its
    phase and the forward's, the declared shardings, which tensors need a gradient, how many contributions
    each gradient receives and those kept so far (to be summed), the names taken, and its moves."""

    phase: Phase
    forward: Phase
    declared: dict[str, TensorRef]
    needs: set[str]
    count: dict[str, int]
    parts: dict[str, list[tuple[str, Value]]]
    taken: set[str]

    def target(self, name: str) -> Value:
        """The layout ``name``'s gradient is due in."""
        ...

    def part_name(self, name: str) -> str:
        """The gradient's name, or a fresh one for one of several contributions."""
        ...

    def contribute(self, primal: str, operands: tuple[str, ...], label: tuple[str, ...]) -> None:
        """One einsum contribution to ``primal``'s gradient."""
        ...

    def settle(self, primal: str, dst: str, value: Value) -> None:
        """A contribution ``dst`` made as ``value``: kept to be summed, or moved to the primal's sharding."""
        ...


@dataclass(frozen=True)
class Site:
    """Where the reference applies a family's node: its operands' indices ``labels`` (one tuple
    each), its result's ``out``, the length of every index known so far (``shape``), what the
    node is: a call (``call``, a dropout's ``salt``) or a sum (its terms' ``signs``), and, in the
    backward, the node's value (``result``: a softmax's gradient reads it)."""

    labels: tuple[tuple[str, ...], ...]
    out: tuple[str, ...]
    shape: dict[str, int]
    call: Call | None = None
    salt: int = 0
    signs: tuple[int, ...] = ()
    result: Array = None

    @property
    def func(self) -> Call:
        """The call (a family of spec functions' sites always have one)."""
        assert self.call is not None
        return self.call


def _never(node: Node) -> bool:
    return False


def _result_indices(call: Call, indices: tuple[str, ...]) -> tuple[str, ...]:
    return indices


def no_step(step: Step) -> bool:
    return False


def _no_aux(call: Call, result: str) -> tuple[str, ...]:
    return ()


def no_saved(step: Step) -> tuple[tuple[TensorRef, int], ...]:
    return ()


@dataclass(frozen=True)
class Capacity:
    """What a call's lowered code fixes as a share of its tokens (a routing capacity): its token index,
    its slot index, the experts index it picks among and how many it picks a token."""

    tokens: str
    slots: str
    experts: str
    picks: int


def _no_capacity(call: Call) -> Capacity | None:
    return None


def _spec_dtype(node: Node) -> dict[str, int]:
    return {}


def _linear(func: str) -> bool:
    return False


@dataclass(frozen=True)
class Reference:
    """A family's meaning on whole arrays (``xp`` numpy or jax.numpy), for the independent reference.

    ``forward(site, xs, xp)`` is the node's value on its operands' values ``xs``;
    ``vjp(site, xs, d, xp)`` the operands' gradients, one each (None where an operand gets none,
    as token ids), for the cotangent ``d`` (``vjp`` None: no operand gets one);
    ``magnitude(site, xs, mags, y)`` (numpy) a bound on the terms behind the value ``y``, given the
    operands' values and magnitudes; ``grad_magnitude(site, xs, mags, d)`` (numpy) the same for the
    operands' gradients, given the cotangent's magnitude ``d`` (None: ``vjp`` of it, right for a map
    linear given the node, such as a mask or a sum); ``nonlinear(func)`` whether a call's value depends
    on its argument's size other than linearly.
    """

    forward: Callable[[Site, Arrays, Any], Array]
    vjp: Callable[[Site, Arrays, Array, Any], tuple[Array | None, ...]] | None
    magnitude: Callable[[Site, Arrays, Arrays, Array], Array]
    grad_magnitude: Callable[[Site, Arrays, Arrays, Array], tuple[Array | None, ...]] | None = None
    # each tensor argument and the indices it is computed towards, given the result's (None: the one
    # argument, as the plain call), and the result's indices given the operands' (None: the first's)
    arguments: Callable[[Call, tuple[str, ...]], tuple[tuple[Expr, tuple[str, ...]], ...]] | None = None
    indices: Callable[[Call, tuple[tuple[str, ...], ...]], tuple[str, ...]] | None = None
    # whether the spec function ``func``'s value depends on its argument's size other than linearly (an
    # activation, a norm, a softmax, a loss): verify brings that argument to unit size
    # (:mod:`shardc.verification.scales`); by default none does
    nonlinear: Callable[[str], bool] = _linear
    # the salt a call's random mask is drawn under, given the statement it is in (a dropout's, the
    # node's :attr:`Site.salt`; None: the family draws none)
    salt: Callable[[Statement, Call], int] | None = None


@dataclass(frozen=True, kw_only=True)
class Family:
    """Everything the passes need of one op family (see the module's docstring)."""

    name: str
    calls: frozenset[str]  # the spec functions it implements (or the forms SUM and RENAME)
    ops: tuple[type, ...]  # the local operations its steps carry
    # the forward of a node (``label``: its statement as ``--explain`` names it)
    plan: Callable[[Phase, Node, dict[str, TensorRef], Value | None, str], None]
    # the backward of a node, given its cotangent's name; None: the result has no gradient (a 0/1 mask)
    backward: Callable[[BackwardPass, Node, str], None] | None
    # one step as one line of JAX (its right-hand side), at the module's sizes (None: shape-generic)
    emit: Callable[[Step, Namer, dict[str, int] | None], str]
    reference: Reference
    # the indices a call's argument is computed towards, given its result's (by default the result's)
    argument: Callable[[Call, tuple[str, ...]], tuple[str, ...]] = _result_indices
    # which of a node's operands its gradient reaches (by default every one; dispatch's gates get none)
    reaches: Callable[[Node], tuple[bool, ...]] | None = None
    # the tensors a node of ``call`` makes besides its result (by default none)
    aux: Callable[[Call, str], tuple[str, ...]] = _no_aux
    # bytes an element of those, where not the spec's dtype (by default all the spec's)
    aux_bytes: Callable[[Node], dict[str, int]] = _spec_dtype
    # whether a node's result is its argument under another name (a rename): its gradient's
    # contributions then pass to the argument's as made, before any is summed
    aliases: Callable[[Node], bool] = field(default=lambda node: False)
    # a node of its own shape (several tensor arguments, tensors made on the way indexed otherwise than
    # the result): its operands and those tensors, named and indexed through the graph builder, given the
    # call and its result's name and indices; None: one argument computed towards ``argument``'s
    # indices, in the result's layout where those are the result's, and ``aux`` of the result's indices
    operands: Callable[[Builder, Call, str, tuple[str, ...]], tuple[tuple[str, ...], tuple[str, ...]]] | None = None
    # whether a node of the family reading an attention-score region stays in it (a softmax, a mask), so
    # selective recomputation reruns it (:func:`shardc.planner.recompute.attention_region`)
    scores: Callable[[Node], bool] = _never
    # the kinds of plan step that are its own whatever their local operation (an einsum's, a copy's)
    steps: tuple[Op, ...] = ()
    # the HBM traffic of one of its steps (the cost model adds it up, minus what fusion saves)
    traffic: Traffic = all_traffic
    # the matmul FLOPs of one of its steps, which the cost model adds at the chip's matmul rate beside its
    # traffic (None: its steps are memory-bound only; attention's are not)
    flops: Flops | None = None
    # the time of those FLOPs on the chip, where its kernel does not run at the chip's matmul rate (None: it does)
    seconds: Seconds | None = None
    # the neighbour sends of one of its steps around a ring, priced against the step's compute (None: none)
    ring: Ring | None = None
    # whether its result is a discrete choice of its inputs (a top-k routing mask), which their rounding
    # can flip: verify judges such a value by the unsharded program's own choices
    chooses: bool = False
    # a call's routing capacity, where its lowered code fixes the slots as a share of the tokens (None: none)
    capacity: Callable[[Call], Capacity | None] = _no_capacity
    # whether XLA fuses its steps with their neighbours (elementwise maps and reductions: loop and
    # reduction fusions; a top-k routing sorts, and is a kernel of its own)
    fusible: bool = True
    # under a framework's own kernels (``fusion none``: one kernel an op; ``statement``): whether a step is part
    # of the one native kernel the framework runs its op as (PyTorch's layer norm, apex's), and whether it is
    # that kernel's last step
    # (:func:`shardc.fusion.memory_traffic` prices such a run of steps by the kernel's own reads and writes)
    native: Callable[[Step], bool] = no_step
    native_last: Callable[[Step], bool] = no_step
    # whether a step is a further result of the kernel an earlier step of the same operands runs (attention's
    # logsumexp, dK, dV): its writes are that kernel's, priced with the kernel's FLOPs (its roofline)
    further: Callable[[Step], bool] = no_step
    # under a framework's own kernels (``fusion none``, ``statement``): the row statistics the native kernel a step
    # is part of keeps for its backward (a layer norm's mean and rstd), each with its bytes an element: the
    # forward's kernel writes them, the backward's reads them, and they are held between the two
    saved: Callable[[Step], tuple[tuple[TensorRef, int], ...]] = no_saved
    # under ``fusion none``: the HBM traffic of one of its steps as the framework's eager kernels run it, where
    # that is not ``traffic`` (PyTorch's cross-entropy backward, two kernels); None: ``traffic``
    eager: Traffic | None = None
    # whether its backward reads its result's cotangent from any value the backward holds (moving it there
    # itself, as a reduction's gradient does): the cotangent is then handed over as its contributions made it,
    # partial sums kept, and its rule's search chooses where it is reduced (a ReduceScatter where the rule runs
    # sharded, not an AllReduce to the result's layout and a slice)
    held_cotangent: bool = False
    # whether a node is linear in its one operand, partial sums in, partial sums out over the same axes (a sum,
    # a mean; a max is not): a value only such a node reads may be handed to it unreduced
    # (:attr:`Node.partial`), so the reduction lands where the tensor is smallest
    linear: Callable[[Node], bool] = _never


_BY_CALL: dict[str, Family] = {}
_BY_OP: dict[type, Family] = {}
_BY_STEP: dict[Op, Family] = {}


def register(family: Family) -> Family:
    """Add ``family``; a spec function or a local operation belongs to one family only."""
    for call in family.calls:
        if call in _BY_CALL:
            raise ValueError(f"{call} is already in the family {_BY_CALL[call].name}")
        _BY_CALL[call] = family
    for op in family.ops:
        if op in _BY_OP:
            raise ValueError(f"{op.__name__} is already in the family {_BY_OP[op].name}")
        _BY_OP[op] = family
    for kind in family.steps:
        if kind in _BY_STEP:
            raise ValueError(f"{kind.name} steps are already the family {_BY_STEP[kind].name}'s")
        _BY_STEP[kind] = family
    return family


def of_call(func: str) -> Family | None:
    """The family of the spec function ``func`` (None: not yet moved to a family)."""
    return _BY_CALL.get(func)


def family_of(call: str) -> Family:
    """The family of ``call``, a registered spec function or form (KeyError: none registered it)."""
    return _BY_CALL[call]


def of_op(op: object) -> Family | None:
    """The family whose steps carry the local operation ``op`` (looked up by its class)."""
    return _BY_OP.get(type(op))


def of_step(step: Step) -> Family | None:
    """The family a plan step belongs to: by its kind (an einsum), else by its local operation (None: a
    collective, or the optimizer's update)."""
    return _BY_STEP.get(step.op) or _BY_OP.get(type(step.fn))


def families() -> tuple[Family, ...]:
    """Every registered family, in registration order."""
    return tuple(dict.fromkeys(_BY_CALL.values()))
