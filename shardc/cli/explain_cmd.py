"""``shardc explain FILE.py:FUNC``: a user's jitted program, its collectives and shardc's plan beside them.

``FUNC()`` (in ``FILE.py``, imported by path) returns ``(jitted_fn, args)``.  XLA is asked for
``--devices`` emulated CPU devices before jax starts (unless XLA_FLAGS already says how many), so the
function can build its mesh on a machine without accelerators; nothing runs, the program is compiled.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Any

from shardc.cli.lower_cmd import emulate_devices
from shardc.errors import ShardcError, clip
from shardc.files import write_text

__all__ = ["register"]

_HELP = "read a jitted jax program as a spec; list its collectives with source lines beside shardc's plan"


def register(sub: Any, name: str) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(name, help=_HELP, description=_HELP)
    parser.add_argument("target", metavar="FILE.py:FUNC",
                        help="a Python file and a function in it returning (jitted_fn, args)")
    parser.add_argument("--hardware", default=None, help="the chip the times are for (default: tpu-v5p)")
    parser.add_argument("--devices", type=int, default=8, help="emulated CPU devices for the program's mesh (8)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--spec-out", metavar="F.shard", help="also write the program's spec there")
    parser.add_argument("--approximate", action="store_true",
                        help="read what the spec language cannot say (a constant inside a run of maps, a log, a "
                             "flip, a mask other than causal) as its nearest map and a note of the spec, not an "
                             "error: its spec then for shardings and collectives alone")
    parser.set_defaults(func=run_explain)


def _load(target: str) -> Any:
    path, sep, func = target.rpartition(":")
    if not sep or not path or not func.isidentifier():
        raise ShardcError(f"expected FILE.py:FUNC, got {clip(repr(target))}",
                          fix="e.g. shardc explain model.py:program")
    if not os.path.isfile(path):
        raise ShardcError(f"no file {clip(path)}", fix="give the path of a Python file")
    spec = importlib.util.spec_from_file_location("shardc_explained", path)
    if spec is None or spec.loader is None:
        raise ShardcError(f"{clip(path)} cannot be imported as Python", fix="give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # the user's code: its error is theirs, said in one line
        raise ShardcError(f"importing {clip(path)} failed: {type(err).__name__}: {clip(str(err))}",
                          fix="run the file with python to see the traceback") from None
    finally:
        sys.path.pop(0)
    if not callable(getattr(module, func, None)):
        raise ShardcError(f"{clip(path)} has no function {func}", fix="name a function of the file")
    return getattr(module, func)


def _made(target: str, program: Any) -> tuple[Any, tuple[Any, ...]]:
    """``FUNC()``'s ``(jitted_fn, args)``; what it raises is the user's code's error, said in one line."""
    shape = "return the jitted function and a tuple of its arguments, (fn, (x, w)); (fn, (x,)) for one"
    try:
        made = program()
    except Exception as err:  # the user's code (a mesh of more devices than there are raises here)
        raise ShardcError(f"{target}() raised {type(err).__name__}: {clip(str(err), 300)}",
                          fix="run the function with python to see the traceback; a mesh of more devices than "
                              "--devices gives (8 unless set) needs a larger --devices") from None
    if not isinstance(made, tuple) or len(made) != 2:
        raise ShardcError(f"{target} must return (jitted_fn, args), not {clip(repr(made))}", fix=shape)
    fn, fn_args = made
    if not callable(fn):
        raise ShardcError(f"{target} returned {clip(repr(fn))} where the jitted function goes", fix=shape)
    if not isinstance(fn_args, tuple | list):
        raise ShardcError(f"{target} returned {type(fn_args).__name__} where the tuple of arguments goes", fix=shape)
    return fn, tuple(fn_args)


def run_explain(args: argparse.Namespace) -> int:
    if not 1 <= args.devices <= 4096:
        raise ShardcError(f"--devices {args.devices}: not a device count", fix="give e.g. --devices 8")
    emulate_devices(args.devices)
    fn, fn_args = _made(args.target, _load(args.target))
    from shardc.explanation.explain_report import explain, render_explanation

    result = explain(fn, *fn_args, hardware=args.hardware, origin=args.target,
                     approximate=args.approximate)
    if args.spec_out:
        write_text(args.spec_out, result.spec, "--spec-out")
    print(json.dumps(result.to_json(), indent=2) if args.json else render_explanation(result), end="\n"
          if args.json else "")
    return 0
