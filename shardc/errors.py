"""The one error class of shardc, and the source spans it points at.

Every mistake a user can make in a ``.shard`` file or on the command line is a
:class:`ShardcError`.  An error carries a :class:`Span` when it is about a place
in the text and renders like a compiler diagnostic::

    fsdp.shard:3:17: error: axis 'Z' is not in the mesh
        Tmp[B_X, F_Z] = In[B_X, D] · W_in[D_X, F]
                    ^
    fix: use one of the mesh axes X, Y, or add Z to the `mesh` line
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ShardcError", "InternalError", "Span", "LAYERS_FEED", "clip"]

# ShardcError.kind of a `layers` spec whose layer outputs cannot feed its inputs (validate._check_feed)
LAYERS_FEED = "layers-feed"


@dataclass(frozen=True)
class Span:
    """A place in a source text: 1-based line and column, and its length."""

    line: int
    column: int
    length: int = 1
    filename: str | None = None
    source_line: str | None = None

    def location(self) -> str:
        name = self.filename or "<spec>"
        return f"{name}:{self.line}:{self.column}"


class ShardcError(Exception):
    """The root (and only) error class of shardc.

    ``message`` says what is wrong, ``fix`` how to repair it, ``span`` where.
    ``str(err)`` is the full rendering with the source line and a caret.  ``kind``, when
    set, names the check that failed for code that acts on it (``LAYERS_FEED``), so no
    caller matches words of the message.
    """

    def __init__(self, message: str, span: Span | None = None, fix: str | None = None,
                 kind: str | None = None) -> None:
        self.message = message
        self.span = span
        self.fix = fix
        self.kind = kind
        super().__init__(self.render())

    def render(self) -> str:
        lines: list[str] = []
        if self.span is not None:
            lines.append(f"{self.span.location()}: error: {self.message}")
            if self.span.source_line is not None:
                text = self.span.source_line.rstrip("\n")
                lines.append(f"    {text}")
                caret = " " * (self.span.column - 1) + "^" * max(1, self.span.length)
                lines.append(f"    {caret}")
        else:
            lines.append(f"error: {self.message}")
        if self.fix:
            lines.append(f"fix: {self.fix}")
        return "\n".join(lines)

    def with_span(self, span: Span) -> ShardcError:
        """The same error, pointing at ``span`` (used when a pass learns the place late)."""
        return ShardcError(self.message, span, self.fix, self.kind)


class InternalError(ShardcError):
    """A bug in shardc itself (a plan that breaks its own invariants), not in the user's input.

    The CLI reports it with exit status 1, like a failed check, rather than 2 (a usage error).
    """

    exit_code = 1


def clip(text: str, limit: int = 40) -> str:
    """``text`` as a message echoes it: whole when short, else its start and how long it was."""
    return text if len(text) <= limit else f"{text[:limit - 12]}... ({len(text)} characters)"
