"""The ``shardc`` command: parses arguments, runs a pass, formats its output.

Each subcommand lives in its own module with ``register(subparsers)``, which
adds its parser and sets ``func`` to a ``run(args) -> int``.  Modules are
imported only when their command runs, so ``shardc plan`` never pays for jax.
A :class:`ShardcError` is printed as a diagnostic (never a traceback), exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from shardc.errors import ShardcError

# command name -> module defining register(); the help line is kept here so
# ``shardc --help`` imports nothing heavy.
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("shardc.cli.plan_cmd", "infer the collectives of forward and backward"),
    "cost": ("shardc.cli.cost_cmd", "cost a plan: time, roofline, memory, thresholds"),
    "hardware": ("shardc.cli.cost_cmd", "list the hardware presets"),
    "lower": ("shardc.cli.lower_cmd", "write the plan as a JAX shard_map module"),
    "verify": ("shardc.cli.lower_cmd", "run the lowered plan and check values and HLO"),
    "compare": ("shardc.cli.lower_cmd", "put the plan beside XLA's partitioner"),
}


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardc", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if name == command:
            importlib.import_module(module).register(sub, name)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except ShardcError as err:
        print(err.render(), file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


def parse_sets(items: Sequence[str] | None) -> dict[str, int]:
    """``--set NAME=VALUE`` pairs as sizes; values take ``_`` separators and ``1e6``."""
    from shardc.spec.parser import parse_size

    sizes: dict[str, int] = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise ShardcError(f"--set expects NAME=VALUE, got {item!r}", fix="write e.g. --set B=1e6")
        sizes[name] = parse_size(value, what=f"--set {name}")
    return sizes


def add_common(parser: argparse.ArgumentParser) -> None:
    """FILE and --set, shared by every command that reads a spec."""
    parser.add_argument("file", metavar="FILE", help="a .shard spec file")
    parser.add_argument("--set", action="append", metavar="NAME=VALUE", default=[],
                        help="override a dim or a mesh axis size (repeatable)")


def read_spec(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """Read and parse FILE, then apply ``--set``; errors are ShardcErrors."""
    from shardc.spec.overrides import apply_overrides
    from shardc.spec.parser import parse

    try:
        with open(args.file, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as err:
        raise ShardcError(f"cannot read {args.file}: {err.strerror}",
                          fix="check the path of the .shard file") from None
    spec = parse(text, filename=args.file)
    sets = parse_sets(args.set)
    return apply_overrides(spec, sets) if sets else spec
