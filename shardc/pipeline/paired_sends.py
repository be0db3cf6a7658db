"""Paired point-to-point exchanges (``schedule 1f1b sends paired``): Megatron-LM's 1F1B pipeline.

Megatron-LM's 1F1B (``forward_backward_pipelining_without_interleaving`` in megatron/schedules.py, 2021; later
megatron/core/pipeline_parallel/schedules.py) calls, between compute ops, the functions of its
p2p_communication.py: in the steady state ``send_forward_recv_backward`` after a forward (its activation to the
next stage, that stage's gradient back) and ``send_backward_recv_forward`` after a backward (its gradient to the
previous stage, that stage's next activation in).  Each is one ``_communicate``, which posts the send and the
receive together (``torch.distributed.batch_isend_irecv``), waits on every request and then
``torch.cuda.synchronize()``: the stage computes nothing until its exchange is done, and the neighbour's matching
call (stage s's after its forward of microbatch w + k, stage s+1's after its backward of k, w stage s's warm-up
forwards) is the same exchange, so both wait for each other.  With ``scatter_gather_tensors_in_pipeline`` (on by
default) each side then all-gathers what it received over its tensor-parallel group (``gather_split_1d_tensor``):
the receiving side's AllGather of a split send (:mod:`shardc.costmodel.boundary_send`).

The exchange's two transfers run at once (NCCL runs a group's send and receive to one peer on its own channels,
and NVLink and InfiniBand links carry both directions at full rate), so it lasts the longer of the two, then
each side's gather of what it got.  The simulation puts each exchange at the end of both ops that precede it: a
forward (not on the last stage) ends with the exchange and the gradient's gather, a backward (not on the first)
with the exchange and the activation's gather; the op reading the other's output starts once both ops ended,
which is when the exchange is done, as in the steady state's order (a stage's forward of w + k, the next
stage's backward of k, exchange, then the one's backward of k and the other's forward of w + k).  Against
``sends blocking`` (DeepSpeed's, four transfers one at a time a middle stage's microbatch) a middle stage holds
two exchanges a microbatch.

Not priced: the warm-up's forwards and the cool-down's backwards send alone (``send_forward`` and
``send_backward``, one transfer and no gather on the sender), taken here at the exchange's time with its gather
(the same but for the gather where an activation and its gradient are of one size); and a lone send waiting for
its receiver to post its receive.
"""

from __future__ import annotations

__all__ = ["paired_transfers", "paired_delays"]


def paired_transfers(chunk: int, chunks: int, sends: tuple[float, float],
                     gathers: tuple[float, float]) -> tuple[float, float]:
    """The seconds of exchanges chunk ``chunk`` of ``chunks`` (one a device: ``1f1b``) ends its forward and its
    backward with: ``sends`` an activation's and a gradient's, each with its receiver's AllGather (``gathers``)."""
    (comm, back), (on, off) = sends, gathers
    exchange = max(comm - on, back - off)  # both directions at once, before the gathers
    return ((exchange + off) * (chunk < chunks - 1),  # after a forward: the activation out, the gradient in
            (exchange + on) * (chunk > 0))  # after a backward: the gradient out, the next activation in


def paired_delays(gathers: tuple[float, float]) -> tuple[float, float]:
    """When another device's output reaches an op, after that op's end (a forward's, a backward's): the two ops
    end with the same exchange, each with its own gather, so the reader's gather less the other's."""
    on, off = gathers
    return on - off, off - on
