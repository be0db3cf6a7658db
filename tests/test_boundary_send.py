"""A pipeline's boundary send as Megatron-LM and DeepSpeed run it (shardc.costmodel.boundary_send): a boundary
replicated over a node's tensor-parallel GPUs crosses InfiniBand 1/t a GPU and is all-gathered over NVLink on the
receiving side; a sharded boundary, a send inside a node and a TPU's send go whole."""

from __future__ import annotations

import pytest

import shardc
from shardc.collectives import NCCL_BASE_S, NCCL_NET_STEP_S, NCCL_NVLINK_STEP_S
from shardc.costmodel.pipeline_figures import PipelineCost

# Megatron-LM's tensor parallelism over Y: the block's output is the AllReduce's, whole on each of Y's GPUs
TENSOR_PARALLEL = ("H[B, E_Y] = In[B, D] · W1[D, E_Y]\n"
                   "Out[B, D] = H[B, E_Y] · W2[E_Y, D]\n")
DATA_PARALLEL = ("H[B_Y, E] = In[B_Y, D] · W1[D, E]\n"
                 "Out[B_Y, D] = H[B_Y, E] · W2[E, D]\n")
# one microbatch's boundary: B=64 in 8 microbatches of 8 rows of D=8192, bf16
WHOLE = 8 * 8192 * 2


def _pipeline(mesh: str, block: str, hardware: str = "h100") -> tuple[PipelineCost, shardc.CostReport]:
    text = (f"mesh {mesh}\nlayers 8\nmicrobatches 8\nschedule 1f1b\nhardware {hardware}\n"
            f"dims B=64, D=8192, E=8192\nparam W1, W2\n{block}")
    report = shardc.cost(shardc.plan(shardc.parse(text, "send.shard")))
    assert report.pipeline is not None
    return report.pipeline, report


def test_a_replicated_boundary_across_nodes_is_split_and_gathered() -> None:
    """Two nodes of 8 H100s (the topology 2x8), the stage axis across them, tensor parallel over the node's 8: each
    GPU sends 1/8 over InfiniBand (its rail, W_dcn, one NCCL step across nodes), then the 8 all-gather the pieces
    over NVLink ((n-1)/n of V at W_ici, a ring of 7 NVLink steps), both on the critical path."""
    pipe, report = _pipeline("P=2 pipeline, Y=8", TENSOR_PARALLEL)
    hw = report.hardware
    base = NCCL_BASE_S if hw.collective_base is None else hw.collective_base
    piece = WHOLE / 8 / hw.w_dcn + base + NCCL_NET_STEP_S
    gather = 7 / 8 * WHOLE / hw.w_ici + base + 7 * NCCL_NVLINK_STEP_S
    assert pipe.p2p_bytes == WHOLE and pipe.network == "dcn" and pipe.p2p_split == ("Y",)
    assert pipe.p2p_s == pytest.approx(piece + gather, rel=1e-12)
    assert pipe.timing.comm == pipe.p2p_s and pipe.timing.comm_back is None  # the gradient back: the same
    # at 131 kB the gather's NCCL latency outweighs the 7/8 of the transfer saved; Megatron-LM's _communicate
    # splits at any size (no threshold), so the cost does too
    assert pipe.p2p_s > WHOLE / hw.w_dcn + base + NCCL_NET_STEP_S
    assert "split over Y and gathered on the receiving side" in report.render()
    assert pipe.to_json()["p2p_split"] == ["Y"]


@pytest.mark.parametrize(("mesh", "block", "hardware", "network"), [
    ("P=2 pipeline, Y=8", DATA_PARALLEL, "h100", "dcn"),  # the boundary sharded over Y: nothing replicated
    ("Y=2, P=8 pipeline", TENSOR_PARALLEL, "h100", "ici"),  # the stage axis inside a node: NVLink, whole
    ("P=2 pipeline over dcn, Y=4", TENSOR_PARALLEL, "tpu-v5p", "dcn"),  # XLA's collective-permute: whole
])
def test_a_send_is_whole_unless_replicated_inside_a_node_and_across_nodes(mesh: str, block: str, hardware: str,
                                                                          network: str) -> None:
    pipe, report = _pipeline(mesh, block, hardware)
    hw = report.hardware
    shard = WHOLE // (8 if block == DATA_PARALLEL else 1)
    if hardware == "tpu-v5p":  # the book's torus: the chip's DCN figure, one hop's latency
        want = shard / hw.w_dcn + hw.hop_latency
    else:
        base = NCCL_BASE_S if hw.collective_base is None else hw.collective_base
        link, step = (hw.w_dcn, NCCL_NET_STEP_S) if network == "dcn" else (hw.w_ici, NCCL_NVLINK_STEP_S)
        want = shard / link + base + step
    assert pipe.p2p_split == () and pipe.network == network and pipe.p2p_bytes == shard
    assert pipe.p2p_s == pytest.approx(want, rel=1e-12)
    assert "gathered on the receiving side" not in report.render()
