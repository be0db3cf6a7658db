"""Semantic checks of a parsed spec: every mistake becomes a ShardcError with a caret.

The parser builds IR without judging it; :func:`validate` then checks, in text
order (so the first problem of the file is the one reported):

- the header: mesh axes named once, dims named once and without `_`, no name
  both a mesh axis and a dim (cost formulas read both as one symbol),
  `layers L` naming a dim, `param` naming input tensors, `const` naming
  inputs that are not params, `zero N over X` naming mesh axes (not the
  pipeline's), each once;
- each tensor reference: an index at most once, each axis in the mesh and used
  at most once (dims and the `{U_..}` suffix together), sizes known and
  divisible by the axes when `dims` is given;
- each statement: known functions, result indices that come from an operand,
  `{U_..}` only on a sum (not on a function's result, not without a contraction),
  no index summed away without a partner operand, reshards keeping indices;
- the data flow: a tensor defined once, never read before its definition, and
  read with one sharding everywhere (an intermediate as it was defined).

>>> from shardc.spec.parser import parse_unchecked
>>> validate(parse_unchecked("mesh X=4\\nOut[B_X, F] = In[B_X, D] · W[D, F]\\n"))
>>> try:
...     validate(parse_unchecked("mesh X=4\\nOut[B_X, F] = In[B_X, D] · W[D_X, F_X]\\n"))
... except ShardcError as err:
...     print(err)
<spec>:2:35: error: axis X is used twice in W[D_X, F_X]
    Out[B_X, F] = In[B_X, D] · W[D_X, F_X]
                                      ^^^
fix: a mesh axis shards at most one dim of a tensor (or marks it unreduced): remove X from one of them
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Iterator

from shardc.errors import ShardcError, Span
from shardc.pipeline.stages import check_pipeline
from shardc.spec.functions import ID_BYTES, integer_args, is_known, known_list, signature
from shardc.spec.ir import Add, Call, Contract, Dim, Expr, Spec, Statement, TensorRef

__all__ = ["validate", "leaves", "calls", "id_refs", "id_names", "id_vocabulary", "element_bytes",
           "chain_indices", "renamed_indices", "dropout_number", "route_slots"]

_DIM_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9]*")


# Reductions that are sums: over a sharded index they leave partial sums, which a result may keep.
LINEAR_REDUCTIONS = frozenset({"sum", "mean"})

# Specs found sound, by id (a Spec is frozen: once sound, always): the parser validates, and
# shardc.plan validates again for a Spec built in Python; the parser's need not be read twice.
_SOUND: weakref.WeakValueDictionary[int, Spec] = weakref.WeakValueDictionary()


def validate(spec: Spec) -> None:
    """Raise the first :class:`ShardcError` found in ``spec``; return None when it is sound."""
    if _SOUND.get(id(spec)) is spec:
        return
    _check(spec)
    _SOUND[id(spec)] = spec


def _check(spec: Spec) -> None:
    _check_mesh(spec)
    _check_dims(spec)
    if not spec.statements:
        raise ShardcError("the spec has no statements", _first_span(spec),
                          fix="add one, e.g. `Out[B_X, F] = In[B_X, D] · W[D, F]`")
    defined = _definitions(spec)
    first: dict[str, tuple[TensorRef, int, bool]] = {}  # name -> (first reference, line, is definition)
    for number, statement in enumerate(spec.statements):
        for ref in _refs_in_text_order(statement):
            _check_ref(ref, spec)
        _check_calls(statement.expr)
        _check_expr(statement.expr, statement.result.indices, spec)
        _check_indices(statement, spec)
        _check_reads(statement, number, defined, first)
        line = statement.result.span.line if statement.result.span else number + 1
        first[statement.result.name] = (statement.result, line, True)
    _check_layers(spec)
    _check_block(spec)
    _check_params(spec, defined)
    _check_const(spec, defined)
    _check_namespaces(spec)
    _check_zero(spec)
    check_pipeline(spec)  # the pipeline axis, microbatches and schedule lines
    _check_feed(spec)  # after the per-reference checks: it compares whole shardings


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


def id_names(spec: Spec) -> frozenset[str]:
    """Every tensor holding token ids (:func:`id_vocabulary`): integers, without a gradient."""
    return frozenset(id_vocabulary(spec))


def element_bytes(spec: Spec) -> dict[str, int]:
    """Bytes an element of each tensor whose elements are not of the spec's dtype: the token ids
    (int32).  The one place this is decided: the planner's volumes, the costs, memory and the HLO
    check all read it (:meth:`shardc.planner.ir.Plan.nbytes`)."""
    return dict.fromkeys(sorted(id_names(spec)), ID_BYTES)


# --- header ---------------------------------------------------------------------------

def _spans(spec: Spec, key: str) -> list[Span | None]:
    return [span for name, span in spec.header_spans if name == key]


def _nth_span(spec: Spec, key: str, n: int) -> Span | None:
    found = _spans(spec, key)
    return found[n] if n < len(found) else spec.span_of(key)


def _first_span(spec: Spec) -> Span | None:
    return spec.span_of("mesh")


def _check_mesh(spec: Spec) -> None:
    seen: set[str] = set()
    for axis in spec.mesh.axes:
        if axis.name in seen:
            raise ShardcError(f"mesh axis {axis.name} is given twice", axis.span,
                              fix="give each mesh axis a different name")
        if axis.size < 1:
            raise ShardcError(f"mesh axis {axis.name} has size {axis.size}", axis.span,
                              fix="a mesh axis has at least 1 device")
        seen.add(axis.name)


def _check_dims(spec: Spec) -> None:
    seen: dict[str, int] = {}
    for name, size in spec.dims:
        span = _nth_span(spec, f"dim:{name}", seen.get(name, 0))
        if not _DIM_NAME_RE.fullmatch(name):
            raise ShardcError(f"`{name}` cannot be a dim name", span,
                              fix="dim names are letters and digits, starting with a letter, without `_` "
                              "(in a tensor the first `_` of a dim starts its axes)")
        if name in seen:
            raise ShardcError(f"dim {name} is given twice in `dims`", span,
                              fix=f"dims are global: give {name} one size")
        if not isinstance(size, int) or size < 1:
            raise ShardcError(f"dim {name} has size {size}", span, fix="use a positive whole number")
        seen[name] = 1


def _check_layers(spec: Spec) -> None:
    layers = spec.layers
    span = spec.span_of("layers")
    if isinstance(layers, int) and layers < 1:
        raise ShardcError(f"`layers {layers}`: a model has at least one layer", span,
                          fix="use layers 1 or more")
    if isinstance(layers, str) and layers not in spec.sizes:
        raise ShardcError(f"`layers {layers}`: {layers} is not a dim with a size", span,
                          fix=f"add {layers} to dims (e.g. `dims {layers}=40`) "
                          "or write the count, `layers 40`")


def _check_block(spec: Spec) -> None:
    """A ``layers L { ... }`` block is not cut into pipeline stages (yet): the statements around it
    would run on the first and last stage (as Megatron-LM places the embedding and the loss), which
    neither the pipeline's cost (its stages are alike) nor its lowering (one layer function) does.
    Dropout is pipelined: a microbatch draws its slice of the whole batch's mask."""
    if spec.mesh.pipeline_axis is None:
        return
    if spec.block is not None:
        raise ShardcError("a `layers` block with a pipeline axis: the pipeline cuts the whole spec into stages "
                          "of identical layers, and does not yet place the statements before the block on the "
                          "first stage and those after it on the last", spec.span_of("layers"),
                          fix="pipeline the layer alone (`layers L` without braces; its first input is what a "
                          "stage receives), and cost the embedding and the loss without the pipeline axis")


def _check_params(spec: Spec, defined: dict[str, int]) -> None:
    if spec.params is not None:
        _check_listed(spec, defined, "param", spec.params, "params are trainable inputs: remove {name} from `param`")


def _check_const(spec: Spec, defined: dict[str, int]) -> None:
    """``const`` names inputs that get no gradient: read, never computed, not trainable."""
    def not_a_param(name: str, span: Span | None) -> None:
        if spec.params is not None and name in spec.params:
            raise ShardcError(f"{name} is both a param and const", span,
                              fix=f"a param is trained, so it has a gradient: remove {name} from `const` "
                              "or from `param`")

    _check_listed(spec, defined, "const", spec.const,
                  "`const` lists inputs that need no gradient: remove {name} from `const`", not_a_param)


def _check_listed(spec: Spec, defined: dict[str, int], keyword: str, listed: tuple[str, ...], computed_fix: str,
                  also: Callable[[str, Span | None], None] | None = None) -> None:
    """A header line listing inputs (``param``, ``const``): each once, read by a statement, never computed."""
    names = {ref.name for s in spec.statements for ref in leaves(s.expr)}
    seen: dict[str, int] = {}
    for name in listed:
        span = _nth_span(spec, f"{keyword}:{name}", seen.get(name, 0))
        if name in seen:
            raise ShardcError(f"{keyword} {name} is listed twice", span, fix=f"list {name} once")
        seen[name] = 1
        if name in defined:
            raise ShardcError(f"{keyword} {name} is computed by a statement, not an input", span,
                              fix=computed_fix.format(name=name))
        if also is not None:
            also(name, span)
        if name not in names:
            inputs = sorted(names - set(defined))
            raise ShardcError(f"{keyword} {name} is not a tensor of the spec", span,
                              fix="list input tensors the statements read: " + (", ".join(inputs) or "none"))


def _check_zero(spec: Spec) -> None:
    """``zero N over AXES``: mesh axes, each once, not the pipeline's (its devices hold other layers)."""
    zero = spec.zero
    if zero is None:
        return
    seen: set[str] = set()
    for axis in zero.axes:
        if axis not in spec.mesh.names:
            raise ShardcError(f"`{zero}`: {axis} is not a mesh axis ({spec.mesh})", zero.span,
                              fix="shard the training state over mesh axes: " + ", ".join(spec.mesh.names))
        if axis in seen:
            raise ShardcError(f"`{zero}`: axis {axis} is given twice", zero.span, fix=f"name {axis} once")
        if spec.mesh.axis(axis).pipeline:
            raise ShardcError(f"`{zero}`: {axis} is the pipeline axis, whose devices hold different layers",
                              zero.span, fix="shard the state over a data-parallel axis of the mesh")
        seen.add(axis)


def _check_feed(spec: Spec) -> None:
    """With ``layers``, each layer's outputs feed the next layer's inputs: their shardings agree.

    The layer is the ``layers L { ... }`` block when there is one (what it reads from before
    it is its input; what it makes and does not read itself, its output), else the whole spec.

    Each activation input (read, never computed, neither a param, nor const, nor token ids) is
    fed by the last output (a result no statement reads) with the same indices; other outputs
    (a layer's keys and values, say) leave the block.  An input with no such output is an error,
    and so is a pair whose shardings differ: the next layer could not read what this one wrote.
    """
    if spec.layers is None:
        return
    block = [st for k, st in enumerate(spec.statements) if spec.repeats(k)]  # the whole spec, or the block
    defined = {s.result.name for s in block}
    every = [r for s in spec.statements for r in leaves(s.expr)]
    read = [r for s in block for r in leaves(s.expr)]
    params = set(spec.params) if spec.params is not None else {r.name for r in every if r.name.startswith("W")}
    ids = id_names(spec)
    skip = defined | params | set(spec.const) | ids
    inputs = list({r.name: r for r in read if r.name not in skip}.values())
    names = {r.name for r in read}
    outputs = [s.result for s in block if s.result.name not in names]  # read after the block, or never
    for given in inputs:
        made = next((o for o in reversed(outputs) if o.indices == given.indices), None)
        if made is None:
            raise ShardcError(f"`layers {spec.layers}` repeats the block, but no output has the indices of "
                              f"its input {given} to feed the next layer", spec.span_of("layers"),
                              fix=f"end the block with an output {given.name}Out{given.sharding_text()}, or "
                              f"declare {given.name} `const` if every layer reads the same value")
        if made.layout != given.layout or made.unreduced != given.unreduced:
            raise ShardcError(f"`layers`: output {made} feeds the next layer's input {given}, but their "
                              "shardings differ", made.span,
                              fix=f"write the output as {made.name}{given.sharding_text()} (the planner then "
                              "reshards it), or change the input's sharding")


def _check_namespaces(spec: Spec) -> None:
    """A mesh axis and a dim share one namespace: volumes like ``2*D*F/X`` name both."""
    dims = dict.fromkeys(name for name, _ in spec.dims)
    dims.update(dict.fromkeys(d.name for s in spec.statements for r in _refs_in_text_order(s) for d in r.dims))
    for axis in spec.mesh.axes:
        if axis.name in dims:
            taken = set(dims) | set(spec.mesh.names)
            other = next(n for n in (*"XYZPQRSTUV", *(f"X{k}" for k in range(len(taken) + 1))) if n not in taken)
            raise ShardcError(f"{axis.name} names both a mesh axis and a dim", axis.span,
                              fix=f"cost formulas name both by their names and could not tell them apart: "
                              f"rename the mesh axis (e.g. {other}) everywhere, or the dim")


# --- tensor references ----------------------------------------------------------------

def _refs_in_text_order(statement: Statement) -> list[TensorRef]:
    reads = list(leaves(statement.expr))
    return reads + [statement.result] if statement.arrow else [statement.result, *reads]


def _check_ref(ref: TensorRef, spec: Spec) -> None:
    indices: set[str] = set()
    used: set[str] = set()
    for dim in ref.dims:
        span = dim.span or ref.span
        if dim.name in indices:
            raise ShardcError(f"index {dim.name} appears twice in {ref}", span,
                              fix="each dim of a tensor needs its own index name; shardc has no "
                              "diagonals or traces: rename one of them")
        indices.add(dim.name)
        _check_axes(dim.axes, used, ref, spec, span, dim)
        _check_size(dim, spec, span)
    _check_axes(ref.unreduced, used, ref, spec, ref.unreduced_span or ref.span, None)


def _check_axes(axes: tuple[str, ...], used: set[str], ref: TensorRef, spec: Spec,
                span: Span | None, dim: Dim | None) -> None:
    mesh = spec.mesh.names
    for axis in axes:
        if axis not in mesh:
            fix = f"use one of the mesh axes {', '.join(mesh)}, or add {axis} to the `mesh` line"
            if dim is not None and len(dim.axes) > 1 and all(len(a) == 1 for a in dim.axes):
                fix = (f"dim names cannot contain `_`: `{dim}` is dim {dim.name} sharded over axes "
                       f"{', '.join(dim.axes)}; name the dim without `_` (e.g. {dim.name}{''.join(dim.axes)})"
                       f" or {fix}")
            raise ShardcError(f"axis {axis} is not in the mesh ({spec.mesh})", span, fix=fix)
        if axis in used:
            raise ShardcError(f"axis {axis} is used twice in {ref}", span,
                              fix=f"a mesh axis shards at most one dim of a tensor (or marks it unreduced): "
                              f"remove {axis} from one of them")
        used.add(axis)


def _check_size(dim: Dim, spec: Spec, span: Span | None) -> None:
    if not spec.dims:
        return  # no sizes: a symbolic spec, nothing to divide
    sizes = spec.sizes
    if dim.name not in sizes:
        raise ShardcError(f"dim {dim.name} has no size, but the spec gives `dims`", span,
                          fix=f"add it to dims: `dims ..., {dim.name}=<size>` (or --set {dim.name}=<size>)")
    devices = 1
    for axis in dim.axes:
        devices *= spec.mesh.size(axis)
    if sizes[dim.name] < devices:
        # XLA pads a dim its devices do not divide (ceil(D / devices) a device), but a dim
        # smaller than its devices leaves some with nothing but padding
        over = " × ".join(f"{a}={spec.mesh.size(a)}" for a in dim.axes)
        raise ShardcError(f"dim {dim.name}={sizes[dim.name]} is smaller than its {devices} devices ({over}) "
                          f"in `{dim}`", span,
                          fix=f"make {dim.name} at least {devices}, or shard it over fewer axes")


# --- statements -----------------------------------------------------------------------

def _check_calls(expr: Expr) -> None:
    """Known functions, each given the arguments its signature asks for."""
    for call in calls(expr):
        span = call.span
        if span is not None:
            span = Span(span.line, span.column, len(call.func), span.filename, span.source_line)
        if not is_known(call.func):
            raise ShardcError(f"unknown function `{call.func}`", span, fix=f"use one of {known_list()}")
        sig = signature(call.func)
        given = (len(call.args), len(call.names), len(call.numbers), call.over is not None)
        if given != (sig.tensors, sig.names, sig.numbers, sig.over):
            raise ShardcError(f"`{call.func}` takes {_takes(sig.tensors, sig.names, sig.numbers, sig.over)}",
                              call.span, fix=f"write it as {sig.usage(call.func)}")


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
    inner = outer + ((call.over,) if kind == "reduce" and call.over is not None else ())
    arg = chain_indices(call.arg, inner)
    if kind == "route":
        _check_route(call, arg, spec)
    for name in (*call.names[:1 if kind == "route" else None], *((call.over,) if call.over is not None else ())):
        if name not in arg:
            raise ShardcError(f"`{call.func}`: {name} is not an index of its argument ({', '.join(arg)})",
                              call.span, fix=f"name one of {', '.join(arg)}")
    if kind == "mask" and call.names[0] == call.names[1]:
        raise ShardcError("causal needs two different indices: the query position, then the key position",
                          call.span, fix="write causal(Sc[B, N, S, T], S, T)")
    if kind == "dropout" and not 0 <= call.numbers[0] < 1:
        raise ShardcError(f"dropout rate {call.numbers[0]:g} is not in [0, 1)", call.span,
                          fix="give the probability of dropping an element, e.g. 0.1")
    if kind in ("embed", "loss"):
        _check_lookup(call)
    for a in call.args:
        _check_expr(a, inner if a is call.arg else chain_indices(a, ()), spec)


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


def route_slots(expr: Expr) -> set[str]:
    """The capacity indices that ``route`` calls in ``expr`` make (no tensor of the spec has them before)."""
    return {c.names[1] for c in calls(expr) if is_known(c.func) and signature(c.func).kind == "route"
            and len(c.names) == 2}


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
    parts = [chain_indices(o, outer) for o in expr.operands]
    acc = parts[0]
    for k in range(1, len(parts)):
        acc = fold(acc, parts[k], set(outer), {i for p in parts[k + 1:] for i in p})
    return acc


def _call_indices(call: Call, outer: tuple[str, ...]) -> tuple[str, ...]:
    """A call's indices: its argument's, less a reduced index; a lookup's or a loss's by kind."""
    kind = signature(call.func).kind if is_known(call.func) else "elementwise"
    if kind == "reduce" and call.over is not None:
        return tuple(i for i in chain_indices(call.arg, outer + (call.over,)) if i != call.over)
    if kind == "embed" and call.more:
        return chain_indices(call.arg, ()) + chain_indices(call.more[0], ())[1:]
    if kind == "loss":
        return ()
    if kind == "route" and len(call.names) == 2:
        return chain_indices(call.arg, outer) + (call.names[1],)
    return chain_indices(call.arg, outer)


def _call_outer(call: Call, arg: Expr, outer: tuple[str, ...]) -> tuple[str, ...]:
    """The indices a call's argument is computed towards."""
    if arg is not call.arg or signature(call.func).kind in ("embed", "loss"):
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
    parts = [chain_indices(o, outer) for o in expr.operands]
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


# --- data flow ------------------------------------------------------------------------

def _definitions(spec: Spec) -> dict[str, int]:
    """Each defined tensor's statement number; a second definition is an error."""
    defined: dict[str, int] = {}
    for number, statement in enumerate(spec.statements):
        result = statement.result
        if result.name in defined:
            earlier = spec.statements[defined[result.name]].result.span
            on = f" (first on line {earlier.line})" if earlier else ""
            raise ShardcError(f"tensor {result.name} is defined twice{on}", result.span,
                              fix=f"give this result another name, e.g. {result.name}2")
        defined[result.name] = number
    return defined


def _check_reads(statement: Statement, number: int, defined: dict[str, int],
                 first: dict[str, tuple[TensorRef, int, bool]]) -> None:
    for ref in leaves(statement.expr):
        if defined.get(ref.name, -1) >= number:
            later = "this" if defined[ref.name] == number else "a later"
            raise ShardcError(f"{ref.name} is read before it is defined (by {later} statement)", ref.span,
                              fix=f"move the statement defining {ref.name} above this one, or rename the "
                              "input so it is not also a result")
        if ref.name not in first:
            first[ref.name] = (ref, ref.span.line if ref.span else number + 1, False)
            continue
        earlier, line, is_definition = first[ref.name]
        if ref != earlier:
            how = "defined" if is_definition else "read"
            raise ShardcError(f"{ref.name} is read as {ref} here but {how} as {earlier} on line {line}",
                              ref.span,
                              fix=f"a tensor has one sharding: write {earlier} here, or add a reshard "
                              f"statement `{ref.name}2{ref.sharding_text()} = {earlier}` "
                              f"and read {ref.name}2")
