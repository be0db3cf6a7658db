"""Reading a user's file (a spec, a hardware TOML): bounded in size and in waiting, UTF-8 only; and
writing one (a lowered module, an export, a chip file) with one error for every way that fails.

A spec is a few kilobytes; anything past :data:`MAX_BYTES` is refused before it
is held in memory (``shardc plan /dev/zero`` must not read until memory runs out).
A device, FIFO or socket is read as it arrives, and a wait of :data:`WAIT_S`
seconds with nothing arriving is an error rather than a hang (a FIFO nobody
writes to).  Text is UTF-8, with or without a byte order mark (editors on Windows
write one); UTF-16/32 and other encodings are refused with the place of the
first byte that is not UTF-8 and a command that converts the file.
"""

from __future__ import annotations

import codecs
import os
import select
import stat

from shardc.errors import ShardcError, Span

__all__ = ["MAX_BYTES", "WAIT_S", "read_bytes", "read_text", "decode", "write_text"]

MAX_BYTES = 1 << 20  # 1 MiB: a 96-layer spec is about 10 kB
WAIT_S = 10.0
_CHUNK = 1 << 16


def read_text(path: str, what: str = "spec file", wait: float = WAIT_S) -> str:
    """The file's text, decoded as UTF-8 (a leading BOM dropped); every failure a :class:`ShardcError`."""
    return decode(read_bytes(path, what, wait), path)


def read_bytes(path: str, what: str = "spec file", wait: float = WAIT_S) -> bytes:
    """At most :data:`MAX_BYTES` bytes of ``path``; a device or FIFO silent for ``wait`` s is an error."""
    fix = f"check the path of the {what}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO without a writer would block in open
    except OSError as err:
        raise ShardcError(f"cannot read {what} {path}: {err.strerror}", fix=fix) from None
    except (ValueError, TypeError) as err:  # an embedded NUL in the path
        raise ShardcError(f"cannot read {what} {path!r}: {err}", fix=fix) from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise ShardcError(f"cannot read {what} {path}: it is a directory", fix=fix)
        if stat.S_ISREG(info.st_mode) and info.st_size > MAX_BYTES:
            raise _too_large(path, what)
        return _read_stream(fd, path, what, wait)
    except OSError as err:
        raise ShardcError(f"cannot read {what} {path}: {err.strerror}", fix=fix) from None
    finally:
        os.close(fd)


def _read_stream(fd: int, path: str, what: str, wait: float) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        ready, _, _ = select.select([fd], [], [], wait)
        if not ready:
            raise ShardcError(f"cannot read {what} {path}: nothing arrived in {wait:g} s",
                              fix="give a regular file, or make sure something writes to the pipe")
        try:
            chunk = os.read(fd, _CHUNK)
        except BlockingIOError:
            continue
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > MAX_BYTES:
            raise _too_large(path, what)
        chunks.append(chunk)


def _too_large(path: str, what: str) -> ShardcError:
    return ShardcError(f"{what} {path} is larger than {MAX_BYTES >> 20} MiB, far beyond any spec",
                       fix=f"check the path of the {what}")


def decode(data: bytes, path: str) -> str:
    """UTF-8 text with an optional BOM; UTF-16/32 and invalid bytes are errors that say where."""
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    for bom, name in ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
                      (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16")):
        if data.startswith(bom):
            raise ShardcError(f"{path} is {name} text; shardc reads UTF-8",
                              fix=f"convert it: iconv -f {name} -t UTF-8 {path} > {path}.utf8")
    if b"\x00" in data:  # no text has one; UTF-16 without a BOM has one every other byte
        raise _not_utf8(data, data.index(b"\x00"), path, "a NUL byte (UTF-16 text without a byte order mark?)",
                        "UTF-16LE")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _not_utf8(data, err.start, path) from None


def _not_utf8(data: bytes, at: int, path: str, what: str | None = None, source: str = "LATIN1") -> ShardcError:
    start = data.rfind(b"\n", 0, at) + 1
    end = data.find(b"\n", at)
    line = data[start:end if end >= 0 else len(data)].decode("utf-8", errors="replace").replace("\x00", " ")
    prefix = data[start:at].decode("utf-8", errors="replace")
    span = Span(data.count(b"\n", 0, at) + 1, len(prefix) + 1, 1, path, line)
    found = what or f"byte 0x{data[at]:02x}, not UTF-8 (Latin-1 or Windows-1252 text?)"
    return ShardcError(f"{path} is not UTF-8: {found}", span,
                       fix=f"save it as UTF-8, e.g. iconv -f {source} -t UTF-8 {path} > {path}.utf8")


def write_text(path: str, text: str, flag: str) -> None:
    """Write ``text`` to ``path`` as UTF-8; a failure is a :class:`ShardcError` naming ``flag``."""
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as err:
        raise ShardcError(f"{flag} {path}: cannot write it ({err.strerror})",
                          fix="name a file in a directory you can write") from None
