"""Checks of a statement's expression: calls, index arguments, sums, chains and renames.

:func:`check_expression` runs them for one statement (after its references are checked,
before its reads are): functions known and given their arguments, each call's index
arguments indices of its tensors, terms of a sum that broadcast, result indices that
come from an operand, partial sums only over a sum, no index summed away without a
partner operand, and renames that keep sizes and places.

>>> from shardc.spec.parser import parse_unchecked
>>> spec = parse_unchecked("mesh X=4\\nOut[B_X, F] = In[B_X, D] · W[D, F]\\n")
>>> check_expression(spec.statements[0], spec)
"""

from __future__ import annotations

import math

from shardc.errors import ShardcError, Span
from shardc.ir.spec import Add, Call, Contract, Dim, Expr, Spec, Statement, TensorRef
from shardc.spec.attention_call import CAUSAL, roles
from shardc.spec.functions import is_known, known_list, signature
from shardc.spec.walk import calls, chain_indices, fold, is_rename, leaves, operand_outers, route_slots

__all__ = ["check_expression"]


# Reductions that are sums: over a sharded index they leave partial sums, which a result may keep.
LINEAR_REDUCTIONS = frozenset({"sum", "mean"})


def check_expression(statement: Statement, spec: Spec) -> None:
    """Raise the first mistake in ``statement``'s expression (its references are checked before)."""
    _check_calls(statement.expr)
    _check_expr(statement.expr, statement.result.indices, spec)
    _check_indices(statement, spec)


def _check_calls(expr: Expr) -> None:
    """Known functions, each given the arguments its signature asks for."""
    for call in calls(expr):
        span = call.span
        if span is not None:
            span = Span(span.line, span.column, len(call.func), span.filename, span.source_line)
        if not is_known(call.func):
            raise ShardcError(f"unknown function `{call.func}`", span, fix=f"use one of {known_list()}")
        sig = signature(call.func)
        _check_window(call, sig.kind)
        given = (len(call.args), len(call.names), len(call.numbers), call.over is not None)
        if sig.kind == "attention" and call.names:
            if call.names != (CAUSAL,):
                raise ShardcError(f"`attention` takes one flag, {CAUSAL}, not {', '.join(call.names)}", call.span,
                                  fix=f"write it as {sig.usage(call.func)}, or without `, {CAUSAL}`")
            given = (given[0], 0, *given[2:])  # the optional flag
        if sig.kind == "attention" and len(call.args) == 5:
            given = (3, *given[1:])  # the optional second (query, key) pair
        if sig.kind == "rotary" and not call.numbers:
            given = (*given[:2], 1, given[3])  # the optional frequency base (theta 10000)
        if sig.kind in ("dispatch", "combine") and len(call.numbers) == 3:
            given = (given[0], given[1], 1, given[3])  # the optional node limit: `k over E, M, G`
        if given != (sig.tensors, sig.names, sig.numbers, sig.over):
            raise ShardcError(f"`{call.func}` takes {_takes(sig.tensors, sig.names, sig.numbers, sig.over)}",
                              call.span, fix=f"write it as {sig.usage(call.func)}")


def _check_window(call: Call, kind: str) -> None:
    """A sliding window narrows a causal mask: only ``causal`` and a causal ``attention`` take one."""
    if call.window is None:
        return
    if kind not in ("mask", "attention"):
        raise ShardcError(f"`{call.func}` takes no window: a sliding window narrows a causal mask", call.span,
                          fix=f"drop `window {call.window}`, or mask with causal(Sc, S, T, window {call.window})")
    if kind == "attention" and CAUSAL not in call.names:
        raise ShardcError(f"attention: `window {call.window}` without `{CAUSAL}`: a sliding window narrows the "
                          "causal mask (keys t with s - W < t <= s)", call.span,
                          fix=f"write attention(Q, K, V over T, causal, window {call.window})")


def _check_rotary(call: Call, arg: tuple[str, ...], spec: Spec) -> None:
    """A rotary embedding rotates its argument's last index (the head dim, of an even size: its halves are the
    pairs) by the position index: two indices, and a frequency base above 0."""
    if arg and call.names[0] == arg[-1]:
        raise ShardcError(f"rotary: {arg[-1]} is the rotated head dim (the argument's last index), not a position",
                          call.span, fix="name the position index, e.g. rotary(Q[B, T, N, H], T)")
    if arg and spec.sizes.get(arg[-1], 0) % 2:
        raise ShardcError(f"rotary: the head dim {arg[-1]}={spec.sizes[arg[-1]]} is odd: its halves are the pairs "
                          "it rotates", call.span, fix=f"give {arg[-1]} an even size")
    if call.numbers and not (math.isfinite(call.numbers[0]) and call.numbers[0] > 0):
        raise ShardcError(f"rotary: a frequency base of {call.numbers[0]:g}: it must be above 0", call.span,
                          fix="give theta as the model does (10000 as LLaMA 2, 500000 as LLaMA 3), or leave it out")


def _takes(tensors: int, names: int, numbers: int, over: bool) -> str:
    parts = [f"{tensors} tensor{'s' * (tensors > 1)}"]
    if names:
        parts.append(f"{names} index names")
    if numbers:
        parts.append("a number")
    if over:
        parts.append("`over` an index")
    return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]


def _check_expr(expr: Expr, outer: tuple[str, ...], spec: Spec) -> None:
    """Each call's index arguments name indices of its tensors; each term of a sum broadcasts."""
    if isinstance(expr, TensorRef):
        return
    if isinstance(expr, Contract):
        parts = [chain_indices(o, outer) for o in expr.operands]
        for operand, part in zip(expr.operands, parts, strict=True):
            _check_expr(operand, part, spec)
        return
    if isinstance(expr, Add):
        full = chain_indices(expr, outer)
        for term in expr.terms:
            mine = chain_indices(term, full)
            if not set(mine) <= set(full):
                extra = ", ".join(i for i in mine if i not in full)
                raise ShardcError(f"a term of this sum has index {extra}, which its widest term lacks", term.span,
                                  fix="`+` and `-` add tensors of the same indices, or broadcast one whose "
                                  "indices are a subset (`X[B, D] + Bias[D]`)")
            _check_expr(term, full, spec)
        return
    _check_call(expr, outer, spec)


def _check_call(call: Call, outer: tuple[str, ...], spec: Spec) -> None:
    kind = signature(call.func).kind
    if kind == "attention":
        _check_attention(call, spec)
        return
    inner = outer + ((call.over,) if kind == "reduce" and call.over is not None else ())
    arg = chain_indices(call.arg, inner)
    if kind in ("route", "dispatch", "combine"):
        _check_route(call, arg, spec)
    if kind in ("dispatch", "combine"):
        _check_dispatch(call, arg, spec)
    routes = kind in ("route", "dispatch", "combine")
    for name in (*call.names[:1 if routes else None], *((call.over,) if call.over is not None else ())):
        if name not in arg:
            raise ShardcError(f"`{call.func}`: {name} is not an index of its argument ({', '.join(arg)})",
                              call.span, fix=f"name one of {', '.join(arg)}")
    if kind == "mask" and call.names[0] == call.names[1]:
        raise ShardcError("causal needs two different indices: the query position, then the key position",
                          call.span, fix="write causal(Sc[B, N, S, T], S, T)")
    if kind == "dropout" and not 0 <= call.numbers[0] < 1:
        raise ShardcError(f"dropout rate {call.numbers[0]:g} is not in [0, 1)", call.span,
                          fix="give the probability of dropping an element, e.g. 0.1")
    if kind == "affine" and not math.isfinite(call.numbers[0]):
        raise ShardcError(f"`{call.func}` by {call.numbers[0]:g}: not a finite number", call.span,
                          fix=f"write {signature(call.func).usage(call.func)}")
    if kind == "rotary":
        _check_rotary(call, arg, spec)
    if kind in ("embed", "loss"):
        _check_lookup(call)
    for a in call.args:
        _check_expr(a, inner if a is call.arg else chain_indices(a, ()), spec)


def _check_attention(call: Call, spec: Spec) -> None:
    """attention(Q, K, V[, Qr, Kr] over T[, causal]): each index's role fits (:func:`roles`), each argument
    checked towards its own indices."""
    q, k, v, *pair = (chain_indices(a, ()) for a in call.args)
    roles(q, k, v, call.over, call.span, *pair)
    for a in call.args:
        _check_expr(a, chain_indices(a, ()), spec)


def _check_route(call: Call, arg: tuple[str, ...], spec: Spec) -> None:
    """route(Gate[G, S, E], S, C, k over E): S orders the tokens, C (new) counts slots, k <= E experts."""
    order, slots = call.names
    k = call.numbers[0]
    fix = "write route(Gate[G, S, E], S, C, 2 over E): the token order index, a new capacity index, k"
    if slots in arg:
        raise ShardcError(f"route: the capacity index {slots} is an index of its argument ({', '.join(arg)})",
                          call.span, fix=fix)
    if order == call.over:
        raise ShardcError(f"route: tokens are ordered along {order}, which is the expert index", call.span, fix=fix)
    experts = (spec.sizes or {}).get(call.over or "")
    if not float(k).is_integer() or k < 1 or (experts is not None and k > experts):
        raise ShardcError(f"route: k={k:g} is not a whole number of experts from 1 to {experts or call.over}",
                          call.span, fix=fix)


def _check_dispatch(call: Call, gates: tuple[str, ...], spec: Spec) -> None:
    """dispatch(Gate[G, S, E], X[G, S, D], ...) and combine(Gate[G, S, E], Ex[G, E, C, D], ...): the tokens
    carry every index of the gates but E, the expert outputs every one but S, and C."""
    order, slots = call.names
    other = chain_indices(call.more[0], ())
    if call.func == "dispatch":
        want, what = [i for i in gates if i != call.over], "the tokens X carry every index of the gates but E"
        fix = "write dispatch(Gate[G, S, E], X[G, S, D], S, C, 2 over E)"
    else:
        want = [i for i in gates if i != order] + [slots]
        what = "the expert outputs Ex carry every index of the gates but S, and the capacity index"
        fix = "write combine(Gate[G, S, E], Ex[G, E, C, D], S, C, 2 over E)"
    if not set(want) <= set(other) or (call.func == "dispatch" and slots in other):
        raise ShardcError(f"{call.func}: {what} ({', '.join(want)}), not ({', '.join(other)})", call.span, fix=fix)
    if len(call.numbers) == 3:
        _check_node_limit(call, spec)


def _check_node_limit(call: Call, spec: Spec) -> None:
    """``k over E, M, G``: the E experts in G groups of E/G (a node's each), each token's k from at most M."""
    k, limit, groups = call.numbers
    experts = (spec.sizes or {}).get(call.over or "")
    fix = (f"write {call.func}(..., 8 over E, 4, 8): top 8 of E from the experts of at most 4 of its 8 "
           "groups (nodes), 0 < M <= G, G dividing E, and M groups holding at least k experts")
    if not (limit.is_integer() and groups.is_integer() and 1 <= limit <= groups):
        raise ShardcError(f"{call.func}: node limit {limit:g} of {groups:g} groups is not a whole number from 1 "
                          f"to the groups", call.span, fix=fix)
    if experts is not None and (experts % groups or limit * experts // groups < k):
        raise ShardcError(f"{call.func}: {groups:g} groups of the {experts} experts along {call.over} "
                          f"{'do not divide them' if experts % groups else f'leave fewer than k={k:g} in {limit:g}'}",
                          call.span, fix=fix)


def _check_lookup(call: Call) -> None:
    """embed(Tok, W[V, ...]) and cross_entropy(Logits[..., V], Tok): one index the ids pick from."""
    if call.func == "embed":
        tok, table = (chain_indices(a, ()) for a in call.args)
        if not table or table[0] in tok or set(table[1:]) & set(tok):
            raise ShardcError("embed(Tok, W): W's first index is the vocabulary the ids pick a row of, and "
                              "its other indices are not Tok's", call.span,
                              fix="write embed(Tok[B, S], W_emb[V, D])")
        return
    logits, tok = (chain_indices(a, ()) for a in call.args)
    extra = [i for i in logits if i not in tok]
    if len(extra) != 1 or not set(tok) <= set(logits):
        raise ShardcError("cross_entropy(Logits, Tok): Tok has every index of Logits but the vocabulary one",
                          call.span, fix="write cross_entropy(Logits[B, S, V], Tok[B, S])")


def _indices(expr: Expr) -> set[str]:
    return {i for ref in leaves(expr) for i in ref.indices} | route_slots(expr)


def _check_indices(statement: Statement, spec: Spec) -> None:
    result, expr = statement.result, statement.expr
    if isinstance(expr, Call) and result.unreduced and expr.func not in LINEAR_REDUCTIONS:
        raise ShardcError(f"{result.name} is a function ({expr.func}) of partial sums",
                          result.unreduced_span or result.span,
                          fix="drop the {U_...} suffix: a function needs reduced values")
    _check_partial_sums(statement)
    if is_rename(statement):
        _check_rename(statement, spec)
        return
    have = _indices(expr)
    for dim in result.dims:
        if dim.name not in have:
            where = "the tensor it copies" if isinstance(expr, TensorRef) else "any operand"
            raise ShardcError(f"result index {dim.name} of {result.name} is not in {where}",
                              dim.span or result.span,
                              fix=f"every result index must come from an operand: add {dim.name} to an "
                              f"operand or remove it from {result.name}")
    _check_summed(expr, set(result.indices), statement)
    _check_chain(expr, result.indices, statement)
    if isinstance(expr, Add | Call):
        made = chain_indices(expr, result.indices)
        if set(made) != set(result.indices):
            what = "a sum" if isinstance(expr, Add) else f"`{expr.func}`"
            raise ShardcError(f"{result.name} has indices {', '.join(result.indices) or 'none'}, but {what} "
                              f"gives {', '.join(made) or 'a scalar'}", result.span,
                              fix=f"write {result.name}[{', '.join(made)}]")


def _check_rename(statement: Statement, spec: Spec) -> None:
    """``Kx[B, T, D] = X[B, S, D]`` renames by position: sizes agree, a shared index keeps its place."""
    result, source = statement.result, statement.expr
    assert isinstance(source, TensorRef)
    sizes = spec.sizes
    for new, old in zip(result.dims, source.dims, strict=True):
        if new.name != old.name and (new.name in source.indices or old.name in result.indices):
            raise ShardcError(f"{result.name} renames {source.name}'s indices by position, but "
                              f"{new.name if new.name in source.indices else old.name} moves",
                              new.span or result.span,
                              fix="a rename keeps each index in its place: rename or transpose in two statements")
        if new.name != old.name and sizes and sizes.get(new.name) != sizes.get(old.name):
            raise ShardcError(f"{result.name} renames {old.name}={sizes.get(old.name)} to "
                              f"{new.name}={sizes.get(new.name)}", new.span or result.span,
                              fix=f"a rename keeps the size: give {new.name} and {old.name} one size in dims")


def _call_outer(call: Call, arg: Expr, outer: tuple[str, ...]) -> tuple[str, ...]:
    """The indices a call's argument is computed towards."""
    if arg is not call.arg or signature(call.func).kind in ("embed", "loss", "attention", "dispatch", "combine"):
        return chain_indices(arg, ())
    return outer + ((call.over,) if call.over is not None and call.over not in outer else ())


def _check_chain(expr: Expr, outer: tuple[str, ...], statement: Statement) -> None:
    """Each product of a chain keeps the indices one side has alone: a chain cannot sum inside one."""
    if isinstance(expr, Call):
        for arg in expr.args:
            _check_chain(arg, _call_outer(expr, arg, outer), statement)
        return
    if isinstance(expr, Add):
        for term in expr.terms:
            _check_chain(term, outer, statement)
        return
    if not isinstance(expr, Contract):
        return
    parts = [chain_indices(o, towards) for o, towards in zip(expr.operands, operand_outers(expr, outer), strict=True)]
    for operand, part in zip(expr.operands, parts, strict=True):
        _check_chain(operand, part, statement)
    acc = parts[0]
    for k in range(1, len(parts)):
        later = {i for p in parts[k + 1:] for i in p}
        out = outer if k == len(parts) - 1 else fold(acc, parts[k], set(outer), later)
        for i in acc + parts[k]:
            if (i in acc) != (i in parts[k]) and i not in out:
                raise ShardcError(
                    f"index {i} is summed over inside one operand of this chain", expr.span or statement.span,
                    fix="a chain contracts indices shared by neighbours; write this step as its own "
                        "statement with the index in its result")
        acc = out


def _check_partial_sums(statement: Statement) -> None:
    """A result can hold partial sums only over a sum: a contracted index, or partial operands."""
    result, expr = statement.result, statement.expr
    reads = list(leaves(expr))
    inherited = {a for ref in reads for a in ref.unreduced}
    contracted = _sums(expr, result.indices)
    for axis in result.unreduced:
        if axis not in inherited and not contracted:
            raise ShardcError(f"{result.name} is unreduced over {axis}, but nothing is summed to make "
                              "partial sums", result.unreduced_span or result.span,
                              fix=f"drop {axis} from the {{U_...}} suffix: only a contraction (an index in "
                              "two operands and not in the result) or a partial-sum operand leaves partial "
                              "sums")


def _sums(expr: Expr, kept: tuple[str, ...]) -> bool:
    """Whether ``expr`` sums over an index (a contraction, ``sum``/``mean``, or a term of ``+``
    that does): its result may then be left as partial sums."""
    if isinstance(expr, Add):
        return any(_sums(t, chain_indices(t, kept)) for t in expr.terms)
    if isinstance(expr, Call):
        return expr.func in LINEAR_REDUCTIONS
    if isinstance(expr, TensorRef):
        return False
    counts: dict[str, int] = {}
    for ref in leaves(expr):
        for index in ref.indices:
            counts[index] = counts.get(index, 0) + 1
    return any(n > 1 and i not in kept for i, n in counts.items())


def _check_summed(expr: Expr, needed: set[str], statement: Statement) -> None:
    """An index leaving ``expr`` without being needed must be contracted with another operand."""
    if isinstance(expr, Call):
        for arg in expr.args:
            _check_summed(arg, set(_call_outer(expr, arg, tuple(needed))), statement)
    elif isinstance(expr, Add):
        for term in expr.terms:
            _check_summed(term, needed, statement)
    elif isinstance(expr, Contract):
        parts = [_indices(o) for o in expr.operands]
        for n, operand in enumerate(expr.operands):
            others = set().union(*(p for m, p in enumerate(parts) if m != n))
            _check_summed(operand, parts[n] & (needed | others), statement)
    else:
        for dim in expr.dims:
            if dim.name not in needed:
                raise _summed_error(expr, dim, statement)


def _summed_error(ref: TensorRef, dim: Dim, statement: Statement) -> ShardcError:
    result = statement.result
    if statement.expr is ref:
        return ShardcError(f"{result.name} drops index {dim.name} of {ref.name}", dim.span or ref.span,
                           fix=f"a reshard copies a tensor with a new sharding: give {result.name} the "
                           f"indices of {ref.name} ({', '.join(ref.indices)})")
    return ShardcError(f"index {dim.name} of {ref.name} is in no other operand and not in the result "
                       f"{result.name}", dim.span or ref.span,
                       fix=f"shardc does not sum over free indices: add {dim.name} to the result "
                       f"{result.name}, or to another operand to contract it")

