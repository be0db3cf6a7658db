"""Paired point-to-point exchanges (``schedule 1f1b sends paired``): Megatron-LM's 1F1B pipeline.

Megatron-LM's 1F1B (``forward_backward_pipelining_without_interleaving`` in megatron/schedules.py, 2021; later
megatron/core/pipeline_parallel/schedules.py) calls, between compute ops, the functions of its
p2p_communication.py, each one ``_communicate``, which posts its transfers together
(``torch.distributed.batch_isend_irecv``), waits on every request and then ``torch.cuda.synchronize()``: the stage
computes nothing until they are done.  Stage s of p, over m microbatches, runs w = min(p - 1 - s, m) warm-up
forwards, then m - w steady pairs, then w cool-down backwards:

* warm-up: ``recv_forward`` (the activation in, alone), the forward, ``send_forward`` (its activation out, alone);
  then, before the steady state, one more ``recv_forward`` (forward w's activation, alone);
* steady, microbatch k: the forward of w + k, ``send_forward_recv_backward`` (its activation to the next stage,
  that stage's gradient of k back: one exchange), the backward of k, ``send_backward_recv_forward`` (its gradient
  to the previous stage, that stage's activation of w + k + 1 in: one exchange), the last one ``send_backward``
  alone;
* cool-down: ``recv_backward`` (the gradient in, alone), the backward, ``send_backward`` (its gradient out, alone).

Each call meets its neighbour's matching call: an exchange another exchange (stage s's after its forward of
w + k, stage s + 1's after its backward of k), a lone send a lone receive (the warm-up's sends the next stage's
warm-up receives and its receive before the steady state, the last steady backward's and the cool-down's sends
the previous stage's cool-down receives), so a forward of j on stage s > 0 receives alone where j <= w, a
backward of k where k >= m - w.  With ``scatter_gather_tensors_in_pipeline`` (on by default) each side then
all-gathers what it received over its tensor-parallel group (``gather_split_1d_tensor``): the receiving side's
AllGather of a split send (:mod:`shardc.costmodel.boundary_send`); a lone send's sender gathers nothing.

An exchange's two transfers run at once (NCCL runs a group's send and receive to one peer on its own channels,
and NVLink and InfiniBand links carry both directions at full rate), so it lasts the longer of the two, then
each side's gather of what it got; a lone transfer lasts its own time, the receiver's gather after it.  The
simulation puts each op's transfers into it: a lone receive before it, its exchange or lone send after it.  An op
that reads another stage's output after an exchange starts when both ops ending with that exchange ended (the
steady state's order: a stage's forward of w + k, the next stage's backward of k, exchange, then the one's
backward of k and the other's forward of w + k); after a lone send it may start one transfer before the sender's
op ends, its receive beside that send.  Against ``sends blocking`` (DeepSpeed's, four transfers one at a time a
middle stage's microbatch) a middle stage's steady microbatch holds two exchanges.

Not priced: a lone send waiting for its receiver to post its receive (the receiver of a warm-up send or a
cool-down one is idle, waiting for that very tensor, unless its own previous transfer is late).
"""

from __future__ import annotations

from array import array

from shardc.pipeline.order_walk import Ones

__all__ = ["paired_transfers", "paired_delays", "megatron_steps"]


def paired_transfers(chunk: int, chunks: int, sends: tuple[float, float],
                     gathers: tuple[float, float]) -> tuple[float, float]:
    """The seconds of exchanges chunk ``chunk`` of ``chunks`` (one a device: ``1f1b``) ends a steady forward and a
    steady backward with: ``sends`` an activation's and a gradient's, each with its receiver's AllGather
    (``gathers``).  The warm-up's and the cool-down's ops hold other transfers: :func:`megatron_steps`."""
    (comm, back), (on, off) = sends, gathers
    exchange = max(comm - on, back - off)  # both directions at once, before the gathers
    return ((exchange + off) * (chunk < chunks - 1),  # after a forward: the activation out, the gradient in
            (exchange + on) * (chunk > 0))  # after a backward: the gradient out, the next activation in


def paired_delays(gathers: tuple[float, float]) -> tuple[float, float]:
    """When another device's output reaches an op, after that op's end (a forward's, a backward's), where the
    two ops end with the same exchange, each with its own gather: the reader's gather less the other's."""
    on, off = gathers
    return on - off, off - on


def _alone(kind: str, j: int, stage: int, stages: int, microbatches: int) -> tuple[bool, bool]:
    """Whether op ``kind`` of microbatch ``j`` on ``stage`` receives alone before it and sends alone after it (a
    forward in the warm-up, a backward last in the steady state or in the cool-down; see the module docstring)."""
    warm = min(stages - 1 - stage, microbatches)
    if kind == "F":
        return stage > 0 and j <= warm, j < warm
    steady = microbatches - warm
    return j >= steady, stage > 0 and j >= steady - 1


def megatron_steps(steps: Ones, stages: int, microbatches: int, compute: list[dict[str, float]],
                   sends: tuple[float, float], gathers: tuple[float, float]
                   ) -> tuple[Ones, list[float], tuple[float, ...]]:
    """A 1F1B walk's ops as Megatron-LM runs them: each step's seconds (its ``compute``, one dict of F and B
    seconds a stage, and the transfers it holds), the walk with a lone transfer's read marked (a forward's
    activation 3, a backward's gradient 4, beside the exchanges' 1 and 2) and the delays by those marks."""
    (comm, back), (on, off) = sends, gathers
    exchange = max(comm - on, back - off)
    after = {"F": (comm - on, exchange + off), "B": (back - off, exchange + on)}  # alone, exchanged
    last = {"F": stages - 1, "B": 0}  # the stage that sends nothing on
    seconds: list[float] = []
    first_how, second_how = array("b", steps.first_how), array("b", steps.second_how)
    for i, (kind, j, s) in enumerate(zip(steps.kind, steps.microbatch, steps.chunk, strict=True)):
        lone_in, lone_out = _alone(kind, j, s, stages, microbatches)
        held = 0.0 if s == last[kind] else after[kind][0 if lone_out else 1]
        if lone_in:  # the transfer in and its gather before the op, its read marked lone
            held += comm if kind == "F" else back
            first_how[i] += 2 * (first_how[i] > 0)
            second_how[i] += 2 * (second_how[i] > 0)
        seconds.append(compute[s][kind] + held)
    marked = Ones(steps.device, steps.kind, steps.microbatch, steps.chunk, steps.first, first_how, steps.second,
                  second_how)
    return marked, seconds, (0.0, *paired_delays(gathers), on - comm, off - back)
