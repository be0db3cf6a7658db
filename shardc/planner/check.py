"""Replay a plan and check it: the invariants a planned step must keep.

This is the planner's own referee, and the property tests' oracle: every step
reads only values its phase holds, every collective does exactly what its op
says to its source (the moves, at the minor end of a dim), every
local einsum is valid (the four cases of sharded matmul), volumes are the bytes
of the cost model, and each phase ends holding what it promised: the declared
results in the forward, every gradient in its primal's sharding in the backward.

>>> import shardc
>>> from shardc.planner.check import check_plan
>>> check_plan(shardc.plan(shardc.parse("mesh X=2\\nC[I, K] = A[I, J_X] · B[J_X, K]\\n")))
[]
"""

from __future__ import annotations

from shardc.collectives import volume_elements
from shardc.errors import InternalError
from shardc.ir.localops import Add, Route, Row, Vocab
from shardc.ir.plan import Monomial, Op, Plan, Step, unfused
from shardc.ir.spec import TensorRef
from shardc.ops.route import check_route_step
from shardc.ops.row_plans import check_row_step
from shardc.sharding.layout import Value
from shardc.timing import plan_time

__all__ = ["check_plan", "require_sound", "replay_step", "comm_time", "step_time"]


def step_time(plan: Plan) -> float:
    """The step time of ``plan`` on its chip: what the planner minimises and ``shardc cost`` reports."""
    return plan_time(plan).step_s


def comm_time(plan: Plan) -> float:
    """Seconds of communication of both phases on the plan's chip (the table's model)."""
    return plan_time(plan).comm_s


def _local_bytes(plan: Plan, ref: TensorRef, step: Step | None = None) -> Monomial:
    """A device's bytes of ``ref``, as ``step`` moves it where given (:meth:`Plan.moved_nbytes`: a param's
    gather type)."""
    den = tuple(a for d in ref.dims for a in d.axes)
    nbytes = plan.moved_nbytes(step) if step is not None else plan.nbytes(ref.name)
    return Monomial.of(nbytes, num=ref.indices, den=den)


def _drop_suffix(ref: TensorRef, dim: int, axes: tuple[str, ...]) -> TensorRef | None:
    have = ref.dims[dim].axes
    if len(axes) == 0 or have[len(have) - len(axes):] != axes:
        return None
    return _with_dim(ref, dim, have[: len(have) - len(axes)])


def _drop_suffixes(ref: TensorRef, dst: TensorRef, axes: tuple[str, ...]) -> TensorRef | None:
    """An AllGather of several dims: each loses a suffix, the suffixes in dim order are ``axes``."""
    if len(dst.dims) != len(ref.dims):
        return None
    removed: list[str] = []
    out = ref
    for d, (have, want) in enumerate(zip(ref.layout, dst.layout, strict=True)):
        if have[:len(want)] != want:
            return None
        removed += have[len(want):]
        out = _with_dim(out, d, want)
    if tuple(removed) != axes or sum(1 for h, w in zip(ref.layout, dst.layout, strict=True) if h != w) < 2:
        return None
    return out


def _with_dim(ref: TensorRef, dim: int, axes: tuple[str, ...]) -> TensorRef:
    dims = list(ref.dims)
    dims[dim] = type(dims[dim])(dims[dim].name, axes)
    return TensorRef(ref.name, tuple(dims), ref.unreduced)


def _with_unreduced(ref: TensorRef, unreduced: tuple[str, ...]) -> TensorRef:
    return TensorRef(ref.name, ref.dims, tuple(sorted(unreduced)))


def replay_step(plan: Plan, step: Step) -> tuple[TensorRef | None, Monomial | None]:
    """What a collective or slice makes of its source, and its volume; None if invalid."""
    src, dim, axes = step.src, step.dim, step.axes
    if src is not None and step.op is Op.ALL_GATHER and dim is None:
        out = _drop_suffixes(TensorRef(step.tensor, src.dims, src.unreduced), step.dst, axes)
        return out, None if out is None else _local_bytes(plan, out, step)
    if src is None or dim is None and step.op is not Op.ALL_REDUCE:
        return None, None
    renamed = TensorRef(step.tensor, src.dims, src.unreduced)
    out = _replayed(renamed, step)
    if out is None or not step.is_collective:
        return out, None
    group = Monomial.of(1, num=axes)
    return out, volume_elements(step.op, _local_bytes(plan, src, step), _local_bytes(plan, out, step), group)


def _replayed(renamed: TensorRef, step: Step) -> TensorRef | None:
    """What the step makes of its (renamed) source, or None if the move is invalid."""
    src, dim, axes = renamed, step.dim, step.axes
    if step.op is Op.ALL_GATHER and dim is not None:
        return _drop_suffix(renamed, dim, axes)
    if step.op is Op.SLICE and dim is not None:
        used = {a for d in src.dims for a in d.axes} | set(src.unreduced)
        if set(axes) & used:
            return None
        return _with_dim(renamed, dim, src.dims[dim].axes + axes)
    if step.op in (Op.ALL_REDUCE, Op.REDUCE_SCATTER):
        if not set(axes) <= set(src.unreduced) or not axes:
            return None
        out = _with_unreduced(renamed, tuple(a for a in src.unreduced if a not in axes))
        if step.op is Op.REDUCE_SCATTER and dim is not None:
            out = _with_dim(out, dim, out.dims[dim].axes + axes)
        return out
    if step.op is Op.ALL_TO_ALL and dim is not None and step.dim2 is not None:
        dropped = _drop_suffix(renamed, step.dim2, axes)
        if dropped is None or dim == step.dim2:
            return None
        return _with_dim(dropped, dim, dropped.dims[dim].axes + axes)
    return None


def check_einsum(step: Step) -> str | None:
    """Why a local einsum is invalid, or None (the four cases of sharded matmul)."""
    ops, out = step.operands, step.dst
    where = [{a: i for d in op.dims for a in d.axes for i in [d.name]} for op in ops]
    result_axes = {d.name: d.axes for d in out.dims}
    contracted: set[str] = set()
    for op in ops:
        for d in op.dims:
            if d.name not in result_axes:
                others = [o for o in ops if o is not op]
                for other in others:
                    match = [x.axes for x in other.dims if x.name == d.name]
                    if match and match[0] != d.axes:
                        return f"contracted index {d.name} sharded differently in the operands"
                contracted |= set(d.axes)
            elif result_axes[d.name] != d.axes:
                return f"index {d.name} is {d.axes} in {op.name} but {result_axes[d.name]} in the result"
    if len(ops) == 2:
        for axis, index in where[0].items():
            found = where[1].get(axis)
            if found is not None and found != index:
                return f"axis {axis} shards {index} in one operand and {found} in the other"
        for op in ops:
            for a in op.unreduced:
                if any(a in o.unreduced for o in ops if o is not op):
                    return f"both operands are partial sums over {a}"
    passed = {a for op in ops for a in op.unreduced}
    if set(out.unreduced) != contracted | passed:
        return f"result unreduced over {out.unreduced}, expected {sorted(contracted | passed)}"
    return None


def _norm(ref: TensorRef) -> TensorRef:
    """A value's identity: partial-sum axes are a set (``{U_YX}`` is ``{U_XY}``)."""
    return _with_unreduced(ref, ref.unreduced)


def _held_at_start(plan: Plan) -> tuple[set[TensorRef], set[TensorRef]]:
    forward = {_norm(i.ref) for i in plan.tensors if i.role in ("param", "input")}
    backward = {_norm(r) for r in [*(i.ref for i in plan.tensors), *plan.residuals, *plan.cotangents]}
    backward |= {_norm(s.dst) for s in plan.recomputed}  # forward steps (checked there), run again first
    return forward, backward


def check_plan(plan: Plan) -> list[str]:
    """Every problem found replaying ``plan`` (empty when the plan is sound)."""
    problems: list[str] = []
    fwd_held, bwd_held = _held_at_start(plan)
    for phase, steps, held in (("forward", plan.forward, fwd_held), ("backward", plan.backward, bwd_held)):
        for k, step in enumerate(steps, 1):
            for part in unfused(step):  # a collective matmul: its collective and its einsum, each checked
                problems += [f"{phase} {k}: {p}" for p in _check_step(plan, part, held)]
                held.add(_norm(part.dst))
        if phase == "forward":
            declared = [i.ref for i in plan.tensors if i.role == "activation"]
            problems += [f"forward never makes {r}" for r in declared if _norm(r) not in held]
    made = {_norm(s.dst) for s in plan.backward}  # once: the check stays linear in the plan's steps
    problems += [f"backward never makes {grad}" for grad in plan.grads if _norm(grad) not in made]
    return problems + _check_optimizer(plan, bwd_held)


def _check_optimizer(plan: Plan, held: set[TensorRef]) -> list[str]:
    """ZeRO-1/2's optimizer phase reads what the backward left and ends with every param as declared.

    An updated shard may come back in several collectives (over a node's axis, then across
    nodes: hierarchical, cheaper for a small param where the latency of one ring over every
    device dominates), so only where each updated param ends is checked."""
    problems: list[str] = []
    updated: set[str] = set()
    gathered: set[str] = set()  # updated params a collective moved since their update
    declared: dict[str, TensorRef] = {}
    for info in plan.tensors:
        declared.setdefault(info.name, info.ref)  # the first, as Plan.tensor finds it
    last: dict[str, TensorRef] = {}  # each tensor's last value the phase made
    for k, step in enumerate(plan.optimizer, 1):
        problems += [f"optimizer {k}: {p}" for p in _check_step(plan, step, held)]
        held.add(_norm(step.dst))
        last[step.tensor] = step.dst
        if step.op is Op.ELEMENTWISE:
            updated.add(step.tensor)
            gathered.discard(step.tensor)
        elif step.tensor in updated and step.is_collective:
            gathered.add(step.tensor)
    for name in sorted(updated):
        if name not in gathered:
            problems.append(f"optimizer: the updated {name} is never gathered back")
        elif _norm(last[name]) != _norm(declared[name]):
            problems.append(f"optimizer: {name} ends as {last[name]}, declared {declared[name]}")
    return problems


def require_sound(plan: Plan) -> None:
    """Raise :class:`InternalError` listing every broken invariant of ``plan`` (none: return)."""
    problems = check_plan(plan)
    if problems:
        listed = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise InternalError(f"internal error: the planner made a broken plan ({listed})",
                            fix="this is a shardc bug: please report the spec; `shardc plan --explain` "
                                "shows the choices that led to it")


def _check_step(plan: Plan, step: Step, held: set[TensorRef]) -> list[str]:
    reads = list(step.operands + step.shapes) + ([step.src] if step.src is not None else [])
    problems = [f"reads {r}, which is not held" for r in reads if _norm(r) not in held]
    if step.op in (Op.EINSUM, Op.COPY):
        why = check_einsum(step)
        return problems + ([f"invalid local einsum {step.dst}: {why}"] if why else [])
    if step.op is Op.ELEMENTWISE and isinstance(step.fn, Route):
        return problems + check_route_step(step)
    if step.op is Op.ELEMENTWISE and isinstance(step.fn, (Row, Vocab)):
        return problems + check_row_step(step)
    if step.op is Op.ELEMENTWISE:
        if any(Value.of(o).layout != Value.of(step.dst).layout and o.indices == step.dst.indices
               for o in step.operands):
            problems.append(f"elementwise {step.fn} changes the layout of {step.dst}")
        if isinstance(step.fn, Add):
            problems += _check_sum(step)
        return problems
    out, volume = replay_step(plan, step)
    if out is None or out != _norm(step.dst):
        problems.append(f"{step.op.title} of {step.src} over {step.axes} does not make {step.dst}")
    elif volume != step.volume:
        problems.append(f"{step.op.title} {step.dst}: volume {step.volume}, expected {volume}")
    return problems


def _check_sum(step: Step) -> list[str]:
    """A local sum: each term laid out as the result on its indices, partial over no axis the result is not."""
    axes = {d.name: d.axes for d in step.dst.dims}
    problems = []
    for term in step.operands:
        if any(axes.get(d.name) != d.axes for d in term.dims):
            problems.append(f"term {term} of {step.dst} is not laid out as the sum")
        if not set(term.unreduced) <= set(step.dst.unreduced):
            problems.append(f"term {term} of {step.dst} is partial over an axis the sum is not")
    return problems
