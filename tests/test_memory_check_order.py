"""When a phase's values are alive beside each other, as XLA runs the MoE examples' steps at verify's sizes
(issue 22's memory check): the computations that read only arguments one after another, a routing run once
for every dispatch step and before the rows move, a dot's result transposed after its operands' copies."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardc
from shardc.costmodel.phase_memory import Buffers, phase_memory
from shardc.costmodel.ring_blocks import rings_together, sums_blocks
from shardc.costmodel.route_memory import routed_once
from shardc.costmodel.step_order import prelude
from shardc.ir.plan import Plan, backward_program
from shardc.ir.spec import TensorRef
from shardc.verification.memory_check import TARGET, XLA_CPU

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
F32 = 4
# the sizes verify lowers moe_layer.shard and moe_dispatch.shard at on 8 devices (lowering.sizes.small_sizes)
VERIFY = {"G": 16, "S": 24, "E": 24, "C": 2, "D": 5, "F": 7, "X": 8}
# XLA's temp_size_in_bytes for those phases at those sizes (benchmarks/memory_check.py; jax 0.10.2, CPU)
XLA_TEMPORARIES = {("moe_layer", "backward"): 31744, ("moe_dispatch", "forward"): 20736,
                   ("moe_dispatch", "backward"): 29824}


@pytest.fixture(scope="module")
def moe() -> dict[str, Plan]:
    return {name: shardc.plan(shardc.parse((EXAMPLES / f"{name}.shard").read_text()))
            for name in ("moe_layer", "moe_dispatch")}


def _arguments(steps: tuple) -> set[TensorRef]:  # type: ignore[type-arg]
    made = {s.dst for s in steps}
    return {ref for s in steps for ref in s.reads if ref not in made}


def test_the_computations_reading_only_arguments_run_one_after_another_before_step_one(moe: dict[str, Plan]) -> None:
    """moe_layer's backward: dEx's dot (Comb copied for it) and dComb = dOut · Ex read only arguments; XLA
    makes Comb's copy, runs dEx's dot, which frees it, then dComb in its bytes (1.25 of XLA's temporaries
    while all three were counted alive at once)."""
    steps = backward_program(moe["moe_layer"])
    names = [s.dst.name for s in steps]
    assert prelude(steps, _arguments(steps)) == {names.index("dEx"): 1 / 3, names.index("dComb"): 2 / 3}


def test_dispatch_steps_routing_the_same_gates_run_the_routing_once(moe: dict[str, Plan]) -> None:
    """moe_dispatch's backward: dEx, dGate and dX_2 each route the gates again in the lowered module; XLA's
    CSE leaves one top-k and one scan, before dEx, its indices (3 int32 a choice) alive to dX_2."""
    steps = backward_program(moe["moe_dispatch"])
    names = [s.dst.name for s in steps]
    again, kept = routed_once(steps, VERIFY)
    assert again == {names.index("dGate"), names.index("dX_2")}
    tokens = 16 // 8 * 24
    assert kept == [(names.index("dEx") - 0.5, names.index("dX_2"), tokens * 2 * 3 * 4)]


def test_a_dispatch_routes_before_its_rows_are_written() -> None:
    """The routing's int32 counts and running sums are freed before the rows are scattered into the zeroed
    slots: the step holds the larger of the two, not their sum."""
    text = ("mesh X=2\ndims G=4, S=8, E=4, C=4, D=6\ndtype f32\nparam W_r\n"
            "Gate[G_X, S, E] = softmax(X[G_X, S, D] · W_r[D, E] over E)\n"
            "In[G_X, E, C, D] = dispatch(Gate[G_X, S, E], X[G_X, S, D], S, C, 2 over E)\n")
    plan = shardc.plan(shardc.parse(text))
    assert plan.sizes is not None
    gates = 4 // 2 * 8 * 4 * 4  # int32 per token and expert: whether it chose it, how many before it did
    rows = 4 // 2 * 4 * (4 + 1) * 6 * F32  # In's rows with a fifth slot, the dropped choices'
    forward = phase_memory(plan, dict(plan.sizes), F32, Buffers())[0]
    assert forward.temporaries == max(2 * gates, rows)


@pytest.mark.parametrize(("name", "phase"), sorted(XLA_TEMPORARIES))
def test_moe_temporaries_within_ten_percent_of_xla(moe: dict[str, Plan], name: str, phase: str) -> None:
    """Each was outside before (1.25, 1.10 and 1.17 of XLA's figure)."""
    (memory,) = (m for m in phase_memory(moe[name], VERIFY, F32, XLA_CPU) if m.phase == phase)
    assert abs(memory.temporaries / XLA_TEMPORARIES[name, phase] - 1) <= TARGET


def test_two_rings_gathering_one_value_run_together() -> None:
    """fsdp_tp.shard's backward at verify's sizes: dW_out's ring and dTmp's both gather dOut over Y; XLA merges
    their collective-permutes (ppermute.27-29, each read by a block matmul of both rings) and runs them block by
    block, so dW_out's sums (96 B, reduce-scattered at instruction 39 of 48) and two of its 24 B block products
    are alive beside W_out's blocks and dTmp's products at its peak (instruction 21): 0.87 of XLA's 920 bytes of
    temporaries with dW_out's ring run alone at step 0 (800 bytes)."""
    plan = shardc.plan(shardc.parse((EXAMPLES / "fsdp_tp.shard").read_text()))
    assert rings_together(backward_program(plan)) == {0: 3}  # dW_out's ring with dTmp's; dIn's passes sums on
    sizes = {"B": 4, "F": 8, "D": 12, "X": 2, "Y": 4}  # lowering.sizes.small_sizes on 8 devices
    backward = phase_memory(plan, sizes, F32, XLA_CPU)[1]
    assert backward.temporaries > 800 and abs(backward.temporaries / 920 - 1) <= TARGET


def test_a_ring_summing_its_block_products_makes_its_result_after_them() -> None:
    """tp.shard's backward at verify's sizes: dTmp's ring gathers dOut's blocks over Y into four products over D
    that its result does not keep; XLA sums them by one fusion (add_add_fusion, instruction 28, where all four
    die), so dTmp is not alive beside them: 1.12 of XLA's 708 bytes of temporaries with it made at the ring's
    start (792 bytes), as the rings reading only arguments are issued there. dW_out's ring writes each product
    into its result (D kept) and dIn's passes partial sums on: neither sums its blocks so."""
    plan = shardc.plan(shardc.parse((EXAMPLES / "tp.shard").read_text()))
    steps = backward_program(plan)
    assert {s.dst.name: sums_blocks(s) for s in steps if s.collective is not None} == \
        {"dW_out": False, "dTmp": True, "dIn": False}
    backward = phase_memory(plan, {"B": 4, "D": 8, "F": 12, "Y": 4}, F32, XLA_CPU)[1]
    assert backward.temporaries < 792 and abs(backward.temporaries / 708 - 1) <= TARGET
