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

import numpy as np

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


def megatron_steps(steps: Ones, stages: int, microbatches: int, compute: list[dict[str, float]],
                   sends: tuple[float, float], gathers: tuple[float, float]
                   ) -> tuple[Ones, list[float], tuple[float, ...]]:
    """A 1F1B walk's ops as Megatron-LM runs them: each step's seconds (its ``compute``, one dict of F and B
    seconds a stage, and the transfers it holds), the walk with a lone transfer's read marked (a forward's
    activation 3, a backward's gradient 4, beside the exchanges' 1 and 2) and the delays by those marks.

    Each op's figures depend on that op alone, so they are made a column at a time (a walk of 1F1B over 48 stages
    is tens of thousands of ops, where a loop over them took a tenth of a layouts search), each float by the
    very additions of a step at a time: the transfer held after, then the lone one before, then the compute."""
    (comm, back), (on, off) = sends, gathers
    exchange = max(comm - on, back - off)
    kind = np.frombuffer(steps.kind.encode(), np.uint8)
    if not np.all((kind == ord("F")) | (kind == ord("B"))):
        raise ValueError("megatron_steps: a 1F1B walk has forwards and backwards only")
    forward = kind == ord("F")
    j, s = np.asarray(steps.microbatch, np.int64), np.asarray(steps.chunk, np.int64)
    lone_in, lone_out = _alone(forward, j, s, stages, microbatches)
    # after an op: nothing from the stage that sends nothing on, else its lone send or its exchange
    held = np.where(forward, np.where(lone_out, comm - on, exchange + off),
                    np.where(lone_out, back - off, exchange + on))
    held = np.where(s == np.where(forward, stages - 1, 0), 0.0, held)
    # before: the transfer in and its gather, its read marked lone
    held = np.where(lone_in, held + np.where(forward, comm, back), held)
    table = np.array([[float(c["F"]), float(c["B"])] for c in compute], np.float64).reshape(-1, 2)
    seconds = (table[s, np.where(forward, 0, 1)] + held).tolist()
    marked = Ones(steps.device, steps.kind, steps.microbatch, steps.chunk, steps.first,
                  _lone(steps.first_how, lone_in), steps.second, _lone(steps.second_how, lone_in))
    return marked, seconds, (0.0, *paired_delays(gathers), on - comm, off - back)


def _alone(forward: np.ndarray, j: np.ndarray, stage: np.ndarray, stages: int, microbatches: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """Whether each op (a forward where ``forward``, else a backward; of microbatch ``j`` on ``stage``) receives
    alone before it and sends alone after it (a forward in the warm-up, a backward last in the steady state or
    in the cool-down; see the module docstring)."""
    warm = np.minimum(stages - 1 - stage, microbatches)
    steady = microbatches - warm
    lone_in = np.where(forward, (stage > 0) & (j <= warm), j >= steady)
    lone_out = np.where(forward, j < warm, (stage > 0) & (j >= steady - 1))
    return lone_in, lone_out


def _lone(how: array[int], lone: np.ndarray) -> array[int]:
    """A read column's ways with a lone transfer's marked: 1 and 2 (sent) become 3 and 4 where ``lone``."""
    ways = np.frombuffer(how, np.int8) if len(how) else np.zeros(0, np.int8)
    return array("b", (ways + 2 * ((ways > 0) & lone)).astype(np.int8).tobytes())
