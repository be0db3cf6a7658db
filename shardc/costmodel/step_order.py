"""When a phase's values live: the step that makes each, the last that reads it, and the order a backend
runs the steps that read only the phase's arguments in (:func:`shardc.costmodel.phase_memory.phase_memory`)."""

from __future__ import annotations

from collections.abc import Collection

from shardc.collectives import Op
from shardc.fusion import is_further, is_product
from shardc.ir.localops import ALIAS
from shardc.ir.plan import Step
from shardc.ir.spec import TensorRef

__all__ = ["lifetimes", "made_at", "prelude", "combined"]


def lifetimes(steps: tuple[Step, ...], products_again: bool = False
               ) -> tuple[dict[TensorRef, list[Step]], dict[TensorRef, int]]:
    """Per value the steps that read it, and the last step it is alive at.

    An AllReduce the plan issues ahead of time (off the critical path) runs after the phase's last
    step, as XLA defers such collectives and combines them into one (its all-reduce combiner): the
    partial sums live to the end.  A ReduceScatter runs at its step, as soon as its partial sums are
    made: its point is to free the unsharded gradient (ZeRO stage 2, Rajbhandari et al. 2020, reduces
    each bucket as soon as its gradients are ready; PyTorch FSDP reduce-scatters each unit's in its
    backward), and a chain that gathers its result again (a gradient sliced, reduce-scattered and
    gathered) runs through at once.  With ``products_again``, a product (one multiply an element) read
    by several steps is made once for its first reader and again inside the fusion of each later one,
    as XLA's instruction fusion duplicates a cheap producer into its consumers: its operands live to its
    last reader (``vocab_parallel.shard``'s backward at 16x its sizes: dN, all-reduced, alive to the
    fusion making dE, which multiplies it by W_norm again, beside dN · W_norm and the normalised E)."""
    readers: dict[TensorRef, list[Step]] = {}
    last: dict[TensorRef, int] = {}
    for k, step in enumerate(steps):
        for ref in step.reads:
            readers.setdefault(ref, []).append(step)
            last[ref] = k
        if step.ahead and step.src is not None and step.op is Op.ALL_REDUCE:
            last[step.src] = len(steps)
    for step in steps if products_again else ():
        if is_product(step) and len(readers.get(step.dst, [])) > 1:
            for ref in step.reads:  # each reader's fusion multiplies them again
                last[ref] = max(last.get(ref, 0), last[step.dst])
    return readers, last


def made_at(steps: tuple[Step, ...]) -> list[int]:
    """Per step the step its value is written at: its own, but a kernel's further results (the
    logsumexp beside the output; dK and dV beside dQ: :func:`shardc.fusion.is_further`) are written by the
    kernel, at its step."""
    out: list[int] = []
    for k, step in enumerate(steps):
        out.append(out[-1] if k > 0 and is_further(step) else k)
    return out


def prelude(steps: tuple[Step, ...], args: set[TensorRef]) -> dict[int, float]:
    """Per computation that reads only the phase's arguments ``args`` (a weight gradient of a saved activation
    and a cotangent, a dot of two residuals), the moment it runs at where the backend runs those first
    (:attr:`~shardc.costmodel.phase_memory.Buffers.arguments_first`): after the copies of the arguments, made
    at 0, and before step 1, one after another in the program's order, so that a copy read only by such
    computations dies at its last reader, before the next is made, as a scheduler running them in sequence
    frees it (``moe_layer.shard``'s backward at verify's sizes: Comb, copied for dEx's dot, dies there, and
    dComb = dOut · Ex, made next, takes its bytes).  A collective (a prefetched gather) or a collective
    matmul reading only arguments is issued at the start, as before."""
    first = [k for k, s in enumerate(steps) if not s.is_collective and s.collective is None and s.fn != ALIAS
             and all(ref in args for ref in s.reads)]
    return {k: (i + 1) / (len(first) + 1) for i, k in enumerate(first)}


def combined(steps: tuple[Step, ...], last: dict[TensorRef, int], outs: Collection[TensorRef] = ()) -> list[int]:
    """Per AllReduce that XLA's all-reduce combiner makes of those run after the phase's last step (:func:`lifetimes`)
    over the same devices, how many it combines, where two or more: one AllReduce of a tuple of their partial
    sums, whose result is a tuple, a table of a pointer a value beside the values, alive while it runs (dp.shard's
    backward at verify's sizes: dW_in's and dW_out's sums combined, their 16-byte table a temporary).  Where
    its values are all the phase returns, ``outs``, that tuple is the phase's own, an output: the program
    returns the AllReduce's result as it is (vocab_parallel.shard's backward: dW_emb, dW_norm, dW_lm)."""
    groups: dict[tuple[str, ...], list[TensorRef]] = {}
    for step in steps:
        if step.op is Op.ALL_REDUCE and step.src is not None and last.get(step.src) == len(steps):
            groups.setdefault(tuple(step.axes), []).append(step.dst)
    return [len(refs) for refs in groups.values() if len(refs) > 1 and set(refs) != set(outs)]
