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

from typing import Any

from jax.extend import core as jex

__all__ = ["TrainingStep", "is_backward", "phase_of"]

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

    def skips(self, eqn: Any) -> bool:
        """Whether ``eqn`` is of the backward or the update (then its results are too)."""
        arrays = [v for v in eqn.invars if not isinstance(v, jex.Literal)]
        backward = is_backward(eqn)
        if not backward and not any(v in self.tainted for v in arrays):
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
        """A call's result ``outer`` is its inner result ``inner``."""
        if inner in self.tainted:
            self.tainted.add(outer)

    def lines(self, names: dict[Any, str], tensors: set[str], ids: set[Any]) -> list[str]:
        """The spec's ``param`` line (the inputs the update reads beside a gradient) and ``const`` line
        (the other inputs the spec reads, which get no gradient; embedding ids are const anyway)."""
        if not self.backward:
            return []
        params = [names[v] for v in self.params if names.get(v) in tensors]
        const = [names[v] for v in dict.fromkeys(self.inputs.values())
                 if names.get(v) in tensors and names[v] not in params and v not in ids]
        return ([f"param {', '.join(params)}"] if params else []) + ([f"const {', '.join(const)}"] if const else [])
