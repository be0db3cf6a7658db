"""Reading an expression of a spec: its tensors, calls, token ids and the indices it leaves.

The parse, plan, cost and lower passes all read a spec's expressions through these
functions, so each question (which references, which calls, which tensors hold token
ids, which indices a chain's intermediate keeps) has one answer.

>>> from shardc.spec.parser import parse
>>> spec = parse("mesh X=4\\nOut[B_X, D] = In[B_X, D] · W_in[D, F] · W_out[F, D]\\n")
>>> [ref.name for ref in leaves(spec.statements[0].expr)]
['In', 'W_in', 'W_out']
>>> fold(("B", "D"), ("D", "F"), {"B", "D"}, {"F", "D"})
('B', 'F')
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from shardc.ir.spec import Add, Call, Contract, DType, Expr, Spec, Statement, TensorRef
from shardc.spec.functions import ID_BYTES, INDEXED, integer_args, is_known, signature

__all__ = ["leaves", "calls", "dropout_number", "id_refs", "id_vocabulary", "id_names", "element_bytes", "nbytes_of",
           "gather_nbytes_of", "route_slots", "domain_reads", "is_rename", "renamed_indices", "fold", "chain_indices",
           "operand_outers", "layer_inputs", "block_reads", "block_feeds", "spec_params"]


def leaves(expr: Expr) -> Iterator[TensorRef]:
    """The tensor references of an expression, left to right."""
    if isinstance(expr, TensorRef):
        yield expr
    elif isinstance(expr, Call):
        for arg in expr.args:
            yield from leaves(arg)
    else:
        for operand in expr.operands if isinstance(expr, Contract) else expr.terms:
            yield from leaves(operand)


def calls(expr: Expr) -> Iterator[Call]:
    """The function calls of an expression, outermost first."""
    if isinstance(expr, Call):
        yield expr
        for arg in expr.args:
            yield from calls(arg)
    elif isinstance(expr, Contract | Add):
        for operand in expr.operands if isinstance(expr, Contract) else expr.terms:
            yield from calls(operand)


def dropout_number(statement: Statement, call: Call) -> int:
    """Which dropout of its statement ``call`` is, outermost first (with the result, its mask's salt)."""
    dropouts = [c for c in calls(statement.expr) if c.func == "dropout"]
    return next(k for k, c in enumerate(dropouts) if c is call)


def id_refs(expr: Expr) -> Iterator[TensorRef]:
    """The token-id tensors of an expression (embed's ids, cross_entropy's targets): no gradient."""
    for call in calls(expr):
        for _, ref in _call_ids(call):
            yield ref


def _call_ids(call: Call) -> Iterator[tuple[int, TensorRef]]:
    """(argument number, reference) of each token-id argument of one call."""
    if is_known(call.func):
        for k in integer_args(call.func):
            arg = call.args[k] if k < len(call.args) else None
            if isinstance(arg, TensorRef):
                yield k, arg


def id_vocabulary(spec: Spec) -> dict[str, str]:
    """Every tensor holding token ids -> the vocabulary index its ids pick from: those embed (the
    table's first index) and cross_entropy (the index of the logits the ids lack) read, and what a
    copy of one reads (``Tok2[B, S] = Tok[B_X, S]`` moves ids, so Tok holds ids too)."""
    found: dict[str, str] = {}
    for statement in spec.statements:
        for call in calls(statement.expr):
            for k, ids in _call_ids(call):
                other = chain_indices(call.args[1 - k], ()) if len(call.args) == 2 else ()
                embed = signature(call.func).kind == "embed"
                vocab = other[:1] if embed else tuple(i for i in other if i not in ids.indices)
                found.setdefault(ids.name, vocab[0] if vocab else "")
    for statement in reversed(spec.statements):  # a copy is defined before what reads it
        source = statement.expr
        if statement.result.name in found and isinstance(source, TensorRef):
            found.setdefault(source.name, found[statement.result.name])
    return found


def domain_reads(spec: Spec) -> dict[str, str]:
    """Every tensor a map defined on part of the reals reads as its argument -> that domain
    (:attr:`~shardc.spec.functions.Signature.domain`: ``log(X)``'s X, "positive"), and what a copy of one
    reads: the values a check draws for it lie there (in both where two read it: x > 0 is x != 0 too)."""
    found: dict[str, str] = {}

    def read(name: str, domain: str) -> None:
        if domain == "positive" or name not in found:
            found[name] = domain

    for statement in spec.statements:
        for call in calls(statement.expr):
            arg = call.args[0] if is_known(call.func) and call.args else None
            if isinstance(arg, TensorRef) and signature(call.func).domain:
                read(arg.name, signature(call.func).domain)
    for statement in reversed(spec.statements):  # a copy is defined before what reads it
        source = statement.expr
        if statement.result.name in found and isinstance(source, TensorRef):
            read(source.name, found[statement.result.name])
    return found


def id_names(spec: Spec) -> frozenset[str]:
    """Every tensor holding token ids (:func:`id_vocabulary`): integers, without a gradient."""
    return frozenset(id_vocabulary(spec))


def element_bytes(spec: Spec) -> dict[str, int]:
    """The spec's tensors whose elements are not of its dtype: those a ``dtype T`` line names, at T's
    bytes, and the token ids (int32), 4 bytes.

    Part of the map :meth:`shardc.planner.graph.Graph.element_bytes` builds (which adds the
    keep-masks a dropout makes, and the gradients and intermediates of the tensors a ``dtype`` line
    names); every pass reads an element's bytes through :func:`nbytes_of`."""
    declared = {name: kind.nbytes for name, kind in spec.tensor_dtypes}
    return declared | dict.fromkeys(sorted(id_names(spec)), ID_BYTES)


def nbytes_of(tensor: str, element_bytes: Mapping[str, int], dtype: DType) -> int:
    """Bytes an element of ``tensor``: its entry in ``element_bytes``, else the spec's dtype's."""
    return element_bytes.get(tensor, dtype.nbytes)


def gather_nbytes_of(axes: Iterable[str], gathered: int | None, over: Iterable[str], own: int | None) -> int | None:
    """Bytes an element of a tensor's AllGather over ``axes`` moves: ``gathered`` (a param's ``param_gather ...
    in T``, None: none) where the gather runs over the ZeRO axes ``over`` alone, FSDP's gathers, the ones
    torchao's float8 all-gather casts (a weight gathered over a tensor-parallel axis is the program's own
    choice, in its own type); else ``own``.  The one rule the search and the plan's readers share."""
    return own if gathered is None or not set(axes) <= set(over) else gathered


def route_slots(expr: Expr) -> set[str]:
    """The capacity indices that ``route`` calls in ``expr`` make (no tensor of the spec has them before)."""
    return {c.names[1] for c in calls(expr) if is_known(c.func) and signature(c.func).kind in ("route", "dispatch")
            and len(c.names) == 2}


def node_limits(spec: Spec) -> dict[tuple[str, str], tuple[int, int, int]]:
    """(expert index, slot index) -> (k, limit, groups) of each node-limited ``dispatch``/``combine``
    (``k over E, M, G``): what the AllToAll moving its slots costs across nodes."""
    return {(call.over, call.names[1]): (int(call.numbers[0]), int(call.numbers[1]), int(call.numbers[2]))
            for statement in spec.statements for call in calls(statement.expr)
            if call.func in INDEXED and len(call.numbers) == 3 and call.over is not None}


def is_rename(statement: Statement) -> bool:
    """``Kx[B, T, D] = X[B, S, D]``: a tensor read under other index names (by position)."""
    expr = statement.expr
    return isinstance(expr, TensorRef) and set(expr.indices) != set(statement.result.indices) and \
        len(expr.indices) == len(statement.result.indices)


def renamed_indices(spec: Spec) -> list[tuple[str, str]]:
    """(new, old) for each index a rename gives another name: the two have one size."""
    pairs: dict[tuple[str, str], None] = {}
    for statement in spec.statements:
        if is_rename(statement):
            assert isinstance(statement.expr, TensorRef)
            for new, old in zip(statement.result.indices, statement.expr.indices, strict=True):
                if new != old:
                    pairs[(new, old)] = None
    return list(pairs)


def fold(left: tuple[str, ...], right: tuple[str, ...], final: set[str], later: set[str]) -> tuple[str, ...]:
    """Indices of a chain intermediate (the book's left-to-right products).

    A shared index is batch, and kept, iff it is in the final result and no later
    operand reads it; otherwise neighbours contract it (``In[B,D]·W_in[D,F]·W_out[F,D]``
    contracts D first and reads a new D in W_out).
    """
    shared = set(left) & set(right)
    batch = {i for i in shared if i in final and i not in later}
    out = [i for i in left if i not in shared or i in batch]
    out += [i for i in right if i not in shared]
    return tuple(out)


def chain_indices(expr: Expr, outer: tuple[str, ...]) -> tuple[str, ...]:
    """The indices ``expr`` leaves, under chain folding towards a result with ``outer``."""
    if isinstance(expr, TensorRef):
        return expr.indices
    if isinstance(expr, Call):
        return _call_indices(expr, outer)
    if isinstance(expr, Add):
        terms = [chain_indices(t, outer) for t in expr.terms]
        return max(terms, key=len)  # the widest term; the others broadcast (checked by validate)
    parts = [chain_indices(o, towards) for o, towards in zip(expr.operands, operand_outers(expr, outer), strict=True)]
    acc = parts[0]
    for k in range(1, len(parts)):
        acc = fold(acc, parts[k], set(outer), {i for p in parts[k + 1:] for i in p})
    return acc


def operand_outers(expr: Contract, outer: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The indices each operand of a chain is computed towards: the result's and those its siblings read.

    A parenthesised group sums an index only where nothing outside it reads that index, as an einsum
    would: ``(Gt[B, F] * U[B, F]) · W[F, D]`` keeps F in the group for W to contract.
    """
    refs = [{i for ref in leaves(o) for i in ref.indices} for o in expr.operands]
    outers = []
    for k in range(len(expr.operands)):
        siblings = set().union(*(r for m, r in enumerate(refs) if m != k))
        outers.append(outer + tuple(sorted(i for i in siblings if i not in outer)))
    return outers


def _call_indices(call: Call, outer: tuple[str, ...]) -> tuple[str, ...]:
    """A call's indices: its argument's, less a reduced index; a lookup's or a loss's by kind."""
    kind = signature(call.func).kind if is_known(call.func) else "elementwise"
    if kind == "reduce" and call.over is not None:
        return tuple(i for i in chain_indices(call.arg, outer + (call.over,)) if i != call.over)
    if kind == "embed" and call.more:
        return chain_indices(call.arg, ()) + chain_indices(call.more[0], ())[1:]
    if kind == "loss":
        return ()
    if kind == "attention" and len(call.more) in (2, 4):  # Q's indices, its head dim replaced by V's (a pair or not)
        q, v = chain_indices(call.arg, ()), chain_indices(call.more[1], ())
        return (*q[:-1], v[-1]) if q and v else q
    if kind == "route" and len(call.names) == 2:
        return chain_indices(call.arg, outer) + (call.names[1],)
    if kind in ("dispatch", "combine") and call.more and len(call.names) == 2 and call.over is not None:
        gates, tokens = chain_indices(call.arg, ()), chain_indices(call.more[0], ())
        order, slots = call.names
        if kind == "dispatch":
            return tuple(i for i in gates if i != order) + (slots,) + tuple(i for i in tokens if i not in gates)
        return tuple(i for i in gates if i != call.over) + tuple(i for i in tokens if i not in gates and i != slots)
    return chain_indices(call.arg, outer)


def layer_inputs(spec: Spec) -> tuple[str, ...]:
    """The activations each ``layers L { ... }`` block reads that a statement before it makes (none
    without a block): what a layer starts from, so what full recomputation keeps for each layer."""
    found: dict[str, None] = {}
    for lo, hi, _ in spec.blocks():
        made = {s.result.name for s in spec.statements[:lo]}
        found.update((r.name, None) for s in spec.statements[lo:hi] for r in leaves(s.expr) if r.name in made)
    return tuple(found)


def spec_params(spec: Spec) -> frozenset[str]:
    """The params: the ``param`` line's names, else every tensor read whose name starts with W."""
    if spec.params is not None:
        return frozenset(spec.params)
    return frozenset(r.name for s in spec.statements for r in leaves(s.expr) if r.name.startswith("W"))


def block_feeds(spec: Spec, block: tuple[Statement, ...]) -> list[tuple[TensorRef, TensorRef | None]]:
    """Each activation input of a repeated block (read, never made in it, neither a param, nor const, nor
    token ids) with the output that feeds it in the next layer: the last result no statement of the block
    reads with the same indices (None where there is none)."""
    defined = {s.result.name for s in block}
    read = [r for s in block for r in leaves(s.expr)]
    skip = defined | spec_params(spec) | set(spec.const) | id_names(spec)
    inputs = list({r.name: r for r in read if r.name not in skip}.values())
    names = {r.name for r in read}
    outputs = [s.result for s in block if s.result.name not in names]  # read after the block, or never
    return [(given, next((o for o in reversed(outputs) if o.indices == given.indices), None)) for given in inputs]


def block_reads(spec: Spec) -> dict[str, int]:
    """Each tensor a repeated statement reads, with the ``layers`` block it repeats in (:meth:`Spec.block_of`;
    every statement's, in block 0, with ``layers`` and no block): what counts once a layer of that block."""
    found: dict[str, int] = {}
    for k, statement in enumerate(spec.statements):
        block = spec.block_of(k)
        if block is not None:
            for ref in leaves(statement.expr):
                found.setdefault(ref.name, block)
    return found
