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
  no index summed away without a partner operand, reshards keeping indices
  (:mod:`shardc.spec.exprs`);
- `recompute` naming functions the spec calls, params or computed tensors, each once;
- `dtype T tensors` naming the spec's float tensors, each once, and `gemm T results` naming statements
  that contract an index, each once (:mod:`shardc.spec.dtypes`);
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
from collections.abc import Callable

from shardc.errors import LAYERS_FEED, ShardcError, Span, clip
from shardc.ir.spec import Dim, Spec, Statement, TensorRef
from shardc.spec.dtypes import check_dtypes, check_gemms
from shardc.spec.exprs import check_expression
from shardc.spec.stages import check_pipeline
from shardc.spec.walk import block_feeds, calls, leaves

__all__ = ["validate", "check_name"]

_DIM_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9]*")
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # the grammar's NAME (grammar/shard.lark)
MAX_NAME = 200  # characters; longer names are no one's intent and only slow every pass


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
    _check_names(spec)
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
        check_expression(statement, spec)  # shardc.spec.exprs
        _check_reads(statement, number, defined, first)
        line = statement.result.span.line if statement.result.span else number + 1
        first[statement.result.name] = (statement.result, line, True)
    _check_layers(spec)
    _check_params(spec, defined)
    _check_const(spec, defined)
    _check_namespaces(spec)
    _check_zero(spec)
    _check_recompute(spec, defined)
    check_dtypes(spec)  # the `dtype T tensors` lines
    check_gemms(spec)  # the `gemm T statements` lines
    check_pipeline(spec)  # the pipeline axis, microbatches and schedule lines
    _check_feed(spec)  # after the per-reference checks: it compares whole shardings


# --- header ---------------------------------------------------------------------------

def _spans(spec: Spec, key: str) -> list[Span | None]:
    return [span for name, span in spec.header_spans if name == key]


def _nth_span(spec: Spec, key: str, n: int) -> Span | None:
    found = _spans(spec, key)
    return found[n] if n < len(found) else spec.span_of(key)


def _first_span(spec: Spec) -> Span | None:
    return spec.span_of("mesh")


def _check_names(spec: Spec) -> None:
    """Every name is what the grammar's NAME admits (a Spec built in Python met no grammar).

    Names reach JAX and XLA as mesh axis names, argument names and HLO metadata; outside
    ASCII letters, digits and `_` (a backquote, a Greek letter, a line separator) XLA has
    aborted the process rather than report an error.
    """
    named = [(a.name, "mesh axis", a.span) for a in spec.mesh.axes]
    named += [(name, "tensor", None) for name in (*(spec.params or ()), *spec.const)]
    for statement in spec.statements:
        for ref in _refs_in_text_order(statement):
            named.append((ref.name, "tensor", ref.span))
            named += [(d.name, "index", d.span or ref.span) for d in ref.dims]
            named += [(axis, "mesh axis", d.span or ref.span) for d in ref.dims for axis in d.axes]
            named += [(axis, "mesh axis", ref.unreduced_span or ref.span) for axis in ref.unreduced]
    for name, what, span in named:
        check_name(name, what, span)


def check_name(name: object, what: str, span: Span | None = None) -> None:
    """``name`` is what the grammar's NAME admits, else a ShardcError saying it cannot name a ``what``."""
    if not isinstance(name, str) or len(name) > MAX_NAME or not _NAME_RE.fullmatch(name):
        raise ShardcError(f"{clip(repr(name))} cannot name a {what}", span,
                          fix=f"names are ASCII letters, digits and `_`, not starting with a digit, "
                              f"at most {MAX_NAME} characters")


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
    counts = [(spec.layers, spec.span_of("layers"))]
    counts += [(layers, spec.span_of(f"layers:{i}")) for i, (_, _, layers) in enumerate(spec.more_blocks, start=1)]
    for layers, span in counts:
        if isinstance(layers, int) and layers < 1:
            raise ShardcError(f"`layers {layers}`: a model has at least one layer", span,
                              fix="use layers 1 or more")
        if isinstance(layers, str) and layers not in spec.sizes:
            raise ShardcError(f"`layers {layers}`: {layers} is not a dim with a size", span,
                              fix=f"add {layers} to dims (e.g. `dims {layers}=40`) "
                              "or write the count, `layers 40`")


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


def _check_recompute(spec: Spec, defined: dict[str, int]) -> None:
    """``recompute NAMES``: each a function the spec calls, a param, or a tensor a statement computes; once."""
    called = {call.func for s in spec.statements for call in calls(s.expr)}
    params = {ref.name for s in spec.statements for ref in leaves(s.expr) if ref.name not in defined
              and (ref.name in spec.params if spec.params is not None else ref.name.startswith("W"))}
    seen: set[str] = set()
    for name in spec.recompute:
        span = _nth_span(spec, f"recompute:{name}", 1 if name in seen else 0)
        if name in seen:
            raise ShardcError(f"recompute {name} is listed twice", span, fix=f"list {name} once")
        seen.add(name)
        if name not in called and name not in params and name not in defined:
            raise ShardcError(f"recompute {name}: not a function the spec calls, a param or a computed tensor", span,
                              fix="name a function (every result of its calls is recomputed), a param (the "
                                  "products reading it), or a tensor a statement computes")


def _check_zero(spec: Spec) -> None:
    """``zero N over AXES``: mesh axes, each once, not the pipeline's (its devices hold other layers); and
    ``param_gather overlapped`` only where ZeRO-1 or 2 gathers the updated params back after the step, and
    ``param_gather in T`` no wider than the spec's dtype."""
    zero = spec.zero
    if spec.param_gather == "overlapped" and (zero is None or zero.stage == 3):
        raise ShardcError("`param_gather overlapped`: only ZeRO-1 and 2 gather the updated params back after the "
                          "step", spec.span_of("param_gather"),
                          fix="add `zero 1 over X` (or 2), or drop the line (ZeRO-3 gathers each param as it runs)")
    kind = spec.param_gather_dtype
    if kind is not None and kind.nbytes > spec.dtype.nbytes:  # a cast before the gather only ever narrows
        raise ShardcError(f"`param_gather in {kind}`: wider than the params' {spec.dtype}, so the gathers "
                          "would move more than the params hold", spec.span_of("param_gather"),
                          fix=f"gather in a type no wider than {spec.dtype} (`in f8`: torchao's float8 "
                              "all-gather), or drop `in ...`")
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
    blocks = spec.blocks() or ((0, len(spec.statements), spec.layers),)  # the whole spec repeats
    spans = [spec.span_of("layers"), *(spec.span_of(f"layers:{i}") for i in range(1, len(blocks)))]
    for (first, end, layers), span in zip(blocks, spans, strict=True):
        _check_block_feed(spec, spec.statements[first:end], layers, span)


def _check_block_feed(spec: Spec, block: tuple[Statement, ...], layers: int | str, span: Span | None) -> None:
    """One block's outputs feed its inputs (:func:`_check_feed`)."""
    for given, made in block_feeds(spec, block):
        if made is None:
            raise ShardcError(f"`layers {layers}` repeats the block, but no output has the indices of "
                              f"its input {given} to feed the next layer", span,
                              fix=f"end the block with an output {given.name}Out{given.sharding_text()}, or "
                              f"declare {given.name} `const` if every layer reads the same value", kind=LAYERS_FEED)
        if made.layout != given.layout or made.unreduced != given.unreduced:
            raise ShardcError(f"`layers`: output {made} feeds the next layer's input {given}, but their "
                              "shardings differ", made.span,
                              fix=f"write the output as {made.name}{given.sharding_text()} (the planner then "
                              "reshards it), or change the input's sharding", kind=LAYERS_FEED)


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
