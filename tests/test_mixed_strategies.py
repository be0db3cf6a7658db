"""Strategies mixed in one spec: examples/moe_transformer.shard, a whole MoE decoder (Mixtral 8x7B's
shapes) with FSDP over X and Z, tensor parallelism over Y, expert parallelism over Z and a
vocabulary-parallel embedding and loss.  The planner, by itself, makes each strategy's collectives;
the bytes expected here are the book's volumes (V: the bytes a device would hold unsharded over
the collective's axes, f32) written from the sizes.  The example's verification (values and HLO,
forward and gradients) runs with every example's, in tests/test_lower.py."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardc
from shardc.ir.plan import Op, Plan
from shardc.planner.check import check_plan

PATH = Path(__file__).resolve().parents[1] / "examples" / "moe_transformer.shard"
AG, RS, AR, A2A = Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_REDUCE, Op.ALL_TO_ALL
Row = tuple[Op, tuple[str, ...], str, int]


@pytest.fixture(scope="module")
def plan() -> Plan:
    # the collectives and the verdict below are the plan under the book's model
    p = shardc.plan(shardc.parse(PATH.read_text(encoding="utf-8"), filename=str(PATH)), model="book")
    assert check_plan(p) == []
    return p


def _sizes(plan: Plan) -> dict[str, int]:
    return {**(plan.spec.sizes or {}), **{a.name: a.size for a in plan.spec.mesh.axes}}


def _collectives(plan: Plan, phase: str) -> list[Row]:
    sizes = _sizes(plan)
    return [(s.op, s.axes, s.tensor, int(s.volume.evaluate(sizes)))  # type: ignore[union-attr]
            for s in getattr(plan, phase) if s.is_collective]


def test_the_example_is_mixtral_on_a_three_axis_mesh(plan: Plan) -> None:
    n = _sizes(plan)
    assert (n["L"], n["D"], n["G"] * n["R"], n["G"], n["H"], n["E"], n["F"], n["V"]) == \
        (32, 4096, 32, 8, 128, 8, 14336, 32000)
    assert n["C"] == 5 * 2 * n["S"] // (4 * n["E"])  # capacity factor 1.25, top-2
    assert (n["X"], n["Y"], n["Z"]) == (32, 4, 8)


def test_forward_collectives_fsdp_tp_experts_and_vocab(plan: Plan) -> None:
    n = _sizes(plan)
    B, S, D, G, R, H, E, C, F, V, X, Y, Z = (n[k] for k in "B S D G R H E C F V X Y Z".split())
    act = 4 * B * S * D // (X * Z)  # the residual stream a device holds: tokens over X and Z, D whole
    slots = 4 * B * E * C * D // (X * Z)  # the expert inputs a device holds, tokens over X, experts over Z
    expert = 4 * E * D * F // (Y * Z)  # one expert matrix: experts over Z, F over Y, gathered over X
    rows = 4 * B * S // (X * Z)  # one value a token
    assert _collectives(plan, "forward") == [
        (AG, ("X", "Z"), "W_emb", 4 * V * D // Y),      # FSDP gathers of the vocabulary-parallel table
        (AR, ("Y",), "X0", act),                         # the vocab-parallel embedding's reduction
        (AG, ("X", "Z"), "W_q", 4 * D * G * R * H // Y),  # FSDP gathers of the heads' shard
        (AG, ("X", "Z"), "W_k", 4 * D * G * H // Y),
        (AG, ("X", "Z"), "W_v", 4 * D * G * H // Y),
        (AG, ("X", "Z"), "W_o", 4 * D * G * R * H // Y),
        (AR, ("Y",), "R1_t1", act),                      # Megatron's AllReduce after attention
        (A2A, ("Z",), "In", slots * Z // Y),             # dispatch: each Y replica moves a 1/Y slice
        (AG, ("Y",), "In", slots),                       # ... and gathers the others'
        (AG, ("X",), "W_gate", expert), (AG, ("X",), "W_up", expert), (AG, ("X",), "W_down", expert),
        (AR, ("Y",), "Ex", slots),                       # the experts' TP AllReduce (F over Y)
        (A2A, ("Z",), "Comb", 4 * B * S * E * C // (X * Y)),  # combine: the weights go to the experts
        (RS, ("Z",), "X1_t1", act * Z // Y),             # ... the weighted outputs come back summed
        (AG, ("Y",), "X1_t1", act),
        (AG, ("X", "Z"), "W_out", 4 * V * D // Y),
        (AR, ("Y",), "Loss_max", rows), (AR, ("Y",), "Loss_sum", rows), (AR, ("Y",), "Loss_target", rows),
        (AR, ("X", "Z"), "Loss", 4),                     # the mean over tokens
    ]


def test_backward_collectives_transpose_the_forward(plan: Plan) -> None:
    n = _sizes(plan)
    B, S, D, G, R, H, E, C, F, V, X, Y, Z = (n[k] for k in "B S D G R H E C F V X Y Z".split())
    act, slots = 4 * B * S * D // (X * Z), 4 * B * E * C * D // (X * Z)
    expert, kv, q = 4 * E * D * F // (Y * Z), 4 * D * G * H // Y, 4 * D * G * R * H // Y
    kv_grad = 4 * B * S * G * H // (X * Z)
    assert _collectives(plan, "backward") == [
        (RS, ("X", "Z"), "dW_out", 4 * V * D // Y), (AG, ("X", "Z"), "W_out", 4 * V * D // Y),
        (AR, ("Y",), "dFn", act),
        (A2A, ("Z",), "dEx", slots * Z // Y), (AG, ("Y",), "dEx", slots),  # combine's transpose
        (A2A, ("Z",), "Ex", slots * Z // Y), (AG, ("Y",), "Ex", slots),    # Ex back to the tokens, for dComb
        (RS, ("X",), "dW_down", expert), (AG, ("X",), "W_down", expert),
        (RS, ("X",), "dW_up", expert), (AG, ("X",), "W_up", expert),
        (RS, ("X",), "dW_gate", expert), (AG, ("X",), "W_gate", expert),
        (AR, ("Y",), "dIn", slots),                                        # the experts' TP AllReduce
        (A2A, ("Z",), "dIn", slots * Z // Y),                              # dispatch's transpose
        (AR, ("X", "Z"), "dW_r", 4 * D * E),                               # the router is data parallel
        (AG, ("Y",), "dL2_1", act),
        (RS, ("X", "Z"), "dW_o", q), (AG, ("X", "Z"), "W_o", q),
        (RS, ("X", "Z"), "dW_v", kv), (AG, ("Y",), "dVl", kv_grad), (AG, ("X", "Z", "Y"), "W_v", kv * Y),
        (RS, ("X", "Z"), "dW_k", kv), (AG, ("Y",), "dK", kv_grad), (AG, ("X", "Z", "Y"), "W_k", kv * Y),
        (RS, ("X", "Z"), "dW_q", q), (AG, ("Y",), "dQ", kv_grad * R), (AG, ("X", "Z", "Y"), "W_q", q * Y),
        (RS, ("X", "Z"), "dW_emb", 4 * V * D // Y),
    ]


def test_the_logits_are_never_gathered(plan: Plan) -> None:
    moved = {s.tensor for s in plan.forward + plan.backward if s.is_collective}
    assert not moved & {"Lg", "dLg"}
    assert all(s.dst.dims[2].axes == ("Y",) for s in plan.forward + plan.backward if s.dst.name in {"Lg", "dLg"})


def test_experts_stay_on_their_devices(plan: Plan) -> None:
    """Expert parallelism: no step gathers the experts' index of a weight or of its gradient."""
    for step in plan.forward + plan.backward:
        if step.dst.name.lstrip("d") in {"W_gate", "W_up", "W_down"}:
            assert step.dst.dims[0].axes == ("Z",), step


def test_cost_verdict_and_parameter_count(plan: Plan) -> None:
    n = _sizes(plan)
    L, D, G, R, H, E, F, V = (n[k] for k in "L D G R H E F V".split())
    report = shardc.cost(plan)
    params = 3 * L * E * D * F + 2 * L * D * (G * R * H + G * H) + L * D * E + 2 * V * D
    assert report.memory.params_total == params == pytest.approx(46.7e9, rel=0.002)  # Mixtral: 46.7B
    assert report.memory.fits
    step = report.step
    # the experts' AllToAlls and gathers outweigh the FLOPs, but not by much: MFU over half
    assert step.bound == "communication" and step.compute_s < step.comm_s < 2 * step.compute_s
    assert 0.5 < step.mfu < 0.7 and step.step_s == pytest.approx(0.43, rel=0.05)
