"""The sequence held in zig-zag order across the plan, where no step looks at positions but attention's.

A causal ring attention kernel balances its load in zig-zag chunks (:mod:`shardc.ops.ring_attention`: the
sequence cut into 2n chunks, device i computing chunks i and 2n - 1 - i).  Taking its blocks contiguous, as
the other steps hold them, it reorders them to zig-zag and back at every call: two sends of half a block an
array before and after the ring, exposed, every layer, forward and backward.  The all-gather form balances
only in that order (:mod:`shardc.ops.balanced_gather`: each device's queries its two chunks, K and V gathered
as held), so it is weighed only where the plan holds it.  Megatron-LM's context parallelism and LLaMA 3's
(Dubey et al. 2024, section 3.3.2) load the tokens in that order instead: the data loader hands device i
chunks i and 2n - 1 - i, and every step that does not look at positions (matmuls, elementwise maps, norms,
the embedding and the loss, the collectives moving blocks) runs on them as they are.  :func:`hold_zigzag`
does that where it is sound: every zig-zag kernel of the plan balances over one set of mesh axes (a ring's;
the all-gather form's, its queries'), and no other step reading or making a value with one of their sequence
dims depends on positions (a causal mask, a dropout mask drawn by position, a rotary embedding, attention
with a causal mask in any other form, a router whose capacity goes by token order).  The lowered program then
permutes each array with such a dim into that order as it enters a phase and back as it leaves
(:func:`sequence_order` says which dims and how many chunks), off the device program, as the data loader does;
the kernels do not reorder.

A pipelined plan holds the order across its stages the same way, where every stage's steps allow it: the
data its first stage reads (the tokens) and its last (the targets) enter permuted, once a step, the sends
between stages carry the activations and their cotangents in that order, and what leaves the pipeline
(a block alone's outputs, its input's gradient) is put back (:mod:`shardc.lowering.pipeline_runtime`).  A
param with one of the sequence dims (a learned position embedding) keeps a pipeline in its own order: the
program takes its params stacked by layer and stage as they are.
"""

from __future__ import annotations

import math
from dataclasses import replace

from shardc.ir.localops import MASK_OPS, Attention, Dispatch, Rotary, Route
from shardc.ir.plan import Plan, Step

__all__ = ["balances", "hold_zigzag", "holds", "may_hold", "order_axes", "sequence_order"]


def hold_zigzag(plan: Plan) -> Plan:
    """``plan`` with its zig-zag kernels marked ``held`` where the whole plan can hold the sequence in their
    order (see the module docstring), and its choices (``--explain``) priced so; else ``plan`` as it is."""
    phases = (plan.forward, plan.recomputed, plan.backward, plan.optimizer)
    kernels = [s for steps in phases for s in steps if isinstance(s.fn, Attention) and s.fn.zigzag]
    orders = {order_axes(s) for s in kernels}
    if len(orders) != 1:
        return plan
    dims = _sequence_dims(kernels)
    (order,) = orders
    if any(_positional(s, dims, order) for steps in phases for s in steps):
        return plan
    if plan.spec.mesh.pipeline_axis is not None and dims & plan.model_dims:
        return plan  # a pipeline's params enter as they are (see the module docstring)

    def held(steps: tuple[Step, ...]) -> tuple[Step, ...]:
        return tuple(replace(s, fn=replace(s.fn, held=True)) if isinstance(s.fn, Attention) and s.fn.zigzag else s
                     for s in steps)

    # --explain's prices of the attention forms as this plan runs them: a zig-zag ring without its reordering
    return replace(plan, forward=held(plan.forward), recomputed=held(plan.recomputed), backward=held(plan.backward),
                   choices=tuple(c.held or c for c in plan.choices))


def order_axes(step: Step) -> tuple[str, ...]:
    """The mesh axes an attention kernel balances its zig-zag chunks over: Ulysses' those it moved off the
    sequence, a ring's, else (the all-gather form) those sharding its queries' positions."""
    fn = step.fn
    assert isinstance(fn, Attention)
    if fn.order:  # Ulysses: the axes it moved off the sequence
        return fn.order
    if fn.ring or fn.query is None:
        return fn.ring
    q = step.operands[0]
    return q.dims[q.indices.index(fn.query)].axes


def holds(plan: Plan) -> bool:
    """Whether ``plan`` holds the sequence in zig-zag order (its zig-zag kernels marked ``held``)."""
    return any(isinstance(s.fn, Attention) and s.fn.held for s in plan.forward)


def balances(plan: Plan) -> bool:
    """Whether a held ``plan`` has a kernel that balances its causal load by the order (a zig-zag ring, the
    all-gather form balanced); a Ulysses kernel holds whole sequences, as fast in either order."""
    return any(isinstance(s.fn, Attention) and s.fn.held and not s.fn.order for s in plan.forward)


def may_hold(plan: Plan) -> bool:
    """Whether a plan of ``plan``'s spec might hold the sequence in zig-zag order, its attention forms priced
    so: a causal attention kernel whose query or key positions are sharded (context parallelism, where a
    zig-zag ring is one of the forms); pipelined or not.  ``plan``'s forms were weighed with the ring's
    reordering priced at every call and without the all-gather form balanced, which only that order allows,
    even where it came to hold the order."""
    if not plan.spec.dims:
        return False
    declared = {info.name: info.ref for info in plan.tensors}  # as the spec shards them, whatever form ran
    for s in plan.forward:
        fn = s.fn
        if isinstance(fn, Attention) and fn.query is not None and fn.part == "out":
            refs = [declared[r.name] for r in (*s.operands, s.dst) if r.name in declared]
            if any(d.axes for ref in refs for d in ref.dims if d.name in (fn.query, fn.key)):
                return True
    return False


def _sequence_dims(kernels: list[Step]) -> frozenset[str]:
    """The key and query dims of attention kernels."""
    fns = [s.fn for s in kernels if isinstance(s.fn, Attention)]
    return frozenset(name for fn in fns for name in (fn.key, fn.query) if name is not None)


def _positional(step: Step, dims: frozenset[str], order: tuple[str, ...]) -> bool:
    """Whether ``step`` reads or makes a value with one of ``dims`` and depends on its positions: a mask, a
    router, a rotary embedding, or attention with a causal mask other than a zig-zag kernel balanced over ``order``."""
    refs = (step.dst, *step.operands, *step.shapes, *((step.src,) if step.src is not None else ()))
    if not any(d.name in dims for ref in refs for d in ref.dims):
        return False
    fn = step.fn
    if isinstance(fn, (*MASK_OPS, Rotary, Route, Dispatch)):
        return True
    return isinstance(fn, Attention) and fn.query is not None and not (fn.zigzag and order_axes(step) == order)


def sequence_order(plan: Plan, sizes: dict[str, int]) -> tuple[frozenset[str], int] | None:
    """The dims ``plan`` holds in zig-zag order and the number of chunks, 2n for n devices balanced (a ring's,
    the all-gather form's queries') at ``sizes``; None where it holds none."""
    kernels = [s for steps in (plan.forward, plan.backward) for s in steps
               if isinstance(s.fn, Attention) and s.fn.held]
    if not kernels:
        return None
    return _sequence_dims(kernels), 2 * math.prod(sizes[a] for a in order_axes(kernels[0]))
