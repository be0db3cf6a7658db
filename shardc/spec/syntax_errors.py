"""Lark's parse failures as :class:`ShardcError`: where, what was found, what was expected.

:func:`syntax_error` renders an ``UnexpectedInput`` raised by the LALR parser of
:mod:`shardc.spec.parser` with the offending line, a caret under the token and a
fix naming the expected terminals in words.
"""

from __future__ import annotations

from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from shardc.accountings import ACCOUNTINGS
from shardc.errors import ShardcError, Span
from shardc.ir.spec import ATTENTION_KERNELS, FUSIONS, GRAD_REDUCES, PARAM_GATHERS, SCHEDULES, DType

__all__ = ["syntax_error"]

# Human words for lark's terminal names, used to say what was expected.
_TERMINAL_WORDS = {
    "NAME": "a name",
    "SIZE": "a number",
    "HWNAME": "a hardware name such as tpu-v5p",
    "HWPATH": "a hardware file such as chip.toml",
    "BRACED_DIM": "a dim with braced axes such as B_{data,model}",
    "OP": "a contraction operator (· @ * ×)",
    "ADDOP": "`+` or `-`",
    "ARROW": "`->`",
    "EQUAL": "`=`",
    "COMMA": "`,`",
    "LPAR": "`(`",
    "RPAR": "`)`",
    "LSQB": "`[`",
    "RSQB": "`]`",
    "LBRACE": "an unreduced mark such as {U_X}",
    "RBRACE": "`}`",
    "_NL": "the end of the line",
    "$END": "the end of the text",
    "MESH": "`mesh`",
    "DIMS": "`dims`",
    "DTYPE": "`dtype`",
    "PARAM": "`param`",
    "CONST": "`const`",
    "HARDWARE": "`hardware`",
    "TOPOLOGY": "`topology`",
    "LAYERS": "`layers`",
    "OVER": "`over` (`over dcn` in the mesh, `over X` after zero)",
    "PIPELINE": "`pipeline`",
    "MICROBATCHES": "`microbatches`",
    "STAGE_LAYERS": "`stage_layers`",
    "SCHEDULE": "`schedule`",
    "ZERO": "`zero`",
    "IN": "`in` and a type",
}


def _one_of(words: tuple[str, ...]) -> str:
    return "one of " + ", ".join(words)


# A line's own words where its grammar reads a bare word (the HWNAME terminal, which the `hardware` line
# named the terminal for): `grad_reduce` alone expected "a hardware name such as tpu-v5p".
_LINE_WORDS = {
    "topology": "a slice or cluster shape such as 4x4x4 or 48x8",
    "schedule": _one_of(SCHEDULES),
    "fusion": _one_of(FUSIONS),
    "grad_reduce": _one_of(GRAD_REDUCES[:2]),
    "attention_kernel": _one_of(ATTENTION_KERNELS),
    "param_gather": _one_of(PARAM_GATHERS),
    "optimizer": _one_of(tuple(ACCOUNTINGS)),
}


def syntax_error(err: UnexpectedInput, lines: list[str], filename: str | None) -> ShardcError:
    """Turn a lark error into a ShardcError: where, what was found, what was expected."""
    line, column, length = getattr(err, "line", -1), getattr(err, "column", -1), 1
    if isinstance(err, UnexpectedToken) and err.token.type not in ("_NL", "$END"):
        found = f"`{err.token}`"
        length = len(str(err.token))
    elif isinstance(err, UnexpectedCharacters):
        found = f"character `{lines[line - 1][column - 1] if 0 < line <= len(lines) else '?'}`"
    else:
        found = "end of line"
    if not (isinstance(line, int) and 0 < line <= len(lines)) or isinstance(err, UnexpectedEOF):
        line = max((i for i, text in enumerate(lines, 1) if text.strip()), default=1)
        column = len(lines[line - 1]) + 1
    source = lines[line - 1]
    column = max(1, min(column, len(source) + 1))
    span = Span(line, column, length, filename, source)
    return ShardcError(f"syntax error: unexpected {found}", span, fix=_expected_fix(err, found, source[:column - 1]))


def _expected_fix(err: UnexpectedInput, found: str, before: str) -> str:
    """What was expected, in words; ``before`` is the line's text before the error, whose first word names
    the words a line of its own reads."""
    expected: set[str] = set()
    if isinstance(err, UnexpectedToken):
        expected = set(err.accepts or err.expected)
    elif isinstance(err, UnexpectedCharacters):
        expected = set(err.allowed or ())
    elif isinstance(err, UnexpectedEOF):
        expected = set(err.expected)
    words = sorted({_word(name, before) for name in expected})
    fix = "expected " + " or ".join(words) if words else "check the syntax against the examples in the docs"
    if "RSQB" in expected and "COMMA" in expected:
        fix += "; a tensor is written Name[dim, dim, ...], a dim as B, B_XY or B_{data,model}"
    elif found == "character `_`" or "`_`" in found:
        fix += "; dim names cannot contain `_` (the first `_` starts the axes)"
    elif "EQUAL" in expected and "ARROW" not in expected and "OP" not in expected:
        fix += "; header lines are written `mesh X=16, Y=4`, `dims B=1024, D=512`"
    return fix


def _word(terminal: str, before: str) -> str:
    """The terminal in words, as the line it is expected on reads it."""
    line = (before.split() or [""])[0]
    if terminal == "HWNAME" and line in _LINE_WORDS:
        return _LINE_WORDS[line]
    if terminal == "NAME" and line in ("grad_reduce", "param_gather") and before.split()[-1] == "in":
        return "a type, " + _one_of(tuple(d.value for d in DType))
    return _TERMINAL_WORDS.get(terminal, terminal.lower())
