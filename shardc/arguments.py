"""Argument checks of the public functions (``shardc.parse``, ``plan``, ``cost``, ``lower``, and ``verify``).

A caller's mistake is a :class:`ShardcError` (a value out of range: a negative
size, a fractional one, an empty chip name, a text past the size cap) or a
``TypeError`` that names the argument (a value of the wrong type, ``None`` where
a value is needed), raised before any pass runs, so no wrong type reaches a pass
as an ``AttributeError`` deep inside and no bad size is silently rounded.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import UnionType

from shardc.errors import ShardcError, clip
from shardc.files import MAX_BYTES
from shardc.spec.lexicon import MAX_SIZE
from shardc.spec.validate import check_name

__all__ = ["check_text", "check_instance", "check_sizes", "check_spans_arg", "check_choice",
           "check_fraction", "check_gradients", "check_verify_args"]


def check_text(text: object, filename: object) -> str:
    """Spec text: a ``str`` of at most :data:`shardc.files.MAX_BYTES` bytes in UTF-8."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str (the spec's text), not {type(text).__name__}")
    if filename is not None and not isinstance(filename, str):
        raise TypeError(f"filename must be a str or None, not {type(filename).__name__}")
    if len(text) > MAX_BYTES or len(text.encode("utf-8", errors="surrogatepass")) > MAX_BYTES:
        raise ShardcError(f"the spec text is larger than {MAX_BYTES >> 20} MiB, far beyond any spec",
                          fix="pass the text of one .shard file (a 96-layer spec is about 10 kB)")
    return text


def check_instance(value: object, kind: type | UnionType, name: str, what: str) -> None:
    """``value`` is a ``kind``, else a TypeError naming the argument ``name``."""
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be {what}, not {type(value).__name__}")


def check_sizes(sizes: object, name: str = "sizes") -> dict[str, int] | None:
    """``None`` or a mapping of dim or mesh axis names to whole sizes from 1 to 1e18."""
    if sizes is None:
        return None
    if not isinstance(sizes, Mapping):
        raise TypeError(f"{name} must be a dict of names to sizes, not {type(sizes).__name__}")
    for key, value in sizes.items():
        if not isinstance(key, str):
            raise TypeError(f"{name} keys must be str (dim or mesh axis names), not {type(key).__name__}")
        shown = f"{name}[{clip(repr(key))}]"
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                raise ShardcError(f"{shown} = {clip(repr(value))} is a float; sizes are whole numbers",
                                  fix=f"pass int({value!r})")
            if isinstance(value, float):
                raise ShardcError(f"{shown} = {clip(repr(value))} is not a whole number",
                                  fix="sizes count elements or devices: pass an int")
            raise TypeError(f"{shown} must be an int, not {type(value).__name__}")
        if not 1 <= value <= MAX_SIZE:
            raise ShardcError(f"{shown} = {clip(str(value))} is out of range",
                              fix="sizes count elements or devices: from 1 to 1e18")
    return dict(sizes)


def check_spans_arg(spans: object) -> None:
    """``None`` or a mapping of mesh axis names to counts (the values are :func:`shardc.hardware.check_spans`'s)."""
    if spans is None:
        return
    if not isinstance(spans, Mapping):
        raise TypeError(f"spans must be a dict of mesh axis names to counts, not {type(spans).__name__}")
    for key in spans:
        if not isinstance(key, str):
            raise TypeError(f"spans keys must be str (mesh axis names), not {type(key).__name__}")


def check_choice(value: object, name: str) -> None:
    """A keyword naming a mode (``save``, ``optimizer``, ...): a str, checked against its choices later."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, not {type(value).__name__}")


def check_fraction(value: object, name: str) -> None:
    """``None`` or a real number (its range is the callee's to check)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise TypeError(f"{name} must be a number or None, not {type(value).__name__}")


def check_gradients(gradients: object) -> None:
    """``None`` or a mapping of input names to the names their gradients take (names a module defines)."""
    if gradients is None:
        return
    if not isinstance(gradients, Mapping):
        raise TypeError(f"gradients must be a dict of tensor names to gradient names, not {type(gradients).__name__}")
    for key, value in gradients.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"gradients must map str to str, not {type(key).__name__} to {type(value).__name__}")
        check_name(value, "gradient")


def check_verify_args(sizes: object, seed: object, save: object) -> None:
    """``verify``'s ``sizes``, ``seed`` (a whole number from 0: numpy's generators take no negative
    seed) and ``save``; ``devices`` is checked once the devices present are known."""
    check_sizes(sizes)
    check_choice(save, "save")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, not {type(seed).__name__}")
    if seed < 0:
        raise ShardcError(f"seed = {clip(str(seed))} is negative", fix="pass a seed of 0 or more")
