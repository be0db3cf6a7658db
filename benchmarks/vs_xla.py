"""Plan vs XLA's partitioner on every example: weighted volume ratio and median runtime ratio.

    python benchmarks/vs_xla.py [--repeats N] [examples/*.shard ...]

Runs on 8 emulated CPU devices (set before jax is imported).  Volume: the plan's
weighted bytes (forward + backward, V (bytes a device would hold unsharded over the axes), AllReduce twice,
AllToAll a quarter) over those of the collectives XLA inserts for the same
computation and boundary shardings, both at the spec's own dims (the mesh cut to the devices; XLA's
programs compiled from abstract arguments).  Time: median wall time of the lowered
forward+backward over the jit-partitioned one, at compare's small sizes (the spec's, shrunk in
proportion; no tensor over 2^18 elements), so it measures dispatch and collective overheads more than FLOPs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="spec files (default: examples/*.shard)")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per program")
    args = parser.parse_args()
    import shardc
    from shardc.verification.compare import compare

    root = Path(__file__).resolve().parent.parent
    files = [Path(f) for f in args.files] or sorted((root / "examples").glob("*.shard"))
    print(f"{'example':<14} {'plan B':>9} {'xla B':>9} {'volume':>7} {'plan ms':>8} {'xla ms':>8}"
          f" {'time':>6}")
    worst = 0.0
    times: list[float] = []
    for path in files:
        result = compare(shardc.parse(path.read_text(), filename=str(path)), repeats=args.repeats)
        ratio = result.volume_ratio
        worst = max(worst, ratio if ratio is not None else 1.0)
        volume = "n/a" if ratio is None else f"{ratio:.3f}"
        if result.time_ratio is not None:
            times.append(result.time_ratio)
        print(f"{path.stem:<14} {result.plan.total:>9.3g} {result.xla.total:>9.3g} {volume:>7} "
              f"{(result.plan.seconds or 0) * 1e3:>8.3f} {(result.xla.seconds or 0) * 1e3:>8.3f} "
              f"{result.time_ratio or 0:>6.2f}")
    if times:
        print(f"median runtime ratio plan/xla over {len(times)} examples: {statistics.median(times):.2f} "
              f"(range {min(times):.2f}-{max(times):.2f}; tiny CPU sizes: dispatch dominates)")
    print(f"worst volume ratio {worst:.3f} (target <= 1.0; n/a: neither side moves anything)")
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
