"""The masks family: ``causal(Sc, S, T)`` and ``dropout(X, rate)``, registered once.

Both are elementwise maps that keep the sharding, planned as ``gelu`` is: each reads its argument
reduced, in the result's layout, and its steps carry what the lowering needs in their typed ``fn``
(:class:`MaskOps`).  A dropout node makes its keep-mask first, a tensor of its own (``<Y>_mask``, one
byte an element, :data:`shardc.spec.functions.MASK_BYTES`), which its backward reads again (so the
mask is a residual, whatever the save policy).  Here too are the JAX line of each step and their
meaning on whole arrays for the reference:

- ``causal``: -inf where the key position T is after the query position S, by global
  position, or with ``window W`` W or more before it (:func:`in_window`) (the lowered
  ``causal_mask`` offsets each device's block by its index
  along the axes that shard S and T); its gradient is the cotangent where not masked.
- ``dropout``: keeps an element where a counter-based hash of its global position and
  the dropout's salt passes the rate (:func:`keep_mask`; the lowered ``keep_mask``
  draws the same global mask, block by block), scaled by 1 / (1 - rate); its gradient
  is the cotangent times that same mask over 1 - rate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from shardc.ir.localops import MASK_OPS, Causal, CausalVjp, Dropout, DropoutMask, DropoutVjp, LocalOp
from shardc.ir.plan import Op, Step
from shardc.ir.spec import Call, Statement, TensorRef
from shardc.ops.elementwise import map_gradient
from shardc.ops.registry import Arrays, Family, Namer, Reference, Site, all_traffic, register
from shardc.ops.text import broadcast_text
from shardc.sharding.layout import Value
from shardc.spec.functions import MASK_BYTES, dropout_salt
from shardc.spec.walk import dropout_number

if TYPE_CHECKING:
    from shardc.ops.registry import BackwardPass, Node
    from shardc.sharding.phase import Phase

__all__ = ["MASKS", "MaskOps", "KEY", "keep_mask", "in_window", "emit"]

KEY = "dropout_key"  # the lowered functions' dropout-key argument (a local of the module's functions)

Array = Any


@dataclass(frozen=True)
class MaskOps:
    """The typed local operations of one mask node's steps, as the family builds them for its call:
    the map (``causal(S,T)``, ``dropout(0.1)``), its gradient, and the keep-mask drawn first (a
    dropout's; None: the map reads nothing but its argument)."""

    apply: LocalOp
    vjp: LocalOp
    draw: LocalOp | None = None


def _causal(statement: Statement, call: Call) -> MaskOps:
    query, key = call.names
    return MaskOps(Causal(query, key, call.window), CausalVjp(query, key, call.window))


def _dropout(statement: Statement, call: Call) -> MaskOps:
    """The map and its gradient at the rate, after the keep-mask drawn under the dropout's salt."""
    rate = call.numbers[0]
    salt = dropout_salt(statement.result.name, dropout_number(statement, call))
    return MaskOps(Dropout(rate), DropoutVjp(rate), DropoutMask(rate, salt))


def _causal_keep(call: Call, labels: tuple[str, ...], shape: tuple[int, ...], salt: int,
                 xp: Any) -> tuple[Array, float]:
    """Keys at or before the query, by position along the whole dims, and within its window (s - W < t <= s,
    :func:`in_window`); no scale.  Positions compared in ``xp``: traced in jax.numpy, an iota and a broadcast
    comparison, no constant of the mask's size."""
    query, key = (xp.arange(shape[labels.index(i)]).reshape(
        [-1 if j == labels.index(i) else 1 for j in range(len(labels))]) for i in call.names)
    return xp.broadcast_to(in_window(query, key, call.window), shape), 1.0


def in_window(query: Array, key: Array, window: int | None) -> Array:
    """Where a causal mask keeps the key: at or before the query position s, and with a sliding window W
    the W positions up to s, s - W < t <= s: W keys, itself among them, as Mistral 7B's paper has a token attend
    to at most W tokens (Jiang et al. 2023, figure 1) and Gemma 2's reference code masks (google/gemma_pytorch's
    local mask: ``tril(-inf, diagonal=-W)``, t <= s - W hidden).  Mistral's own prefill mask
    (``triu(mask, diagonal=-W)``, section 2's "between i - W and i") keeps one key more, s - W itself: W + 1.
    The reference's one definition, for the mask and the fused attention."""
    keep = key <= query
    return keep if window is None else keep & (key > query - window)


def _dropout_keep(call: Call, labels: tuple[str, ...], shape: tuple[int, ...], salt: int,
                  xp: Any) -> tuple[Array, float]:
    """The keep-mask drawn under the salt, scaled by 1 / (1 - r)."""
    rate = call.numbers[0]
    return keep_mask(shape, labels, salt, rate, xp), 1.0 / (1.0 - rate)


@dataclass(frozen=True)
class _Function:
    """One spec function of the family, what the passes read of it by its name: the local operations of
    its node's steps given the statement the call is in, the tensors its node makes beside its result
    (suffixes of the result's name), where it keeps a whole array's elements and their scale, and what
    an element it does not keep becomes."""

    local_ops: Callable[[Statement, Call], MaskOps]
    aux: tuple[str, ...]
    keep: Callable[[Call, tuple[str, ...], tuple[int, ...], int, Any], tuple[Array, float]]
    fill: float


_FUNCTIONS = {
    "causal": _Function(_causal, (), _causal_keep, -np.inf),  # a score masked out weighs nothing in a softmax
    "dropout": _Function(_dropout, ("_mask",), _dropout_keep, 0.0),
}


def _local_ops(node: Node) -> MaskOps:
    assert node.call is not None
    return _FUNCTIONS[node.call.func].local_ops(node.statement, node.call)


def _salt(statement: Statement, call: Call) -> int:
    """The salt the call's keep-mask is drawn under (a dropout's), 0 where it draws none (a causal mask)."""
    draw = _FUNCTIONS[call.func].local_ops(statement, call).draw
    return draw.salt if isinstance(draw, DropoutMask) else 0


def _plan(phase: Phase, node: Node, declared: dict[str, TensorRef], target: Value | None, label: str) -> None:
    """The argument reduced, in the result's layout (read index by index), then the map (no choice to
    explain); a dropout draws its keep-mask first."""
    ops = _local_ops(node)
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


def _backward(bw: BackwardPass, node: Node, grad: str) -> None:
    """``causal``: the cotangent where not masked; ``dropout``: times the forward's keep-mask / (1 - r)."""
    if (found := map_gradient(bw, node)) is None:
        return
    z, value, want = found
    operands: tuple[TensorRef, ...] = (bw.phase.ref(grad, value),)
    for mask in node.aux:  # the keep-mask: a residual whatever the save policy (it is not recomputed)
        bw.phase.hold(mask, value)
        operands = (bw.phase.ref(mask, value), *operands)
    dst = bw.part_name(z)
    bw.phase.emit(Step(Op.ELEMENTWISE, dst, bw.phase.ref(dst, want), operands=operands, fn=_local_ops(node).vjp),
                  want)
    bw.settle(z, dst, want)


def _aux(call: Call, result: str) -> tuple[str, ...]:
    """A dropout makes its keep-mask, ``<result>_mask``; a causal mask makes nothing."""
    return tuple(result + suffix for suffix in _FUNCTIONS[call.func].aux)


def _aux_bytes(node: Node) -> dict[str, int]:
    return dict.fromkeys(node.aux, MASK_BYTES)


def _dim(ref: TensorRef, index: str) -> str:
    d = ref.indices.index(index)
    return f"({d}, {ref.dims[d].axes!r})"


def emit(step: Step, var: Namer, sizes: dict[str, int] | None = None) -> str:
    """causal / dropout and their gradients, every operand in the result's index order (any sizes)."""
    fn = step.fn
    dst = step.dst
    x = [broadcast_text(var(ref), ref.indices, dst.indices) for ref in step.operands]
    if isinstance(fn, (Causal, CausalVjp)):
        fill = ", fill=0" if isinstance(fn, CausalVjp) else ""
        fill += f", window={fn.window}" if fn.window is not None else ""
        return f"causal_mask({x[0]}, {_dim(dst, fn.query)}, {_dim(dst, fn.key)}{fill})"
    assert fn is not None and isinstance(fn, MASK_OPS)
    rate = float(fn.rate)
    if isinstance(fn, DropoutMask):
        order = tuple(sorted(range(len(dst.indices)), key=lambda d: dst.indices[d]))
        return (f"keep_mask({x[0]}, {fn.salt}, {rate!r}, {dst.layout!r}, {order!r}, {KEY}, "
                f"{dst.indices!r}, MICROBATCH)")
    return f"jnp.where({x[0]}, {x[1]} / {1 - rate!r}, 0)"


def keep_mask(shape: tuple[int, ...], labels: tuple[str, ...], salt: int, rate: float, xp: Any = np) -> Array:
    """A dropout's global keep-mask: murmur3's 32-bit finaliser of each element's position (dims in
    sorted index-name order) plus the salt, kept where at least ``rate`` * 2**32.  Computed in ``xp``
    (jax.numpy while XLA's side traces: iotas and integer maps, no constant of the mask's size; the
    same uint32 arithmetic, so the same mask).

    The hash wraps modulo 2**32 by design; numpy warns of that on 0-d values (a scalar
    dropout), so the warning is silenced here, where the wrapping is meant.
    """
    with np.errstate(over="ignore"):
        h = xp.zeros(shape, xp.uint32)
        for d in sorted(range(len(shape)), key=lambda d: labels[d]):
            pos = xp.arange(shape[d], dtype=xp.uint32).reshape([shape[d] if k == d else 1 for k in range(len(shape))])
            h = h * np.uint32(shape[d]) + pos
        h = h + np.uint32(salt)
        for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
            h = (h ^ (h >> np.uint32(shift))) * np.uint32(factor)
        h = h ^ (h >> np.uint32(16))
    return h >= np.uint32(min(int(rate * 2**32), 2**32 - 1))


def _keep(call: Call, labels: tuple[str, ...], shape: tuple[int, ...], salt: int,
          xp: Any) -> tuple[Array, float]:
    """(where the value passes, its scale): causal keeps key <= query, dropout its keep-mask / (1 - r)."""
    return _FUNCTIONS[call.func].keep(call, labels, shape, salt, xp)


def _apply(site: Site, x: Array, xp: Any, absolute: bool = False) -> Array:
    keep, scale = _keep(site.func, site.labels[0], tuple(x.shape), site.salt, xp)
    fill = 0.0 if absolute else _FUNCTIONS[site.func.func].fill  # a magnitude masked out is 0
    return xp.where(keep, x * scale, fill)


def _forward(site: Site, xs: Arrays, xp: Any) -> Array:
    return _apply(site, xs[0], xp)


def _vjp(site: Site, xs: Arrays, d: Array, xp: Any) -> Arrays:
    keep, scale = _keep(site.func, site.labels[0], tuple(d.shape), site.salt, xp)
    return (xp.where(keep, d * scale, 0.0),)


def _magnitude(site: Site, xs: Arrays, mags: Arrays, y: Array) -> Array:
    """Linear given the mask: the magnitudes masked alike (0 where masked)."""
    return _apply(site, mags[0], np, absolute=True)


def _traffic(step: Step, nbytes: Callable[[TensorRef], float]) -> tuple[tuple[float, ...], float]:
    """A keep-mask is a hash of each element's position (:func:`keep_mask`): it reads none of its argument's
    data and writes the mask; every other step reads its operands and writes its result."""
    if isinstance(step.fn, DropoutMask):
        return tuple(0.0 for _ in step.operands), nbytes(step.dst)
    return all_traffic(step, nbytes)


MASKS = register(Family(name="masks", calls=frozenset(_FUNCTIONS), ops=MASK_OPS, plan=_plan,
                        backward=_backward, emit=emit, reference=Reference(_forward, _vjp, _magnitude, salt=_salt),
                        aux=_aux, aux_bytes=_aux_bytes, scores=lambda node: True, traffic=_traffic))
