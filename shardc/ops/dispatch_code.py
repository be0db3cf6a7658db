"""``dispatch`` and ``combine`` (index-based expert routing), as lowering and the numpy reference see them.

:func:`dispatch_code` writes a planned step (:mod:`shardc.ops.dispatch`: S, E and C
whole on the device) as one call of a :mod:`shardc.lowering.runtime` helper
(``expert_dispatch`` and the rest: ``jax.lax.top_k``, a cumulative count along S, then a
scatter or gather by those indices), its operands transposed to the helper's order (batch
indices, then S and E, or E and C, then features) and its result back to the step's.  The
capacity is C's share of the tokens the step is given (:func:`shardc.ops.route_code.capacity_code`).

The whole-array meaning (:func:`whole_forward`, :func:`whole_vjp`) is written again the dense
way, for :mod:`shardc.lowering.reference`: ``route``'s 0/1 mask and einsums with it (GShard,
Lepikhin et al. 2020), so the index-based module is checked against an independent program.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardc.ir.localops import Dispatch
from shardc.ir.plan import Step
from shardc.ir.spec import TensorRef
from shardc.ops.route_code import capacity_code, route_forward

__all__ = ["dispatch_code", "canonical", "whole_forward", "whole_vjp"]

Array = Any
# collect (an unweighted combine) sums a token's slot rows as dispatch's gradient does, and its gradient
# writes dY's rows into the slots as dispatch writes the tokens': the same helpers
_HELPERS = {"dispatch": "expert_dispatch", "combine": "expert_combine", "dispatch_vjp": "expert_dispatch_vjp",
            "combine_vjp": "expert_combine_vjp", "combine_gate_vjp": "expert_gate_vjp",
            "collect": "expert_dispatch_vjp", "collect_vjp": "expert_dispatch"}
# the parts whose second operand (and result) is token-indexed [batch, S, features]
_TOKEN_READ = frozenset({"dispatch", "combine_vjp", "combine_gate_vjp", "collect_vjp"})


def canonical(fn: Dispatch, gates: tuple[str, ...], other: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """The helper's index order of the gates, of a token-indexed tensor and of an expert-indexed one,
    given the gates' indices and another operand's (its features: the indices the gates lack, less C);
    under ``fn.each`` the token-indexed tensor has the expert index after S."""
    batch = tuple(i for i in gates if i not in (fn.order, fn.experts))
    features = tuple(i for i in other if i not in gates and i != fn.slots)
    each = (fn.experts,) if fn.each else ()
    return (batch + (fn.order, fn.experts), batch + (fn.order,) + each + features,
            batch + (fn.experts, fn.slots) + features)


def _moved(code: str, have: tuple[str, ...], want: tuple[str, ...]) -> str:
    if have == want:
        return code
    return f"jnp.transpose({code}, {tuple(have.index(i) for i in want)})"


def dispatch_code(step: Step, var: Callable[[TensorRef], str], sizes: dict[str, int] | None) -> str:
    """One dispatch, combine or gradient step as one line of Python."""
    fn = step.fn
    assert isinstance(fn, Dispatch)
    gates, second = step.operands[0], step.operands[1]
    g_order, tokens, experts = canonical(fn, gates.indices, second.indices)
    token_read = fn.part in _TOKEN_READ
    args = [_moved(var(gates), gates.indices, g_order),
            _moved(var(second), second.indices, tokens if token_read else experts)]
    if fn.part == "combine_gate_vjp":
        rows = step.operands[2]
        args.append(_moved(var(rows), rows.indices, experts))
    made = {"dispatch": experts, "combine": tokens, "dispatch_vjp": tokens, "combine_vjp": experts,
            "combine_gate_vjp": g_order, "collect": tokens, "collect_vjp": experts}[fn.part]
    capacity = capacity_code(f"{var(gates)}.shape[{gates.indices.index(fn.order)}]", fn.order, fn.slots, sizes)
    nodes = f", limit={fn.limit}, groups={fn.groups}" if fn.limit else ""
    nodes += ", each=True" if fn.each else ""
    code = f"{_HELPERS[fn.part]}({', '.join(args)}, k={fn.k}, capacity={capacity}{nodes})"
    return _moved(code, made, step.dst.indices)


# --- whole arrays: the reference (dense, through route's mask) ------------------------------

def _mask(gates: Array, k: int, capacity: int, xp: Any, nodes: tuple[int, int]) -> Array:
    """Route's 0/1 mask of canonical gates [*batch, S, E]: [*batch, S, E, C] (``nodes``: node-limited)."""
    lead = gates.ndim - 2
    return route_forward(gates, lead, lead + 1, capacity, k, xp, nodes)


def _flat(x: Array, lead: int, inner: int, xp: Any) -> Array:
    return xp.reshape(x, (-1, *x.shape[lead:lead + inner], int(_prod(x.shape[lead + inner:]))))


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def whole_forward(part: str, gates: Array, other: Array, k: int, capacity: int, xp: Any,
                  weights: Array | None = None, nodes: tuple[int, int] = (0, 0), each: bool = False) -> Array:
    """``dispatch`` (``other``: tokens [*batch, S, *f] -> [*batch, E, C, *f]; ``each``: [*batch, S, E, *f],
    each slot its expert's) or ``combine`` (``other``: expert rows [*batch, E, C, *f] -> [*batch, S, *f]),
    on canonical whole arrays; ``weights`` (the gates by default) weigh the combine, routed by ``gates``;
    ``collect`` is combine unweighted."""
    lead = gates.ndim - 2
    mask = xp.reshape(_mask(gates, k, capacity, xp, nodes), (-1, *gates.shape[-2:], capacity))
    gates = gates if weights is None else weights
    if part == "dispatch":
        inner = 2 if each else 1
        y = xp.einsum("nsec,nsef->necf" if each else "nsec,nsf->necf", mask, _flat(other, lead, inner, xp))
        return xp.reshape(y, (*gates.shape[:-2], gates.shape[-1], capacity, *other.shape[lead + inner:]))
    if part == "collect":
        gates = xp.ones_like(gates)
    weights = mask * xp.reshape(gates, (-1, *gates.shape[-2:]))[..., None]
    y = xp.einsum("nsec,necf->nsf", weights, _flat(other, lead, 2, xp))
    return xp.reshape(y, (*gates.shape[:-1], *other.shape[lead + 2:]))


def whole_vjp(part: str, gates: Array, other: Array, d: Array, k: int, capacity: int, xp: Any,
              weights: Array | None = None, nodes: tuple[int, int] = (0, 0),
              each: bool = False) -> tuple[Array | None, Array]:
    """(the gates' gradient or None, the other operand's) of :func:`whole_forward` for the cotangent ``d``
    (``weights``, ``each``: as there)."""
    lead = gates.ndim - 2
    mask = xp.reshape(_mask(gates, k, capacity, xp, nodes), (-1, *gates.shape[-2:], capacity))
    gates = gates if weights is None else weights
    if part == "dispatch":
        dx = xp.einsum("nsec,necf->nsef" if each else "nsec,necf->nsf", mask, _flat(d, lead, 2, xp))
        return None, xp.reshape(dx, other.shape)
    rows, ds = _flat(other, lead, 2, xp), _flat(d, lead, 1, xp)
    if part == "collect":
        return None, xp.reshape(xp.einsum("nsec,nsf->necf", mask, ds), other.shape)
    weights = mask * xp.reshape(gates, (-1, *gates.shape[-2:]))[..., None]
    d_rows = xp.reshape(xp.einsum("nsec,nsf->necf", weights, ds), other.shape)
    d_gates = xp.einsum("nsec,necf,nsf->nse", mask, rows, ds)
    return xp.reshape(d_gates, gates.shape), d_rows
