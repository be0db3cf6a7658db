"""The index-based expert routing family: ``dispatch`` and ``combine``, registered once.

``In[G, E, C, D] = dispatch(Gate[G, S, E], X[G, S, D], S, C, k over E)`` writes each token's row into
its slot of each of its k experts, and ``Y[G, S, D] = combine(Gate[G, S, E], Ex[G, E, C, D], S, C, k
over E)`` sums each token's k expert rows weighted by its gates: the routing of ``route`` (GShard,
Lepikhin et al. 2020; Switch, Fedus et al. 2021) held as indices, as MegaBlocks (Gale et al. 2023)
and DeepSeek-V3's expert parallelism move tokens, rather than as a one-hot mask ``[G, S, E, C]``
contracted with the tokens.  Its steps are data movement: no FLOPs, their HBM bytes memory-bound
(:func:`~shardc.ops.registry.all_traffic`), each a kernel of its own (a scatter or a gather); the
expert-parallel AllToAll is the move of ``In`` (and of ``Ex``) between the gates' batch sharding and
the experts' axis, tokens x k x D bytes.  The backward keeps the gates, never a mask.

:mod:`shardc.ops.dispatch_plans` plans both, forward and backward; :mod:`shardc.ops.dispatch_code`
writes their steps as calls of :mod:`shardc.lowering.runtime`'s ``expert_*`` helpers and gives their
meaning on whole arrays (the dense mask form, an independent program for the reference).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from shardc.errors import ShardcError
from shardc.ir.localops import Dispatch
from shardc.ir.spec import Call, Expr
from shardc.ops.dispatch_code import canonical, dispatch_code, whole_forward, whole_vjp
from shardc.ops.dispatch_plans import dispatch_backward, plan_dispatch
from shardc.ops.registry import Arrays, Builder, Family, Reference, Site, register
from shardc.spec.walk import chain_indices

if TYPE_CHECKING:
    from shardc.ops.registry import Node

__all__ = ["DISPATCH"]

Array = Any


def _operands(builder: Builder, call: Call, result: str, indices: tuple[str, ...]) -> tuple[tuple[str, ...],
                                                                                        tuple[str, ...]]:
    """The gates and the tokens (or expert rows), each towards its own indices; nothing else is kept."""
    return tuple(builder.argument(arg, result, chain_indices(arg, ())) for arg in call.args), ()


def _fn(call: Call) -> Dispatch:
    assert call.over is not None
    return Dispatch(call.func, call.names[0], call.over, call.names[1], int(call.numbers[0]))


def _orders(site: Site) -> tuple[Dispatch, tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """The call's operation, the gates' canonical order, the other operand's, the result's."""
    fn = _fn(site.func)
    gates, tokens, experts = canonical(fn, *site.labels)
    return (fn, gates, tokens, experts) if fn.part == "dispatch" else (fn, gates, experts, tokens)


def _to(x: Array, have: tuple[str, ...], want: tuple[str, ...], xp: Any) -> Array:
    return xp.transpose(x, tuple(have.index(i) for i in want)) if have != want else x


def _canonical(site: Site, xs: Arrays, xp: Any) -> tuple[Dispatch, Array, Array, int]:
    fn, gates, other, _ = _orders(site)
    if fn.slots not in site.shape:
        raise ShardcError(f"{fn.part}'s capacity index {fn.slots} has no size", fix=f"give {fn.slots} a size in dims")
    return (fn, _to(xs[0], site.labels[0], gates, xp), _to(xs[1], site.labels[1], other, xp),
            site.shape[fn.slots])


def _forward(site: Site, xs: Arrays, xp: Any) -> Array:
    fn, gates, other, capacity = _canonical(site, xs, xp)
    return whole_forward(fn.part, gates, other, fn.k, capacity, xp)


def _back(site: Site, grads: tuple[Array | None, Array], xp: Any) -> tuple[Array | None, ...]:
    """The gradients, from canonical order to each operand's."""
    _, gates, other, _ = _orders(site)
    d_gates, d_other = grads
    return (None if d_gates is None else _to(d_gates, gates, site.labels[0], xp),
            _to(d_other, other, site.labels[1], xp))


def _vjp(site: Site, xs: Arrays, d: Array, xp: Any) -> tuple[Array | None, ...]:
    fn, gates, other, capacity = _canonical(site, xs, xp)
    return _back(site, whole_vjp(fn.part, gates, other, d, fn.k, capacity, xp), xp)


def _magnitude(site: Site, xs: Arrays, mags: Arrays, y: Array) -> Array:
    """The rows' magnitudes moved (dispatch) or summed with the gates' magnitudes as weights (combine)."""
    fn, gates, other, capacity = _canonical(site, xs, np)
    _, mag_gates, mag_other, _ = _canonical(site, mags, np)
    return whole_forward(fn.part, gates, mag_other, fn.k, capacity, np, weights=mag_gates)


def _grad_magnitude(site: Site, xs: Arrays, mags: Arrays, d: Array) -> tuple[Array | None, ...]:
    fn, gates, other, capacity = _canonical(site, xs, np)
    _, mag_gates, mag_other, _ = _canonical(site, mags, np)
    grads = whole_vjp(fn.part, gates, mag_other, np.abs(d), fn.k, capacity, np, weights=mag_gates)
    return _back(site, grads, np)


def _arguments(call: Call, keep: tuple[str, ...]) -> tuple[tuple[Expr, tuple[str, ...]], ...]:
    return tuple((arg, chain_indices(arg, ())) for arg in call.args)


def _indices(call: Call, operands: tuple[tuple[str, ...], ...]) -> tuple[str, ...]:
    """The result in the helpers' order: batch, E, C, features (dispatch); batch, S, features (combine)."""
    _, tokens, experts = canonical(_fn(call), *operands)
    return experts if call.func == "dispatch" else tokens


def _reaches(node: Node) -> tuple[bool, ...]:
    """dispatch's gradient reaches the tokens, not the gates (a routing is 0/1, as route's mask);
    combine's reaches both."""
    return (node.fn != "dispatch", True)


DISPATCH = register(Family(
    name="dispatch", calls=frozenset({"dispatch", "combine"}), ops=(Dispatch,), plan=plan_dispatch,
    backward=dispatch_backward, emit=dispatch_code,
    reference=Reference(_forward, _vjp, _magnitude, _grad_magnitude, _arguments, _indices),
    operands=_operands, reaches=_reaches, fusible=False))
