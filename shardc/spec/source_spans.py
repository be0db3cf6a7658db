"""Where a token lies in the text being parsed: the spans every parsing callback gives its errors and nodes.

The parser (:func:`shardc.spec.parser.parse_unchecked`) sets :data:`parsing`'s ``lines`` and ``filename``
while it parses; the callbacks, the statements' (:mod:`shardc.spec.parser`) and the header lines'
(:mod:`shardc.spec.header_lines`), read them through :func:`token_span`.
"""

from __future__ import annotations

import threading

from lark import Token

from shardc.errors import ShardcError, Span
from shardc.spec.lexicon import parse_size

__all__ = ["parsing", "token_span", "join_spans", "token_size"]

parsing = threading.local()  # the text being parsed: the inline transformer is shared by threads


def token_span(token: Token, end: Token | None = None) -> Span:
    """The span of a token, or from ``token`` to the end of ``end`` when they share a line."""
    lines: list[str] = parsing.lines
    line = token.line or 1
    column = token.column or 1
    length = len(str(token)) or 1
    if end is not None and end.line == line and end.end_column is not None:
        length = max(1, end.end_column - column)
    source = lines[line - 1] if 0 < line <= len(lines) else None
    return Span(line, column, length, parsing.filename, source)


def join_spans(first: Span | None, last: Span | None) -> Span | None:
    """A span from the start of ``first`` to the end of ``last`` (same line)."""
    if first is None or last is None or first.line != last.line:
        return first
    return Span(first.line, first.column, last.column + last.length - first.column,
                first.filename, first.source_line)


def token_size(token: Token, what: str) -> int:
    """The size a token writes (:func:`shardc.spec.lexicon.parse_size`), its error at the token."""
    try:
        return parse_size(str(token), what)
    except ShardcError as err:
        raise err.with_span(token_span(token)) from None
