"""Where ``--plot`` and ``--schedule-plot`` may write an image, checked before anything is drawn.

The path's extension must name a format matplotlib writes (matplotlib picks the
format from it, and without one it would write ``PATH.png`` instead of ``PATH``);
its folder must exist; it must not be a directory, a device, a FIFO or a socket.
A file already there is replaced only when it is an image (a matplotlib image, or
one whose first bytes are an image format's signature): anything else (a spec, a
report, raw pixels nobody can tell from data) needs ``force``, so a mistyped path
never destroys a user's file.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from shardc.errors import ShardcError

__all__ = ["check_image_path", "pyplot", "is_image", "save_figure"]

_PEEK = 8192  # matplotlib names itself in the header (png, svg, ps, pgf) or the trailer (pdf)
# First bytes of the formats matplotlib writes without naming itself (via Pillow, or gzip for svgz).
_SIGNATURES = (b"GIF87a", b"GIF89a", b"\xff\xd8\xff", b"II*\x00", b"MM\x00*", b"\x1f\x8b", b"\x89PNG",
               b"%PDF", b"%!PS")


def pyplot(flag: str) -> Any:
    """matplotlib's pyplot on the Agg canvas, or an error saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ShardcError(f"{flag} needs matplotlib, which is not installed",
                          fix=f"pip install 'shardc[plot]' (or matplotlib), or drop {flag}") from None
    return plt


def check_image_path(path: str, flag: str, force: bool = False) -> None:
    """Refuse ``path`` unless matplotlib can write an image there without destroying anything."""
    plt = pyplot(flag)
    fig = plt.figure()
    formats = fig.canvas.get_supported_filetypes()
    plt.close(fig)
    suffix = os.path.splitext(path)[1][1:].lower()
    if suffix not in formats:
        said = (f"the extension .{suffix} is not an image format matplotlib writes" if suffix
                else "the path has no extension to say the image format")
        raise ShardcError(f"{flag} {path}: {said}",
                          fix="end the path with one of " + ", ".join(f".{k}" for k in sorted(formats)))
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise ShardcError(f"{flag} {path}: no directory {folder}", fix="create it, or write the image elsewhere")
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as err:
        raise ShardcError(f"{flag} {path}: {err.strerror}", fix="write the image elsewhere") from None
    if stat.S_ISDIR(info.st_mode):
        raise ShardcError(f"{flag} {path}: it is a directory", fix=f"name a file in it, e.g. {path}/out.{suffix}")
    if not stat.S_ISREG(info.st_mode):
        raise ShardcError(f"{flag} {path}: it is a device, FIFO or socket, not a file",
                          fix="name a regular file for the image")
    if not force and not is_image(path):
        raise ShardcError(f"{flag} {path}: the file exists and is not an image; it would be replaced",
                          fix="write the image elsewhere, or add --force to replace the file")


def save_figure(plt: Any, fig: Any, path: str, flag: str, dpi: float | None = None) -> None:
    """Write ``fig`` to ``path`` (checked first by :func:`check_image_path`) and close it; what matplotlib
    or the system still refuses (a full disk, a format it cannot write after all) is a ShardcError naming
    ``flag``."""
    try:
        fig.savefig(path, dpi=dpi)
    except OSError as err:
        raise ShardcError(f"cannot write {path}: {err.strerror}", fix=f"check the {flag} path") from None
    except ValueError as err:  # matplotlib's refusals of a path or a format
        raise ShardcError(f"cannot write {path}: {err}", fix=f"check the {flag} path") from None
    finally:
        plt.close(fig)


def is_image(path: str) -> bool:
    """An empty file, a matplotlib image, or a file starting with an image format's signature."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(_PEEK)
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(size - _PEEK, 0))
            tail = handle.read(_PEEK)
    except OSError:
        return False
    if not head:
        return True
    if b"matplotlib" in head.lower() or b"matplotlib" in tail.lower():
        return True
    return head.startswith(_SIGNATURES) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP") or head[4:8] == b"ftyp"
