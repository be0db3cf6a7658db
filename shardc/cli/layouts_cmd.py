"""``shardc layouts FILE``: rank the mesh layouts of a spec (and ``--with`` variants) on a chip count."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

from shardc.accountings import ACCOUNTINGS, chosen
from shardc.chip_choice import resolve_hardware
from shardc.cli.main import (
    add_collective_matmul,
    add_common,
    add_model_flags,
    add_recompute,
    add_topology,
    check_hardware_flag,
    configure_chip,
)
from shardc.cli.spec_args import load_spec, parse_sets
from shardc.errors import ShardcError, clip
from shardc.layouts import Options, search_layouts

__all__ = ["register", "run_layouts"]


def _chips(text: str) -> int:
    """``--chips``: a whole number (``4096``, ``4_096``, ``4e3``), read exactly; range checks come later."""
    try:
        value = Decimal(text.replace("_", "")) if len(text) <= 100 else Decimal("NaN")
        whole = value.is_finite() and value == value.to_integral_value() and abs(value.adjusted()) < 100
    except InvalidOperation:
        whole = False
    if not whole:
        raise argparse.ArgumentTypeError(f"expects a whole number of chips, got {clip(repr(text))}")
    return int(value)


def _knobs(text: str) -> tuple[str, ...]:
    """``--knobs``: names from KNOBS, comma-separated, or ``all``."""
    from shardc.layouts.knobs import KNOBS

    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if names == ("all",):
        return KNOBS
    wrong = [n for n in names if n not in KNOBS]
    if wrong or not names:
        raise argparse.ArgumentTypeError(f"expects knobs among {', '.join(KNOBS)} (or all), got {clip(repr(text))}")
    return names


def _progress() -> Callable[[int, int], None] | None:
    """On a terminal, a ``planned k/n`` line on stderr, rewritten in place and cleared at the end."""
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        end = "\r" if done < total else "\r" + " " * 40 + "\r"
        print(f"planned {done}/{total}", end=end, file=sys.stderr, flush=True)

    return show


def register(subparsers: Any, name: str) -> None:
    parser = subparsers.add_parser(
        name, help="rank the mesh layouts of a spec on a number of chips",
        description="Rank every layout of FILE (and of each --with spec) on --chips chips: each assignment of "
                    "sizes to the mesh axes whose product is the chip count, in each order of the axes that "
                    "lays them on other links, planned for the chip and costed as `shardc cost` costs it.  DCN "
                    "axes and axes given with --set keep their size.  Layouts "
                    "that fit HBM come first, then by step time, then by critical-path communication, then "
                    "by memory.")
    add_common(parser)
    parser.add_argument("--chips", type=_chips, metavar="N",
                        help="the chips to lay out (default: the spec's own device count)")
    parser.add_argument("--with", dest="others", action="append", default=[], metavar="FILE",
                        help="another spec of the same model to search beside FILE (repeatable)")
    parser.add_argument("--hardware", metavar="NAME", help="a preset (see `shardc hardware`)")
    parser.add_argument("--hardware-file", metavar="TOML", help="a chip of your own (keys: shardc hardware)")
    add_model_flags(parser)
    parser.add_argument("--optimizer", choices=tuple(ACCOUNTINGS), default=None,
                        help="training-state accounting (see `shardc cost --help`)")
    parser.add_argument("--save", choices=("default", "none", "all"), default="default",
                        help="the plans' residual policy (see `shardc plan --help`)")
    add_recompute(parser)
    add_collective_matmul(parser)
    parser.add_argument("--mfu", type=float, metavar="FRACTION",
                        help="also give each step time at this MFU (never under the step time)")
    parser.add_argument("--top", type=int, default=20, metavar="K",
                        help="list the best K layouts (20; 0 lists all)")
    parser.add_argument("--jobs", type=int, default=0, metavar="J",
                        help="processes that plan the candidates (0: one a core, up to 8, when 8 or more plans)")
    parser.add_argument("--knobs", type=_knobs, default=(), metavar="K,K",
                        help="also search every combination of these settings of the step for the best "
                             "layouts: microbatches, schedule, recompute, zero, offload (host offload of the "
                             "kept activations or the optimizer, on a chip with a host link figure; or all)")
    parser.add_argument("--exact", action="store_true",
                        help="plan every candidate at its own sizes (past 64 candidates the search plans each "
                             "template once and re-costs it, then plans the best rows at their own sizes)")
    parser.add_argument("--json", action="store_true", help="print the search as JSON")
    add_topology(parser)
    parser.set_defaults(func=run_layouts)


def run_layouts(args: argparse.Namespace) -> int:
    check_hardware_flag(args)
    if args.top < 0:
        raise ShardcError(f"--top must be 0 (all) or more, got {clip(str(args.top))}", fix="write e.g. --top 10")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ShardcError(f"--mfu must be in (0, 1], got {args.mfu}", fix="write e.g. --mfu 0.4")
    if args.jobs < 0:
        raise ShardcError(f"--jobs must be 0 (one a core) or more, got {clip(str(args.jobs))}",
                          fix="write e.g. --jobs 4")
    paths = list(dict.fromkeys([args.file, *args.others]))  # a file given twice is searched once
    specs = [load_spec(path, args.set, args.optimizer, args.grad_reduce_dtype, args.param_gather_dtype)
             for path in paths]
    fixed = frozenset(parse_sets(args.set))
    hw = configure_chip(resolve_hardware(args.hardware, args.hardware_file, specs[0]), args)
    accounting = chosen(specs[0].optimizer, args.optimizer)  # the spec's line, or --optimizer over it
    options = Options(hw, args.save, args.recompute, accounting, args.mfu, args.topology, args.knobs, args.exact,
                      args.collective_matmul)
    search = search_layouts(specs, options, args.chips, fixed, args.jobs, _progress())
    if args.json:
        print(json.dumps(search.to_json(args.top), indent=2, allow_nan=False))
    else:
        print(search.render(args.top), end="")
    return 0
