"""The cost figures as exact formulas in the dims, the mesh sizes and the hardware symbols.

Symbols: one per dim and per mesh axis (named as in the spec), the chip's
FLOPs/s ``C`` and ``W_ici``, ``W_dcn`` (bidirectional bytes/s of one axis, as
:mod:`shardc.costmodel.collective` uses them), and ``L`` or the spec's layer
count.  The hardware symbols are kept apart from the user's names: a spec with a
dim or axis named ``C`` gets the chip's FLOPs/s as ``C_chip`` (:func:`hardware_symbols`),
so ``flops / C`` never cancels a dim.  Formulas carry the bandwidth terms of
collectives, not the latency bound.  They are :class:`Poly` sums of monomials
(:mod:`shardc.costmodel.poly`), so costing imports no computer algebra system.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from shardc.costmodel.collective import FACTOR, links, split_axes
from shardc.costmodel.poly import Poly
from shardc.planner.ir import Monomial, Op, Step
from shardc.spec.ir import Mesh

__all__ = ["HardwareSymbols", "hardware_symbols", "StepFormula", "PhaseFormula", "symbol", "monomial",
           "step_formula", "phase_formula", "evaluate", "over"]


@dataclass(frozen=True)
class HardwareSymbols:
    """The names the chip's figures take in formulas: the book's C, W_ici and W_dcn unless a spec uses them."""

    flops: str = "C"
    ici: str = "W_ici"
    dcn: str = "W_dcn"

    def names(self) -> tuple[str, str, str]:
        return self.flops, self.ici, self.dcn


def hardware_symbols(taken: Iterable[str]) -> HardwareSymbols:
    """The hardware names, each suffixed ``_chip`` (again, if need be) while a dim or axis has it."""
    used = set(taken)
    names = []
    for name in HardwareSymbols().names():
        while name in used:
            name += "_chip"
        used.add(name)
        names.append(name)
    return HardwareSymbols(*names)


def symbol(name: str) -> Poly:
    """The formula of a dim, a mesh axis or a hardware figure alone."""
    return Poly.symbol(name)


def monomial(m: Monomial) -> Poly:
    """A plan :class:`Monomial` (``2*D*F/Y``) as a formula."""
    return Poly.monomial(m.coeff, m.powers)


@dataclass(frozen=True)
class StepFormula:
    """One step's formulas: FLOPs (per device and model), weighted bytes, and bytes per W.

    ``q_ici`` / ``q_dcn`` are the bytes that divide W_ici / W_dcn in the step's
    time, so ``time = flops/C + q_ici/W_ici + q_dcn/W_dcn``.
    """

    flops: Poly
    model_flops: Poly
    weighted: Poly
    q_ici: Poly
    q_dcn: Poly


@dataclass(frozen=True)
class PhaseFormula:
    """Sums over a phase (or the whole step), times the layer count."""

    flops: Poly
    model_flops: Poly
    comm_bytes: Poly
    q_ici: Poly
    q_dcn: Poly
    hw: HardwareSymbols = field(default=HardwareSymbols())

    @property
    def compute_s(self) -> Poly:
        return self.flops / symbol(self.hw.flops)

    @property
    def comm_s(self) -> Poly:
        return self.q_ici / symbol(self.hw.ici) + self.q_dcn / symbol(self.hw.dcn)

    def compute_s_text(self) -> str:
        """``compute_s`` with the chip's symbol kept outside a sum: ``(2*B*D/X + B*F/X)/C``."""
        return over(self.flops, self.hw.flops)

    def comm_s_text(self) -> str:
        """``comm_s`` one quotient a network: ``(4*B*D/X + 4*D*F/Y)/W_ici``."""
        parts = [over(q, name) for q, name in ((self.q_ici, self.hw.ici), (self.q_dcn, self.hw.dcn))
                 if not q.is_zero]
        return " + ".join(parts) if parts else "0"

    def exprs(self) -> dict[str, str]:
        """The formulas as the ``*_expr`` fields of the JSON report."""
        return {"comm_bytes_expr": str(self.comm_bytes), "comm_s_expr": self.comm_s_text(),
                "compute_flops_expr": str(self.flops), "compute_s_expr": self.compute_s_text(),
                "model_flops_expr": str(self.model_flops)}

    def __add__(self, other: PhaseFormula) -> PhaseFormula:
        return PhaseFormula(self.flops + other.flops, self.model_flops + other.model_flops,
                            self.comm_bytes + other.comm_bytes, self.q_ici + other.q_ici,
                            self.q_dcn + other.q_dcn, self.hw)


def over(expr: Poly, name: str) -> str:
    """``expr / name`` printed with the sum kept whole."""
    if expr.is_zero:
        return "0"
    return str(expr / symbol(name)) if expr.is_monomial else f"({expr})/{name}"


def step_formula(step: Step, mesh: Mesh, spans: Mapping[str, int] | None = None) -> StepFormula:
    """The formulas of one step (zeros where a step has no such figure)."""
    zero = Poly()
    if step.op is Op.EINSUM:
        flops, model = _einsum(step)
        return StepFormula(flops, model, zero, zero, zero)
    if not step.is_collective or step.volume is None:
        return StepFormula(zero, zero, zero, zero, zero)
    factor = FACTOR[step.op]
    volume = monomial(step.volume)
    ici, dcn = split_axes(mesh, step.axes)
    q_ici = factor * volume / links(ici, spans) if ici else zero
    group_ici = Poly.monomial(1, tuple((a, 1) for a in ici))
    q_dcn = factor * volume / group_ici if dcn else zero
    return StepFormula(zero, zero, factor * volume, q_ici, q_dcn)


def _einsum(step: Step) -> tuple[Poly, Poly]:
    axes_of: dict[str, tuple[str, ...]] = {}
    for ref in (*step.operands, step.dst):
        for dim in ref.dims:
            # the occurrence sharded over the most axes is the piece a device works on
            if len(dim.axes) >= len(axes_of.get(dim.name, ())):
                axes_of[dim.name] = dim.axes
    flops, model = Poly.number(2), Poly.number(2)
    for name, axes in axes_of.items():
        flops *= symbol(name) / Poly.monomial(1, tuple((a, 1) for a in axes))
        model *= symbol(name)
    return flops, model


def phase_formula(steps: tuple[Step, ...], mesh: Mesh, layers: int | str | None,
                  spans: Mapping[str, int] | None = None, hw: HardwareSymbols | None = None) -> PhaseFormula:
    """The sums of a phase's step formulas, multiplied by the layer count (a number or a symbol)."""
    parts = [step_formula(s, mesh, spans) for s in steps]
    count = symbol(layers) if isinstance(layers, str) else Poly.number(layers if isinstance(layers, int) else 1)

    def total(values: list[Poly]) -> Poly:
        return count * sum(values, Poly())

    return PhaseFormula(total([p.flops for p in parts]), total([p.model_flops for p in parts]),
                        total([p.weighted for p in parts]), total([p.q_ici for p in parts]),
                        total([p.q_dcn for p in parts]), hw or HardwareSymbols())


def evaluate(expr: Poly, values: Mapping[str, float]) -> float:
    """A formula's value at sizes and hardware figures (every free symbol must be given)."""
    return expr.evaluate(values)
