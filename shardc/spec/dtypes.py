"""Element types as a spec writes them: ``dtype f8`` for every tensor, ``dtype bf16 Sc, Pr`` for some.

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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lark import Token

from shardc.errors import ShardcError, Span
from shardc.ir.spec import DType, Spec
from shardc.spec.walk import id_names, leaves

__all__ = ["dtype_line", "merge_dtypes", "check_dtypes"]


def _dtype(word: str, span: Span) -> DType:
    try:
        return DType(word)
    except ValueError:
        known = ", ".join(d.value for d in DType)
        raise ShardcError(f"unknown dtype `{word}`", span, fix=f"use one of {known}") from None


def dtype_line(children: list[Token], span: Callable[[Token], Span]) -> tuple[str, Any, Span]:
    """``dtype T`` (the spec's type: item ``dtype``) or ``dtype T a, b`` (item ``dtype_tensors``: the type
    and each named tensor with its span)."""
    kind = _dtype(str(children[1]), span(children[1]))
    names = [(str(t), span(t)) for t in children[2:] if t.type == "NAME"]
    if not names:
        return ("dtype", kind, span(children[0]))
    return ("dtype_tensors", (kind, names), span(children[0]))


def merge_dtypes(value: tuple[DType, list[tuple[str, Span]]], declared: list[tuple[str, DType]],
                 spans: list[tuple[str, Span]]) -> None:
    """Add a ``dtype T a, b`` line's tensors to those ``declared`` so far, each name's span under ``dtype:NAME``."""
    kind, names = value
    declared.extend((name, kind) for name, _ in names)
    spans.extend((f"dtype:{name}", s) for name, s in names)


def check_dtypes(spec: Spec) -> None:
    """Each tensor a ``dtype T`` line names is one of the spec's, named once, a float (token ids are
    int32) and of a type other than the spec's ``dtype`` (a line that changes nothing is a slip)."""
    tensors = {s.result.name for s in spec.statements} | {r.name for s in spec.statements for r in leaves(s.expr)}
    ids = id_names(spec)
    spans = {key.removeprefix("dtype:"): s for key, s in reversed(spec.header_spans) if key.startswith("dtype:")}
    seen: set[str] = set()
    for name, kind in spec.tensor_dtypes:
        span = spans.get(name)
        if name in seen:
            twice = [s for key, s in spec.header_spans if key == f"dtype:{name}"][1:2]
            raise ShardcError(f"tensor {name} is given a dtype twice", twice[0] if twice else span,
                              fix=f"name {name} on one `dtype` line")
        seen.add(name)
        if not isinstance(kind, DType):  # a Spec built in Python
            raise ShardcError(f"{name}: {kind!r} is not a dtype", span,
                              fix="use one of " + ", ".join(f"DType.{d.name}" for d in DType))
        if name not in tensors:
            raise ShardcError(f"`dtype {kind} {name}`: no tensor of the spec is named {name}", span,
                              fix="name a tensor a statement reads or computes")
        if name in ids:
            raise ShardcError(f"{name} holds token ids, which are int32", span,
                              fix=f"remove {name} from the `dtype {kind}` line")
        if kind is spec.dtype:
            raise ShardcError(f"{name} is declared {kind}, the spec's dtype already", span,
                              fix=f"remove {name} from the line: every tensor not named is {spec.dtype}")
