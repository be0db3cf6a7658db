"""Element types as a spec writes them: ``dtype f8`` for every tensor, ``dtype bf16 Sc, Pr`` for some;
``gemm f8`` for the type every GEMM quantizes its inputs to, ``gemm bf16 Lg, Gate`` for some statements'.

A mixed-precision run keeps some tensors wider than the rest (DeepSeek-V3's FP8 training, arXiv
2412.19437 section 3.3: the linear layers' GEMMs in FP8, attention, the router, the embedding and
the output head in BF16).  The parser turns each ``dtype`` line into a header item here; the
validator checks the tensors a line names.  The IR keeps the declarations (``Spec.tensor_dtypes``)
and ``Spec.dtype_of`` reads them.

>>> from shardc.spec.parser import parse
>>> spec = parse("mesh X=2\\ndtype f8\\ndtype bf16 W\\nO[B, F] = I[B, D] · W[D, F]\\n")
>>> spec.dtype_of("W"), spec.dtype_of("I")
(<DType.BF16: 'bf16'>, <DType.F8: 'f8'>)
>>> spec.dtype_lines()
['dtype bf16 W']

Storage and compute are apart in FP8 training (DeepSeek-V3, arXiv 2412.19437, section 3.3 and its
Figure 6; NVIDIA Transformer Engine's ``fp8_autocast``): the activations and weights are kept in BF16
or FP32 and each GEMM's inputs quantized to FP8 just before it, in the forward (Fprop) and in both
backward GEMMs (Dgrad, Wgrad), while the embedding, the output head, the MoE gating, the norms and
attention stay in BF16.  ``gemm f8`` says so: every contraction of the spec runs its three GEMMs on
FP8 inputs; ``gemm bf16 Lg`` names the statements (by result) whose GEMMs keep BF16.

>>> spec = parse("mesh X=2\\ngemm f8\\ngemm bf16 O\\nH[B, F] = I[B, D] · W[D, F]\\nO[B, D] = H[B, F] · V[F, D]\\n")
>>> spec.gemm_of("H"), spec.gemm_of("O"), spec.gemm_lines()
(<DType.F8: 'f8'>, <DType.BF16: 'bf16'>, ['gemm f8', 'gemm bf16 O'])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from lark import Token

from shardc.errors import ShardcError, Span, clip
from shardc.ir.spec import Add, Call, Contract, DType, Expr, Spec
from shardc.spec.walk import id_names, leaves

__all__ = ["dtype_named", "typed_words", "dtype_line", "merge_dtypes", "check_dtypes", "check_gemms", "contracts"]


def dtype_named(word: str, span: Span, what: str = "dtype", fix: Callable[[list[str]], str] | None = None) -> DType:
    """The element type ``word`` names, else an error at ``span``: "unknown ``what``", the fix ``fix`` makes of
    the known names, or "use one of" them."""
    try:
        return DType(word)
    except ValueError:
        known = [d.value for d in DType]
        raise ShardcError(f"unknown {what} `{word}`", span,
                          fix=fix(known) if fix is not None else f"use one of {', '.join(known)}") from None


def typed_words(children: list[Token], span: Callable[..., Span], keyword: str, known: tuple[str, ...],
                what: str, example: str, why: str) -> tuple[list[Token], DType | None]:
    """A framework line's words after its keyword, the first one of ``known`` (none: the line names only a
    type), and the type its ``in T`` names (None: not written): ``grad_reduce after-backward in f32``,
    ``param_gather in f8``.  An unknown word or type is an error at it; ``what`` names the type (its ``why``:
    who casts to ``example``)."""
    words = [t for t in children[1:] if t.type in ("HWNAME", "NAME")]
    kind = None
    if any(t.type == "IN" for t in children):
        token = words.pop()
        kind = dtype_named(clip(str(token)), span(token), what,
                           lambda names: "write one of " + ", ".join(f"`in {k}`" for k in names) + f" ({why})")
    if words and str(words[0]) not in known:
        raise ShardcError(f"unknown {keyword} `{clip(str(words[0]))}`", span(words[0]),
                          fix="use one of " + ", ".join(f"`{keyword} {k}`" for k in known)
                          + f", each optionally followed by `in {example}` (the {what})")
    return words, kind


def dtype_line(children: list[Token], span: Callable[[Token], Span]) -> tuple[str, Any, Span]:
    """``dtype T`` (the spec's type: item ``dtype``) or ``dtype T a, b`` (item ``dtype_tensors``: the type
    and each named tensor with its span); a ``gemm`` line likewise (items ``gemm``, ``gemm_tensors``)."""
    keyword = str(children[0])
    kind = dtype_named(str(children[1]), span(children[1]))
    names = [(str(t), span(t)) for t in children[2:] if t.type == "NAME"]
    if not names:
        return (keyword, kind, span(children[0]))
    return (f"{keyword}_tensors", (kind, names), span(children[0]))


def merge_dtypes(value: tuple[DType, list[tuple[str, Span]]], declared: list[tuple[str, DType]],
                 spans: list[tuple[str, Span]], keyword: str = "dtype") -> None:
    """Add a ``dtype T a, b`` (or ``gemm T a, b``) line's names to those ``declared`` so far, each name's
    span under ``dtype:NAME`` (``gemm:NAME``)."""
    kind, names = value
    declared.extend((name, kind) for name, _ in names)
    spans.extend((f"{keyword}:{name}", s) for name, s in names)


def _named_once(spec: Spec, keyword: str, declared: tuple[tuple[str, DType], ...], what: str,
                noun: str) -> Iterator[tuple[str, DType, Span | None]]:
    """Each name the ``keyword T a, b`` lines declare, with its type and its span: named once, of a DType."""
    spans = {key.removeprefix(f"{keyword}:"): s for key, s in reversed(spec.header_spans)
             if key.startswith(f"{keyword}:")}
    seen: set[str] = set()
    for name, kind in declared:
        span = spans.get(name)
        if name in seen:
            twice = [s for key, s in spec.header_spans if key == f"{keyword}:{name}"][1:2]
            raise ShardcError(f"{what} {name} is given {noun} twice", twice[0] if twice else span,
                              fix=f"name {name} on one `{keyword}` line")
        seen.add(name)
        if not isinstance(kind, DType):  # a Spec built in Python
            raise ShardcError(f"{name}: {kind!r} is not a dtype", span,
                              fix="use one of " + ", ".join(f"DType.{d.name}" for d in DType))
        yield name, kind, span


def check_dtypes(spec: Spec) -> None:
    """Each tensor a ``dtype T`` line names is one of the spec's, named once, a float (token ids are
    int32) and of a type other than the spec's ``dtype`` (a line that changes nothing is a slip)."""
    tensors = {s.result.name for s in spec.statements} | {r.name for s in spec.statements for r in leaves(s.expr)}
    ids = id_names(spec)
    for name, kind, span in _named_once(spec, "dtype", spec.tensor_dtypes, "tensor", "a dtype"):
        if name not in tensors:
            raise ShardcError(f"`dtype {kind} {name}`: no tensor of the spec is named {name}", span,
                              fix="name a tensor a statement reads or computes")
        if name in ids:
            raise ShardcError(f"{name} holds token ids, which are int32", span,
                              fix=f"remove {name} from the `dtype {kind}` line")
        if kind is spec.dtype:
            raise ShardcError(f"{name} is declared {kind}, the spec's dtype already", span,
                              fix=f"remove {name} from the line: every tensor not named is {spec.dtype}")


def contracts(expr: Expr, keep: tuple[str, ...]) -> bool:
    """Whether ``expr`` (indexed by ``keep``) holds a contraction that sums an index: a GEMM.  An
    elementwise product (``G[B, F] · U[B, F]``, SwiGLU's) sums nothing."""
    if isinstance(expr, Contract):
        read = {i for o in expr.operands for ref in leaves(o) for i in ref.indices}
        return bool(read - set(keep)) or any(contracts(o, keep) for o in expr.operands)
    if isinstance(expr, Call):
        return any(contracts(a, keep) for a in expr.args)
    if isinstance(expr, Add):
        return any(contracts(t, keep) for t in expr.terms)
    return False


def check_gemms(spec: Spec) -> None:
    """Each statement a ``gemm T`` line names is one of the spec's, named once, runs a GEMM (a contraction
    that sums an index) and is given a type other than the spec's ``gemm T`` (a line changing nothing is a slip)."""
    results = {s.result.name: s for s in spec.statements}
    if spec.gemm is not None and not isinstance(spec.gemm, DType):  # a Spec built in Python
        raise ShardcError(f"gemm: {spec.gemm!r} is not a dtype", spec.span_of("gemm"),
                          fix="use one of " + ", ".join(f"DType.{d.name}" for d in DType))
    for name, kind, span in _named_once(spec, "gemm", spec.gemm_tensors, "statement", "a gemm type"):
        statement = results.get(name)
        if statement is None:
            raise ShardcError(f"`gemm {kind} {name}`: no statement of the spec computes {name}", span,
                              fix="name the result of a statement whose einsum contracts an index")
        if not contracts(statement.expr, statement.result.indices):
            raise ShardcError(f"`gemm {kind} {name}`: {name}'s statement contracts no index, so it runs no GEMM",
                              span, fix=f"remove {name} from the line (a `gemm` line names matmuls)")
        if kind is spec.gemm:
            raise ShardcError(f"{name}'s GEMMs are {kind}, the spec's `gemm {kind}` already", span,
                              fix=f"remove {name} from the line: every GEMM not named runs in {kind}")
