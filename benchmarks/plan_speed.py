"""Planning speed, against the targets of issue 9.

Prints, each with its target:

- the 96-layer spec (two einsums a layer, FSDP + TP MLP blocks): parse + plan, < 0.2 s, and the
  plan checker on its plan;
- a LLaMA decoder layer (RMSNorm, causal attention, SwiGLU) written out 96 times, every layer
  its own tensors and params: parse + plan, the plan checker (``shardc plan`` runs it on
  every plan) and the collective-matmul fusion on its plan, each doing work linear in the plan's steps;
- the 8-axis MaxText-style mesh (``data=16, stage=1, fsdp=1, seq=1, tensor=4, expert=1,
  ctx=1, tt=1``): plan, < 1 s (size-1 axes are stripped before the search);
- an MLP block on 4, 5 and 6 mesh axes of size 2, and two specs on 6 and 5 axes of size 2
  whose references write the axes apart (no two always together): plan, < 5 s;
- PaLM 540B with its cross-pod data parallelism written over two DCN axes (``W=2 over dcn, Z=2 over
  dcn, X=128, Y=12``, ``B_WZX``): plan, < 10 s (the exact search finishes; where it overruns its
  budget, as at ``X=32, Y=4``, a second search moves W and Z as one, issues 20 and 21);
- eight axes of size 2 written apart: past the planner's budget (a count of search work, not
  seconds), so the clear error, with the time it took to say so;
- ``shardc plan`` and ``shardc cost`` on an example, wall time of a fresh process
  (imports included), < 0.3 s and < 0.6 s;
- DeepSeek-V3 671B (``benchmarks/runs/deepseek_v3.shard``, 256 routed experts top-8): plan and cost,
  each < 3 s.

Run with ``python benchmarks/plan_speed.py [LAYERS]`` from the repository root.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's shardc, not an installed one

import shardc  # noqa: E402
from shardc.errors import ShardcError  # noqa: E402
from shardc.ir.plan import Plan  # noqa: E402
from shardc.ir.spec import Spec  # noqa: E402
from shardc.planner.check import check_plan  # noqa: E402
from shardc.planner.collective_matmul import fuse_collective_matmuls  # noqa: E402


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


# One LLaMA-2 70B decoder layer as examples/llama_layer_fsdp_tp.shard writes it; {x} is the layer's
# input, {k} its number: every tensor and param of a layer is its own.
LLAMA_LAYER = """\
L1{k}[B_X, S, D] = rmsnorm({x}[B_X, S, D] over D)
Kx{k}[B_X, T, D] = L1{k}[B_X, S, D]
Q{k}[B_X, S, G_Y, R, H] = L1{k}[B_X, S, D] · W_q{k}[D_X, G_Y, R, H]
K{k}[B_X, T, G_Y, H] = Kx{k}[B_X, T, D] · W_k{k}[D_X, G_Y, H]
V{k}[B_X, T, G_Y, H] = Kx{k}[B_X, T, D] · W_v{k}[D_X, G_Y, H]
Sc{k}[B_X, G_Y, R, S, T] = Q{k}[B_X, S, G_Y, R, H] · K{k}[B_X, T, G_Y, H]
P{k}[B_X, G_Y, R, S, T] = softmax(causal(Sc{k}[B_X, G_Y, R, S, T], S, T) over T)
C{k}[B_X, S, G_Y, R, H] = P{k}[B_X, G_Y, R, S, T] · V{k}[B_X, T, G_Y, H]
R1{k}[B_X, S, D] = {x}[B_X, S, D] + C{k}[B_X, S, G_Y, R, H] · W_o{k}[G_Y, R, H, D_X]
L2{k}[B_X, S, D] = rmsnorm(R1{k}[B_X, S, D] over D)
Gt{k}[B_X, S, F_Y] = silu(L2{k}[B_X, S, D] · W_gate{k}[D_X, F_Y])
U{k}[B_X, S, F_Y] = L2{k}[B_X, S, D] · W_up{k}[D_X, F_Y]
A{k}[B_X, S, F_Y] = Gt{k}[B_X, S, F_Y] * U{k}[B_X, S, F_Y]
Out{k}[B_X, S, D] = R1{k}[B_X, S, D] + A{k}[B_X, S, F_Y] · W_down{k}[F_Y, D_X]
"""


def llama_spec(layers: int) -> str:
    """``layers`` LLaMA decoder layers written out (no ``layers`` block), each feeding the next."""
    params = ", ".join(f"{w}{k}" for k in range(1, layers + 1)
                       for w in ("W_q", "W_k", "W_v", "W_o", "W_gate", "W_up", "W_down"))
    lines = ["mesh X=32, Y=8", "dims B=256, S=4096, T=4096, D=8192, G=8, R=8, H=128, F=28672",
             f"param {params}"]
    for k in range(1, layers + 1):
        lines.append(LLAMA_LAYER.format(k=k, x="X" if k == 1 else f"Out{k - 1}"))
    return "\n".join(lines)


MAXTEXT = """mesh data=16, stage=1, fsdp=1, seq=1, tensor=4, expert=1, ctx=1, tt=1
dims B=1024, D=4096, F=16384
H[B_{data,fsdp}, F_{tensor,expert}] = In[B_{data,fsdp}, D_{seq}] · W_in[D_{fsdp,stage}, F_{tensor,expert}]
Out[B_{data,fsdp}, D_{ctx}] = H[B_{data,fsdp}, F_{tensor,expert}] · W_out[F_{tensor,tt}, D_{fsdp}]
"""


def axes_of_two(n: int) -> str:
    """An FSDP + TP MLP block on ``n`` mesh axes of size 2: half shard the batch, half the hidden dim."""
    names = "XYZPQR"[:n]
    batch, hidden = names[: n // 2], names[n // 2:]
    return (f"mesh {', '.join(f'{a}=2' for a in names)}\ndims B=4096, D=1024, F=4096\n"
            f"T[B_{batch}, F_{hidden}] = In[B_{batch}, D] · W_in[D_{batch}, F_{hidden}]\n"
            f"Out[B_{batch}, D] = T[B_{batch}, F_{hidden}] · W_out[F_{hidden}, D_{batch}]\n")


# Six axes of size 2 written apart: no two axes always together, so none move as one
# (the spec: 35 s and a give-up at the 30 s budget before the search kept axes in place).
SIX_APART = """mesh P=2, Q=2, R=2, X=2, Y=2, Z=2
dims B=4096, D=1024, F=4096
T[B_{P,Q}, F_{X,Y}] = In[B_{P,R}, D_Z] · W_in[D_{Q,X}, F_{Y,Z}]
Out[B_{P,Q}, D_R] = T[B_{P,Q}, F_{X,Y}] · W_out[F_{Z,X}, D_{Y,Q}]
"""

# Five axes written apart, attention-style projections with tensors of three and four dims.
FIVE_APART = """mesh P=2, Q=2, R=2, X=2, Y=2
dims B=256, L=2048, D=1024, H=32, K=64
A[B_P, L_R, H_{Q,X}, K] = In[B_{P,Q}, L_R, D_Y] · Wq[D_{X,Y}, H_Q, K]
Out[B_P, L_{R,Y}, D_X] = A[B_P, L_R, H_{Q,X}, K] · Wo[H_{Q,X}, K, D_Y]
"""


# Eight axes of size 2 written apart: more search than the planner's budget allows.
EIGHT_APART = """mesh P=2, Q=2, R=2, S=2, X=2, Y=2, Z=2, W=2
dims B=4096, D=1024, F=4096
T[B_{P,Q,S}, F_{X,Y}] = In[B_{P,R}, D_{Z,W}] · W_in[D_{Q,X,S}, F_{Y,Z}]
Out[B_{P,Q}, D_{R,W}] = T[B_{P,Q,S}, F_{X,Y}] · W_out[F_{Z,X}, D_{Y,Q,S}]
"""


def two_dcn_levels() -> str:
    """PaLM 540B (``benchmarks/runs/palm_540b.shard``), its two pods' data parallelism written as two DCN
    levels of two (pods of slices): the same chips, the batch over ``B_WZX``."""
    text = (ROOT / "benchmarks" / "runs" / "palm_540b.shard").read_text(encoding="utf-8")
    split = text.replace("mesh Z=2 over dcn, X=256, Y=12", "mesh W=2 over dcn, Z=2 over dcn, X=128, Y=12")
    assert split != text, "palm_540b.shard's mesh line changed: update two_dcn_levels"
    return split.replace("B_ZX", "B_WZX")


def timed(label: str, text: str, target: float) -> None:
    t0 = time.perf_counter()
    try:
        shardc.plan(shardc.parse(text))
        outcome = "planned"
    except ShardcError as err:
        outcome = f"gave up: {err.message}"
    total = time.perf_counter() - t0
    print(f"{label}: parse + plan {total:.3f} s = {total / target:.2f} x the {target:g} s target ({outcome})")


def deep(layers: int, runs: int = 5) -> None:
    """Parse + plan of the deep spec, the best of ``runs`` (the machine may be busy in some)."""
    for sized in (True, False):
        text = deep_spec(layers, sized)
        best = (float("inf"), 0.0, 0.0)
        for _ in range(runs):
            t0 = time.perf_counter()
            spec = shardc.parse(text, filename="deep.shard")
            t1 = time.perf_counter()
            result = shardc.plan(spec)
            t2 = time.perf_counter()
            best = min(best, (t2 - t0, t1 - t0, t2 - t1))
        steps = len(result.forward) + len(result.backward)
        total, parse, plan = best
        print(f"{layers} layers, {'with' if sized else 'without'} dims (best of {runs}): parse {parse:.3f} s, "
              f"plan {plan:.3f} s ({steps} steps), total {total:.3f} s = {total / 0.2:.2f} x the 0.2 s target; "
              f"check {checked(result):.3f} s")


def checked(plan: Plan) -> float:
    """Seconds the plan checker takes on ``plan`` (which must be sound)."""
    t0 = time.perf_counter()
    problems = check_plan(plan)
    took = time.perf_counter() - t0
    assert not problems, problems[:3]
    return took


def fused(spec: Spec, planned: Plan) -> float:
    """Seconds the collective-matmul fusion takes on ``spec``'s plan before it (which must give ``planned``),
    the best of three runs."""
    plain = shardc.plan(spec, collective_matmul=False)
    took = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        result = fuse_collective_matmuls(plain)
        took = min(took, time.perf_counter() - t0)
    assert result == planned
    return took


def llama(layers: int) -> None:
    """Parse + plan of ``layers`` LLaMA layers written out, then the checker and the collective-matmul
    fusion on the plan; twice the layers should take about twice the time of each (they are linear in the
    steps)."""
    for n in (layers // 2, layers):
        t0 = time.perf_counter()
        spec = shardc.parse(llama_spec(n), filename="llama.shard")
        result = shardc.plan(spec)
        planned = time.perf_counter() - t0
        steps = len(result.forward) + len(result.backward)
        print(f"LLaMA layer written out {n} times: parse + plan {planned:.3f} s ({steps} steps), "
              f"check {checked(result):.3f} s, collective-matmul fusion {fused(spec, result):.3f} s")


def cli(command: str, example: str, target: float) -> None:
    """Wall time of ``shardc COMMAND`` in a fresh interpreter, the best of three runs."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "shardc", command, example], cwd=ROOT, check=True,
                       capture_output=True)
        best = min(best, time.perf_counter() - t0)
    print(f"shardc {command} {example}: {best:.3f} s wall = {best / target:.2f} x the {target:g} s target")


def deepseek(target: float) -> None:
    """Plan and cost of DeepSeek-V3, each the better of two runs (the machine may be shared)."""
    path = ROOT / "benchmarks" / "runs" / "deepseek_v3.shard"
    spec = shardc.parse(path.read_text(encoding="utf-8"), filename=str(path))
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        plan = shardc.plan(spec, recompute="selective")
        t1 = time.perf_counter()
        shardc.cost(plan)
        times.append((t1 - t0, time.perf_counter() - t1))
    planned, costed = min(p for p, _ in times), min(c for _, c in times)
    print(f"DeepSeek-V3 671B: plan {planned:.2f} s = {planned / target:.2f} x, cost {costed:.2f} s = "
          f"{costed / target:.2f} x the {target:g} s target")


def main() -> None:
    shardc.plan(shardc.parse("mesh X=2\nA[B_X] = C[B]\n"))  # imports the planner: later figures exclude that
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 96
    deep(layers)
    llama(layers)
    timed("8-axis MaxText-style mesh (6 axes of size 1)", MAXTEXT, 1.0)
    for n in (4, 5, 6):
        timed(f"{n} axes of size 2", axes_of_two(n), 5.0)
    timed("6 axes of size 2 written apart", SIX_APART, 5.0)
    timed("5 axes of size 2 written apart (3- and 4-dim tensors)", FIVE_APART, 5.0)
    timed("PaLM 540B over two DCN levels (4 axes)", two_dcn_levels(), 10.0)
    timed("8 axes of size 2 written apart (past the budget: the error)", EIGHT_APART, 60.0)
    cli("plan", "examples/fsdp_tp.shard", 0.3)
    cli("cost", "examples/fsdp_tp.shard", 0.6)
    deepseek(3.0)


if __name__ == "__main__":
    main()
