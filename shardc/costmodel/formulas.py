"""The cost figures as sympy formulas in the dims, the mesh sizes and the hardware symbols.

Symbols: one positive symbol per dim and per mesh axis (named as in the spec),
``C`` (FLOPs/s), ``W_ici`` and ``W_dcn`` (bidirectional bytes/s of one axis, as
:mod:`shardc.costmodel.collective` uses them), and ``L`` or the spec's layer count.
Formulas carry the bandwidth terms of collectives, not the latency bound.
sympy takes about a second to import, so it is imported here only, on first use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from shardc.costmodel.collective import FACTOR, links, split_axes
from shardc.planner.ir import Monomial, Op, Step
from shardc.spec.ir import Mesh

if TYPE_CHECKING:
    import sympy

__all__ = ["StepFormula", "PhaseFormula", "symbol", "monomial", "step_formula", "phase_formula",
           "HW_SYMBOLS"]

HW_SYMBOLS = ("C", "W_ici", "W_dcn")


@cache
def symbol(name: str) -> sympy.Symbol:
    """The positive sympy symbol of a dim, a mesh axis or a hardware figure."""
    import sympy

    return sympy.Symbol(name, positive=True)


def monomial(m: Monomial) -> sympy.Expr:
    """A plan :class:`Monomial` (``2*D*F/Y``) as a sympy expression."""
    import sympy

    expr: sympy.Expr = sympy.Rational(m.coeff.numerator, m.coeff.denominator)
    for name, power in m.powers:
        expr *= symbol(name) ** power
    return expr


@dataclass(frozen=True)
class StepFormula:
    """One step's formulas: FLOPs (per device and model), weighted bytes, and bytes per W.

    ``q_ici`` / ``q_dcn`` are the bytes that divide W_ici / W_dcn in the step's
    time, so ``time = flops/C + q_ici/W_ici + q_dcn/W_dcn``.
    """

    flops: sympy.Expr
    model_flops: sympy.Expr
    weighted: sympy.Expr
    q_ici: sympy.Expr
    q_dcn: sympy.Expr


@dataclass(frozen=True)
class PhaseFormula:
    """Sums over a phase (or the whole step), times the layer count."""

    flops: sympy.Expr
    model_flops: sympy.Expr
    comm_bytes: sympy.Expr
    q_ici: sympy.Expr
    q_dcn: sympy.Expr

    @property
    def compute_s(self) -> sympy.Expr:
        return self.flops / symbol("C")

    @property
    def comm_s(self) -> sympy.Expr:
        return self.q_ici / symbol("W_ici") + self.q_dcn / symbol("W_dcn")

    def __add__(self, other: PhaseFormula) -> PhaseFormula:
        return PhaseFormula(self.flops + other.flops, self.model_flops + other.model_flops,
                            self.comm_bytes + other.comm_bytes, self.q_ici + other.q_ici,
                            self.q_dcn + other.q_dcn)


def step_formula(step: Step, mesh: Mesh, spans: Mapping[str, int] | None = None) -> StepFormula:
    """The formulas of one step (zeros where a step has no such figure)."""
    import sympy

    zero = sympy.Integer(0)
    if step.op is Op.EINSUM:
        flops, model = _einsum(step)
        return StepFormula(flops, model, zero, zero, zero)
    if not step.is_collective or step.volume is None:
        return StepFormula(zero, zero, zero, zero, zero)
    factor = sympy.Rational(FACTOR[step.op].numerator, FACTOR[step.op].denominator)
    volume = monomial(step.volume)
    ici, dcn = split_axes(mesh, step.axes)
    q_ici = factor * volume / links(ici, spans) if ici else zero
    group_ici = sympy.Mul(*(symbol(a) for a in ici))
    q_dcn = factor * volume / group_ici if dcn else zero
    return StepFormula(zero, zero, factor * volume, q_ici, q_dcn)


def _einsum(step: Step) -> tuple[sympy.Expr, sympy.Expr]:
    import sympy

    axes_of: dict[str, tuple[str, ...]] = {}
    for ref in (*step.operands, step.dst):
        for dim in ref.dims:
            # the occurrence sharded over the most axes is the piece a device works on
            if len(dim.axes) >= len(axes_of.get(dim.name, ())):
                axes_of[dim.name] = dim.axes
    flops: sympy.Expr = sympy.Integer(2)
    model: sympy.Expr = sympy.Integer(2)
    for name, axes in axes_of.items():
        flops *= symbol(name) / sympy.Mul(*(symbol(a) for a in axes))
        model *= symbol(name)
    return flops, model


def phase_formula(steps: tuple[Step, ...], mesh: Mesh, layers: int | str | None,
                  spans: Mapping[str, int] | None = None) -> PhaseFormula:
    """The sums of a phase's step formulas, multiplied by the layer count (a number or a symbol)."""
    import sympy

    parts = [step_formula(s, mesh, spans) for s in steps]
    count: sympy.Expr = sympy.Integer(1)
    if isinstance(layers, int):
        count = sympy.Integer(layers)
    elif isinstance(layers, str):
        count = symbol(layers)

    def total(values: list[sympy.Expr]) -> sympy.Expr:
        return sympy.expand(count * sympy.Add(*values))

    return PhaseFormula(total([p.flops for p in parts]), total([p.model_flops for p in parts]),
                        total([p.weighted for p in parts]), total([p.q_ici for p in parts]),
                        total([p.q_dcn for p in parts]))


def evaluate(expr: sympy.Expr, values: dict[str, float]) -> float:
    """A formula's value at sizes and hardware figures (every free symbol must be given)."""
    subs = {s: values[s.name] for s in expr.free_symbols}  # type: ignore[attr-defined]
    return float(expr.subs(subs))
