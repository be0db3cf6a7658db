"""``shardc cost FILE`` and ``shardc hardware``: the cost model on the command line.

The chip is, in order: ``--hardware-file``, ``--hardware``, the spec's
``hardware`` line, tpu-v5p.  ``--sweep B=1e3:1e7`` replaces the report by a
sweep table (``--with FILE`` adds plans to compare, ``--plot out.png`` draws it).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from shardc.cli.main import add_common, parse_sets, read_spec

__all__ = ["register", "run_cost", "run_hardware"]


def register(subparsers: Any, name: str) -> None:
    """Add the ``cost`` or the ``hardware`` subcommand (both live here)."""
    if name == "hardware":
        parser = subparsers.add_parser(name, help="list the hardware presets")
        parser.add_argument("--json", action="store_true", help="print the presets as JSON")
        parser.set_defaults(func=run_hardware)
        return
    parser = subparsers.add_parser(name, help="cost a plan: time, roofline, memory, thresholds")
    add_common(parser)
    parser.add_argument("--hardware", metavar="NAME", help="a preset (see `shardc hardware`)")
    parser.add_argument("--hardware-file", metavar="TOML", help="a chip of your own (keys: shardc hardware)")
    parser.add_argument("--save", choices=("default", "none", "all"), default="default",
                        help="the plan's residual policy")
    parser.add_argument("--optimizer", choices=("adam10", "adam16"), default="adam10",
                        help="memory accounting: 10 or 16 bytes a param")
    parser.add_argument("--mfu", type=float, metavar="FRACTION", help="also give the step time at this MFU")
    parser.add_argument("--spans", action="append", default=[], metavar="AXIS=K",
                        help="mesh axis AXIS is laid over K physical ICI axes (the book's M_X; repeatable)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--sweep", metavar="DIM=LOW:HIGH", help="log-spaced sweep of one dim")
    parser.add_argument("--points", type=int, default=13, help="points of the sweep (13)")
    parser.add_argument("--with", dest="others", action="append", default=[], metavar="FILE",
                        help="another spec to sweep beside FILE (repeatable)")
    parser.add_argument("--plot", metavar="PNG", help="draw the sweep (needs matplotlib)")
    parser.add_argument("--schedule-plot", metavar="PNG", help="draw the pipeline schedule as a Gantt chart")
    parser.set_defaults(func=run_cost)


def run_hardware(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from shardc.costmodel.hardware import PRESETS

    if args.json:
        print(json.dumps({k: asdict(h) | {"w_ici": h.w_ici, "c_over_w_ici": h.intensity_ici}
                          for k, h in PRESETS.items()}, indent=2))
        return 0
    print(f"{'name':<9} {'C FLOP/s':>9} {'ICI 1-way':>10} {'W_ici':>8} {'C/W_ici':>8} {'HBM':>6} "
          f"{'HBM B/s':>8} {'DCN/IB':>8} {'C/W_dcn':>8}  notes")
    for h in PRESETS.values():
        print(f"{h.name:<9} {h.flops:>9.3g} {h.ici_bandwidth:>10.3g} {h.w_ici:>8.3g} {h.intensity_ici:>8.0f} "
              f"{h.hbm_bytes / 1e9:>4.0f}GB {h.hbm_bandwidth:>8.3g} {h.dcn_bandwidth:>8.3g} "
              f"{h.intensity_dcn:>8.0f}  {h.description}")
    print("W_ici = 2 x the one-way link figure (bidirectional, per mesh axis); DCN/IB per chip, as is; "
          "hop latency 1e-6 s.\n--hardware-file chip.toml takes the keys: name, flops, ici_bandwidth, "
          "hbm_bytes, hbm_bandwidth, dcn_bandwidth, hop_latency, ici_domain, description")
    return 0


def run_cost(args: argparse.Namespace) -> int:
    from shardc import plan
    from shardc.costmodel.report import cost

    spec = read_spec(args)
    the_plan = plan(spec, save=args.save)
    if args.sweep:
        return _run_sweep(args, the_plan)
    report = cost(the_plan, hardware=args.hardware, mfu=args.mfu, optimizer=args.optimizer,
                  hardware_file=args.hardware_file, spans=parse_sets(args.spans) or None)
    print(report.json_text() if args.json else report.render(), end="\n" if args.json else "")
    if args.schedule_plot:
        from shardc.costmodel.pipeline import draw_schedule

        draw_schedule(report, args.schedule_plot)
        if not args.json:
            print(f"wrote {args.schedule_plot}")
    return 0


def _run_sweep(args: argparse.Namespace, first: Any) -> int:
    from shardc import parse, plan
    from shardc.costmodel.hardware import resolve_hardware
    from shardc.costmodel.sweep import parse_sweep, plot, sweep
    from shardc.spec.overrides import apply_overrides

    dim, low, high = parse_sweep(args.sweep)
    hw = resolve_hardware(args.hardware, args.hardware_file, first.spec.hardware)
    plans = [first]
    for path in args.others:
        try:
            with open(path, encoding="utf-8") as handle:
                spec = parse(handle.read(), filename=path)
        except OSError as err:
            from shardc.errors import ShardcError

            raise ShardcError(f"cannot read {path}: {err.strerror}", fix="check the --with path") from None
        sets = parse_sets(args.set)
        plans.append(plan(apply_overrides(spec, sets) if sets else spec, save=args.save))
    spans = parse_sets(args.spans) or None
    sweeps = [sweep(p, hw, dim, low, high, args.points, spans=spans) for p in plans]
    if args.json:
        print(json.dumps([s.to_json() for s in sweeps], indent=2))
    else:
        print("\n".join(s.render() for s in sweeps), end="")
    if args.plot:
        plot(sweeps, args.plot, hw)
        print(f"wrote {args.plot}")
    return 0
