"""DeepSeek-V3's memory per GPU, stage by stage, as shardc counts it and as the report ran it.

    python benchmarks/deepseek_v3_memory.py [benchmarks/runs/deepseek_v3.shard] [--stages 0,1,3]

Prints, for the pipeline stages asked (under DualPipe a device: 0 holds stages 0 and 15, the ends, 3
holds stages 3 and 12, 8 MoE layers as devices 1 to 14 do), the training state (params, gradients,
optimizer state), the gathered weights and the activations (each of its stages' values times the
microbatches of that stage it holds at its peak under the spec's schedule), under three accountings:

* ``shardc``: ``shardc cost --recompute selective`` as it is (``adam10``; every kept value at its
  declared type: the spec's ``dtype f8``, 1 byte, 2 bytes what its ``dtype bf16`` lines name), the
  spec's ``recompute`` line recomputing what the report recomputes
  ("DeepSeek-V3 Technical Report", arXiv 2412.19437, section 3.2.3: every RMSNorm and the MLA
  up-projections; section 3.3.2: the MoE SwiGLU's output);
* ``+ state``: the report's optimizer state (``--optimizer mixed14``: bf16 params, fp32 gradients
  accumulated over the microbatches, fp32 master weights, bf16 Adam moments);
* ``+ formats``: the report's cached-activation formats (section 3.3.3, "Low-Precision Activation") on the
  values shardc keeps: the inputs of a matmul with a weight (a Linear's input) and of a SwiGLU cached in
  FP8 (1 byte), but the attention output (the input of the Linear after attention) in E5M6 (12 bits, 1.5
  bytes); each FP8 or E5M6 value with its tile's FP32 scale (section 3.3.1: a scale a 1x128 tile, 4 bytes a
  128 elements); every other value in BF16 (2 bytes; token ids int32).  The spec declares types by tensor,
  not by what reads them (its residual stream stays at 1 byte: see its header), so this column is
  computed here from shardc's own table of kept values.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import shardc
from shardc.costmodel.memory import residual_table, value_bytes
from shardc.costmodel.stage_memory import dualpipe_held, kept_copies
from shardc.ir.localops import Attention
from shardc.ir.plan import Plan, Step
from shardc.ir.spec import TensorRef
from shardc.pipeline.boundary import microbatch_dim
from shardc.spec.stages import pipeline_of
from shardc.units import fmt_bytes

ROOT = Path(__file__).resolve().parent.parent


def _params(step: Step, plan: Plan) -> set[str]:
    declared = {info.name for info in plan.tensors if info.role == "param"}
    return {r.name for r in step.operands if r.name in declared}


SCALE = 4 / 128  # an FP32 scale a 1x128 tile (section 3.3.1), bytes an element
E5M6 = 12 / 8  # the attention output's format (section 3.3.3), bytes an element


def paper_bytes(plan: Plan) -> dict[TensorRef, float]:
    """Bytes an element of each value the plan keeps, in the report's cached formats."""
    silu = {s.dst for s in plan.forward if str(s.fn) == "silu"}
    fp8 = {r for s in plan.forward if _params(s, plan) or str(s.fn) == "silu" for r in s.operands} \
        | {r for s in plan.forward if any(o in silu for o in s.operands) for r in s.operands}
    attended = {s.dst.name for s in plan.forward if isinstance(s.fn, Attention) and s.fn.part == "out"}
    out = {}
    for ref, _ in residual_table(plan):
        if plan.nbytes(ref.name) == 4:  # token ids
            out[ref] = 4.0
        elif ref in fp8:
            out[ref] = (E5M6 if ref.name in attended else 1.0) + SCALE
        else:
            out[ref] = 2.0
    return out


def stage_rows(plan: Plan, optimizer: str, stage: int, element: dict[TensorRef, float] | None) -> dict[str, float]:
    """A stage's (a device's) bytes: params, grads, optimizer, gathered, one microbatch's activations (the mean
    over the microbatches held), held, total.  All but the cached formats are shardc's stage table
    (``shardc cost``'s), the copies of each value a device keeps its
    :func:`shardc.costmodel.stage_memory.kept_copies`; ``element`` prices each value's elements anew."""
    pipe = pipeline_of(plan.spec)
    assert pipe is not None and plan.sizes is not None
    sizes = dict(plan.sizes)
    dim = microbatch_dim(plan)
    micro = sizes | {dim: sizes[dim] // pipe.microbatches}
    report = shardc.cost(plan, optimizer=optimizer).pipeline
    assert report is not None
    row = report.stages[stage]
    kept = row.activation_bytes
    if element is not None:
        chunks = dualpipe_held(plan, pipe, report.simulation, micro)
        copies = kept_copies(plan, pipe, [s.held for s in report.stages], chunks)[stage]
        kept = math.fsum(value_bytes(plan, ref, micro) / plan.nbytes(ref.name) * element[ref] * count
                         for ref, count in copies.items())
    params = row.state_bytes - row.grad_bytes - row.optimizer_bytes
    return {"params": params, "grads": row.grad_bytes, "optimizer": row.optimizer_bytes,
            "gathered": row.gathered_bytes, "activations a microbatch": kept / row.held,
            "microbatches held": row.held, "activations": kept,
            "total": row.state_bytes + row.gathered_bytes + kept}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", nargs="?", default=str(ROOT / "benchmarks" / "runs" / "deepseek_v3.shard"))
    parser.add_argument("--stages", default="0,1,3", help="pipeline stages to show")
    args = parser.parse_args()
    spec = shardc.parse(Path(args.spec).read_text(), filename=args.spec)
    plan = shardc.plan(spec, recompute="selective")
    paper = paper_bytes(plan)
    columns = (("shardc", "adam10", None), ("+ state", "mixed14", None), ("+ formats", "mixed14", paper))
    for stage in (int(s) for s in args.stages.split(",")):
        rows = [stage_rows(plan, optimizer, stage, element) for _, optimizer, element in columns]
        print(f"stage {stage}: " + "  ".join(f"{name:>24}" for name, _, _ in columns))
        for key in rows[0]:
            cells = [f"{r[key]:>24g}" if key == "microbatches held" else f"{fmt_bytes(r[key]):>24}" for r in rows]
            print(f"  {key:<24}" + "  ".join(cells))
        print()
    return 0 if math.isfinite(sum(paper.values())) else 1


if __name__ == "__main__":
    raise SystemExit(main())
