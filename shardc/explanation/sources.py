"""Where a jaxpr equation came from (the user's source line) and how explain's messages print it."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["comment", "equation_text", "installed", "shape_text", "source_line"]


def source_line(eqn: Any) -> str:
    """``file:line`` of the user's code that made a jaxpr equation ('' when jax kept none): the innermost
    frame outside jax and installed packages (a flax layer's caller, not flax), else jax's user frame."""
    from jax._src import source_info_util

    frames = list(source_info_util.user_frames(eqn.source_info.traceback))
    frame = next((f for f in frames if not installed(f.file_name)), frames[0] if frames else None)
    return f"{frame.file_name}:{frame.start_line}" if frame is not None else ""


def installed(path: str) -> bool:
    """Whether a source file is of an installed package (a library the user's program calls)."""
    return any(part in path.replace("\\", "/") for part in ("/site-packages/", "/dist-packages/"))


def shape_text(var: Any) -> str:
    return "[" + ", ".join(map(str, var.aval.shape)) + "]"


def equation_text(eqn: Any) -> str:
    """The equation as the jaxpr prints it, its operands' and results' shapes (no sub-jaxprs)."""
    ins = ", ".join(shape_text(v) for v in eqn.invars)
    outs = ", ".join(shape_text(v) for v in eqn.outvars)
    return f"{outs} = {eqn.primitive.name} {ins}"


def comment(text: str) -> str:
    return re.sub(r"[\r\n]+", " ", text)[:200]

