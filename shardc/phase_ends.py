"""The collectives issued ahead that no compute of their phase can hide: those at its two ends.

A collective issued ahead of time (a weight's AllGather, a gradient's ReduceScatter: ``Step.ahead``)
overlaps its phase's compute (:func:`shardc.phase_time.phase_seconds`), but only compute that does not wait on
it and that runs while it can run.  The program issues a weight's gather at the start of the phase at the
earliest and a gradient's reduction once the step that makes the gradient is done, so two are left with
nothing beside them:

- the head: the gathers the phase's first compute step reads (through the steps that only slice or
  rename what they make), which it waits on from the phase's start;
- the tail: the reductions of what the phase's last compute step makes, after it.

In a ``layers`` block the next layer's gathers are issued under this layer's compute (XLA's latency-hiding
scheduler and its collective pipeliner on TPU; PyTorch FSDP's prefetch of the next layer's parameters), so
the head and the tail are exposed once a phase, not once a layer.  (MaxText's and PyTorch FSDP's traces
show the same: the first layer's all-gather and the last reduce-scatter of a step run with no compute
beside them.)
"""

from __future__ import annotations

from collections.abc import Sequence

from shardc.ir.plan import Step

__all__ = ["exposed_ends"]


def exposed_ends(steps: Sequence[Step], busy_s: Sequence[float], comm_s: Sequence[float]) -> float:
    """Seconds of a phase's collectives issued ahead that no compute hides, at its head and its tail
    (``busy_s``: each step's compute and memory-bound time; ``comm_s``: each step's collective time), one
    pass of its steps with the links taking the collectives in the plan's order."""
    if not any(b > 0 and not s.is_collective for s, b in zip(steps, busy_s, strict=True)):
        return 0.0  # a phase of collectives alone (ZeRO's optimizer phase): nothing to overlap anyway
    return _head(steps, busy_s, comm_s) + _tail(steps, busy_s, comm_s)


def _head(steps: Sequence[Step], busy_s: Sequence[float], comm_s: Sequence[float]) -> float:
    """How long compute waits on the gathers of what the phase is given (issued from its start, one after
    another): for each step, when the last gather it reads is done, less the compute before it."""
    made: set[object] = set()  # values a compute step of the phase makes, directly or through a slice
    done: dict[object, float] = {}  # a value -> when the gathers it is read through are done
    issued = busy = wait = 0.0
    for step, b, c in zip(steps, busy_s, comm_s, strict=True):
        reads = step.reads
        ready = max((done.get(r, 0.0) for r in reads), default=0.0)
        if step.is_collective and step.ahead and not any(r in made for r in reads):
            issued += c
            done[step.dst] = max(ready, issued)
        elif step.is_collective or b == 0:  # a slice, a rename, an exposed collective: what it reads
            done[step.dst] = ready
            made.update((step.dst,) if any(r in made for r in reads) else ())
        else:
            wait = max(wait, ready - busy)
            busy += b
            made.add(step.dst)
    return wait


def _tail(steps: Sequence[Step], busy_s: Sequence[float], comm_s: Sequence[float]) -> float:
    """How long the reductions of what the phase computes outlast its compute: each issued once the
    compute step that makes its operand is done, the links taking one after another."""
    made: dict[object, float] = {}  # a value the phase computes -> when it is there
    busy = links = 0.0
    for step, b, c in zip(steps, busy_s, comm_s, strict=True):
        reads = step.reads
        ready = max((made[r] for r in reads if r in made), default=None)
        if step.is_collective and step.ahead:
            if ready is not None:
                links = max(links, ready) + c
        elif not step.is_collective and b > 0:
            busy += b
            made[step.dst] = busy
        elif ready is not None:
            made[step.dst] = ready
    return max(0.0, links - busy)
