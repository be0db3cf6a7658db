"""``shardc lower``, ``shardc verify``, ``shardc compare``: the plan as JAX code, run and checked.

``lower`` only writes text (no jax import).  ``verify`` and ``compare`` run
jax; before its first import they ask XLA for 8 emulated CPU devices (unless
XLA_FLAGS already says how many), since the environment must say so before
jax starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from shardc.cli.main import add_common, read_spec
from shardc.errors import ShardcError

__all__ = ["register"]

_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def register(sub: Any, name: str) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(name, help=_HELP[name], description=_HELP[name])
    add_common(parser)
    parser.add_argument("--save", choices=("default", "none", "all"), default="default",
                        help="residual policy of the plan (see `shardc plan --help`)")
    if name == "lower":
        parser.add_argument("-o", "--output", metavar="MODULE.py", help="write here instead of stdout")
    else:
        parser.add_argument("--json", action="store_true", help="print the result as JSON")
        parser.add_argument("--devices", type=int, default=8,
                            help="devices to run on (emulated on a CPU; default 8)")
    parser.set_defaults(func={"lower": run_lower, "verify": run_verify, "compare": run_compare}[name])


_HELP = {
    "lower": "write the plan as a JAX shard_map module",
    "verify": "run the lowered plan and check values and HLO collectives against the plan",
    "compare": "put the plan's collectives beside XLA's partitioner (jit with NamedSharding)",
}


def run_lower(args: argparse.Namespace) -> int:
    from shardc.lowering.api import lowered_mesh, lowered_sizes
    from shardc.lowering.codegen import generate
    from shardc.planner.planner import plan

    result = plan(read_spec(args), save=args.save)
    mesh = lowered_mesh(result, None)
    if result.spec.mesh.pipeline_axis is not None:  # GPipe over the stage axis
        from shardc.lowering.pipeline import lower_pipeline

        source = lower_pipeline(result, load=False).source
    else:
        source = generate(result, mesh, lowered_sizes(result, None, mesh)).source
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as handle:
                handle.write(source)
        except OSError as err:
            raise ShardcError(f"cannot write {args.output}: {err.strerror}",
                              fix="check the directory exists and is writable") from None
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(source, end="")
    return 0


def emulate_devices(count: int) -> None:
    """Ask XLA for ``count`` CPU devices, unless jax is already up or the flag is set."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "jax" not in sys.modules and _DEVICE_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={count}".strip()


def run_verify(args: argparse.Namespace) -> int:
    spec = read_spec(args)
    emulate_devices(args.devices)
    from shardc.lowering.verify import render_report, verify

    report = verify(spec, devices=args.devices, save=args.save)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(render_report(report), end="")
    return 0 if report.ok else 1


def run_compare(args: argparse.Namespace) -> int:
    spec = read_spec(args)
    emulate_devices(args.devices)
    from shardc.lowering.compare import compare, render_comparison

    result = compare(spec, devices=args.devices, save=args.save)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(render_comparison(result), end="")
    return 0
