"""``causal`` and ``dropout``: elementwise maps that keep the sharding, planned beside ``gelu``.

Both read their argument reduced, in the result's layout, and their steps say what
the lowering needs in the step's typed ``fn`` (:mod:`shardc.ir.localops`):

- ``causal(S,T)``: -inf where the key position T is after the query position S,
  by GLOBAL position: lowered, each device offsets its block's positions by its
  index along the axes that shard S and T, so a sequence-sharded score is masked
  as the whole one is.  Its gradient passes the cotangent where not masked.
- ``dropout(r)``: keeps each element with probability 1 - r, scaled by 1/(1 - r).
  The forward makes the keep-mask first, a tensor of its own (``<Y>_mask``, one
  byte an element, :data:`MASK_BYTES`), from a counter-based hash of the
  element's global position (so every device draws its own block of one global
  mask, and the numpy reference draws the same mask); the backward multiplies the
  cotangent by that same mask over 1 - r, so the mask is a residual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardc.ir.localops import LocalOp
from shardc.ir.plan import Op, Step
from shardc.ir.spec import TensorRef
from shardc.sharding.layout import Value
from shardc.sharding.phase import Phase
from shardc.spec.functions import MASK_BYTES

if TYPE_CHECKING:
    from shardc.ops.registry import BackwardPass, Node

__all__ = ["MaskOps", "plan_masked", "plan_masked_backward", "MASK_BYTES"]


@dataclass(frozen=True)
class MaskOps:
    """The typed local operations of one mask node's steps, as its family builds them for its call:
    the map (``causal(S,T)``, ``dropout(0.1)``), its gradient, and the keep-mask drawn first (a
    dropout's; None: the map reads nothing but its argument)."""

    apply: LocalOp
    vjp: LocalOp
    draw: LocalOp | None = None


def plan_masked(phase: Phase, node: Node, declared: dict[str, TensorRef], target: Value | None,
                ops: MaskOps) -> None:
    """The argument reduced, in the result's layout (read index by index), then the map."""
    (arg,) = node.operands
    target, want = phase.map_argument(arg, node.result, node.indices, target, declared.get(arg),
                                      f"a {node.fn}", node.statement.span)
    operands: tuple[TensorRef, ...] = (phase.ref(arg, want),)
    if ops.draw is not None:
        (mask,) = node.aux
        phase.emit(Step(Op.ELEMENTWISE, mask, phase.ref(mask, target), operands=operands, fn=ops.draw), target)
        operands = (phase.ref(mask, target), *operands)  # (mask, x), as its gradient reads (mask, dY)
    phase.emit(Step(Op.ELEMENTWISE, node.result, phase.ref(node.result, target), operands=operands, fn=ops.apply),
               target)
    declared.setdefault(node.result, phase.ref(node.result, target))
    declared.setdefault(arg, phase.ref(arg, want))


def plan_masked_backward(bw: BackwardPass, node: Node, grad: str, vjp: LocalOp) -> None:
    """``causal``: the cotangent where not masked; ``dropout``: times the forward's keep-mask / (1 - r)."""
    (z,) = node.operands
    if z not in bw.needs:
        return
    value = bw.target(node.result)
    by_index = dict(zip(node.indices, value.layout, strict=True))
    want = Value(tuple(by_index[i] for i in bw.phase.indices[z]), ())
    operands: tuple[TensorRef, ...] = (bw.phase.ref(grad, value),)
    for mask in node.aux:  # the keep-mask: a residual whatever the save policy (it is not recomputed)
        bw.phase.hold(mask, value)
        operands = (bw.phase.ref(mask, value), *operands)
    dst = bw.part_name(z)
    bw.phase.emit(Step(Op.ELEMENTWISE, dst, bw.phase.ref(dst, want), operands=operands, fn=vjp), want)
    bw.settle(z, dst, want)
