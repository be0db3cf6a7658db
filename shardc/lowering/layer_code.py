"""One line of Python for each step of the transformer-layer ops: sums, renames, masks.

A sum's term is laid out in the result's index order (``jnp.transpose``) and given a
size-1 axis where it broadcasts (``Bias[None, None, :]``); a reduced term added to a
sum that stays partial over axes ``U`` is added on the devices of coordinate 0 along
``U`` only (``jnp.where(jax.lax.axis_index(U) == 0, x, 0)``), so the partial sums add
up to the sum once.  A rename is the same array under a new name.
"""

from __future__ import annotations

from collections.abc import Callable

from shardc.lowering.template import LOCALS
from shardc.planner.ir import Step
from shardc.planner.localops import MASK_OPS, Add, Alias, Causal, CausalVjp, DropoutMask, Neg
from shardc.planner.sums import guard_axes
from shardc.spec.ir import TensorRef

__all__ = ["LAYER_OPS", "layer_code", "broadcast_text"]

LAYER_OPS = (Add, Neg, Alias, *MASK_OPS)  # the local operations written here


def _axes_entry(axes: tuple[str, ...]) -> str:
    return repr(axes[0]) if len(axes) == 1 else "(" + ", ".join(repr(a) for a in axes) + ")"


def broadcast_text(name: str, indices: tuple[str, ...], out: tuple[str, ...]) -> str:
    """``name`` (with ``indices``) as an array that broadcasts against one with ``out``."""
    order = [i for i in out if i in indices]
    text = name
    if tuple(order) != indices:
        perm = tuple(indices.index(i) for i in order)
        text = f"jnp.transpose({text}, {perm})"
    if len(order) != len(out):
        text += "[" + ", ".join(":" if i in indices else "None" for i in out) + "]"
    return text


def _term(ref: TensorRef, dst: TensorRef, var: Callable[[TensorRef], str]) -> str:
    text = broadcast_text(var(ref), ref.indices, dst.indices)
    guard = guard_axes(ref, dst)
    if guard:
        text = f"jnp.where(jax.lax.axis_index({_axes_entry(guard)}) == 0, {text}, 0)"
    return text


def _dim(ref: TensorRef, index: str) -> str:
    d = ref.indices.index(index)
    return f"({d}, {ref.dims[d].axes!r})"


def _mask_code(step: Step, var: Callable[[TensorRef], str]) -> str:
    """causal / dropout and their gradients, every operand in the result's index order."""
    fn = step.fn
    dst = step.dst
    x = [broadcast_text(var(ref), ref.indices, dst.indices) for ref in step.operands]
    if isinstance(fn, (Causal, CausalVjp)):
        fill = ", fill=0" if isinstance(fn, CausalVjp) else ""
        return f"causal_mask({x[0]}, {_dim(dst, fn.query)}, {_dim(dst, fn.key)}{fill})"
    assert fn is not None and isinstance(fn, MASK_OPS)
    rate = float(fn.rate)
    if isinstance(fn, DropoutMask):
        order = tuple(sorted(range(len(dst.indices)), key=lambda d: dst.indices[d]))
        return (f"keep_mask({x[0]}, {fn.salt}, {rate!r}, {dst.layout!r}, {order!r}, {LOCALS[0]}, "
                f"{dst.indices!r}, MICROBATCH)")
    return f"jnp.where({x[0]}, {x[1]} / {1 - rate!r}, 0)"


def layer_code(step: Step, var: Callable[[TensorRef], str]) -> str:
    """The right-hand side of a sum, a negation or an alias."""
    fn = step.fn
    if isinstance(fn, MASK_OPS):
        return _mask_code(step, var)
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
