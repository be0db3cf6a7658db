"""Where the communication of attention's all-gather and Ulysses forms hides under the kernel.

Context parallelism shards the sequence over mesh axes.  Its ring form sends K and V around while the
kernel computes, and its threshold is the ring step's (:func:`shardc.steptime.ring_time`).  The other
two forms move whole arrays before and after the kernel: the all-gather form (LLaMA 3's, Dubey et al.
2024, section 3.3.2) gathers K and V along the keys T and reduce-scatters dK and dV back; Ulysses (Jacobs
et al. 2023) moves the sequence's axes onto the heads with an AllToAll of Q, K and V (dO in the backward)
and back with one of the output (dQ, dK, dV).  Either way the kernel's compute grows as the square of
the tokens a device and the moves linearly, so at ``c`` tokens a device the moves take as long as the
kernel from ``c * moves / kernel`` tokens a device on (:func:`shardc.steptime.hidden_from`): the book's
threshold for them, in the ring's terms.  :func:`with_thresholds` sets it on each kernel's row of a phase
(``hidden_from``, beside the moves' time ``cp_comm_s`` and the form, ``context_parallel``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from shardc.ir.localops import Attention
from shardc.ir.plan import Op, Step
from shardc.spec.attention_call import roles
from shardc.step_cost import StepCost
from shardc.steptime import hidden_from

__all__ = ["with_thresholds", "context_moves"]


def with_thresholds(steps: Sequence[Step], rows: Sequence[StepCost], sizes: Mapping[str, int]) -> tuple[StepCost, ...]:
    """``rows`` (one a step of ``steps``, a phase) with each attention kernel's row that has context-parallel
    moves (:func:`context_moves`) carrying them: their form, their time and the tokens a device from which
    the kernel's compute takes longer than they do."""
    out = list(rows)
    for k, step in enumerate(steps):
        moves = context_moves(steps, k)
        if not moves:
            continue
        fn = step.fn
        assert isinstance(fn, Attention)
        devices = math.prod(sizes[a] for a in dict.fromkeys(a for j in moves for a in steps[j].axes))
        comm = math.fsum(rows[j].comm_s for j in moves)
        form = "all-gather, balanced" if fn.zigzag else "all-gather"  # zig-zag chunks: shardc.ops.balanced_gather
        form = "Ulysses" if any(steps[j].op is Op.ALL_TO_ALL for j in moves) else form
        out[k] = replace(rows[k], context_parallel=form, cp_comm_s=comm,
                         hidden_from=hidden_from(sizes[fn.key] / devices, comm, rows[k].compute_s))
    return tuple(out)


def context_moves(steps: Sequence[Step], k: int) -> list[int]:
    """The collectives of a phase that move the sequence for the attention kernel at ``k`` (none for any
    other step, or a ring's): into it, a gather of K or V along the keys, or an AllToAll that gathers the
    sequence (the query position or the keys) of one of its operands; out of it and its further results
    (the logsumexp, dK, dV), a ReduceScatter onto the keys or an AllToAll that shards the sequence again."""
    kernel = steps[k]
    fn = kernel.fn
    if not isinstance(fn, Attention) or not fn.kernel or fn.ring:
        return []
    q, kk, v = kernel.operands[:3]
    seq = {fn.key, roles(q.indices, kk.indices, v.indices, fn.key).query}
    made = {s.dst for s in steps if isinstance(s.fn, Attention) and s.operands == kernel.operands}

    def moves(s: Step) -> bool:
        if not s.is_collective or s.dim is None:
            return False
        if s.dst in kernel.operands and s.op is Op.ALL_GATHER:
            return s.dst.dims[s.dim].name == fn.key
        if s.dst in kernel.operands and s.op is Op.ALL_TO_ALL and s.dim2 is not None:
            return s.dst.dims[s.dim2].name in seq
        if s.src in made and s.op is Op.REDUCE_SCATTER:
            return s.dst.dims[s.dim].name == fn.key
        return s.src in made and s.op is Op.ALL_TO_ALL and s.dst.dims[s.dim].name in seq

    return [j for j, s in enumerate(steps) if moves(s)]
