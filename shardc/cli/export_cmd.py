"""``shardc export``: the plan's shardings for jax, MaxText or flax (text only, no jax import)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from shardc.cli.main import add_common
from shardc.cli.spec_args import read_spec
from shardc.errors import ShardcError
from shardc.export.jax_export import jax_module
from shardc.export.logical import flax_rules, maxtext_yaml, parse_names
from shardc.files import write_text
from shardc.planner.check import require_sound
from shardc.planner.planner import plan

__all__ = ["register"]

_HELP = "write the plan's shardings as a jax module, a MaxText rule file or flax's logical axis rules"


def register(sub: Any, name: str) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(name, help=_HELP, description=_HELP)
    add_common(parser)
    parser.add_argument("--to", required=True, choices=("jax", "maxtext", "flax"),
                        help="jax: a Python module (make_mesh, SHARDINGS, GRAD_SHARDINGS, OUT_SHARDINGS); "
                             "maxtext: a custom_mesh_and_rule YAML with the ici/dcn parallelism; "
                             "flax: the logical_axis_rules list")
    parser.add_argument("-o", "--output", metavar="OUT", help="write here instead of stdout")
    parser.add_argument("--names", action="append", metavar="D=embed,...", default=[],
                        help="maxtext/flax: a dim's logical name (D=embed) or a mesh axis's MaxText axis "
                             "(X=fsdp), comma-separated, repeatable")
    parser.add_argument("--save", choices=("default", "none", "all"), default="default",
                        help="residual policy of the plan (see `shardc plan --help`)")
    parser.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    if args.names and args.to == "jax":
        raise ShardcError("--names applies to --to maxtext and --to flax", fix="drop --names, or pick maxtext or flax")
    if args.output and os.path.exists(args.output) and os.path.samefile(args.output, args.file):
        raise ShardcError(f"-o {args.output} is the spec itself: writing there would replace it",
                          fix="write the export elsewhere")
    planned = plan(read_spec(args), save=args.save)
    require_sound(planned)
    if args.to == "jax":
        text = jax_module(planned)
    else:
        names = parse_names(args.names, planned)
        text = maxtext_yaml(planned, names) if args.to == "maxtext" else flax_rules(planned, names)
    if not args.output:
        print(text, end="")
        return 0
    write_text(args.output, text, "-o")
    print(f"wrote {args.output}", file=sys.stderr)
    return 0
