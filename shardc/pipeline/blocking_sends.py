"""Blocking point-to-point sends (``schedule 1f1b sends blocking``): DeepSpeed's pipeline engine's, so Megatron-
DeepSpeed's (BLOOM's, MT-NLG's).

DeepSpeed's pipeline engine runs its TrainSchedule (deepspeed/runtime/pipe/schedule.py) as lists of instructions a
step: a forward step ``RecvActivation``, ``SendGrad`` (the previous backward's), ``ForwardPass``; a backward step
``SendActivation`` (the previous forward's), ``RecvGrad``, ``BackwardPass``; the instructions' docstrings say "The
communication is blocking".  Each is ``p2p.send``/``p2p.recv`` (deepspeed/runtime/pipe/p2p.py), which asserts
``async_op == False`` and calls ``dist.send``/``dist.recv`` (or, before torch 1.8, ``dist.broadcast`` over the
two ranks' group) without ``async_op``: the call waits for the transfer, so the stage's next kernels queue behind
it, on the sender and on the receiver alike.  A transfer therefore holds both its devices for its time, and a
stage's compute never runs under its own sends: a middle stage's microbatch takes F + B plus four transfers (the
activation in and out, the gradient in and out), where the default model (``sends async``: each send delays only
the op that reads it, as a separately streamed send would) takes F + B.

The simulation prices it by putting each chunk's transfers into its ops: a forward takes its activation's receive
(not on the first chunk) and its send (not on the last), a backward its gradient's receive (not on the last) and
its send (not on the first); and an op that reads another device's output may start one transfer before that op
ends, its receive beside the other's send.  Where a cross-node send is split over the node's replicas
(:mod:`shardc.costmodel.boundary_send`: the engine's ``PartitionedTensor``, whose ``.full()`` all-gathers the
pieces on the receiving side), the receiver alone holds that AllGather, after the transfer.
Not priced: the engine's order inside a step (its gradient goes out
after the next activation came in, rather than right after its backward: the same transfers, in another order),
and a sender waiting for its receiver to post the matching receive while the receiver still computes.
"""

from __future__ import annotations

from typing import NamedTuple

from shardc.pipeline.paired_sends import paired_delays, paired_transfers

__all__ = ["Held", "transfers", "blocking_delays"]


class Held(NamedTuple):
    """How the sends hold their devices: the receiving side's AllGathers of an activation and of a gradient (of
    the sends' times), and whether a step's send and receive go as one exchange (``sends paired``, Megatron-LM's:
    :mod:`shardc.pipeline.paired_sends`) or one transfer at a time (``sends blocking``, DeepSpeed's)."""

    gather: float = 0.0
    gather_back: float = 0.0
    paired: bool = False


def transfers(chunk: int, chunks: int, sends: tuple[float, float], held: Held) -> tuple[float, float]:
    """The seconds of held transfers chunk ``chunk`` of ``chunks`` (one a device: ``1f1b``) adds to its
    forward and to its backward: ``sends`` an activation's and a gradient's, each with its receiver's AllGather
    (``held``'s, of them), which under ``sends blocking`` the sender does not hold."""
    gathers = held.gather, held.gather_back
    if held.paired:
        return paired_transfers(chunk, chunks, sends, gathers)
    (comm, back), (on, off) = sends, gathers
    first, last = chunk == 0, chunk == chunks - 1
    return (comm * (not first) + (comm - on) * (not last),  # the activation in (gathered), then out
            back * (not last) + (back - off) * (not first))  # the gradient in (gathered), then back


def blocking_delays(sends: tuple[float, float], held: Held) -> tuple[float, float]:
    """When another device's output reaches an op, after that op's end (a forward's, a backward's): one
    transfer (without the receiver's gather) before it, the receive running beside the send the producer's op
    ends with; paired, :func:`shardc.pipeline.paired_sends.paired_delays`."""
    if held.paired:
        return paired_delays((held.gather, held.gather_back))
    return held.gather - sends[0], held.gather_back - sends[1]
