"""The rotary position embedding: ``rotary(X[B, T, N, H], T)`` (``rotary(X, T, theta)``), registered once.

RoFormer's rotary position embedding (Su et al. 2021, arXiv 2104.09864, section 3.4.2) rotates pairs of a
query's or key's head dim by angles proportional to the token's position, so that the score of a query and a
key depends on their positions' difference only.  The pairs are the head dim's halves, as LLaMA's reference
code (``rotate_half``) and MaxText's ``apply_rotary_embedding`` pair them (the paper pairs neighbours,
``x[2i], x[2i+1]``, which a spec of the half-split form's weights permuted computes): for H the argument's
last index, i < H/2 and the global position t along the position index,

    angle(t, i) = t * theta ** (-2i / H)
    y = x * cos(angle) + rotate_half(x) * sin(angle),   rotate_half(x) = concatenate([-x2, x1])

with ``x1, x2`` the halves of H and theta 10000 unless given (RoFormer's and LLaMA 2's; LLaMA 3 takes 500000).

Planned as a map that keeps the sharding but for H: each pair's two elements are H/2 apart, so H must be
whole on a device (a declared result with H sharded is refused; the planner's own choice gathers it), while
every other index may stay sharded, the position index too: the lowered code offsets each device's block of
positions by its index along the axes sharding it (``jax.lax.axis_index``, :func:`shardc.lowering.runtime.rotary`).
The rotation is orthogonal, so its gradient is the inverse rotation (angles negated) of the cotangent: it
reads no argument, so nothing is kept for it.  One memory-bound step each way (it reads x and writes y; its
few FLOPs, six multiply-adds and a sine and cosine an element, are far under the time of its bytes, as a
GELU's are, and counted by no chip's matmul rate), fused with its neighbouring maps and into the epilogue of
the projection that makes its argument as XLA fuses any elementwise op (:mod:`shardc.fusion`): the angles are
an iota's maps inside that kernel, no table read.  A step that depends on positions, it keeps the plan from
holding the sequence in zig-zag order (:mod:`shardc.planner.zigzag_order`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from shardc.errors import ShardcError
from shardc.ir.localops import Rotary
from shardc.ir.plan import Op, Step
from shardc.ir.spec import Call, TensorRef
from shardc.ops.elementwise import map_gradient, map_step
from shardc.ops.registry import Arrays, Family, Namer, Reference, Site, register
from shardc.ops.text import aligned_text
from shardc.sharding.layout import Value
from shardc.sharding.search import reshard

if TYPE_CHECKING:
    from shardc.ops.registry import BackwardPass, Node
    from shardc.sharding.phase import Phase

__all__ = ["ROTARY", "THETA", "rotary_of", "rotate", "emit"]

Array = Any
THETA = 10000.0  # RoFormer's frequency base (arXiv 2104.09864, section 3.2.2), LLaMA 2's default


def rotary_of(call: Call, head: str, inverse: bool = False) -> Rotary:
    """The call's rotation of the head dim ``head`` (its argument's last index)."""
    return Rotary(call.names[0], head, call.numbers[0] if call.numbers else THETA, inverse)


def _whole_head(value: Value, indices: tuple[str, ...], head: str) -> Value:
    """``value`` with the head dim's sharding dropped (gathered): each pair's two elements on one device."""
    return Value(tuple(() if i == head else axes for i, axes in zip(indices, value.layout, strict=True)),
                 value.unreduced)


def _plan(phase: Phase, node: Node, declared: dict[str, TensorRef], target: Value | None, label: str) -> None:
    """The argument reduced, in the result's layout with H whole (read index by index), then the rotation."""
    assert node.call is not None
    (arg,) = node.operands
    head = phase.indices[arg][-1]
    if target is None:
        natural = phase.natural(arg, declared.get(arg))
        held = dict(zip(phase.indices[arg], _whole_head(natural, phase.indices[arg], head).layout, strict=True))
        target = Value(tuple(held[i] for i in node.indices), ())
    elif target.layout[node.indices.index(head)]:
        axes = ", ".join(target.layout[node.indices.index(head)])
        raise ShardcError(f"{node.result}: a rotary embedding rotates {head} in pairs H/2 apart, so {head} must be "
                          f"whole on a device, not sharded over {axes}", node.statement.span,
                          fix=f"leave {head} unsharded in {node.result} (shard the heads or another dim)")
    target, want = phase.map_argument(arg, node.result, node.indices, target, declared.get(arg),
                                      "a rotary embedding", node.statement.span)
    map_step(phase, node, declared, target, want, rotary_of(node.call, head))


def _backward(bw: BackwardPass, node: Node, grad: str) -> None:
    """dX = the inverse rotation of dY (the rotation is orthogonal), H whole: the cotangent alone is read."""
    assert node.call is not None
    if (found := map_gradient(bw, node)) is None:
        return
    z, value, want = found
    head = bw.phase.indices[z][-1]
    if value.unreduced or any(value.layout[node.indices.index(head)]):
        whole = _whole_head(Value(value.layout, ()), node.indices, head)
        _, moves = reshard(bw.phase.ctx, grad, node.indices, bw.phase.held[grad], whole)
        bw.phase.moves(grad, moves, note="the cotangent with the rotated dim whole")
        value, want = whole, _whole_head(want, bw.phase.indices[z], head)
    dst = bw.part_name(z)
    bw.phase.emit(Step(Op.ELEMENTWISE, dst, bw.phase.ref(dst, want), operands=(bw.phase.ref(grad, value),),
                       fn=rotary_of(node.call, head, inverse=True)), want)
    bw.settle(z, dst, want)


def emit(step: Step, var: Namer, sizes: dict[str, int] | None = None) -> str:
    """``rotary(x, (position dim, its axes), head dim, theta, inverse)``, the operand in the result's order."""
    fn = step.fn
    assert isinstance(fn, Rotary)
    (ref,) = step.operands
    dst = step.dst
    x = aligned_text(var(ref), ref.indices, dst.indices)
    d = dst.indices.index(fn.position)
    return (f"rotary({x}, ({d}, {dst.dims[d].axes!r}), {dst.indices.index(fn.head)}, {fn.theta!r}"
            f"{', inverse=True' if fn.inverse else ''})")


def _angles(labels: tuple[str, ...], shape: tuple[int, ...], position: str, theta: float, xp: Any) -> Array:
    """angle(t, i) = t * theta ** (-2i / H) for i < H/2, H the last dim, broadcast against the array's halves."""
    n, t = shape[-1], labels.index(position)
    if n % 2:
        raise ShardcError(f"rotary: the head dim {labels[-1]} has {n} elements, not an even number of pairs",
                          fix=f"give {labels[-1]} an even size")
    pos = xp.arange(shape[t]).reshape([-1 if d == t else 1 for d in range(len(shape))])
    rate = (theta ** (-2.0 * xp.arange(n // 2) / n)).reshape([1] * (len(shape) - 1) + [-1])
    return pos * rate


def rotate(x: Array, labels: tuple[str, ...], position: str, theta: float, sign: float, xp: Any) -> Array:
    """``x`` (indices ``labels``, the head dim last) rotated by its positions, angles times ``sign`` (-1: back)."""
    angle = _angles(labels, tuple(x.shape), position, theta, xp)
    cos, sin = xp.cos(angle), sign * xp.sin(angle)
    x1, x2 = xp.split(x, 2, axis=-1)
    return xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _site_rotation(site: Site) -> tuple[tuple[str, ...], str, float]:
    fn = rotary_of(site.func, site.labels[0][-1])
    return site.labels[0], fn.position, fn.theta


def _forward(site: Site, xs: Arrays, xp: Any) -> Array:
    labels, position, theta = _site_rotation(site)
    return rotate(xs[0], labels, position, theta, 1.0, xp)


def _vjp(site: Site, xs: Arrays, d: Array, xp: Any) -> Arrays:
    labels, position, theta = _site_rotation(site)
    return (rotate(d, labels, position, theta, -1.0, xp),)


def _bound(site: Site, mag: Array) -> Array:
    """The terms behind a rotated value: each pair's two magnitudes, times 1 + the angle (the lowered code
    rounds the angle t * theta ** (-2i / H) to its type, moving cos and sin by that much times a unit of its
    last place)."""
    labels, position, theta = _site_rotation(site)
    grow = 1.0 + np.abs(_angles(labels, tuple(mag.shape), position, theta, np))
    m1, m2 = np.split(mag, 2, axis=-1)
    return np.concatenate([grow * (m1 + m2)] * 2, axis=-1)


def _magnitude(site: Site, xs: Arrays, mags: Arrays, y: Array) -> Array:
    return _bound(site, mags[0])


def _grad_magnitude(site: Site, xs: Arrays, mags: Arrays, d: Array) -> Arrays:
    return (_bound(site, d),)


ROTARY = register(Family(name="rotary", calls=frozenset({"rotary"}), ops=(Rotary,), plan=_plan, backward=_backward,
                         emit=emit, reference=Reference(_forward, _vjp, _magnitude, _grad_magnitude)))
