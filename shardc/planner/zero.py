"""ZeRO (Rajbhandari et al. 2020): the training state sharded over data-parallel axes.

``zero STAGE over X`` (one or more mesh axes) shards, per param not already
sharded over X, the optimizer state (stage 1), and the gradient (stage 2), and
the param itself (stage 3) over X.  Where a param goes (:func:`zero_layout`): X
is appended to its first dim no axis shards yet, else to the first sharded dim
(with sizes, the first such dim its devices divide, else the first at least as large, padded as any
uneven dim is, as FSDP and DeepSpeed pad their flat shards); a param a spec already
declares sharded over X is left as it is (its state is sharded with it).

* Stage 3 is FSDP: :func:`zero3_spec` rewrites each param's declared sharding
  (every reference), and the planner gathers it before use and reduce-scatters
  its gradient, as for any sharded param.
* Stages 1 and 2 leave the params replicated over X, and add a third phase after
  the backward, the optimizer step (:func:`plan_optimizer`): the update of each
  param's ZeRO shard (a local step) and the AllGather of the updated param.  At
  stage 1 the backward leaves each such gradient partial over X (instead of
  all-reducing it; every device holds a whole gradient, 2Ψ), and the optimizer
  phase reduce-scatters it onto the shard first.  At stage 2 the backward makes
  the gradient on the shard (its reduction is a ReduceScatter as it is made, as
  DeepSpeed's stage 2 overlaps it with the backward), so no device holds the
  whole gradient (2Ψ/N).  Either way the ReduceScatter and the AllGather are the
  bytes of the one AllReduce they replace (the paper's "same communication volume
  as data parallelism", section 7).
"""

from __future__ import annotations

import math
from dataclasses import replace

from shardc.errors import ShardcError
from shardc.ir.localops import UPDATE
from shardc.ir.plan import Op, Step
from shardc.ir.spec import Call, Contract, Dim, Expr, Spec, TensorRef, Zero
from shardc.sharding.layout import Layout, Value
from shardc.sharding.phase import Phase
from shardc.sharding.search import reshard
from shardc.spec.walk import leaves

__all__ = ["zero_axes", "zero_layout", "zero3_spec", "zero_params", "plan_optimizer"]



def zero_axes(spec: Spec) -> tuple[str, ...]:
    """The ZeRO axes of size > 1, as written (none without a ``zero`` line)."""
    if spec.zero is None:
        return ()
    return tuple(a for a in spec.zero.axes if spec.mesh.size(a) > 1)


def zero_layout(ref: TensorRef, axes: tuple[str, ...], spec: Spec) -> Layout | None:
    """The layout of ``ref``'s ZeRO shard over ``axes``; None if ``ref`` is sharded over all of them."""
    used = {a for d in ref.dims for a in d.axes} | set(ref.unreduced)
    extra = tuple(a for a in axes if a not in used)
    if not extra:
        return None
    devices = math.prod(spec.mesh.size(a) for a in extra)
    sizes = spec.sizes

    def share(dim: Dim) -> int:  # the devices ``dim`` would be cut over, its own axes' and the ZeRO axes'
        return devices * math.prod(spec.mesh.size(a) for a in dim.axes)

    def fits(dim: Dim) -> bool:
        return dim.name not in sizes or sizes[dim.name] % share(dim) == 0

    def pads(dim: Dim) -> bool:  # uneven, padded as any uneven dim is (ceil(size / devices) a device)
        return dim.name not in sizes or sizes[dim.name] >= share(dim)

    def waste(dim: Dim) -> float:  # the share of the padded dim that is padding (the least wins, first on a tie)
        return -sizes[dim.name] % share(dim) / sizes[dim.name] if dim.name in sizes else 0.0

    order = [d for d in ref.dims if not d.axes] + [d for d in ref.dims if d.axes]
    # an even shard where a dim allows it; else a padded one, as FSDP and DeepSpeed pad their flat
    # shards to a multiple of the ranks (FSDP on 124 nodes shards a 12288-wide weight so)
    padded = [d for d in order if pads(d)]
    chosen = next((d for d in order if fits(d)), None) or (min(padded, key=waste) if padded else None)
    if chosen is None:
        span = spec.zero.span if spec.zero is not None else None
        raise ShardcError(f"`{spec.zero}`: every dim of {ref} is smaller than its devices over "
                          f"{', '.join(extra)} ({devices} devices)", span,
                          fix=f"shard {ref.name} over those axes yourself, or use fewer ZeRO axes")
    return tuple(d.axes + extra if d is chosen else d.axes for d in ref.dims)


def zero_params(spec: Spec, params: frozenset[str], declared: dict[str, TensorRef]) -> dict[str, Layout]:
    """Each param ZeRO shards, with its shard's layout (stages 1 and 2: the optimizer phase's)."""
    axes = zero_axes(spec)
    out: dict[str, Layout] = {}
    for name in sorted(params, key=list(declared).index):
        layout = zero_layout(declared[name], axes, spec) if axes else None
        if layout is not None:
            out[name] = layout
    return out


def zero3_spec(spec: Spec, params: frozenset[str]) -> tuple[Spec, tuple[str, ...]]:
    """``spec`` with each param in its ZeRO-3 shard (every reference), and a note per param moved."""
    zero: Zero | None = spec.zero
    if zero is None or zero.stage != 3 or not zero_axes(spec):
        return spec, ()
    new: dict[str, TensorRef] = {}
    for statement in spec.statements:
        for ref in leaves(statement.expr):
            if ref.name in params and ref.name not in new:
                layout = zero_layout(ref, zero_axes(spec), spec)
                if layout is not None:
                    dims = tuple(replace(d, axes=axes) for d, axes in zip(ref.dims, layout, strict=True))
                    new[ref.name] = replace(ref, dims=dims)
    if not new:
        return spec, ()
    statements = tuple(replace(s, expr=_rewrite(s.expr, new)) for s in spec.statements)
    notes = tuple(f"`{zero}` shards {new[n].name} as {new[n]} (FSDP: gathered before use)" for n in new)
    return replace(spec, statements=statements), notes


def _rewrite(expr: Expr, new: dict[str, TensorRef]) -> Expr:
    """``expr`` with every reference to a tensor of ``new`` replaced by its new sharding."""
    if isinstance(expr, TensorRef):
        return new.get(expr.name, expr)
    if isinstance(expr, Call):
        return replace(expr, arg=_rewrite(expr.arg, new), more=tuple(_rewrite(m, new) for m in expr.more))
    if isinstance(expr, Contract):
        return replace(expr, operands=tuple(_rewrite(o, new) for o in expr.operands))
    return replace(expr, terms=tuple(_rewrite(t, new) for t in expr.terms))


def plan_optimizer(phase: Phase, shards: dict[str, Layout], declared: dict[str, TensorRef],
                   grads: dict[str, TensorRef]) -> tuple[Step, ...]:
    """The optimizer phase of ZeRO-1/2: per param, its gradient onto the shard, the update, AllGather.

    ``grads`` maps each param to its gradient as the backward left it: partial over
    the ZeRO axes it was summed over (stage 1: a ReduceScatter here), or on the
    shard already (stage 2: nothing to move).  Each move is the cheapest reshard the
    planner's search finds (:func:`shardc.sharding.search.reshard`).
    """
    for param, layout in shards.items():
        grad, full = grads[param], Value.of(declared[param])
        shard = Value(layout, ())
        g_idx, p_idx = grad.indices, declared[param].indices
        phase.hold(grad.name, Value.of(grad))
        phase.moves(grad.name, reshard(phase.ctx, grad.name, g_idx, (Value.of(grad),), shard)[1],
                    note="ZeRO: the gradient onto the optimizer state's shard")
        phase.hold(param, full)
        phase.moves(param, reshard(phase.ctx, param, p_idx, (full,), shard)[1])
        own = phase.ref(param, shard)
        phase.emit(Step(Op.ELEMENTWISE, param, own, operands=(own, phase.ref(grad.name, shard)), fn=UPDATE,
                        note="the optimizer step on this device's shard"))
        phase.moves(param, reshard(phase.ctx, param, p_idx, (shard,), full)[1],
                    note="ZeRO: the updated param to every device")
    return tuple(phase.steps)
