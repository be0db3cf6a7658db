"""The reductions and norms family: ``softmax``, ``rmsnorm``, ``layernorm`` (the argument's indices)
and ``sum``, ``mean``, ``max``, ``logsumexp`` (the reduced index dropped), each ``over`` one index.

:mod:`shardc.planner.rows` plans the forward (the reduced index gathered, or per-row
statistics all-reduced) and :mod:`shardc.planner.rows_backward` the closed-form
backward; the node makes its row statistics on the way (:func:`stat_names`, one value
a row each, of the argument's indices less the reduced one).  Each step carries a
:class:`~shardc.planner.localops.Row` (a statistic's AllReduce names a
:class:`~shardc.planner.localops.Combine` where it is not a sum), written as one line
of JAX by :func:`shardc.lowering.rows.row_code`.  Its meaning on whole arrays, and the
bounds on the terms behind its value and its gradient, are the functions of
:mod:`shardc.lowering.rows` along the reduced index.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardc.lowering import rows
from shardc.names import fresh
from shardc.ops.registry import Builder, Family, Namer, Reference, Site, register
from shardc.planner.ir import Step
from shardc.planner.localops import Combine, Row
from shardc.planner.rows import plan_rows
from shardc.planner.rows_backward import rows_backward
from shardc.planner.rowstats import stat_names
from shardc.spec.functions import signature
from shardc.spec.ir import Call, Expr

if TYPE_CHECKING:
    from shardc.planner.graph import Node

__all__ = ["REDUCTIONS", "emit"]

Array = Any


def _argument(call: Call, indices: tuple[str, ...]) -> tuple[str, ...]:
    """The result's indices, and the reduced one where the result drops it."""
    assert call.over is not None
    return indices if call.over in indices else indices + (call.over,)


def _aux(call: Call, result: str) -> tuple[str, ...]:
    """The forward's row statistics (``max`` is its own, so it makes none)."""
    return stat_names(call.func, result)


def _aux_bytes(node: Node) -> dict[str, int]:
    return {}


def _operands(builder: Builder, call: Call, result: str, indices: tuple[str, ...]) -> tuple[tuple[str, ...],
                                                                                        tuple[str, ...]]:
    """The argument, computed towards :func:`_argument`'s indices in a layout of its own, and the row
    statistics, named uniquely, of the argument's indices less the reduced one."""
    arg = builder.argument(call.arg, result, _argument(call, indices))
    rows_of = tuple(i for i in builder.indices[arg] if i != call.over)
    aux = tuple(fresh(base, builder.names) for base in _aux(call, result))
    builder.indices.update({a: rows_of for a in aux})
    return (arg,), aux


def emit(step: Step, var: Namer, sizes: dict[str, int] | None = None) -> str:
    """One row step (shape-generic: a mean divides by the reduced index's global length)."""
    return rows.row_code(step, var)


def _axis(site: Site) -> int:
    assert site.call.over is not None
    return site.labels.index(site.call.over)


def _forward(site: Site, x: Array, xp: Any) -> Array:
    return rows.forward(site.call.func, x, _axis(site), xp)


def _vjp(site: Site, d: Array, xp: Any) -> Array:
    """The closed-form gradient, at the argument and the result the forward made."""
    return rows.vjp(site.call.func, site.args[0], site.result, d, _axis(site), xp)


def _magnitude(site: Site, x: Array, mag: Array, y: Array) -> Array:
    return rows.magnitude(site.call.func, x, mag, _axis(site))


def _grad_magnitude(site: Site, d: Array) -> Array:
    """Not linear: the bound reads the row's largest magnitude (:func:`shardc.lowering.rows.grad_magnitude`)."""
    return rows.grad_magnitude(site.call.func, site.args[0], site.mags[0], d, _axis(site))


def _arguments(call: Call, keep: tuple[str, ...]) -> tuple[tuple[Expr, tuple[str, ...]], ...]:
    return ((call.arg, _argument(call, keep)),)


def _indices(call: Call, operands: tuple[tuple[str, ...], ...]) -> tuple[str, ...]:
    """The argument's indices, less the reduced one for a reduction (``sum``, ``max``, ...)."""
    (labels,) = operands
    reduces = signature(call.func).kind == "reduce"
    return tuple(i for i in labels if i != call.over) if reduces else labels


REDUCTIONS = register(Family(
    "reductions", frozenset({"softmax", "rmsnorm", "layernorm", "sum", "mean", "max", "logsumexp"}), (Row, Combine),
    _argument, _aux, _aux_bytes, plan_rows, rows_backward, emit,
    Reference(_forward, _vjp, _magnitude, grad_magnitude=_grad_magnitude, arguments=_arguments, indices=_indices),
    operands=_operands, scores=lambda call: call.func == "softmax"))
