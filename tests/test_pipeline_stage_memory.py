"""A pipelined stage's memory: the activations in flight, a tick's working set, the gradient sums."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import shardc
from shardc.collectives import Op
from shardc.costmodel.memory import value_bytes
from shardc.costmodel.phase_memory import Buffers, phase_memory
from shardc.costmodel.stage_memory import gradient_reductions
from shardc.device_pieces import local_elements
from shardc.ir.localops import Attention
from shardc.ir.plan import Plan
from shardc.ir.spec import Schedule
from shardc.lowering.pipeline_lowering import lower_pipeline
from shardc.lowering.pipeline_runtime import _once
from shardc.planner.zigzag_order import sequence_order
from shardc.spec.stages import pipeline_of
from shardc.verification.pipeline_layers import run_blocks
from shardc.verification.pipeline_memory import (
    _data,
    _gradient_shapes,
    control_scalars,
    other_ends,
    results,
    run_fixed_bytes,
)
from shardc.verification.pipeline_verify import check_pipeline_memory, run_sizes, run_split
from tests.test_zigzag_pipeline import MODEL as ZIGZAG

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _plan(name: str, schedule: str | None = None) -> Plan:
    plan = shardc.plan(shardc.parse((EXAMPLES / f"{name}.shard").read_text()))
    if schedule is None:
        return plan
    return replace(plan, spec=replace(plan.spec, schedule=Schedule(schedule)))


def test_a_stage_counts_its_working_set_and_gradient_sums() -> None:
    report = shardc.cost(_plan("llama3_405b"))
    assert report.pipeline is not None
    first = report.pipeline.stages[0]
    assert first.working_bytes > 0
    assert first.memory_bytes == (first.state_bytes + first.activation_bytes + first.gathered_bytes
                                  + first.working_bytes + first.accumulator_bytes)
    # zero 2 over X: each block gradient is reduce-scattered once a step from the unsharded sums, twice
    # the shard the stage keeps (X = 64 holds 1/64 of each)
    assert first.accumulator_bytes > first.working_bytes
    assert report.pipeline.to_json()["per_stage"][0]["working_bytes"] == first.working_bytes


def test_the_working_set_is_a_microbatch_through_the_sections_a_stage_runs() -> None:
    plan = _plan("pipeline_llama2_13b")
    report = shardc.cost(plan)
    assert report.pipeline is not None
    pipe = report.pipeline
    sizes = dict(report.sizes) | {pipe.dim: pipe.microbatch_size}
    middle, last = pipe.stages[1], pipe.stages[-1]
    block = max(p.temporaries for p in phase_memory(plan, sizes, section="block"))
    after = max(p.temporaries for p in phase_memory(plan, sizes, section="after"))
    assert middle.sections == ("block",) and middle.working_bytes == block
    assert "after" in last.sections and last.working_bytes == max(block, after)
    assert pipe.stages[0].sections == ("block", "before")  # the embedding runs on the first stage


def test_an_all_reduce_sums_in_place_and_gpipe_holds_every_microbatch() -> None:
    plan = _plan("yi_34b")
    report = shardc.cost(plan)
    assert report.pipeline is not None
    reductions = {plan.backward[k].tensor: plan.backward[k].op for k in gradient_reductions(plan)}
    assert reductions == {"dW_emb": Op.ALL_REDUCE, "dW_k": Op.REDUCE_SCATTER, "dW_v": Op.REDUCE_SCATTER}
    # zero 1: dW_emb all-reduced in place, nothing held for it; dW_k and dW_v reduce-scattered over Y once a
    # step from their sums unsharded (D x G x H in bf16), 15 layers a stage
    assert all(s.accumulator_bytes == 2 * 7168 * 8 * 128 * 2 * 15 for s in report.pipeline.stages)
    gpipe = shardc.cost(_plan("yi_34b", "gpipe"))
    assert gpipe.pipeline is not None
    assert gpipe.pipeline.stages[0].held == gpipe.pipeline.pipeline.microbatches


def test_a_pipelined_backward_slices_each_residual_a_dot_reads_out_of_its_ring() -> None:
    """The lowered schedule keeps the residuals in rings (:mod:`shardc.lowering.pipeline_slots`): a tick's
    backward slices its microbatch's out, each into a buffer of its own where a dot reads it (X, 4 x 4 floats
    on a device), none where only a map does (H, read by gelu's derivative: the slice fused into it); XLA's
    CPU backend makes the slices first, as they read only the loop's state (llama3_405b's backward at
    verify's sizes: Q, K and V's slices, 20 kB each, alive from the tick's start to their layer's dots)."""
    text = "mesh X=2\ndims B=8, D=4, F=6\nparam W\nH[B_X, F] = X[B_X, D] · W[D, F]\nY[B_X, F] = gelu(H[B_X, F])\n"
    plan = shardc.plan(shardc.parse(text))
    assert plan.sizes is not None and [r.name for r in plan.residuals] == ["H"]
    plain, sliced = (phase_memory(plan, dict(plan.sizes), 4, Buffers(arguments_first=True, ring_slices=flag))[1]
                     for flag in (False, True))
    assert (plain.argument_copies, sliced.argument_copies) == (0, 4 * 4 * 4)
    assert sliced.temporaries == plain.temporaries + 4 * 4 * 4  # alive beside dH at dW's dot


def test_verify_cuts_a_zigzag_sequence_into_whole_chunks() -> None:
    """A sequence held in zig-zag order is cut into 2n chunks over a ring of n devices: verify's sizes make
    it whole chunks (over C = 2 it ran S = 6, four chunks of one token: the program held 4 of its 6 tokens;
    llama3_405b_128k's memory was costed at 6, 1.24 of XLA's bytes)."""
    plan = shardc.plan(shardc.parse(ZIGZAG.replace("C=4", "C=2")))
    assert sequence_order(plan, {"C": 2}) == (frozenset({"S", "T"}), 4)
    sizes, _, _ = run_sizes(plan, 8)
    assert sizes["C"] == 2 and sizes["S"] % 4 == 0 and sizes["T"] % 4 == 0


def test_the_rings_keep_a_value_saved_under_two_names_once() -> None:
    """``Kx = L1`` (a rename) is one array the forward returns under two names: the lowered pipeline's rings
    keep it once, as ``shardc cost`` counts it (they kept both: 240 B a layer and microbatch more in
    pipeline_llama's run, XLA's temporaries 61.4 kB where 59.7 kB now), and the backward reads it by both."""
    l1, q = np.zeros((2, 3)), np.zeros((2, 3))  # equal values, two arrays: kept apart
    assert _once({"L1": l1, "Kx": l1, "Q": q}) == {("L1", "Kx"): l1, ("Q",): q}


def test_the_check_counts_the_data_the_schedules_program_takes_and_returns() -> None:
    """The pipelined program takes the whole batch's inputs and the outputs' cotangents and returns the
    outputs and the inputs' gradients (pipeline_llama's X, dOut, Out and dX: XLA's arguments and outputs
    beyond the params and their gradients, 1.92 and 1.99 kB); a stage of shardc cost holds its
    microbatches' activations, not the data, so the check counts it beside the stage (0.85 -> 0.91)."""
    plan = _plan("pipeline_llama")
    sizes, _, _ = run_sizes(plan, 8)
    x = sizes["B"] // sizes["X"] * sizes["S"] * sizes["D"] * 4  # X[B_X, S, D] in float32, on a device
    assert _data(plan, sizes, 4) == 4 * x


def test_the_data_counts_a_dtype_lines_floats_at_the_runs_width() -> None:
    """The schedule's program is compiled with every float at the run's width (float32), a ``dtype`` line's
    bf16 tensors too: X and Out named bf16 are still 4 bytes an element in its data (they were counted at
    2, as the unpipelined check counted them before :meth:`Plan.fixed_bytes`)."""
    text = (EXAMPLES / "pipeline_llama.shard").read_text().replace("hardware tpu-v5p\n",
                                                                   "hardware tpu-v5p\ndtype f32\ndtype bf16 X, Out\n")
    plan = shardc.plan(shardc.parse(text))
    assert dict(plan.element_bytes)["X"] == 2
    sizes, _, _ = run_sizes(plan, 8)
    x = sizes["B"] // sizes["X"] * sizes["S"] * sizes["D"] * 4
    assert _data(plan, sizes, 4) == 4 * x



def _program(plan: Plan) -> tuple[Any, dict[str, int]]:
    sizes, layers, micro = run_sizes(plan, 8)
    lowered = lower_pipeline(plan, sizes=sizes, layers=layers, microbatches=micro, split=run_split(plan),
                             blocks=run_blocks(plan, layers))
    return lowered.namespace.PIPELINE, lowered.sizes


def test_the_check_counts_the_schedule_loops_control_scalars() -> None:
    """XLA's CPU backend keeps the scalars the schedule's loop body reads of its tick tables (entries, slots,
    predicates), each a buffer on its own 64-byte line, through the tick (pipeline_llama's and
    pipeline_llama2_13b's buffer assignments: 35 and 34 pred[] and s32[] values in the body's temporaries, 28
    of them the tables' and the gradient sums' writes, the rest the layer's own and the residual ring's
    writes); the check counted none.  The counter (3), F's and B's hand-ons, 7 each, F's and B's params
    slot, the rings' row and the cotangent's write (4), three stage predicates and a write's test for each
    of the 4 shapes of the block's params (W_q, W_k, W_v one; W_o; W_gate, W_up one; W_down)."""
    plan = _plan("pipeline_llama")
    program, sizes = _program(plan)
    assert [len(program.placement.links(s)) for s in (1, -1)] == [1, 1] and program.weight_ticks is None
    assert _gradient_shapes(plan, sizes, program) == 4
    assert control_scalars(program, 4) == 3 + 2 * 7 + 4 + 3 + 4
    # a zero-bubble schedule's W reads its own table: one more params slot and two more stage predicates
    assert control_scalars(replace(program, weight_ticks=program.backward_ticks), 4) == 28 + 3
    # with two chunks a device (interleaved 2: XLA keeps 23) the range and receiver tests and the stage
    # predicates are fused into the writes: 3 a hand-on
    chunked = SimpleNamespace(weight_ticks=None, placement=SimpleNamespace(chunks=2))
    assert control_scalars(chunked, 4) == 3 + 2 * 3 + 4 + 4


@pytest.mark.slow
def test_xla_keeps_at_least_the_control_scalars_the_check_counts(tmp_path: Path) -> None:
    """pipeline_llama's schedule compiled, its buffer assignment read: the pred[] and s32[] values of the
    loop body's temporaries are the 28 the check counts and 8 it does not (the residual ring's writes'
    tests, 3, the layer's params slots, 4, and the device's index along the axis the norm's backward
    reduce-scatters its input's gradient over, which its local slice reads: a select_n of axis_index in the
    loop body), each on a 64-byte line of its own."""
    check = check_pipeline_memory(_plan("pipeline_llama"), 8, options={"xla_dump_to": str(tmp_path)})
    text = next(tmp_path.glob("*_local*buffer-assignment.txt")).read_text()
    temps = re.search(r"preallocated-temp:\n((?: value:.*\n)+)", text)
    assert temps is not None
    # a value each (the loop's phis are its counter's buffer again, not counted)
    scalars = re.findall(r"<\d+ \S+ @\d+> \(size=[1-8],offset=(\d+)\): (?:pred|s32)\[\]", temps[1])
    assert check.scalars == 28 and len(scalars) == check.scalars + 8
    assert all(int(offset) % 64 == 0 for offset in scalars)


def test_the_check_counts_the_other_ends_params_the_program_takes_on_every_device() -> None:
    """The schedule's program is one SPMD program: every device takes both ends' params and returns their
    gradients (yi_34b's buffer assignment: stage 0 takes W_out, f32[1,8,5], and returns its gradient), where
    shardc's stage holds only its own end.  yi_34b at verify's sizes: W_emb[V_Y, D] and W_out[D, V_Y] are
    40 / 8 x 8 = 40 elements a device, each with a gradient as large (zero 1: the gradient not sharded)."""
    plan = _plan("yi_34b")
    sizes, _, _ = run_sizes(plan, 8)
    assert (sizes["V"] // sizes["Y"]) * sizes["D"] == 40
    pipe = pipeline_of(plan.spec)
    assert pipe is not None
    first, middle, last = (other_ends(plan, pipe, s, sizes) for s in (0, 1, pipe.stages - 1))
    assert (first, middle, last) == (2 * 40, 4 * 40, 2 * 40)  # W_out's, both ends', W_emb's: param and gradient


def test_the_attention_logsumexp_scales_to_the_runs_float() -> None:
    """The run's attention kernel holds each row's logsumexp at its compute type (float32 or wider: the run's
    float), not at shardc cost's 4 bytes scaled by the run's element factor (8 bytes a row counted for a bf16
    spec run in float32, 16 in a float64 run): the check costs it at the spec's dtype, scaled with the other
    floats; the token ids keep their 4 bytes."""
    plan = _plan("llama3_405b")
    lse = {s.dst.name for s in plan.forward if isinstance(s.fn, Attention) and s.fn.part == "lse"}
    assert lse and all(plan.fixed_bytes()[n] == 4 for n in lse)
    fixed = run_fixed_bytes(plan)
    assert not lse & fixed.keys()
    assert fixed["Tok"] == 4
    run = replace(plan, element_bytes=tuple(sorted(fixed.items())))
    sizes, _, _ = run_sizes(plan, 8)
    ref = next(s.dst for s in plan.forward if s.dst.name in lse)
    rows = local_elements(ref, sizes)  # B_X, S_Y, G, R at verify's sizes
    assert rows == sizes["B"] // sizes["X"] * sizes["S"] // sizes["Y"] * sizes["G"] * sizes["R"]
    element = 4  # the float32 run: a bf16 spec's floats scale by 2
    assert value_bytes(run, ref, sizes) * element / plan.spec.dtype.nbytes == rows * 4  # was rows * 8


def test_the_check_counts_the_tuple_the_program_returns_its_results_in() -> None:
    """XLA's CPU backend returns the program's results in a tuple, one 8-byte pointer a result (pipeline_llama's
    buffer assignment: 9 results, its outputs 72 bytes beyond the arrays): its 7 params' gradients, Out and dX."""
    program, _ = _program(_plan("pipeline_llama"))
    assert results(program) == 7 + 2
