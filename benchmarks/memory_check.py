"""shardc's memory per device against XLA's buffer assignment, per example: the README's table.

    python benchmarks/memory_check.py [--scale K] [examples/*.shard ...]

Lowers every unpipelined example as ``shardc verify`` does (8 emulated CPU devices, its small
sizes; ``--scale K`` multiplies every dim by K, the mesh kept) and prints per phase the ratio
shardc / XLA of the arguments, outputs, temporaries and their total, and the headline: the total
of the phase XLA needs most for (``shardc verify --json``'s ``memory_check.ratio``).  Then every
pipelined example as the pipelined verify lowers it (verify's sizes; no ``--scale``), its schedule's
program compiled in float32: shardc's fullest stage beside XLA's figures for it, reported, not judged
(:mod:`shardc.verification.pipeline_memory`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="spec files (default: examples/*.shard)")
    parser.add_argument("--scale", type=int, default=1, help="multiply every dim of verify's sizes by this")
    args = parser.parse_args()
    import jax

    import shardc
    from shardc.lowering.api import lower
    from shardc.lowering.replan import unlowered_optimizer
    from shardc.lowering.sizes import devices_to_check, small_sizes
    from shardc.verification.memory_check import TARGET, check_memory
    from shardc.verification.route_load import overflowing

    root = Path(__file__).resolve().parent.parent
    files = [Path(f) for f in args.files] or sorted((root / "examples").glob("*.shard"))
    head = "  ".join(f"{p + ' ' + c:>8}" for p in ("fwd", "bwd") for c in ("args", "outs", "temp", "all"))
    print(f"{'example':<26} {'ratio':>5}  {head}")
    pipelined = []
    for path in files:
        plan = shardc.plan(shardc.parse(path.read_text(), filename=str(path)))
        if plan.spec.mesh.pipeline_axis is not None:
            pipelined.append((path, plan))
            continue
        zero = plan if plan.optimizer else None
        plain, _ = unlowered_optimizer(plan)
        sizes, _ = overflowing(plain, small_sizes(zero or plain, devices_to_check(plain, jax.device_count())), {})
        mesh = {a.name for a in plan.spec.mesh.axes}
        check = check_memory(lower(zero or plain, sizes={k: v if k in mesh else v * args.scale
                                                         for k, v in sizes.items()}))
        cells = "  ".join(f"{r.ratio:>8.2f}" if r.ratio is not None else f"{'-':>8}" for r in check.rows)
        mark = "" if check.within_target else f"  (outside {TARGET:.0%})"
        print(f"{path.name:<26} {check.headline.ratio or 0:>5.2f}  {cells}{mark}")
    if pipelined:
        _pipelined(pipelined, jax.device_count())
    return 0


def _pipelined(plans: list[tuple[Path, Any]], devices: int) -> None:
    """shardc's fullest stage beside XLA's schedule program, per pipelined example: bytes a device."""
    from shardc.units import fmt_bytes
    from shardc.verification.pipeline_verify import check_pipeline_memory

    short = {"gradients": "grads", "other ends": "ends", "activations": "activ.", "gathered weights": "gathered",
             "working set": "working", "gradient sums": "sums"}
    for k, (path, plan) in enumerate(plans):
        check = check_pipeline_memory(plan, devices)
        mine, xla = dict(check.shardc_parts), dict(check.xla_parts)
        if k == 0:  # the header names the parts the check reports, in its order
            heads = ("shardc", *(short.get(name, name) for name in mine))
            print(f"\n{'pipelined example':<26} {'ratio':>5}  {' '.join(f'{c:>9}' for c in heads)}  "
                  f"{'XLA':>9} {'args':>9} {'outs':>9} {'temp':>9}  held/M")
        cells = [check.shardc_bytes, *mine.values(), check.xla_bytes, xla["arguments"], xla["outputs"],
                 xla["temporaries"]]
        text = [f"{fmt_bytes(n):>9}" for n in cells]
        split = 1 + len(mine)
        print(f"{path.name:<26} {check.ratio or 0:>5.2f}  {' '.join(text[:split])}  {' '.join(text[split:])}  "
              f"{check.held:g}/{check.microbatches}")


if __name__ == "__main__":
    raise SystemExit(main())
