"""Time to parse and plan a deep spec: 96 layers, two einsums a layer (FSDP + TP MLP blocks).

Target (issue 2): parse + plan under 1 s on this machine.  Prints the figures and
the ratio to the target; run with ``python benchmarks/plan_speed.py [LAYERS]``.
"""

from __future__ import annotations

import sys
import time

import shardc


def deep_spec(layers: int, sized: bool = True) -> str:
    lines = ["mesh X=16, Y=4"]
    if sized:
        lines.append("dims B=1_048_576, D=8192, F=32768")
    prev = "H0"
    for k in range(1, layers + 1):
        lines.append(f"T{k}[B_X, F_Y] = {prev}[B_X, D_Y] · W_in{k}[D_X, F_Y]")
        lines.append(f"H{k}[B_X, D_Y] = T{k}[B_X, F_Y] · W_out{k}[F_Y, D_X]")
        prev = f"H{k}"
    return "\n".join(lines) + "\n"


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 96
    for sized in (True, False):
        text = deep_spec(layers, sized)
        t0 = time.perf_counter()
        spec = shardc.parse(text, filename="deep.shard")
        t1 = time.perf_counter()
        result = shardc.plan(spec)
        t2 = time.perf_counter()
        steps = len(result.forward) + len(result.backward)
        total = t2 - t0
        print(f"{layers} layers, {'with' if sized else 'without'} dims: parse {t1 - t0:.3f} s, "
              f"plan {t2 - t1:.3f} s ({steps} steps), total {total:.3f} s = {total / 1.0:.2f} x the 1 s target")


if __name__ == "__main__":
    main()
