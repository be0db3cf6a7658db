"""``shardc plan FILE``: the forward and backward listings of a spec."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

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
from shardc.cli.spec_args import parse_spans, read_spec
from shardc.costmodel.fitting import fitting_plan as plan  # the fastest plan that fits the chip's memory
from shardc.errors import InternalError
from shardc.planner.check import require_sound
from shardc.planner.plan_text import render_explain, render_text, to_json

__all__ = ["register"]


def register(sub: Any, name: str) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help="infer the collectives of forward and backward",
        description="Infer every collective the forward and backward pass need, one numbered line a step.")
    add_common(parser)
    parser.add_argument("--save", choices=("default", "none", "all"), default="default",
                        help="residual policy: default keeps gathered activations and gathers weights "
                             "again; none keeps nothing gathered; all keeps everything")
    add_recompute(parser, detail=True)
    add_collective_matmul(parser)
    parser.add_argument("--hardware", metavar="NAME",
                        help="plan for this chip (see `shardc hardware`; default: the spec's, else tpu-v5p)")
    parser.add_argument("--hardware-file", metavar="TOML", help="plan for a chip of your own")
    parser.add_argument("--spans", action="append", default=[], metavar="AXIS=K",
                        help="mesh axis AXIS is laid over K physical ICI axes (as for `shardc cost`)")
    add_topology(parser)
    add_model_flags(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--explain", action="store_true",
                        help="also list, per einsum, the alternatives considered and why one won")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_hardware_flag(args)
    spec = read_spec(args)
    hw = configure_chip(resolve_hardware(args.hardware, args.hardware_file, spec), args)
    result = plan(spec, save=args.save, hardware=hw, spans=parse_spans(args.spans, spec),
                  recompute=args.recompute, explain=args.explain, topology=args.topology,
                  collective_matmul=args.collective_matmul)
    try:
        require_sound(result)  # a broken plan is a shardc bug: say so (exit 1), never print it as sound
    except InternalError as err:
        print(err.render(), file=sys.stderr)
        return err.exit_code
    if args.json:
        data = to_json(result)
        if args.explain:
            data["choices"] = [_choice_json(c) for c in result.choices]
            data["memory_choices"] = [{"plan": c.label, "step_s": c.step_s, "memory_bytes": c.memory_bytes,
                                       "chosen": c.chosen} for c in result.memory_choices]
        print(json.dumps(data, indent=2, allow_nan=False))  # strict JSON: a NaN would be a bug
        return 0
    text = render_text(result)
    if args.explain:
        text += render_explain(result)
    print(text, end="")
    return 0


def _choice_json(choice: Any) -> dict[str, Any]:
    return {
        "phase": choice.phase,
        "statement": choice.statement,
        "reason": choice.reason,
        "alternatives": [
            {"collectives": a.description, "time_s": a.time, "bytes_expr": a.volume, "count": a.collectives,
             "chosen": a.chosen}
            for a in choice.alternatives
        ],
    }
