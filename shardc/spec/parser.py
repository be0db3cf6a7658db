"""Parse ``.shard`` text into the spec IR (then check it with :func:`validate`).

This module only parses: it turns text into :mod:`shardc.ir.spec` nodes;
lark's syntax errors become :class:`ShardcError` with a caret in
:mod:`shardc.spec.syntax_errors`.  Every semantic check lives in
:mod:`shardc.spec.validate`.

>>> spec = parse("mesh X=4, Y=2\\nOut[B_X, F_Y] = In[B_X, D] · W[D, F_Y]\\n")
>>> spec.mesh.names
('X', 'Y')
>>> str(spec.statements[0])
'Out[B_X, F_Y] = In[B_X, D] · W[D, F_Y]'
>>> parse_size("3_000_000", "B"), parse_size("2.5e3", "D")
(3000000, 2500)

Representation decisions (other passes rely on them):

- ``A · B · C`` is one flat :class:`Contract` of three operands; parentheses
  make nested Contracts (``(A · B) · C``), and a group around a whole operand
  list or a single operand is dropped (``(A)`` is ``A``).
- The chain form ``A · B -> R`` is ``Statement(arrow=True)``; meaning is the same.
- Several ``dims`` lines (and several ``param`` or ``const`` lines) merge, in order;
  ``mesh``, ``dtype`` (the spec's type), ``gemm T``, ``hardware`` and ``layers`` may appear once each;
  ``dtype T a, b`` and ``gemm T a, b`` lines (some tensors' type: :mod:`shardc.spec.dtypes`) merge.
  Header lines may come anywhere; statements keep their order.
- A line's first word ``mesh``/``dims``/``dtype``/``gemm``/``param``/``const``/``hardware``/``layers``/
  ``microbatches``/``stage_layers``/``schedule``/``zero``/``fusion``/``grad_reduce``/``attention_kernel``/
  ``param_gather``/``optimizer``/``recompute`` is the keyword, so those eighteen words cannot name a tensor or
  function there.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from lark import Lark, Token, Transformer
from lark.exceptions import UnexpectedInput, VisitError

from shardc.errors import ShardcError, Span
from shardc.ir.spec import (
    Add,
    Call,
    Contract,
    Dim,
    DType,
    Expr,
    Spec,
    Statement,
    TensorRef,
)
from shardc.spec.call_args import IndexArg, NumberArg, WindowArg, sort_args
from shardc.spec.dtypes import merge_dtypes
from shardc.spec.header_lines import Block, HeaderLines
from shardc.spec.lexicon import MAX_SIZE, cache_file, grammar_text, parse_size
from shardc.spec.source_spans import join_spans, parsing, token_size, token_span
from shardc.spec.syntax_errors import syntax_error
from shardc.spec.validate import validate

__all__ = ["parse", "parse_size", "grammar_text", "MAX_SIZE"]

# the header lines that may repeat, merging in order (any other kind is given once)
_MERGED = ("dims", "param", "const", "recompute", "dtype_tensors", "gemm_tensors")
MAX_NESTING = 48  # parentheses deeper than this are an error: keeps every pass far from the recursion limit
_AXIS_RUN_RE = re.compile(r"[A-Za-z]+")
_DIM_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9]*")

_local = threading.local()  # the text being parsed: the inline transformer is shared by threads
_parser_lock = threading.Lock()
_parser: Lark | None = None


def _get_parser() -> Lark:
    # Built once (grammar analysis costs ~0.1 s, cached on disk), with the transformer inline so no
    # tree is built.
    global _parser
    with _parser_lock:
        if _parser is None:
            _parser = Lark(grammar_text(), parser="lalr", lexer="contextual",
                           propagate_positions=True, transformer=_Builder(), cache=cache_file())
        return _parser


def parse(text: str, filename: str | None = None) -> Spec:
    """Parse spec text and validate it; every mistake is a :class:`ShardcError`."""
    spec = parse_unchecked(text, filename)
    validate(spec)
    return spec


def parse_unchecked(text: str, filename: str | None = None) -> Spec:
    """Parse spec text into IR without the semantic checks of :func:`validate`."""
    if not isinstance(text, str):
        raise ShardcError(f"spec text must be a str, not {type(text).__name__}")
    text = text.removeprefix("\ufeff")  # a UTF-8 byte order mark, which open(..., encoding="utf-8") keeps
    lines = [line.rstrip("\r") for line in text.split("\n")]  # lark counts lines by newlines only
    _check_nesting(lines, filename)
    parsing.lines, parsing.filename = lines, filename
    try:
        spec = _get_parser().parse(text if text.endswith("\n") else text + "\n")
    except VisitError as err:  # a transformer callback raised: lark wraps it (tree mode only)
        if isinstance(err.orig_exc, ShardcError):
            raise err.orig_exc from None
        raise
    except UnexpectedInput as err:
        raise syntax_error(err, lines, filename) from None
    finally:
        parsing.lines, parsing.filename = None, None
    assert isinstance(spec, Spec)
    return spec


def _check_nesting(lines: list[str], filename: str | None) -> None:
    # Reject pathological nesting before parsing, so no later pass can hit RecursionError.
    for number, line in enumerate(lines, start=1):
        depth = 0
        for column, char in enumerate(line.split("#", 1)[0], start=1):
            depth += (char == "(") - (char == ")")
            if depth > MAX_NESTING:
                span = Span(number, column, 1, filename, line)
                raise ShardcError(f"parentheses nested more than {MAX_NESTING} deep", span,
                                  fix="split the expression into several statements")


class _Builder(HeaderLines, Transformer[Token, Any]):
    """Lark callbacks, one per grammar rule, building IR bottom-up during the LALR parse."""

    # --- tensors and dims -------------------------------------------------------------
    def dim(self, children: list[Token]) -> Dim:
        head = children[0]
        if head.type == "BRACED_DIM":
            axes = tuple(str(t) for t in children[1:] if t.type == "NAME")
            return Dim(str(head)[:-2], axes, span=token_span(head, children[-1]))
        name, underscore, run = str(head).partition("_")
        span = token_span(head)
        if not _DIM_NAME_RE.fullmatch(name):
            raise ShardcError(f"`{head}` is not a dim: a dim name starts with a letter", span,
                              fix="write a dim as B, B_XY or B_{data,model}")
        if underscore and not _AXIS_RUN_RE.fullmatch(run):
            raise ShardcError(
                f"`{head}`: after the first `_` come one-letter axis names, not `{run}`", span,
                fix=f"dim names cannot contain `_`; for axes with longer names write {name}_{{{run}}}"
                " (a braced, comma separated list), or rename the dim without `_`")
        return Dim(name, tuple(run), span=span)

    def tensor(self, children: list[Any]) -> TensorRef:
        name: Token = children[0]
        close = next(i for i, c in enumerate(children) if isinstance(c, Token) and c.type == "RSQB")
        dims = tuple(c for c in children[1:close] if isinstance(c, Dim))
        unreduced: tuple[str, ...] = ()
        suffix_span: Span | None = None
        end: Token = children[close]
        if len(children) > close + 1:  # the `{U_..}` suffix, lexed as a dim named U
            suffix: Dim = children[close + 2]
            end, suffix_span = children[-1], token_span(children[close + 1], children[-1])
            if suffix.name != "U" or not suffix.axes:
                raise ShardcError(f"`{{{suffix}}}` after {name}[...] is not an unreduced mark", suffix_span,
                                  fix="write {U_X}, {U_XY} or {U_{data,model}} for partial sums over axes")
            unreduced = suffix.axes
        return TensorRef(str(name), dims, unreduced, span=token_span(name, end), unreduced_span=suffix_span)

    # --- expressions ------------------------------------------------------------------
    def expr(self, children: list[Any]) -> Expr:
        terms = tuple(c for c in children if not isinstance(c, Token))
        if len(terms) == 1:
            result: Expr = terms[0]
            return result
        signs = (1, *(1 if str(c) == "+" else -1 for c in children if isinstance(c, Token)))
        return Add(terms, signs, span=join_spans(terms[0].span, terms[-1].span))

    def product(self, children: list[Any]) -> Expr:
        operands = tuple(c for c in children if not isinstance(c, Token))
        if len(operands) == 1:
            result: Expr = operands[0]
            return result
        op = next(str(c) for c in children if isinstance(c, Token))
        return Contract(operands, op=op, span=join_spans(operands[0].span, operands[-1].span))

    def group(self, children: list[Any]) -> Expr:
        result: Expr = children[1]
        return result

    def index_arg(self, children: list[Token]) -> IndexArg:
        return IndexArg(str(children[0]), token_span(children[0]))

    def number_arg(self, children: list[Token]) -> NumberArg:
        *sign, token = children  # a sign where one is written: shift(X, -1)
        try:
            value = float(str(token).replace("_", "")) * (-1.0 if [str(c) for c in sign] == ["-"] else 1.0)
        except ValueError:
            raise ShardcError(f"`{token}` is not a number", token_span(token),
                              fix="write a number such as 0.1") from None
        return NumberArg(value, token_span(sign[0], token) if sign else token_span(token))

    def window_arg(self, children: list[Token]) -> WindowArg:
        """``window W``: W keys, a positive whole number."""
        return WindowArg(token_size(children[1], "a sliding window"), token_span(children[0], children[1]))

    def call(self, children: list[Any]) -> Call:
        name, close = children[0], children[-1]
        args = [c for c in children[2:] if not isinstance(c, Token)]
        over = next((str(children[k + 1]) for k, c in enumerate(children)
                     if isinstance(c, Token) and c.type == "OVER"), None)
        windows = [a for a in args if isinstance(a, WindowArg)]
        if len(windows) > 1:
            raise ShardcError(f"`{name}(...)` has two windows", windows[1].span, fix="give one `window W`")
        exprs, names, numbers = sort_args(str(name), args)
        return Call(str(name), exprs[0], span=token_span(name, close), more=tuple(exprs[1:]),
                    names=tuple(names), numbers=tuple(numbers), over=over,
                    window=windows[0].value if windows else None)

    def assign(self, children: list[Any]) -> Statement:
        result, expr = children[0], children[2]
        return Statement(result, expr, arrow=False, span=join_spans(result.span, expr.span))

    def chain(self, children: list[Any]) -> Statement:
        expr, result = children[0], children[2]
        return Statement(result, expr, arrow=True, span=join_spans(expr.span, result.span))

    def start(self, children: list[Any]) -> Spec:
        return _build_spec([c for c in children if not isinstance(c, Token)])


def _build_spec(items: list[Any]) -> Spec:
    """Gather the lines into a Spec: header lines merge or must be unique, statements keep order."""
    statements: list[Statement] = []
    seen: dict[str, Span] = {}
    header: dict[str, Any] = {kind: [] for kind in _MERGED} | {"param": None}
    spans: list[tuple[str, Span]] = []
    block: tuple[int, int] | None = None
    more: list[tuple[int, int, int | str]] = []
    for item in items:
        if isinstance(item, Statement):
            statements.append(item)
            continue
        if isinstance(item, Block):
            if not item.statements:
                raise ShardcError("`layers` block has no statements", item.span,
                                  fix="put the statements of one layer between `{` and `}`")
            where = (len(statements), len(statements) + len(item.statements))
            statements.extend(item.statements)
            if block is not None:  # a later block: its own layer count
                more.append((*where, item.layers))
                spans.append((f"layers:{len(more)}", item.span))
                continue
            block = where
            item = ("layers", item.layers, item.span)
        kind, value, span = item
        if kind in seen and kind not in _MERGED:
            raise ShardcError(f"`{kind}` is given twice (first on line {seen[kind].line})", span,
                              fix=f"keep one `{kind}` line")
        seen.setdefault(kind, span)
        spans.append((kind, span))
        _merge(header, spans, kind, value)
    if "mesh" not in header:
        lines: list[str] = parsing.lines
        raise ShardcError("the spec has no `mesh` line", Span(1, 1, 1, parsing.filename, lines[0]),
                          fix="start the spec with the device mesh, e.g. `mesh X=16, Y=4`")
    return _spec(statements, header, spans, block, more)


def _merge(header: dict[str, Any], spans: list[tuple[str, Span]], kind: str, value: Any) -> None:
    """One header line into ``header``: a line that may repeat (:data:`_MERGED`) adds to the ones before, with
    a span for each name it gives; any other is the spec's one line of its kind."""
    if kind == "dims":
        header["dims"].extend((name, size) for name, size, _ in value)
        spans.extend((f"dim:{name}", s) for name, _, s in value)
    elif kind == "param":
        header["param"] = (header["param"] or []) + [name for name, _ in value]
        spans.extend((f"param:{name}", s) for name, s in value)
    elif kind in ("dtype_tensors", "gemm_tensors"):
        merge_dtypes(value, header[kind], spans, kind.removesuffix("_tensors"))
    elif kind in ("const", "recompute"):
        header[kind] += [name for name, _ in value]
        spans.extend((f"{kind}:{name}", s) for name, s in value)
    else:
        header[kind] = value


def _spec(statements: list[Statement], header: dict[str, Any], spans: list[tuple[str, Span]],
          block: tuple[int, int] | None, more: list[tuple[int, int, int | str]]) -> Spec:
    """The spec of the gathered lines: ``block`` the first ``layers`` block's statements, ``more`` the later
    blocks' with their layer counts."""
    params = header["param"]
    grad_reduce, reduce_dtype = header.get("grad_reduce", (None, None))
    param_gather, gather_dtype = header.get("param_gather", (None, None))
    return Spec(
        mesh=header["mesh"],
        statements=tuple(statements),
        dims=tuple(header["dims"]),
        dtype=header.get("dtype", DType.BF16),
        params=None if params is None else tuple(params),
        const=tuple(header["const"]),
        hardware=header.get("hardware"),
        topology=header.get("topology"),
        layers=header.get("layers"),
        block=block,
        more_blocks=tuple(more),
        microbatches=header.get("microbatches"),
        stage_layers=header.get("stage_layers"),
        schedule=header.get("schedule"),
        zero=header.get("zero"),
        fusion=header.get("fusion"),
        grad_reduce=grad_reduce,
        grad_reduce_dtype=reduce_dtype,
        attention_kernel=header.get("attention_kernel"),
        param_gather=param_gather,
        param_gather_dtype=gather_dtype,
        optimizer=header.get("optimizer"),
        recompute=tuple(header["recompute"]),
        tensor_dtypes=tuple(header["dtype_tensors"]),
        gemm=header.get("gemm"),
        gemm_tensors=tuple(header["gemm_tensors"]),
        filename=parsing.filename,
        header_spans=tuple(spans),
    )
