"""DeepSeek-V3's recomputation (a spec's ``recompute`` line) and ``benchmarks/deepseek_v3_memory.py``'s
cached-activation formats on the values shardc keeps, on a DeepSeek-V3-shaped layer small enough to plan
at once."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

import shardc
from shardc.costmodel.memory import value_bytes
from shardc.costmodel.pipeline_figures import PipelineCost
from shardc.costmodel.stage_memory import chunk_copies, dualpipe_held
from shardc.ir.plan import Plan
from shardc.spec.stages import pipeline_of

ROOT = Path(__file__).resolve().parent.parent
LAYER = """mesh X=2
dims B=4, S=8, T=8, D=16, N=2, H=4, Q=8, R=4, E=4, C=4, F=8
param W_dq, W_uq, W_dkv, W_uk, W_uv, W_o, W_r, W_gate, W_up, W_down
recompute rmsnorm, W_uq, W_uk, W_uv, Gt, Ag, A
L1[B_X, S, D] = rmsnorm(X[B_X, S, D] over D)
Cq[B_X, S, Q] = rmsnorm(L1[B_X, S, D] · W_dq[D, Q] over Q)
Qn[B_X, S, N, H] = Cq[B_X, S, Q] · W_uq[Q, N, H]
Kx[B_X, T, D] = L1[B_X, S, D]
Ckv[B_X, T, R] = rmsnorm(Kx[B_X, T, D] · W_dkv[D, R] over R)
Kn[B_X, T, N, H] = Ckv[B_X, T, R] · W_uk[R, N, H]
Vl[B_X, T, N, H] = Ckv[B_X, T, R] · W_uv[R, N, H]
At[B_X, S, N, H] = attention(Qn[B_X, S, N, H], Kn[B_X, T, N, H], Vl[B_X, T, N, H] over T, causal)
R1[B_X, S, D] = X[B_X, S, D] + At[B_X, S, N, H] · W_o[N, H, D]
L2[B_X, S, D] = rmsnorm(R1[B_X, S, D] over D)
Gate[B_X, S, E] = sigmoid(L2[B_X, S, D] · W_r[D, E])
In[B_X, E, C, D] = dispatch(Gate[B_X, S, E], L2[B_X, S, D], S, C, 2 over E)
Gw[B_X, E, C] = dispatch(Gate[B_X, S, E], Gate[B_X, S, E], S, C, 2 over E)
Gt[B_X, E, C, F] = silu(In[B_X, E, C, D] · W_gate[E, D, F])
U[B_X, E, C, F] = In[B_X, E, C, D] · W_up[E, D, F]
Ag[B_X, E, C, F] = Gt[B_X, E, C, F] * U[B_X, E, C, F]
A[B_X, E, C, F] = Ag[B_X, E, C, F] * Gw[B_X, E, C]
Ex[B_X, E, C, D] = A[B_X, E, C, F] · W_down[E, F, D]
Out[B_X, S, D] = R1[B_X, S, D] + collect(Gate[B_X, S, E], Ex[B_X, E, C, D], S, C, 2 over E)
"""


@pytest.fixture(scope="module")
def deepseek_v3(deepseek_v3_plan: Plan) -> tuple[Plan, PipelineCost]:
    """benchmarks/runs/deepseek_v3.shard's plan (conftest's) costed with its optimizer state once for the module
    (seconds of CPU): three tests read the plan and its pipeline report, none changes them."""
    report = shardc.cost(deepseek_v3_plan, optimizer="mixed14").pipeline
    assert report is not None
    return deepseek_v3_plan, report


def _benchmark():  # type: ignore[no-untyped-def]
    path = ROOT / "benchmarks" / "deepseek_v3_memory.py"
    spec = importlib.util.spec_from_file_location("deepseek_v3_memory", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("deepseek_v3_memory", module)
    spec.loader.exec_module(module)
    return module


def test_norms_up_projections_and_swiglu_outputs_recomputed_linear_inputs_in_fp8() -> None:
    plan = shardc.plan(shardc.parse(LAYER), recompute="selective")
    kept = {ref.name: size for ref, size in _benchmark().paper_bytes(plan).items()}
    # recomputed, so not kept: every RMSNorm's output, the MLA up-projections' outputs, the SwiGLU's silu
    # and product, weighed by the gates (and the rename of a norm's output)
    recomputed = {"L1", "Kx", "Cq", "Ckv", "L2", "Qn", "Kn", "Vl", "Gt", "Ag", "A"}
    assert not recomputed & set(kept)
    assert recomputed <= {s.tensor for s in plan.recomputed}
    # a Linear's input (the dispatched tokens) and the SwiGLU's inputs in FP8, each with its tile's scale
    assert {kept[name] for name in ("In", "U", "Gt_t1")} == {1 + 4 / 128}
    assert kept["At"] == 1.5 + 4 / 128  # the input of the Linear after attention: E5M6
    # the rest in BF16: the residual stream, the gates; the experts' outputs are not kept (the gates weigh
    # the SwiGLU's output at the experts, so their gradient reads the recomputed A, not Ex)
    assert {kept[name] for name in ("R1", "Gw")} == {2.0} and "Ex" not in kept


def test_the_recompute_line_costs_its_rerun_in_the_backward() -> None:
    """What the line names is made again in the backward: its FLOPs count there, its bytes not in memory."""
    lean = shardc.cost(shardc.plan(shardc.parse(LAYER), recompute="selective"))
    plain = shardc.cost(shardc.plan(shardc.parse(LAYER.replace("recompute rmsnorm, W_uq, W_uk, W_uv, Gt, Ag, A\n",
                                                               "")), recompute="selective"))
    b, s, t, q, r, n, h, e, c, f = 4, 8, 8, 8, 4, 2, 4, 4, 4, 8
    up = 2 * (b * s * q * n * h + 2 * b * t * r * n * h)  # Qn, Kn and Vl again, each an einsum of 2 FLOPs a term
    swiglu = 2 * 2 * b * e * c * f  # Ag = Gt * U and A = Ag * Gw again (the norms and silu are no einsums)
    assert lean.backward.compute_flops - plain.backward.compute_flops == (up + swiglu) / 2  # B over X=2
    assert lean.memory.residual_bytes < plain.memory.residual_bytes


def test_the_benchmark_reprices_the_values_the_cost_stage_table_keeps(deepseek_v3: tuple[Plan, PipelineCost]) -> None:
    """The script's cached formats reprice the values a device keeps as shardc counts them (its copies of each,
    the microbatches held): at the spec's own element sizes they are the stage table's activations, device 0
    (the ends and the dense layers) and device 3 alike; the spec's types (BF16, FP8 where section 3.3.4 caches a
    Linear's or a SwiGLU's input) come within 5% of the report's formats, which hold the attention output in
    E5M6 (1.5 bytes, the spec 2) and a scale a 128 FP8 elements (the spec none)."""
    plan, report = deepseek_v3
    benchmark = _benchmark()
    own = {ref: float(plan.nbytes(ref.name)) for ref in benchmark.paper_bytes(plan)}
    for stage in (0, 3):
        row = benchmark.stage_rows(plan, "mixed14", stage, own)
        assert row["microbatches held"] == report.stages[stage].held
        assert row["activations"] == pytest.approx(report.stages[stage].activation_bytes, rel=1e-12)
        paper = benchmark.stage_rows(plan, "mixed14", stage, benchmark.paper_bytes(plan))["activations"]
        assert paper == pytest.approx(row["activations"], rel=0.05) and paper != row["activations"]


def test_the_published_layout_fits_80_gb_keeping_no_expert_output(deepseek_v3: tuple[Plan, PipelineCost]) -> None:
    """The report's layout (its optimizer state, its recomputation) fits each H800's 80 GB once the gates
    weigh the experts' SwiGLU outputs at the experts (DeepEP's dispatch carries them there) and the rows
    come back summed: the backward keeps no expert output Ex (470 MB a layer and microbatch in BF16, which
    put every device over 80 GB)."""
    plan, report = deepseek_v3
    assert "Ex" not in {r.name for r in plan.residuals}
    assert all(stage.memory_bytes < 80e9 for stage in report.stages)


def test_device_0_keeps_16_microbatches_of_its_first_stage_and_1_of_its_last(
        deepseek_v3: tuple[Plan, PipelineCost]) -> None:
    """Under DualPipe device 0 holds, at its peak, 16 microbatches of stage 0 (the embedding and the dense
    layers) and 1 of stage 15 (the heads' logits, the MTP layer): its activations are those counts of each
    stage's values, not 8.5 of each (which counted 8.5 microbatches of both heads' BF16 logits)."""
    plan, report = deepseek_v3
    assert report.stages[0].held == 17
    pipe = pipeline_of(plan.spec)
    assert pipe is not None and plan.sizes is not None
    micro = dict(plan.sizes) | {"B": 15360 // 120}
    assert dualpipe_held(plan, pipe, report.simulation, micro)[0] == {0: 16, 31: 1}
    chunk = [math.fsum(value_bytes(plan, r, micro) * k for r, k in c.items()) for c in chunk_copies(plan, pipe)]
    assert report.stages[0].activation_bytes == pytest.approx(16 * chunk[0] + chunk[31], rel=1e-9)
    assert report.stages[0].activation_bytes < 8.5 * (chunk[0] + chunk[31])
