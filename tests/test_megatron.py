"""Megatron-LM's collectives come out of the planner by itself (Shoeybi et al. 2019; Korthikanti
et al. 2022): per GPT layer, tensor parallelism all-reduces exactly twice forward and twice
backward over the tensor axis, each of the activation's size; sequence parallelism turns each
AllReduce into an AllGather entering and a ReduceScatter leaving the tensor-parallel region."""

from __future__ import annotations

from pathlib import Path

import shardc
from shardc.chip_choice import resolve_hardware
from shardc.ir.plan import Plan, Step

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _plan(name: str, save: str = "default", model: str | None = None, collective_matmul: bool = True) -> Plan:
    spec = shardc.parse((EXAMPLES / f"{name}.shard").read_text(encoding="utf-8"))
    return shardc.plan(spec, save=save, hardware=resolve_hardware(None, None, spec.hardware).configured(model),
                       collective_matmul=collective_matmul)


def _moves(steps: tuple[Step, ...]) -> list[tuple[str, tuple[str, ...], str]]:
    return [(s.op.title, s.axes, str(s.volume)) for s in steps if s.is_collective]


def test_tensor_parallel_layer_all_reduces_twice_each_way() -> None:
    p = _plan("gpt_layer_tp", model="book")
    twice = [("AllReduce", ("Y",), "2*B*D*S")] * 2
    assert _moves(p.forward) == twice
    assert _moves(p.backward) == twice  # the partial dX of Q, K and V are added before one AllReduce
    # (the book's model: the chip's hides weight gathers issued ahead under compute, and on an H100 node
    # its search finds attention's output resharded and W_o gathered ahead 1% faster than this)


def test_sequence_parallel_layer_gathers_in_and_scatters_out() -> None:
    way = [("AllGather", ("Y",), "2*B*D*S"), ("ReduceScatter", ("Y",), "2*B*D*S")] * 2
    p = _plan("gpt_layer_tp_sp", collective_matmul=False)  # Megatron's collectives, none run as a ring
    assert _moves(p.forward) == way and _moves(p.backward) == way
    # --save none keeps no gathered value: the backward gathers the two norm outputs again (as
    # Korthikanti et al. count memory), once each: a rename (Kx of L1) is the same array
    again = _plan("gpt_layer_tp_sp", "none", collective_matmul=False)
    assert _moves(again.forward) == way
    regathered = [s.tensor for s in again.backward if s.is_collective and s.tensor in ("L1", "Kx", "L2")]
    assert sorted(regathered) in (["Kx", "L2"], ["L1", "L2"])
    assert len(_moves(again.backward)) == len(way) + 2
    # the same bytes as tensor parallelism's AllReduces (one AllReduce is a ReduceScatter + AllGather)
    tp = shardc.cost(_plan("gpt_layer_tp", model="book"))
    sp = shardc.cost(_plan("gpt_layer_tp_sp", collective_matmul=False))
    assert tp.step.comm_bytes == sp.step.comm_bytes


def test_fsdp_with_tensor_parallelism_in_one_llama_layer() -> None:
    p = _plan("llama_layer_fsdp_tp")
    over_y = [m for m in _moves(p.forward) if m[1] == ("Y",)]
    assert over_y == [("AllReduce", ("Y",), "2*B*D*S/X")] * 2
    gathered = {s.tensor for s in p.forward if s.is_collective and s.axes == ("X",)}
    assert gathered == {"W_q", "W_k", "W_v", "W_o", "W_gate", "W_up", "W_down"}  # FSDP: weights only
