"""Speed of ``shardc layouts``: the layout search over every mesh axis assignment of a chip count.

Prints, for each case, the candidates, how many were planned, reused and skipped, the
seconds (serial, one process) and the seconds a plan, with its target:

- ``examples/llama2_13b.shard`` on 4096 chips (2 axes: 13 candidates, 7 refused as N=40 heads
  < Y), with its pure-data-parallel variant beside it: < 5 s;
- ``examples/llama2_13b_hsdp.shard`` on 4096 chips (3 axes: 91 candidates): < 60 s serial,
  the number to watch being seconds a plan (the planner's own speed: ``plan_speed.py``);
- the same with ``--jobs 0`` (a process a core), when the machine has more than one;
- ``benchmarks/specs/pipeline_llama2_13b_hsdp.shard`` on 4096 chips (4 axes, PP x DP x FSDP x TP:
  455 candidates, 251 valid, and 1589 other orders of their mesh axes, each template planned once
  and re-costed, the orders that cannot be chosen skipped by bounds): < 30 s of CPU, then with the
  product of the knobs (microbatches, schedule, recompute, ZeRO) searched for the best layouts too, in one process and
  with ``--jobs 0`` (the templates over a process a core: < 30 s of wall clock on two idle cores).

Each line gives candidates a second of CPU time (the process's, not the wall clock's: the
number holds on a machine other work shares).  Run with ``python benchmarks/layouts_speed.py
[--four]`` from the repository root (``--four``: the four-axis cases alone).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's shardc, not an installed one

import shardc  # noqa: E402
from shardc.hardware import get_hardware  # noqa: E402
from shardc.layouts import Options, search_layouts  # noqa: E402
from shardc.layouts.knobs import KNOBS  # noqa: E402


def _spec(name: str) -> shardc.ir.spec.Spec:  # type: ignore[name-defined]
    path = ROOT / name
    return shardc.parse(path.read_text(encoding="utf-8"), name)


def _cpu() -> float:
    """CPU seconds of this process and of the worker processes it has waited for."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def case(title: str, files: list[str], chips: int, target_s: float, jobs: int = 1,
         knobs: tuple[str, ...] = ()) -> None:
    specs = [_spec(f) for f in files]
    start, cpu = time.perf_counter(), _cpu()
    search = search_layouts(specs, Options(get_hardware("tpu-v5p"), mfu=0.4, knobs=knobs), chips=chips, jobs=jobs)
    took, cpu = time.perf_counter() - start, _cpu() - cpu
    s = search.stats
    best = search.chosen
    per_plan = took / s["planned"] if s["planned"] else 0.0
    spent = cpu if jobs == 1 else took  # over processes: the wall clock (on a machine shared, more)
    verdict = "ok" if spent < target_s else "SLOW"
    how = (f"{s['templates']:.0f} templates, {s['planned']:.0f} planned, {s['recosted']:.0f} left re-costed"
           if "templates" in s else f"{s['planned']:.0f} planned, {s['reused']:.0f} reused")
    print(f"{title}: {s['candidates']:.0f} candidates, {how}, {len(search.skipped)} skipped; {took:.1f} s wall, "
          f"{cpu:.1f} s CPU over {s['jobs']:.0f} process(es) ({per_plan:.2f} s a plan, "
          f"{s['candidates'] / max(cpu, 1e-9):.1f} candidates a CPU second), target < {target_s:g} s: {verdict}")
    if best is not None:
        print(f"  chosen {best.spec} {best.axes_text}: {best.step_s * 1e3:.1f} ms a step, {best.bound}-bound")


def main() -> None:
    four = "benchmarks/specs/pipeline_llama2_13b_hsdp.shard"
    if "--four" not in sys.argv:
        _three()
    case("pipeline_llama2_13b_hsdp, 4096 chips, 4 axes", [four], 4096, 30.0)
    case("pipeline_llama2_13b_hsdp, 4096 chips, 4 axes, every knob", [four], 4096, 30.0, knobs=KNOBS)
    if (os.cpu_count() or 1) > 1:
        case("pipeline_llama2_13b_hsdp, 4096 chips, 4 axes, every knob, --jobs 0", [four], 4096, 30.0, jobs=0,
             knobs=KNOBS)


def _three() -> None:
    case("llama2_13b + DP variant, 4096 chips, 2 axes",
         ["examples/llama2_13b.shard", "tests/specs/llama2_13b_dp.shard"], 4096, 5.0)
    case("llama2_13b_hsdp, 4096 chips, 3 axes", ["examples/llama2_13b_hsdp.shard"], 4096, 60.0)
    if (os.cpu_count() or 1) > 1:
        case("llama2_13b_hsdp, 4096 chips, 3 axes, --jobs 0", ["examples/llama2_13b_hsdp.shard"], 4096, 60.0,
             jobs=0)


if __name__ == "__main__":
    main()
