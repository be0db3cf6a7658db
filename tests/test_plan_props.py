"""Property tests of the planner over random specs and meshes (shardc.testing strategies)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, note, settings
from hypothesis import strategies as st

import shardc
from shardc.ir.plan import Op, Step
from shardc.ir.spec import Add, Call, Contract, Dim, Expr, Mesh, MeshAxis, Spec, TensorRef
from shardc.planner.check import check_plan, replay_step, step_time
from shardc.spec.walk import leaves
from shardc.testing import specs


def _specs(**options: object) -> st.SearchStrategy[Spec]:
    """Random specs, half of them with a route (top-k routing) and statements reading its mask."""
    return st.one_of(specs(**options), specs(routes=True, **options))  # type: ignore[arg-type]


@settings(max_examples=15)
@given(_specs(max_devices=8, max_statements=3), st.sampled_from(["default", "none", "all"]))
def test_every_plan_replays(spec, save) -> None:  # type: ignore[no-untyped-def]
    """Local einsums are valid, moves do what they say, each phase ends where it promised."""
    note(str(spec))
    p = shardc.plan(spec, save=save)
    assert check_plan(p) == []
    handed_on = {i.ref for i in p.tensors} | set(p.residuals) | set(p.grads)
    for steps in (p.forward, p.backward):
        for k, step in enumerate(steps):  # XLA drops a move nothing reads: the plan must not promise one
            if step.is_collective or step.op is Op.SLICE:
                read = any(s.src == step.dst or step.dst in s.operands for s in steps[k + 1:])
                assert read or step.dst in handed_on, step


@settings(max_examples=15)
@given(_specs(max_devices=8, max_statements=3, dims=True))
def test_search_never_costs_more_than_the_rules(spec) -> None:  # type: ignore[no-untyped-def]
    note(str(spec))
    searched = shardc.plan(spec)
    rules = shardc.plan(spec, strategy="rules")
    assert check_plan(rules) == []
    assert step_time(searched) <= step_time(rules) * (1 + 1e-9) + 1e-15  # the objective `shardc cost` reports


def _split(step: Step) -> tuple[Step, Step]:
    """An AllReduce as a ReduceScatter onto dim 0 followed by an AllGather of it."""
    src = step.src
    assert src is not None
    scattered_axes = src.dims[0].axes + step.axes
    rs_dst = TensorRef(step.tensor, (Dim(src.dims[0].name, scattered_axes),) + src.dims[1:],
                       tuple(a for a in src.unreduced if a not in step.axes))
    rs = replace(step, op=Op.REDUCE_SCATTER, dim=0, dst=rs_dst)
    ag = replace(step, op=Op.ALL_GATHER, src=rs_dst, dim=0, dst=step.dst)
    return rs, ag


@settings(max_examples=15)
@given(_specs(max_devices=8, max_statements=3, dims=True))
def test_all_reduce_is_reduce_scatter_plus_all_gather(spec) -> None:  # type: ignore[no-untyped-def]
    p = shardc.plan(spec)
    sizes = p.size_map
    assert sizes is not None
    for step in p.forward + p.backward:
        if step.op is not Op.ALL_REDUCE or not step.dst.dims:
            continue
        rs, ag = _split(step)
        rs_out, rs_volume = replay_step(p, rs)
        ag_out, ag_volume = replay_step(p, ag)
        assert rs_out == rs.dst and ag_out == step.dst
        assert rs_volume is not None and ag_volume is not None and step.volume is not None
        weighted = step.weighted_volume()
        assert weighted is not None
        assert weighted.evaluate(sizes) == rs_volume.evaluate(sizes) + ag_volume.evaluate(sizes)


def _differentiable_reads(expr: Expr) -> set[str]:
    """The tensors ``expr`` reads but through a route's gates (a 0/1 mask has no gradient)."""
    if isinstance(expr, TensorRef):
        return {expr.name}
    if isinstance(expr, Call):
        return set() if expr.func == "route" else set().union(*map(_differentiable_reads, expr.args))
    return set().union(*map(_differentiable_reads, expr.operands if isinstance(expr, Contract) else expr.terms))


def _reach_an_output(spec: Spec) -> set[str]:
    """Tensors some output (a result nothing reads) depends on past no route mask."""
    read = {r.name for s in spec.statements for r in leaves(s.expr)}
    live = {s.result.name for s in spec.statements if s.result.name not in read}
    for statement in reversed(spec.statements):
        if statement.result.name in live:
            live |= _differentiable_reads(statement.expr)
    return live


@settings(max_examples=15)
@given(_specs(max_devices=8, max_statements=3))
def test_gradients_for_every_input_but_const(spec) -> None:  # type: ignore[no-untyped-def]
    p = shardc.plan(spec)
    inputs = {i.name for i in p.tensors if i.role in ("param", "input")} & _reach_an_output(spec)
    names = {g.name for g in p.grads}
    assert names == {p.grad_name(n) for n in inputs - set(spec.const)}
    made = {s.tensor for s in p.backward if s.op in (Op.EINSUM, Op.ELEMENTWISE)}  # gradients and their parts
    assert not (made | {c.name for c in p.cotangents}) & {i.name for i in p.tensors}  # never a user's name
    for grad in p.grads:
        primal = p.tensor(p.primal(grad.name)).ref
        assert grad.dims == primal.dims and grad.unreduced == ()


def _with_unit_axes(spec: Spec, data: st.DataObject) -> Spec:
    """``spec`` on its mesh plus size-1 axes, each written into some references' dims."""
    names = [n for n in ("U1", "U2") if n not in spec.mesh.names]
    axes = list(spec.mesh.axes)
    for name in names:
        axes.insert(data.draw(st.integers(0, len(axes))), MeshAxis(name, 1))

    def ref(r: TensorRef) -> TensorRef:
        dims = list(r.dims)
        for name in names:
            if dims and data.draw(st.booleans()):
                k = data.draw(st.integers(0, len(dims) - 1))
                at = data.draw(st.integers(0, len(dims[k].axes)))
                dims[k] = Dim(dims[k].name, dims[k].axes[:at] + (name,) + dims[k].axes[at:])
        return replace(r, dims=tuple(dims))

    def expr(e: Expr) -> Expr:
        if isinstance(e, TensorRef):
            return ref(e)
        if isinstance(e, Call):
            return replace(e, arg=expr(e.arg))
        if isinstance(e, Add):
            return replace(e, terms=tuple(expr(t) for t in e.terms))
        assert isinstance(e, Contract)
        return replace(e, operands=tuple(expr(o) for o in e.operands))

    seen: dict[str, TensorRef] = {}  # a tensor read twice is written alike both times

    def same(e: Expr) -> Expr:
        if isinstance(e, TensorRef):
            return seen.setdefault(e.name, expr(e))
        if isinstance(e, Call):
            return replace(e, arg=same(e.arg))
        if isinstance(e, Add):
            return replace(e, terms=tuple(same(t) for t in e.terms))
        assert isinstance(e, Contract)
        return replace(e, operands=tuple(same(o) for o in e.operands))

    statements = []
    for s in spec.statements:
        body = same(s.expr)
        seen[s.result.name] = result = seen.get(s.result.name) or ref(s.result)
        statements.append(replace(s, result=result, expr=body))
    return replace(spec, mesh=Mesh(tuple(axes)), statements=tuple(statements))


@settings(max_examples=15)
@given(_specs(max_devices=8, max_statements=3), st.data())
def test_planning_is_invariant_under_adding_size_one_axes(spec, data) -> None:  # type: ignore[no-untyped-def]
    """Size-1 axes are stripped before the search: the steps are those of the spec without them."""
    padded = _with_unit_axes(spec, data)
    note(str(padded))
    a, b = shardc.plan(spec), shardc.plan(padded)
    assert a.forward == b.forward and a.backward == b.backward
    assert check_plan(b) == []
