"""One line of Python for each step of the transformer-layer ops: sums and renames (masks: :mod:`shardc.ops.masks`).

A sum's term is laid out in the result's index order (``jnp.transpose``) and given a
size-1 axis where it broadcasts (``Bias[None, None, :]``); a reduced term added to a
sum that stays partial over axes ``U`` is added on the devices of coordinate 0 along
``U`` only (``jnp.where(jax.lax.axis_index(U) == 0, x, 0)``), so the partial sums add
up to the sum once.  A rename is the same array under a new name.
"""

from __future__ import annotations

from collections.abc import Callable

from shardc.ops.text import broadcast_text
from shardc.planner.ir import Step
from shardc.planner.localops import Add, Alias, Neg
from shardc.planner.sums import guard_axes
from shardc.spec.ir import TensorRef

__all__ = ["layer_code"]


def _axes_entry(axes: tuple[str, ...]) -> str:
    return repr(axes[0]) if len(axes) == 1 else "(" + ", ".join(repr(a) for a in axes) + ")"


def _term(ref: TensorRef, dst: TensorRef, var: Callable[[TensorRef], str]) -> str:
    text = broadcast_text(var(ref), ref.indices, dst.indices)
    guard = guard_axes(ref, dst)
    if guard:
        text = f"jnp.where(jax.lax.axis_index({_axes_entry(guard)}) == 0, {text}, 0)"
    return text


def layer_code(step: Step, var: Callable[[TensorRef], str]) -> str:
    """The right-hand side of a sum, a negation or an alias."""
    fn = step.fn
    if isinstance(fn, Alias):
        return var(step.operands[0])
    if isinstance(fn, Neg):
        return "-" + var(step.operands[0])
    assert isinstance(fn, Add)
    parts = []
    for k, (sign, ref) in enumerate(zip(fn.signs, step.operands, strict=True)):
        text = _term(ref, step.dst, var)
        parts.append(("-" if sign < 0 else "") + text if k == 0 else f"{'+' if sign > 0 else '-'} {text}")
    return " ".join(parts)
