"""Computation beside a collective on a GPU: the one rule every overlap in the cost model uses.

A collective's kernels hold some of the chip's cores while they run (NCCL's channels, one CTA an SM that
no compute kernel shares; DeepSeek-V3's all-to-all kernels, 20 of the H800's 132 SMs:
:attr:`shardc.hardware.Hardware.overlap_share`), so computation overlapped with it runs on the rest, at
``1 - share`` of its rate, and at its whole rate once the collective is done: :func:`beside` gives the
time until the first of the two ends, :func:`beside_seconds` until both have.  Where the cost overlaps a
collective with computation it runs by them: a phase's ahead collectives under its compute
(:func:`shardc.phase_time.phase_seconds`), the collectives of DualPipe's F&B pair under the other chunk's
computation (:mod:`shardc.pipeline.pairing`), and a pipeline's gradient reductions under the last
microbatch's backward (:func:`reduced_after`: :mod:`shardc.costmodel.pipeline_cost` costs them by it and
:func:`shardc.timing.plan_time`, the planner's objective, weighs them by it).  Point-to-point sends (a pipeline's
between stages, a ring kernel's to its neighbour: NCCL send/recv to one peer) hold SMs too, but how many
is not measured (the chip's ``collective_sms`` are a node's collective channels), so they take none here;
host copies run on the copy engines, not the SMs.
"""

from __future__ import annotations

import math

__all__ = ["beside", "beside_seconds", "reduced_after", "gathered_before"]


def beside(work_s: float, comm_s: float, share: float) -> tuple[float, float]:
    """Computation of ``work_s`` seconds (at the whole chip's rate) and a collective of ``comm_s`` seconds
    started together, the collective holding ``share`` of the cores: (the seconds until the first of the
    two ends, the computation's seconds of work left then)."""
    rate = 1.0 - share
    done_s = work_s / rate if rate > 0 else math.inf  # the computation alone on the cores left
    if done_s <= comm_s:
        return done_s, 0.0
    return comm_s, max(0.0, work_s - rate * comm_s)


def beside_seconds(work_s: float, comm_s: float, share: float) -> float:
    """Computation of ``work_s`` seconds and a collective of ``comm_s`` seconds started together: the seconds
    until both are done (:func:`beside`'s, then the work left at the whole rate).  The computation loses
    ``share`` of the collective's time where it outlasts it, else the collective sets the time."""
    return max(work_s + share * comm_s, comm_s)


def reduced_after(backward_s: float, reduce_s: float, share: float, after_backward: bool = False) -> float:
    """The seconds a pipeline's once-a-step gradient reductions (``reduce_s``) add to the step: issued as the
    last microbatch's backward (``backward_s``) makes each layer's gradient, they run beside it
    (:func:`beside_seconds`; Megatron-LM's overlapped gradient reduction), so what they add is the
    ``share`` of them that backward loses, or what of them outlasts it; ``after_backward`` (the framework
    reduces once the backward is done, ``grad_reduce after-backward``): all of them."""
    if after_backward:
        return reduce_s
    return max(0.0, beside_seconds(backward_s, reduce_s, share) - backward_s)


def gathered_before(forward_s: float, gather_s: float, share: float, overlapped: bool) -> float:
    """The seconds ZeRO-1/2's param all-gathers after the update (``gather_s``) add to the step: all of them
    (exposed, DeepSpeed's ZeRO-1/2 and Megatron-LM's distributed optimizer by default), or, ``overlapped``
    (``param_gather overlapped``: Megatron-LM's ``--overlap-param-gather``, whose forward pre-hooks wait for
    each bucket's gather as the next step's first forward reaches its params), what of them outlasts that
    forward (``forward_s``) or the ``share`` of them it loses, as the gradient reductions beside the last
    backward (:func:`reduced_after`)."""
    return reduced_after(forward_s, gather_s, share, after_backward=not overlapped)
