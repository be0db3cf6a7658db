"""A spec's step by kind, from shardc's own cost: GEMM compute, the attention kernel, each memory-bound
op's passes (their HBM bytes), the optimizer's update and the exposed communication.

    python benchmarks/step_breakdown.py benchmarks/runs/mpt_7b_h100.shard benchmarks/runs/mpt_7b_a100.shard

Each row is what ``shardc cost`` sums into the step (a phase's rows times the layers that run them); the
kinds add up to the step time.  For a spec without a pipeline.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import shardc  # noqa: E402
from shardc.collectives import Op  # noqa: E402
from shardc.costmodel.cost_report import CostReport  # noqa: E402
from shardc.layer_counts import runs  # noqa: E402


def kinds(report: CostReport) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds by kind of the step of ``report``, and the HBM bytes of each memory-bound op."""
    seconds: dict[str, float] = defaultdict(float)
    moved: dict[str, float] = defaultdict(float)
    for phase in report.step.parts:
        counts = (phase.layers, *phase.more_layers)
        for row in phase.rows:
            n = runs(row.once, row.block, counts) * phase.repeats
            if row.is_collective:
                continue
            if row.op is Op.EINSUM:
                seconds["GEMM compute"] += row.compute_s * n
                seconds["GEMM bytes past its FLOPs"] += row.memory_s * n
            elif row.flops:  # a fused attention kernel: its matmuls, and its inputs' and outputs' bytes
                seconds["attention kernel"] += row.compute_s * n
                seconds["attention kernel's bytes"] += row.memory_s * n
            elif row.memory_bytes:
                name = "memory-bound " + row.text.split("(")[0]
                seconds[name] += row.memory_s * n
                moved[name] += row.memory_bytes * n
    seconds["optimizer update"] = report.step.update_s
    seconds["exposed communication"] = report.step.step_s - report.step.compute_s - report.step.memory_s
    return seconds, moved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--recompute", default="none")
    args = parser.parse_args()
    for path in args.specs:
        spec = shardc.parse(Path(path).read_text(encoding="utf-8"), filename=path)
        report = shardc.cost(shardc.plan(spec, recompute=args.recompute))
        seconds, moved = kinds(report)
        passes = sum(s for k, s in seconds.items() if k.startswith("memory-bound"))
        print(f"{path} on {report.hardware.name}: step {report.step.step_s * 1e3:.1f} ms, MFU {report.step.mfu:.1%}; "
              f"memory-bound passes {passes * 1e3:.1f} ms, {sum(moved.values()) / 1e9:.0f} GB")
        for kind, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
            if s >= 5e-5:
                bytes_moved = f"{moved[kind] / 1e9:8.1f} GB" if kind in moved else ""
                print(f"  {kind:40} {s * 1e3:9.2f} ms {bytes_moved}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
