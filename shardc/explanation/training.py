"""A training step's jaxpr cut into its forward, its backward and its update.

``jax.value_and_grad(loss)`` traces the loss as a linearized forward (equations whose name stack
is ``jvp(...)``) and its transpose (``transpose(jvp(...))``, the backward: jax records each
transformation in the equation's name stack, and in the compiled HLO's ``op_name`` metadata).
What reads a backward value (the optimizer's ``p - lr * g``, its moments) is the update.  shardc
derives the backward of a forward spec itself, so only the forward is read as the spec; an input
the update reads beside a gradient is a parameter (``param``), every other input of a training
step gets no gradient (``const``).
"""

from __future__ import annotations

import math
from typing import Any

from jax.extend import core as jex

from shardc.errors import ShardcError
from shardc.explanation.fresh import CALLS, Made
from shardc.explanation.numpy_prims import evaluate
from shardc.explanation.sources import source_line

__all__ = ["TrainingStep", "carried", "is_backward", "phase_of"]

_TRANSPOSE = "transpose("


def is_backward(eqn: Any) -> bool:
    """Whether jax made ``eqn`` by transposing a linearized function (a gradient's backward)."""
    return _TRANSPOSE in str(eqn.source_info.name_stack)


def phase_of(op_name: str, training: bool) -> str:
    """A compiled op's phase from its ``op_name`` (the jaxpr's name stack): forward, backward, update."""
    if not training or "jvp(" in op_name and _TRANSPOSE not in op_name:
        return "forward"
    return "backward" if _TRANSPOSE in op_name else "update"


class TrainingStep:
    """The values of the backward and the update, found equation by equation in program order."""

    def __init__(self, inputs: list[Any]) -> None:
        self.inputs: dict[Any, Any] = {v: v for v in inputs}  # a var (inner ones too) -> the input it is
        self.tainted: set[Any] = set()  # values of the backward or the update
        self.params: list[Any] = []  # inputs the update reads beside a gradient, in the order read
        self.backward = False  # whether the program has a backward at all
        self.mixed: set[int] = set()  # the calls (by id) whose jaxpr holds a forward and its backward
        self.losses: set[Any] = set()  # the forward's scalars nothing reads: the loss jax.grad drops

    def forward(self, jaxpr: Any) -> list[Any]:
        """The equations of ``jaxpr`` the spec reads: in a jaxpr with a backward, those of the forward
        that its primal results need (the loss, the values the program returns), not those the
        linearization adds for the backward alone (a max's ``eq`` mask, ``2 * x`` of a square)."""
        tainted = set(self.tainted)
        kept = [eqn for eqn in jaxpr.eqns if not self.skips(eqn)]
        if self.tainted == tainted:
            return kept
        # the primal results: what the program returns of the forward, and the loss (a gradient's
        # function returns a scalar) where nothing reads it; the linearization's dead ends are arrays
        read = {v for eqn in jaxpr.eqns for v in eqn.invars if not isinstance(v, jex.Literal)}
        live = {v for eqn in kept for v in eqn.outvars if v not in read and not v.aval.shape}
        self.losses.update(live)
        live.update(v for v in jaxpr.outvars if not isinstance(v, jex.Literal) and v not in self.tainted)
        needed = []
        for eqn in reversed(kept):
            if id(eqn) in self.mixed or any(v in live for v in eqn.outvars):
                needed.append(eqn)
                live.update(v for v in eqn.invars if not isinstance(v, jex.Literal))
        return needed[::-1]

    def write_losses(self, reader: Any, jaxpr: Any) -> None:
        """Write each loss's run of maps (a scale after its sum: ``jnp.sum(...) * 0.5``), which nothing reads
        and so nothing else writes: jax seeds the backward with that scale, so the spec's gradients need it; a
        scalar result's too (the spec writes no scalar result, but its last statement is the program's value).
        Where no loss has the scale the backward is seeded with, it is written after the loss (:meth:`seeded`)."""
        scalars = [v for v in jaxpr.outvars if not isinstance(v, jex.Literal) and not v.aval.shape]
        if self.backward and not self.losses and not scalars:
            # jax seeds the backward with the loss's scale, but the forward's value it is of is gone (a jaxpr
            # after dead-code elimination drops the unread loss with its whole chain, the sum and the square):
            # read as it stands, the spec's forward would have no loss and its backward be of something else
            raise ShardcError("the program takes a gradient (jax's transpose of a linearized forward) but its "
                              "jaxpr holds no loss it is of: no scalar of the forward is left, nor returned (jax "
                              "dropped the unread loss), so the spec cannot say what its gradients are of",
                              fix="return the loss beside the update (jax.value_and_grad), or explain the loss "
                                  "function alone")
        for loss in dict.fromkeys([*self.losses, *scalars]):
            if reader.base(loss) in reader.region and not reader.is_constant(loss):  # not a step count's
                reader.tensor(loss)
        self.seeded(reader, jaxpr, list(dict.fromkeys([*self.losses, *scalars])))

    def seeded(self, reader: Any, jaxpr: Any, losses: list[Any]) -> None:
        """The loss times the scale jax seeds its backward with, where the one sum read as the loss lacks it.

        A loss ``sum(h) * a`` (a mean's 1/n) is seeded with ``1.0 * a``, a scalar of literals alone broadcast to
        h's shape, the transpose of the sum.  The forward's unread ``* a`` is kept by tracing, but not by
        dead-code elimination where the sum is read elsewhere (``jax.grad(has_aux=True)`` returning the sum too):
        read as it stands the spec's loss would be the sum, and its gradients ``1/a`` times jax's.  A jitted loss
        (``jax.jit(loss)``, flax's and optax's pjit calls) holds its sum in the forward's call and its seed in the
        backward's (``1.0`` passed in, divided there), so both are read through calls (:class:`_Flat`)."""
        flat = _Flat(jaxpr)
        found: dict[Any, list[tuple[Any, float]]] = {}  # a loss's sum (a call's inside) -> (loss, its scale)
        for loss in losses:
            base, scale = _tail(loss, flat)
            found.setdefault(base, []).append((loss, scale))
        _one_loss(flat, {base for base, scaled in found.items() if any(reader.base(v) in reader.names
                                                                        for v, _ in scaled)})
        lacking = []
        for base, scaled in found.items():
            total = flat.made.get(base)
            seed = flat.seed(total.invars[0].aval.shape) if total is not None and \
                total.primitive.name == "reduce_sum" else None
            if seed is not None and any(math.isclose(seed, scale, rel_tol=1e-6) for _, scale in scaled):
                return  # the loss read holds the seed's scale
            written = [(loss, scale) for loss, scale in scaled if reader.base(loss) in reader.names]
            if seed is not None and written:
                lacking.append((*written[0], seed))
        if len(lacking) != 1:
            return
        ((loss, scale, seed),) = lacking
        made = Made()
        reader.dims[made] = []
        reader.make(made, "fn", (reader.tensor(loss),), fn="scale", value=seed / scale, line="")
        reader.notes.append(f"the loss {reader.names[made]} is {reader.names[reader.tensor(loss)]} times "
                            f"{seed / scale:g}, read from the seed of the program's gradient: its forward no "
                            "longer holds that scale (jax dropped it, unread)")

    def skips(self, eqn: Any) -> bool:
        """Whether ``eqn`` is of the backward or the update (then its results are too); a call of a
        jaxpr with a backward inside taints the results its backward makes."""
        arrays = [v for v in eqn.invars if not isinstance(v, jex.Literal)]
        backward = is_backward(eqn)
        if not backward and not any(v in self.tainted for v in arrays):
            inner = _inner(eqn)
            if inner is not None:
                made = _tainted(inner)
                self.backward |= bool(made)
                if made:  # its forward is read inside it
                    self.mixed.add(id(eqn))
                self.tainted.update(v for v, w in zip(eqn.outvars, inner.outvars, strict=True) if w in made)
            return False
        self.backward |= backward
        self.tainted.update(eqn.outvars)
        if not backward:
            for v in arrays:
                given = self.inputs.get(v)
                if given is not None and given not in self.params:
                    self.params.append(given)
        return True

    def enter(self, outer: Any, inner: Any) -> None:
        """A call's inner variable ``inner`` is its operand ``outer``."""
        if outer in self.inputs:
            self.inputs[inner] = self.inputs[outer]

    def leave(self, outer: Any, inner: Any) -> None:
        """A call's result ``outer`` is its inner result ``inner`` (a loss where ``outer`` is: a jitted loss's,
        its result dropped by the caller, jax's ``_``)."""
        if inner in self.tainted:
            self.tainted.add(outer)
        elif self.backward and (outer in self.losses or isinstance(outer, jex.DropVar)) \
                and not isinstance(inner, jex.Literal) and not inner.aval.shape:
            self.losses.add(inner)

    def lines(self, names: dict[Any, str], tensors: set[str], ids: set[Any], layers: tuple[list[Any], list[Any]]
              ) -> list[str]:
        """The spec's ``param`` line (the inputs the update reads beside a gradient, and a scan's stacked
        weights) and ``const`` line (the other inputs of a training step, and what every layer of a scan
        reads alike, which get no gradient; embedding ids are const anyway)."""
        stacked, shared = layers
        params = [names[v] for v in dict.fromkeys([*self.params, *stacked]) if names.get(v) in tensors]
        others = list(self.inputs.values()) if self.backward else shared
        const = [names[v] for v in dict.fromkeys(others) if names.get(v) in tensors and names[v] not in params
                 and v not in ids]
        return ([f"param {', '.join(params)}"] if params else []) + ([f"const {', '.join(const)}"] if const else [])


def _one_loss(flat: _Flat, sums: set[Any]) -> None:
    """Refuse a step whose forward writes scalars of two sums (``has_aux`` returning a metric beside the loss, a
    mean absolute error): the spec's backward is of its scalar results, jax's of the loss alone, and which one
    that is the jaxpr does not say (the metric, traced under the loss's ``jvp`` too, is no more apart)."""
    if len(sums) > 1:
        lines = sorted({source_line(flat.made[v]) for v in sums if v in flat.made} - {""})
        raise ShardcError("the training step's forward makes scalars of more than one sum (" + ", ".join(lines)
                          + "): a metric beside the loss (jax.grad's has_aux); the spec's backward would be of "
                          "them all, jax's gradient is of the loss alone", fix="explain the step with the loss as "
                          "its one scalar (return the metrics from a step of their own, or leave them out)")


class _Flat:
    """A jaxpr's equations with those of its calls (:data:`~shardc.explanation.fresh.CALLS`) inside: what makes each
    value, a call's inner input being its operand and its result its inner result, and the backward's equations in
    program order (a call's inside, whose name stacks are empty, is of the backward where the call is)."""

    def __init__(self, jaxpr: Any) -> None:
        self.made: dict[Any, Any] = {}
        self.same: dict[Any, Any] = {}
        self.backward: list[Any] = []
        self.add(jaxpr, False)

    def add(self, jaxpr: Any, backward: bool) -> None:
        for eqn in jaxpr.eqns:
            inner = _inner(eqn) if eqn.primitive.name in CALLS else None
            if inner is None:
                self.made.update((v, eqn) for v in eqn.outvars)
                self.backward += [eqn] if backward or is_backward(eqn) else []
                continue
            self.same.update(zip(inner.invars, eqn.invars, strict=False))
            self.same.update(zip(eqn.outvars, inner.outvars, strict=True))
            self.add(inner, backward or is_backward(eqn))

    def find(self, var: Any) -> Any:
        """The value ``var`` is, through calls: a literal, or a variable an equation of no call makes."""
        while not isinstance(var, jex.Literal) and var in self.same:
            var = self.same[var]
        return var

    def seed(self, shape: tuple[int, ...]) -> float | None:
        """The scalar of literals alone the backward's first broadcast to ``shape`` reads: jax's seed of a loss's
        sum over an array of that shape (1.0 times the loss's scale); None where there is none."""
        for eqn in self.backward:
            if eqn.primitive.name == "broadcast_in_dim" and not eqn.invars[0].aval.shape \
                    and tuple(eqn.outvars[0].aval.shape) == tuple(shape):
                value = _literal(eqn.invars[0], self)
                if value != 0.0:  # zeros (a where's other branch, in jax.checkpoint's forward made again) seed none
                    return value
        return None


def _tail(var: Any, flat: _Flat) -> tuple[Any, float]:
    """(the value, its factor) where the scalar ``var`` is a value times literals (``x * a``, ``x / a``, ``-x``)."""
    factor = 1.0
    while (eqn := flat.made.get(var := flat.find(var))) is not None and not var.aval.shape \
            and eqn.primitive.name in ("mul", "div", "neg"):
        literals = [v for v in eqn.invars if isinstance(v, jex.Literal)]
        arrays = [v for v in eqn.invars if not isinstance(v, jex.Literal)]
        if len(arrays) != 1 or len(literals) != len(eqn.invars) - 1 or (eqn.primitive.name == "div" and literals
                                                                          and eqn.invars[1] is not literals[0]):
            break
        number = float(literals[0].val) if literals else -1.0
        factor *= 1.0 / number if eqn.primitive.name == "div" else number
        var = arrays[0]
    return var, factor


def _literal(var: Any, flat: _Flat) -> float | None:
    """A scalar's value where it is made of literals alone by arithmetic (through calls); None otherwise."""
    var = flat.find(var)
    if isinstance(var, jex.Literal):
        return float(var.val)
    eqn = flat.made.get(var)
    if eqn is None or eqn.primitive.name not in ("mul", "div", "neg", "convert_element_type"):
        return None
    values = [_literal(v, flat) for v in eqn.invars]
    return None if None in values else float(evaluate(eqn, values))


def _inner(eqn: Any) -> Any:
    """The jaxpr a call equation runs (pjit, a custom_jvp's), else None."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = getattr(eqn.params.get(key), "jaxpr", eqn.params.get(key))
        if isinstance(inner, jex.Jaxpr):
            return inner
    return None


def _tainted(jaxpr: Any) -> set[Any]:
    """The values of ``jaxpr`` its own backward (and what reads one) makes."""
    step = TrainingStep([])
    for eqn in jaxpr.eqns:
        step.skips(eqn)
    return step.tainted


def carried(body: Any, carry: int) -> set[int]:
    """The equations (by id) of a scan's body that its carry needs: not those that make its per-layer
    outputs alone (a linearized scan's residuals for the backward)."""
    live = {v for v in body.outvars[:carry] if not isinstance(v, jex.Literal)}
    needed: set[int] = set()
    for eqn in reversed(body.eqns):
        if any(v in live for v in eqn.outvars):
            needed.add(id(eqn))
            live.update(v for v in eqn.invars if not isinstance(v, jex.Literal))
    return needed
