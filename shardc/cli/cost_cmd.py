"""``shardc cost FILE`` and ``shardc hardware``: the cost model on the command line.

The chip is, in order: ``--hardware-file``, ``--hardware``, the spec's
``hardware`` line, tpu-v5p.  ``--sweep B=1e3:1e7`` replaces the report by a
sweep table (``--with FILE`` adds plans to compare, ``--plot out.png`` draws it).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, replace
from typing import Any

from shardc import plan
from shardc.accountings import ACCOUNTINGS
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
from shardc.cli.spec_args import load_spec, parse_spans, read_spec
from shardc.costmodel.cost_report import cost, missing_sizes
from shardc.costmodel.offload import OFFLOADS
from shardc.costmodel.pipeline_cost import draw_schedule
from shardc.costmodel.sweep import check_plot_path, parse_sweep, plot, sweep
from shardc.costmodel.symbolic import cost_formulas
from shardc.errors import ShardcError, clip
from shardc.hardware import PRESETS
from shardc.images import check_image_path
from shardc.lowering.sizes import devices_to_check, shrink_mesh

__all__ = ["register", "run_cost", "run_hardware", "MAX_POINTS"]

MAX_POINTS = 1000  # a sweep's table is read by a person; more points would only eat memory


def register(subparsers: Any, name: str) -> None:
    """Add the ``cost`` or the ``hardware`` subcommand (both live here)."""
    if name == "hardware":
        parser = subparsers.add_parser(
            name, help="list the hardware presets",
            description="List the hardware presets (FLOPs/s, link and HBM bandwidths, HBM size) and the keys "
                        "a --hardware-file takes.")
        parser.add_argument("--json", action="store_true", help="print the presets as JSON")
        parser.set_defaults(func=run_hardware)
        return
    parser = subparsers.add_parser(
        name, help="cost a plan: time, roofline, memory, thresholds",
        description="Cost the plan of FILE on a chip: each step's bytes, FLOPs and time, per phase and for "
                    "the whole step, memory per device, and the thresholds where the step turns "
                    "communication-bound.  Without sizes for every dim it prints the same table as "
                    "formulas.  The chip: --hardware-file, else --hardware, else the spec's `hardware` "
                    "line, else tpu-v5p.")
    add_common(parser)
    parser.add_argument("--hardware", metavar="NAME", help="a preset (see `shardc hardware`)")
    parser.add_argument("--hardware-file", metavar="TOML", help="a chip of your own (keys: shardc hardware)")
    parser.add_argument("--save", choices=("default", "none", "all"), default="default",
                        help="the plan's residual policy (see `shardc plan --help`)")
    add_recompute(parser)
    add_collective_matmul(parser)
    parser.add_argument("--optimizer", choices=tuple(ACCOUNTINGS), default=None,
                        help="training-state accounting, over the spec's `optimizer` line (default adam10): " +
                             "; ".join(f"{k} {v[3]}" for k, v in ACCOUNTINGS.items()))
    parser.add_argument("--offload", choices=OFFLOADS, default="none",
                        help="hold the kept activations, the optimizer state or both in the host's memory, "
                             "moved over the chip's host link (hardware host_bandwidth) under the phases; an "
                             "offloaded optimizer is updated by the host's CPU (ZeRO-Offload, host_adam_rate)")
    parser.add_argument("--offload-delayed", action="store_true",
                        help="with the optimizer offloaded, the host's update runs a step late, beside the next "
                             "step's forward and backward (ZeRO-Offload's one-step delayed parameter update)")
    parser.add_argument("--mfu", type=float, metavar="FRACTION", help="also give the step time at this MFU")
    parser.add_argument("--spans", action="append", default=[], metavar="AXIS=K",
                        help="mesh axis AXIS is laid over K physical ICI axes (the book's M_X; repeatable)")
    add_topology(parser)
    add_model_flags(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--sweep", metavar="DIM=LOW:HIGH",
                        help="instead of the report, a table of compute vs communication time at log-spaced "
                             "sizes of one dim (or mesh axis), the plan kept fixed")
    parser.add_argument("--points", type=int, default=None, metavar="N",
                        help=f"points of the sweep, 2 to {MAX_POINTS} (13)")
    parser.add_argument("--with", dest="others", action="append", default=[], metavar="FILE",
                        help="another spec to sweep beside FILE (repeatable)")
    parser.add_argument("--plot", metavar="PATH",
                        help="draw the sweep to PATH (.png, .pdf, .svg, ...; needs matplotlib)")
    parser.add_argument("--schedule-plot", metavar="PATH",
                        help="draw the pipeline schedule as a Gantt chart (.png, ...; needs matplotlib)")
    parser.add_argument("--force", action="store_true",
                        help="let --plot or --schedule-plot replace a file that is not an image")
    parser.add_argument("--check-memory", action="store_true",
                        help="also compile the step as `shardc verify` lowers it (emulated CPU devices, its small "
                             "sizes) and set the memory per device beside XLA's buffer assignment")
    parser.set_defaults(func=run_cost)


def run_hardware(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps({k: asdict(h) | {"w_ici": h.w_ici, "c_over_w_ici": h.intensity_ici,
                                          "w_dcn": h.w_dcn, "c_over_w_dcn": h.intensity_dcn,
                                          "peak_f8": h.peak("f8")}
                          for k, h in PRESETS.items()}, indent=2))
        return 0
    print(f"{'name':<9} {'C FLOP/s':>9} {'fp8':>8} {'ICI 1-way':>10} {'W_ici':>8} {'C/W_ici':>8} {'HBM':>6} "
          f"{'HBM B/s':>8} {'DCN/IB':>8} {'C/W_dcn':>8} {'matmul':>7}  notes")
    for h in PRESETS.values():
        best = max((e for _, e in h.matmul_efficiency), default=1.0)
        print(f"{h.name:<9} {h.flops:>9.3g} {h.peak('f8'):>8.3g} {h.ici_bandwidth:>10.3g} {h.w_ici:>8.3g} "
              f"{h.intensity_ici:>8.0f} {h.hbm_bytes / 1e9:>4.0f}GB {h.hbm_bandwidth:>8.3g} {h.dcn_bandwidth:>8.3g} "
              f"{h.intensity_dcn:>8.0f} {best:>7.0%}  {h.description}")
    print("W_ici = 2 x the one-way link figure on a torus (bidirectional, per mesh axis); on a GPU its NVLink "
          "egress, one way, x ici_efficiency (an in-node AllReduce at nvls_efficiency where the NVSwitches "
          "reduce); DCN/IB: the line rate per chip, W_dcn x dcn_efficiency; hop latency 1e-6 s; fp8: the f8 matmul "
          "rate;\nmatmul: the best measured fraction of peak a matmul reaches (smaller matmuls reach less; "
          "--model book: all at peak).\n--hardware-file chip.toml takes the keys: name, flops, flops_f8, "
          "ici_bandwidth, hbm_bytes, hbm_bandwidth, dcn_bandwidth, hop_latency, bucket_bytes, collective_base, "
          "matmul_efficiency, matmul_efficiency_f8 ([[flops, fraction], ...]), attention_forward, "
          "attention_backward ([[keys, fraction], ...]: a fused attention kernel's), ici_domain, torus_side, "
          "torus_dims, ici_efficiency, nvls_efficiency, "
          "dcn_efficiency, hbm_efficiency, matmul_hbm_efficiency, host_bandwidth, host_adam_rate, book, description; "
          "or base = \"a100\" (a preset) and only the keys that differ from it; a spec's `hardware` line may name "
          "such a file (`hardware chip.toml`, beside the spec)")
    return 0


def run_cost(args: argparse.Namespace) -> int:
    _check_flags(args)
    spec = read_spec(args)
    hw = configure_chip(resolve_hardware(args.hardware, args.hardware_file, spec), args)
    spans = parse_spans(args.spans, spec)
    if args.schedule_plot:  # before any work: a bad path must not cost a whole run
        check_image_path(args.schedule_plot, "--schedule-plot", args.force)
    the_plan = plan(spec, save=args.save, hardware=hw, spans=spans,  # planned for the chip it is costed on
                    recompute=args.recompute, topology=args.topology, collective_matmul=args.collective_matmul,
                    fit_memory=True, optimizer=args.optimizer, offload=args.offload)  # fits the memory costed here
    if args.sweep:
        return _run_sweep(args, the_plan)
    memory = _memory_check(the_plan) if args.check_memory else None
    sizes = {a.name: a.size for a in spec.mesh.axes} | dict(spec.sizes)
    if missing_sizes(the_plan, sizes):
        formulas = cost_formulas(the_plan, spans=spans, optimizer=args.optimizer)  # on the plan's chip
        if args.mfu is not None:
            formulas = replace(formulas, notes=formulas.notes + (f"--mfu {args.mfu}: the step time at an MFU "
                                                                 "needs the sizes",))
        if args.offload != "none":
            formulas = replace(formulas, notes=formulas.notes + (f"--offload {args.offload}: the host traffic "
                                                                 "needs the sizes",))
        _print(args, formulas.to_json(), formulas.render(), memory)
        return 0
    report = cost(the_plan, mfu=args.mfu, optimizer=args.optimizer, spans=spans, offload=args.offload,
                  offload_delayed=args.offload_delayed)
    if args.schedule_plot:  # drawn before the report is printed: a refusal leaves no half output
        draw_schedule(report, args.schedule_plot, args.force)
    _print(args, report.to_json(), report.render(), memory)
    if args.schedule_plot and not args.json:
        print(f"wrote {args.schedule_plot}")
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    """Flags that only mean something together: none is silently ignored."""
    check_hardware_flag(args)
    alone = [flag for flag, given in (("--plot", args.plot), ("--with", args.others),
                                      ("--points", args.points is not None)) if given]
    if alone and not args.sweep:
        raise ShardcError(f"{alone[0]} only applies to a sweep, and no --sweep was given",
                          fix=f"add --sweep DIM=LOW:HIGH, or drop {alone[0]}")
    if args.sweep and args.offload != "none":
        raise ShardcError("--offload changes the report's memory and step, which --sweep replaces",
                          fix="run the two separately")
    if args.offload_delayed and args.offload not in ("optimizer", "both"):
        raise ShardcError("--offload-delayed delays the host's update of an offloaded optimizer, and none is",
                          fix="add --offload optimizer (or both), or drop --offload-delayed")
    if args.sweep and args.schedule_plot:
        raise ShardcError("--schedule-plot draws the report's pipeline, which --sweep replaces",
                          fix="run the two separately")
    if args.sweep and args.check_memory:
        raise ShardcError("--check-memory compiles the report's step, which --sweep replaces",
                          fix="run the two separately")
    if args.force and not (args.plot or args.schedule_plot):
        raise ShardcError("--force only lets --plot or --schedule-plot replace a file, and neither was given",
                          fix="drop --force")


def _memory_check(plan: Any) -> Any:
    """The plan's memory against XLA's, compiled on as many emulated devices as ``shardc verify`` uses."""
    from shardc.cli.lower_cmd import emulate_devices

    devices = devices_to_check(plan)
    emulate_devices(math.prod(s for _, s in shrink_mesh([(a.name, a.size) for a in plan.spec.mesh.axes], devices)))
    from shardc.verification.memory_check import check_plan_memory

    return check_plan_memory(plan, devices)


def _print(args: argparse.Namespace, data: dict[str, Any], text: str, memory: Any) -> None:
    """The report as JSON (with ``memory_check`` under --check-memory) or as text, the check's table after."""
    if args.json:
        if memory is not None:
            data = {**data, "memory_check": memory.to_json()}
        print(json.dumps(data, indent=2, allow_nan=False))
        return
    print(text, end="")
    if memory is not None:
        from shardc.verification.memory_check import render_memory  # loads jax: only under --check-memory

        print("\n" + render_memory(memory), end="")


def _run_sweep(args: argparse.Namespace, first: Any) -> int:
    dim, low, high = parse_sweep(args.sweep)
    points = 13 if args.points is None else args.points
    if not 2 <= points <= MAX_POINTS:
        raise ShardcError(f"--points must be from 2 to {MAX_POINTS}, got {clip(str(points))}",
                          fix="write e.g. --points 13")
    if args.plot:
        check_plot_path(args.plot, args.force)
    hw = configure_chip(resolve_hardware(args.hardware, args.hardware_file, first.spec), args)
    plans = [first] + [plan(load_spec(path, args.set, args.optimizer, args.grad_reduce_dtype,
                                args.param_gather_dtype), save=args.save,
                            hardware=hw, recompute=args.recompute, topology=args.topology,
                            collective_matmul=args.collective_matmul, fit_memory=True, optimizer=args.optimizer,
                            offload=args.offload)
                       for path in args.others]
    spans = parse_spans(args.spans, first.spec)
    sweeps = [sweep(p, hw, dim, low, high, points, spans=spans) for p in plans]
    if args.json:
        print(json.dumps([s.to_json() for s in sweeps], indent=2))
    else:
        print("\n".join(s.render() for s in sweeps), end="")
    if args.plot:
        plot(sweeps, args.plot, hw, args.force)
        print(f"wrote {args.plot}")
    return 0
