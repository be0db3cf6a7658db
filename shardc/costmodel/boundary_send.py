"""A pipeline's send of a stage's boundary activation (or its gradient) to the neighbouring stage, as the GPU
frameworks send it.

Where the activation is replicated over mesh axes inside a node (tensor parallelism's: every rank of the group
holds the whole output of the block's last AllReduce) and the stage axis crosses nodes, the frameworks do not
send t copies over the same InfiniBand links: each of the t ranks sends 1/t of it and the receiving node
all-gathers the pieces over NVLink (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", arXiv 2104.04473, section 4.1, the scatter/gather optimization).

* Megatron-LM does it by default: megatron/arguments.py defines only ``--no-scatter-gather-tensors-in-pipeline``
  (``action='store_false'``, so ``scatter_gather_tensors_in_pipeline`` is True unless named), and
  megatron/p2p_communication.py's ``_communicate`` sends ``split_tensor_into_1d_equal_chunks`` of the tensor,
  waits for the receives, then ``gather_split_1d_tensor`` (an AllGather over the tensor-parallel group), both
  ways (the activation on, its gradient back).
* DeepSpeed's pipeline engine (Megatron-DeepSpeed's, so BLOOM's and MT-NLG's) too: deepspeed/runtime/pipe/
  engine.py sets ``is_pipe_partitioned`` (and ``is_grad_partitioned``) whenever the model is tensor-parallel
  (its ``pipe_partitioned`` and ``grad_partitioned`` config both default True), sends a ``PartitionedTensor``'s
  local part and calls ``.full()`` (an AllGather over the model-parallel slice) before the forward runs.
* torchtitan shards the residual stream over the tensor-parallel group (its ``apply_tp`` puts
  ``SequenceParallel`` on the norms and ``Shard(1)`` on the blocks' outputs), so its boundary is already split
  over it and torch.distributed.pipelining sends each rank's piece: such a spec's boundary (``S_Y``) is not
  replicated over Y, and this changes nothing for it.

The frameworks agree, so no spec line chooses: the split applies to every GPU cluster's cross-node send of a
replicated boundary.  The AllGather is on the critical path: the receiving stage runs nothing of the microbatch
until the gathered activation is whole (Megatron-LM's receive returns only after it), so a send's time is the
piece's transfer plus the gather's.  A TPU's XLA program sends each device's whole shard (a collective-permute),
as does shardc's lowered pipeline on any chip: the split is the cost model's, not the program's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardc.collectives import Layout, Op, axis_links, collective_time
from shardc.hardware import Hardware
from shardc.ir.plan import Plan
from shardc.ir.spec import TensorRef

__all__ = ["BoundarySend", "boundary_send", "send_split"]


@dataclass(frozen=True)
class BoundarySend:
    """One send of a microbatch's boundary tensor between neighbouring stages."""

    seconds: float  # the transfer, and where it is split, the receiving side's AllGather after it
    network: str  # the stage axis's network the transfer went over ("ici", "dcn", "ici+dcn")
    split: tuple[str, ...] = ()  # the axes each rank sends 1/t over and the receivers gather over; () sent whole
    gather_s: float = 0.0  # of ``seconds``, the AllGather's


def send_split(plan: Plan, ref: TensorRef, axis: str, sizes: dict[str, int], spans: Layout) -> tuple[str, ...]:
    """The mesh axes a cross-node send of the boundary ``ref`` is split over: those it is replicated over (no dim
    sharded on them) that lie inside one node of a GPU cluster; () where the stage axis ``axis`` is not laid
    across a GPU cluster's nodes."""
    mesh = plan.spec.mesh
    stage = axis_links(spans, axis, sizes.get(axis, mesh.size(axis)))
    if not stage.nodes or stage.outer == 1:  # a TPU's send, or one inside a node: sent whole
        return ()
    sharded = {a for d in ref.dims for a in d.axes}
    inside = (a for a in mesh.names if a != axis and a not in sharded and sizes.get(a, mesh.size(a)) > 1)
    return tuple(a for a in inside if _in_node(spans, a, sizes.get(a, mesh.size(a))))


def _in_node(spans: Layout, axis: str, chips: int) -> bool:
    links = axis_links(spans, axis, chips)
    return links.nodes and links.outer == 1


def boundary_send(plan: Plan, ref: TensorRef, axis: str, volume: float, sizes: dict[str, int], hw: Hardware,
                  spans: Layout) -> BoundarySend:
    """The send of ``volume`` bytes (a device's shard of the boundary ``ref``) over the stage axis ``axis``, split
    over the node's replicas as the frameworks split it (:func:`send_split`)."""
    mesh = plan.spec.mesh
    split = send_split(plan, ref, axis, sizes, spans)
    t = math.prod(sizes.get(a, mesh.size(a)) for a in split)
    send = collective_time(Op.COLLECTIVE_PERMUTE, volume / t, (axis,), mesh, sizes, hw, spans)
    if not split:
        return BoundarySend(send.seconds, send.network)
    # V of an AllGather is the gathered bytes: the device's whole shard again
    gather = collective_time(Op.ALL_GATHER, volume, split, mesh, sizes, hw, spans)
    return BoundarySend(send.seconds + gather.seconds, send.network, split, gather.seconds)
