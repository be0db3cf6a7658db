"""A command's spec from its arguments: the FILE parsed, ``--set`` sizes applied, ``--spans`` checked.

Imported by the commands that read a spec, never by ``shardc --help`` (:mod:`shardc.cli.main`), which
loads no parser.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from shardc.errors import ShardcError, clip
from shardc.files import read_text
from shardc.hardware import check_spans
from shardc.ir.spec import DType
from shardc.spec.overrides import apply_overrides
from shardc.spec.parser import parse, parse_size
from shardc.spec.validate import validate

__all__ = ["parse_sets", "parse_spans", "load_spec", "read_spec"]


def parse_sets(items: Sequence[str] | None, flag: str = "--set") -> dict[str, int]:
    """``--set NAME=VALUE`` pairs (or another ``flag``'s) as sizes; values take ``_`` separators and ``1e6``."""
    example = "X=3" if flag == "--spans" else "B=1e6"
    sizes: dict[str, int] = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise ShardcError(f"{flag} expects NAME=VALUE, got {clip(repr(item))}", fix=f"write e.g. {flag} {example}")
        sizes[name] = parse_size(value, what=f"{flag} {clip(name)}")
    return sizes


def parse_spans(items: Sequence[str] | None, spec: Any) -> dict[str, int] | None:
    """``--spans AXIS=K``: an ICI mesh axis of the spec over K physical axes, each of 2 chips or more."""
    spans = parse_sets(items, "--spans")
    check_spans(spec.mesh, spans)
    return spans or None


def load_spec(path: str, sets: Sequence[str] | None = None, optimizer: str | None = None,
              reduce_dtype: str | None = None, gather_dtype: str | None = None) -> Any:
    """Read and parse a spec file, then apply ``--set`` pairs, ``--optimizer`` (over the spec's ``optimizer``
    line), ``--grad-reduce-dtype`` (over its ``grad_reduce ... in T``: the plan's gradient reductions are
    sized by them, :func:`shardc.accountings.reduce_dtype`) and ``--param-gather-dtype`` (over its
    ``param_gather ... in T``: the params' gathers); errors are ShardcErrors."""
    spec = parse(read_text(path), filename=path)
    sizes = parse_sets(sets)
    spec = apply_overrides(spec, sizes) if sizes else spec
    spec = spec if optimizer is None else dataclasses.replace(spec, optimizer=optimizer)
    spec = spec if reduce_dtype is None else dataclasses.replace(spec, grad_reduce_dtype=DType(reduce_dtype))
    if gather_dtype is not None:  # checked as the line is (a type no wider than the params'), at no line of it
        spans = tuple(s for s in spec.header_spans if s[0] != "param_gather")
        spec = dataclasses.replace(spec, param_gather_dtype=DType(gather_dtype), header_spans=spans)
        validate(spec)
    return spec


def read_spec(args: argparse.Namespace) -> Any:
    """FILE, ``--set`` and (where the command has them) ``--optimizer``, ``--grad-reduce-dtype`` and
    ``--param-gather-dtype`` of a command's arguments, parsed."""
    return load_spec(args.file, args.set, getattr(args, "optimizer", None), getattr(args, "grad_reduce_dtype", None),
                     getattr(args, "param_gather_dtype", None))
