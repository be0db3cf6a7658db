"""``shardc calibrate``: measure this host's chip and write it as a hardware file."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from typing import Any

from shardc.calibrate.chip import calibrated, chip_toml
from shardc.errors import ShardcError
from shardc.files import write_text

__all__ = ["register"]


def register(sub: Any, name: str) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help="measure this chip and write a hardware file",
        description="Time matmuls over sizes, memory streaming and every collective over this host's devices "
                    "through JAX, fit each collective to latency + bytes/bandwidth, and write the chip as a "
                    "hardware file for --hardware-file (or a spec's `hardware` line).")
    parser.add_argument("--out", metavar="TOML", help="write the file here (default: print it)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--name", metavar="NAME", help="the chip's name in the file (default: <preset>-measured)")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and few repeats (seconds; for a check, not for a real chip's figures)")
    parser.add_argument("--devices", type=int, metavar="N",
                        help="on a CPU host, emulate N devices (XLA's host platform device count)")
    parser.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    if args.out is not None:
        if not args.out or os.path.isdir(args.out):
            raise ShardcError(f"--out {args.out!r} is not a file path", fix="name a file, e.g. --out chip.toml")
        if os.path.exists(args.out) and not os.path.isfile(args.out):
            raise ShardcError(f"--out {args.out} is not a regular file", fix="name a file, e.g. --out chip.toml")
        if os.path.exists(args.out) and not args.force:
            raise ShardcError(f"--out {args.out} exists", fix="name another file, or add --force to replace it")
    if args.devices is not None:
        if not 1 <= args.devices <= 512:
            raise ShardcError(f"--devices {args.devices}: must be 1 to 512", fix="write e.g. --devices 8")
        if "jax" in sys.modules:
            raise ShardcError("--devices must be set before jax starts", fix="run `shardc calibrate` on its own")
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()


def run(args: argparse.Namespace) -> int:
    _check(args)
    from shardc.calibrate.measure import FULL, QUICK
    from shardc.calibrate.run import measure

    measured = measure(QUICK if args.quick else FULL, lambda what: print(f"measuring {what}", file=sys.stderr))
    chip = calibrated(measured, args.name)
    text = chip_toml(chip, measured, datetime.date.today().isoformat())
    if args.out is None:
        print(text, end="")
        return 0
    write_text(args.out, text, "--out")
    print(f"wrote {args.out}: {chip.name}, {measured.devices} x {measured.device_kind}", file=sys.stderr)
    return 0
