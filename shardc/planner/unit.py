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
"""

from __future__ import annotations

from dataclasses import replace

from shardc.spec.ir import Call, Contract, Expr, Mesh, Spec, TensorRef

__all__ = ["strip_unit_axes", "canonical", "without_unit_axes"]


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
        return replace(e, arg=_expr(e.arg, unit))
    assert isinstance(e, Contract)
    return replace(e, operands=tuple(_expr(o, unit) for o in e.operands))
