"""Size-1 mesh axes are free: stripped from every reference before the search.

Sharding a dim over an axis of one device leaves every local block whole, and a
partial sum over one device is already the sum, so ``A[M_X, E_P]`` with ``P=1``
is ``A[M_X, E]`` and ``{U_P}`` is nothing.  A collective over such an axis moves
no bytes and XLA drops it, so a plan that kept the axis would promise
collectives the program never runs; and every size-1 axis multiplies the
layouts the search walks (an 8-axis mesh with six of them plans as a 2-axis
one).  Planning therefore runs on the spec with those axes gone: plans are
invariant under adding size-1 axes, and no move ever names one.

Partial-sum axes are sorted here as well, so ``{U_YX}`` and ``{U_XY}`` are one value.

On a mesh of :data:`DCN_BONDS` axes whose exact search overruns its budget, the planner searches
again with the DCN axes every reference writes together (``B_WZX`` on
``mesh W=2 over dcn, Z=2 over dcn, X=32, Y=4``) bonded too (``bonded_axes(spec, dcn=True)``), the
rest of the search exact: what it gives up is using W and Z apart, on two dims or in two roles,
which the spec never does (the plan says so in a note, :func:`bond_note`).  That can cost a little
where a tensor the spec replicates over both would be sharded over one: on 150 random specs of
``mesh W=2 over dcn, Z=2 over dcn, X=2, Y=2`` writing ``WZ`` together, 5 plans differ from the
search of every axis alone, four of them 0.3-5% slower and one 8% faster (the search is exact
einsum by einsum, not over a whole phase); PaLM 540B's spec so written plans exactly as the search
of every axis alone does.

On a mesh of more than :data:`EXACT_AXES` axes (of size > 1) the layouts of one
tensor run to the tens of thousands and the exact search to minutes, so there the
search moves *bonded* axes as one (:func:`bonded_axes`): axes that every reference
of the spec writes together, adjacent and in one order (``B_XYZ`` and ``D_XYZ``,
never ``X`` without ``Y``).  Each collective still runs over, and is priced by,
its member axes; what the search gives up is splitting such a group.

Past :data:`EXACT_AXES` axes the search also keeps each axis where the spec puts it
(:func:`placements`): an axis may shard only an index some reference of the spec shards
over it, and the axes on one index keep the order the spec writes them in (where the
spec writes them in more than one order, any order).  A tensor then has a few hundred
layouts, not tens of thousands; what the search gives up is sharding a dim over an axis
the spec never uses for it (slicing a replicated axis onto another dim only to gather
it again, say), except on the way to a gather: free axes sliced onto the gathered dim
and gathered with it are one move (:func:`shardc.sharding.layout.spanning`), so a gather
still spans as many links as it can.  The plan says so in a note (:func:`restriction_note`).  The book's rules
plan is one of the planner's candidates, so the plan is never worse than it; its reshards
are searched under the same restriction, so it may be dearer than the rules' plan over
every layout (on the written-apart 5- and 6-axis specs of ``benchmarks/plan_speed.py``
the planner's plan is still the cheaper, ``tests/test_many_axes.py``).
"""

from __future__ import annotations

from dataclasses import replace

from shardc.ir.spec import Add, Call, Expr, Mesh, Network, Spec, TensorRef
from shardc.spec.walk import leaves

__all__ = ["strip_unit_axes", "canonical", "without_unit_axes", "bonded_axes", "unwritten_axes", "EXACT_AXES",
           "placements", "Placements", "restriction_note", "bond_note", "DCN_BONDS"]

# index -> (the axes that may shard it, each axis's rank in the one order they may take on it,
# or None where the spec writes them in more than one order)
Placements = dict[str, tuple[frozenset[str], dict[str, int] | None]]

# Up to this many mesh axes (of size > 1) the search treats every axis alone: exact.
EXACT_AXES = 4
# From this many axes, where the exact search overruns its budget, DCN axes the spec always writes
# together move as one in a second search, the rest of it exact: two levels of the data-centre network
# (pods of slices, or two rails) carrying one parallelism, `mesh W=2 over dcn, Z=2 over dcn, X=32, Y=4`
# with `B_WZX`.  Four axes alone multiply an einsum's configurations and a tensor's layouts ~10-fold over
# three (PaLM 540B's spec so written: 454k steps of search against 49k with W and Z merged), past the
# budget; moved as one, W and Z are searched as the merged axis WZ=4 is, whose plans are plans of the
# split mesh (the same collectives over W and Z).
DCN_BONDS = 4


def canonical(ref: TensorRef, unit: frozenset[str]) -> TensorRef:
    """``ref`` without the axes in ``unit``, its partial-sum axes sorted (spans kept)."""
    dims = tuple(replace(d, axes=tuple(a for a in d.axes if a not in unit)) if set(d.axes) & unit else d
                 for d in ref.dims)
    unreduced = tuple(sorted(a for a in ref.unreduced if a not in unit))
    if dims == ref.dims and unreduced == ref.unreduced:
        return ref
    return replace(ref, dims=dims, unreduced=unreduced)


def without_unit_axes(mesh: Mesh) -> Mesh:
    return Mesh(tuple(a for a in mesh.axes if a.size != 1))


def strip_unit_axes(spec: Spec) -> Spec:
    """``spec`` on its mesh without size-1 axes, every reference canonical."""
    unit = frozenset(a.name for a in spec.mesh.axes if a.size == 1)
    statements = tuple(replace(s, result=canonical(s.result, unit), expr=_expr(s.expr, unit))
                       for s in spec.statements)
    return replace(spec, mesh=without_unit_axes(spec.mesh), statements=statements)


def _expr(e: Expr, unit: frozenset[str]) -> Expr:
    if isinstance(e, TensorRef):
        return canonical(e, unit)
    if isinstance(e, Call):
        return replace(e, arg=_expr(e.arg, unit), more=tuple(_expr(a, unit) for a in e.more))
    if isinstance(e, Add):
        return replace(e, terms=tuple(_expr(t, unit) for t in e.terms))
    return replace(e, operands=tuple(_expr(o, unit) for o in e.operands))


def bonded_axes(spec: Spec, dcn: bool = False) -> tuple[tuple[str, ...], ...] | None:
    """The search's units on a mesh of more than :data:`EXACT_AXES` axes, or with ``dcn`` (the search
    again after the exact one overran) of :data:`DCN_BONDS` axes with DCN axes always written together;
    else None (each axis alone).

    ``b`` is bonded to ``a`` when every reference that uses either writes ``b`` right after
    ``a`` in one dim, or both among its partial sums, and both axes are on the same network
    (from :data:`DCN_BONDS` up to :data:`EXACT_AXES` axes, the data-centre network only).
    A unit is a maximal run of bonded axes; units are listed in mesh order of their first axis.
    """
    names = spec.mesh.names
    if len(names) < DCN_BONDS or (len(names) <= EXACT_AXES and not dcn):
        return None
    refs = [r for s in spec.statements for r in (s.result, *leaves(s.expr))]
    after: dict[str, str] = {}
    for a in names:
        for b in names:
            if a != b and _bonded(a, b, refs) and spec.mesh.axis(a).network is spec.mesh.axis(b).network \
                    and (len(names) > EXACT_AXES or spec.mesh.axis(a).network is Network.DCN):
                after[a] = b
    if not after:
        return None
    firsts = [a for a in names if a not in after.values()]
    # axes bonded both ways (only ever partial sums together, `{U_PQ}`) have no first: they start
    # a unit of their own, in mesh order, so every axis is in exactly one unit
    starts = firsts + [a for a in names if a not in firsts]
    units = []
    covered: set[str] = set()
    for a in starts:
        if a in covered:
            continue
        unit = [a]
        while unit[-1] in after and after[unit[-1]] not in unit and after[unit[-1]] not in covered:
            unit.append(after[unit[-1]])
        covered.update(unit)
        units.append(tuple(unit))
    return tuple(sorted(units, key=lambda u: names.index(u[0])))


def unwritten_axes(spec: Spec) -> tuple[str, ...]:
    """Mesh axes of size > 1 no tensor of the spec is written over (the stage axis aside): the search tries
    each on every dim, the one thing that makes a mesh of few axes search long."""
    refs = [r for s in spec.statements for r in (s.result, *leaves(s.expr))]
    written = {a for r in refs for a in (*r.unreduced, *(x for d in r.dims for x in d.axes))}
    stage = spec.mesh.pipeline_axis
    return tuple(a.name for a in spec.mesh.axes
                 if a.name not in written and a.size != 1 and (stage is None or a.name != stage.name))


def _bonded(a: str, b: str, refs: list[TensorRef]) -> bool:
    seen = False
    for ref in refs:
        in_a = any(a in d.axes for d in ref.dims) or a in ref.unreduced
        in_b = any(b in d.axes for d in ref.dims) or b in ref.unreduced
        if in_a != in_b:
            return False
        if not in_a:
            continue
        seen = True
        if (a in ref.unreduced) != (b in ref.unreduced):
            return False
        for d in ref.dims:
            if a in d.axes and (d.axes.index(a) + 1 >= len(d.axes) or d.axes[d.axes.index(a) + 1] != b):
                return False
    return seen


def placements(spec: Spec, units: tuple[tuple[str, ...], ...] | None) -> Placements | None:
    """Where the search may put each axis past :data:`EXACT_AXES` axes (see above), else None."""
    if len(spec.mesh.names) <= EXACT_AXES:
        return None
    unit_of = {a: u for u in (units or tuple((a,) for a in spec.mesh.names)) for a in u}
    refs = [r for s in spec.statements for r in (s.result, *leaves(s.expr))]
    axes: dict[str, set[str]] = {}
    before: dict[str, set[tuple[tuple[str, ...], tuple[str, ...]]]] = {}  # index -> (unit, unit after it)
    for ref in refs:
        for dim in ref.dims:
            axes.setdefault(dim.name, set()).update(dim.axes)
            seq = list(dict.fromkeys(unit_of[a] for a in dim.axes))
            before.setdefault(dim.name, set()).update(zip(seq, seq[1:], strict=False))
    out: Placements = {}
    for index, used in axes.items():
        order = _order([u for u in dict.fromkeys(unit_of[a] for a in spec.mesh.names) if set(u) & used],
                       before[index])
        rank = None if order is None else {a: k for k, a in enumerate(a for u in order for a in u)}
        out[index] = (frozenset(used), rank)
    return out


def _order(units: list[tuple[str, ...]], edges: set[tuple[tuple[str, ...], tuple[str, ...]]]
           ) -> list[tuple[str, ...]] | None:
    """The units in an order that keeps every (earlier, later) edge, ties in mesh order; None on a cycle."""
    order: list[tuple[str, ...]] = []
    left = list(units)
    while left:
        free = [u for u in left if not any(b == u and a in left for a, b in edges)]
        if not free:
            return None
        order.append(free[0])
        left.remove(free[0])
    return order


def restriction_note(spec: Spec) -> str:
    return (f"search restricted past {EXACT_AXES} mesh axes (this mesh has {len(spec.mesh.names)} of size > 1): "
            "each axis shards only dims the spec shards over it, in the spec's order "
            "(the rules plan, one of the candidates, reshards under the same restriction)")


def bond_note(units: tuple[tuple[str, ...], ...]) -> str | None:
    """The note of a search that moved axes as one on a mesh it otherwise searches exactly (see
    :data:`DCN_BONDS`); None where every axis moved alone."""
    bonded = [u for u in units if len(u) > 1]
    if not bonded:
        return None
    groups = ", ".join("".join(u) for u in bonded)
    return (f"the exact search of {sum(map(len, units))} mesh axes overran its budget, so the axes always written "
            f"together over dcn were searched as one ({groups}): the plan is the merged axis's, with the "
            "collectives over its member axes, and may not be the cheapest that uses them apart")
