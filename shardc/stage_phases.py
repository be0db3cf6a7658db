"""The phases a training step runs a plan's steps in, and how often it runs each.

The backward needs the forward's results, so the training step takes ``forward +
backward``, plus the optimizer phase of ZeRO-1/2 (``Plan.optimizer``: its
all-gathers, after the backward; ZeRO-1's gradient reduce-scatters, which the plan lists there, run in the
backward as ZeRO-2's do, :func:`zero_reductions`), plus the update.  A pipeline's stage runs its
forward and backward once a microbatch (:func:`microbatched`) and its gradient reductions once a step
on the microbatches' sums (:func:`stage_phases`), issued under the last microbatch's backward, which hides
them as the pipeline's cost hides them (:func:`shardc.overlap.reduced_after`, :func:`reductions_exposed`),
then the optimizer phase.  The forward steps a ``--recompute`` mode runs again (``Plan.recomputed``) are
part of the backward phase.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from shardc.hardware import Hardware
from shardc.ir.localops import Update
from shardc.ir.plan import Plan, Step, TensorInfo
from shardc.ir.spec import Spec
from shardc.overlap import reduced_after
from shardc.phase_time import PhaseTime
from shardc.pipeline.boundary import batch_dim, gradient_reductions
from shardc.spec.stages import pipeline_of

__all__ = ["microbatched", "stage_run", "stage_phases", "zero_reductions", "reductions_exposed"]


def reductions_exposed(reduce: PhaseTime, backward_s: float, hw: Hardware) -> float:
    """What a pipelined stage's gradient reductions, once a step (``reduce``), add to its step: issued under
    the last microbatch's backward (``backward_s``, one microbatch's), on the cores they leave it, or after it
    where the framework reduces then (:func:`shardc.overlap.reduced_after`, as the pipeline's cost adds them);
    under ``grad_reduce after-backward over dcn`` their DCN phase after it, the rest beside it."""
    if not reduce.comm_s:
        return 0.0
    return reduce.deferred_s + reduced_after(backward_s, reduce.seconds - reduce.deferred_s, hw.overlap_share,
                                             hw.reduces_after_backward)


def microbatched(plan: Plan, sizes: Mapping[str, int], book: bool = False) -> tuple[dict[str, int], int]:
    """The sizes a pipelined plan's stage runs at, one microbatch's (the batch dim cut M ways, where M
    divides it), and M, how many times it runs them; a plan without a pipeline: the sizes, once.

    A stage runs its layers on one microbatch at a time (:mod:`shardc.costmodel.pipeline_cost`), so its
    einsums' efficiency, its memory-bound steps and a dim's padding are a microbatch's.  The book's model
    costs the whole batch at once.
    """
    return stage_run(plan.spec, plan.tensors, sizes, book)


def stage_run(spec: Spec, tensors: tuple[TensorInfo, ...], sizes: Mapping[str, int],
              book: bool = False) -> tuple[dict[str, int], int]:
    """:func:`microbatched` of a pipelined ``spec`` whose tensors are ``tensors``, before it is planned: the
    sizes and the count its stage's plan is searched at (:func:`shardc.planner.planner.plan`)."""
    pipe = pipeline_of(spec)
    values = dict(sizes)
    if pipe is None or book:
        return values, 1
    dim = batch_dim(spec, tensors)
    m = pipe.microbatches
    if dim not in values or values[dim] % m or m == 1:
        return values, 1
    values[dim] = values[dim] // m
    return values, m


def stage_phases(plan: Plan, repeats: int) -> tuple[tuple[Step, ...], tuple[Step, ...], tuple[Step, ...]]:
    """A training step's steps in the phases it runs them: the forward and the backward (the forward steps
    it recomputes first), each ``repeats`` times, once a microbatch under a pipeline; then once a step the
    gradient reductions, which a pipeline runs on the microbatches' sums after its backward
    (:func:`shardc.pipeline.boundary.gradient_reductions`), and the optimizer phase (ZeRO-1/2)."""
    once = gradient_reductions(plan) if repeats > 1 else frozenset()
    backward = plan.recomputed + tuple(s for k, s in enumerate(plan.backward) if k not in once)
    moves = zero_reductions(plan)
    reduced = tuple(replace(plan.optimizer[k], ahead=True) for k in sorted(moves))  # issued ahead, bucketed
    rest = tuple(s for k, s in enumerate(plan.optimizer) if k not in moves)
    if repeats > 1:  # with the pipeline's once-a-step reductions, under the last microbatch's backward
        return plan.forward, backward, tuple(plan.backward[k] for k in sorted(once)) + reduced + rest
    return plan.forward, _issued_in(backward, reduced), rest


def zero_reductions(plan: Plan) -> frozenset[int]:
    """The optimizer phase's steps (ZeRO-1's) that move a gradient onto its optimizer-state shard, which the
    step runs in the backward, each issued, in buckets, as the gradient it reduces is made, as ZeRO-2's are:
    DeepSpeed's stages 1 and 2 share one bucketed reduction path, its backward hooks
    (``runtime/zero/stage_1_and_2.py``, ``create_gradient_handling_hooks`` under ``overlap_comm``; stage 1
    differs only in keeping the whole gradient), and Megatron-LM's distributed optimizer, ZeRO-1 in memory
    (its grad buffer holds every gradient), reduce-scatters its grad buffer's buckets by the same DDP path
    as an all-reduce (``overlap_grad_reduce``); under a pipeline, with its other gradient reductions, under
    the last microbatch's backward (:mod:`shardc.costmodel.stage_optimizer`)."""
    grads = {plan.grad_name(i.name) for i in plan.tensors if i.role == "param"}
    return frozenset(k for k, s in enumerate(plan.optimizer) if s.tensor in grads and not isinstance(s.fn, Update))


def _issued_in(backward: tuple[Step, ...], moves: tuple[Step, ...]) -> tuple[Step, ...]:
    """``backward`` with each of ``moves`` (in order, each reading what the backward or an earlier move
    makes) right after the step that makes what it reads, as the backward's own gradient reductions are;
    under ``grad_reduce after-backward`` the buckets of ahead reductions are exposed
    (:func:`shardc.phase_time.comm_split`)."""
    out = list(backward)
    for step in moves:
        at = max((k for k, s in enumerate(out) if s.dst in step.reads), default=len(out) - 1)
        out.insert(at + 1, step)
    return tuple(out)
