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


# Three-axis specs the property tests once found slow (a chain of three operands
# whose intermediate has four indices: ~200 candidate layouts to choose from).
HARD = {
    "chain on 3 axes": """mesh Z=2 over dcn, expert=4, data=1
dims H=24, J=16, N=16, B=24
Out4[H, J_{expert}, N, B_{data}] = W_in1[B_{Z,expert}] × W3[H_{expert}, J, N_Z] × emb2[B_{Z,expert}, N_{data}, H]
""",
    "dot on 3 axes": """mesh pipe=2, Y=2, P=2
dims Seq=24, V2=24, B=16, H=32
param Bias1
Out3[Seq_P, V2_{pipe}, B] = In2[Seq, H_{P,Y,pipe}] @ Bias1[H_Y, B, V2_{P,pipe}]
""",
}


def hard() -> None:
    for name, text in HARD.items():
        t0 = time.perf_counter()
        shardc.plan(shardc.parse(text))
        total = time.perf_counter() - t0
        print(f"{name}: parse + plan {total:.3f} s = {total / 1.0:.2f} x the 1 s target")


def random_specs(count: int = 300) -> None:
    """Plan time over random valid specs (shardc.testing) on meshes of up to 8 devices."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from shardc.testing import specs

    times: list[float] = []

    @settings(max_examples=count, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(specs(max_devices=8, max_statements=3), st.sampled_from(["default", "none", "all"]))
    def run(spec: shardc.spec.ir.Spec, save: str) -> None:  # type: ignore[name-defined]
        t0 = time.perf_counter()
        shardc.plan(spec, save=save)
        times.append(time.perf_counter() - t0)

    run()
    times.sort()
    print(f"{len(times)} random specs: plan median {times[len(times) // 2]:.3f} s, "
          f"p95 {times[int(len(times) * 0.95)]:.3f} s, max {times[-1]:.3f} s = {times[-1]:.2f} x the 1 s target")


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
    hard()
    random_specs()


if __name__ == "__main__":
    main()
