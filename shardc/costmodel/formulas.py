"""The cost figures as exact formulas in the dims, the mesh sizes and the hardware symbols.

Symbols: one per dim and per mesh axis (named as in the spec), the chip's
FLOPs/s ``C`` and ``W_ici``, ``W_dcn`` (bidirectional bytes/s of one axis, as
:mod:`shardc.collectives` uses them), and ``L`` or the spec's layer
count.  The hardware symbols are kept apart from the user's names: a spec with a
dim or axis named ``C`` gets the chip's FLOPs/s as ``C_chip`` (:func:`hardware_symbols`),
so ``flops / C`` never cancels a dim.  Formulas carry the bandwidth terms of
collectives, not the latency bound.  They are exact symengine expressions
(integer and rational coefficients), expanded to sums of monomials; symengine
imports in a fraction of sympy's time, and only the cost pass imports it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

import symengine as se
from symengine import Basic as Expr  # a formula

from shardc.collectives import FACTOR, Layout, bandwidth_terms, einsum_flops
from shardc.ir.plan import Monomial, Op, Step, unfused
from shardc.ir.precision import Precision
from shardc.ir.spec import Mesh
from shardc.ops.registry import of_op
from shardc.ring_sends import matmul_ring, ring_bytes, shared_rings
from shardc.steptime import RingTransfer

__all__ = ["Expr", "HardwareSymbols", "hardware_symbols", "StepFormula", "PhaseFormula", "symbol", "monomial",
           "number", "product", "text", "step_formula", "phase_formula", "evaluate", "over", "ZERO"]

ZERO = se.Integer(0)


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


def symbol(name: str) -> Expr:
    """The formula of a dim, a mesh axis or a hardware figure alone."""
    return se.Symbol(name)


def number(value: int | Fraction) -> Expr:
    """An exact number (a :class:`~fractions.Fraction` stays a rational)."""
    value = Fraction(value)
    return se.Rational(value.numerator, value.denominator)


def product(names: Iterable[str]) -> Expr:
    """The product of the symbols ``names`` (1 for none): a group of mesh axes."""
    result = se.Integer(1)
    for name in names:
        result *= symbol(name)
    return result


def text(expr: Expr) -> str:
    """A formula as the book (and ``shardc plan``) writes it: ``4*B*D/X + 5*D*S/2``, ``1/X``, ``C/(2*W_ici)``.

    symengine's own printing writes ``(5/2)*D*S`` and ``X**(-1)`` and orders terms by
    hash; here each term is one fraction, and terms go in lexicographic order of
    their powers (the order sympy prints), so the text is the same on every platform.
    """
    if not expr.is_Add:
        return _fraction(expr)
    names = sorted(str(s) for s in expr.free_symbols)

    def order(term: Expr) -> tuple[int, ...]:
        powers = {str(k): int(v) for k, v in term.as_powers_dict().items() if not k.is_Number}
        return tuple(powers.get(n, 0) for n in names)

    out = ""
    for term in sorted(expr.args, key=order, reverse=True):
        part = _fraction(term)
        out += part if not out else f" - {part[1:]}" if part.startswith("-") else f" + {part}"
    return out


def _fraction(term: Expr) -> str:
    num, den = term.as_numer_denom()
    if den.is_Add and text(den).startswith("-"):  # 2550*F/(F - 2550*Y), not -2550*F/(-F + 2550*Y)
        num, den = -num, se.expand(-den)
    if den == 1:
        return _product(num)
    top = f"({text(num)})" if num.is_Add else _product(num)
    return f"{top}/({_product(den)})" if den.is_Add or den.is_Mul else f"{top}/{_product(den)}"


def _product(expr: Expr) -> str:
    """A product of a number, symbols and sums: the number first, symbols by name, then the sums."""
    if expr.is_Add:
        return text(expr)
    if not expr.is_Mul:
        return str(expr)
    factors = sorted(expr.args, key=lambda f: (not f.is_Number, f.is_Add, str(f.args[0] if f.is_Pow else f)))
    parts = [f"({text(f)})" if f.is_Add else str(f) for f in factors]
    if parts[0] == "-1":
        return "-" + "*".join(parts[1:])
    return "*".join(parts)


def monomial(m: Monomial) -> Expr:
    """A plan :class:`Monomial` (``2*D*F/Y``) as a formula."""
    result = number(m.coeff)
    for name, power in m.powers:
        result *= symbol(name) ** power
    return result


@dataclass(frozen=True)
class StepFormula:
    """One step's formulas: FLOPs (per device and model), weighted bytes, and bytes per W.

    ``q_ici`` / ``q_dcn`` are the bytes that divide W_ici / W_dcn in the step's
    time, so ``time = flops/C + q_ici/W_ici + q_dcn/W_dcn``.
    """

    flops: Expr
    model_flops: Expr
    weighted: Expr
    q_ici: Expr
    q_dcn: Expr


@dataclass(frozen=True)
class PhaseFormula:
    """Sums over a phase (or the whole step), times the layer count."""

    flops: Expr
    model_flops: Expr
    comm_bytes: Expr
    q_ici: Expr
    q_dcn: Expr
    hw: HardwareSymbols = field(default=HardwareSymbols())

    @property
    def compute_s(self) -> Expr:
        return self.flops / symbol(self.hw.flops)

    @property
    def comm_s(self) -> Expr:
        return self.q_ici / symbol(self.hw.ici) + self.q_dcn / symbol(self.hw.dcn)

    def compute_s_text(self) -> str:
        """``compute_s`` with the chip's symbol kept outside a sum: ``(2*B*D/X + B*F/X)/C``."""
        return over(self.flops, self.hw.flops)

    def comm_s_text(self) -> str:
        """``comm_s`` one quotient a network: ``(4*B*D/X + 4*D*F/Y)/W_ici``."""
        parts = [over(q, name) for q, name in ((self.q_ici, self.hw.ici), (self.q_dcn, self.hw.dcn)) if q != 0]
        return " + ".join(parts) if parts else "0"

    def exprs(self) -> dict[str, str]:
        """The formulas as the ``*_expr`` fields of the JSON report."""
        return {"comm_bytes_expr": text(self.comm_bytes), "comm_s_expr": self.comm_s_text(),
                "compute_flops_expr": text(self.flops), "compute_s_expr": self.compute_s_text(),
                "model_flops_expr": text(self.model_flops)}

    def __add__(self, other: PhaseFormula) -> PhaseFormula:
        return PhaseFormula(se.expand(self.flops + other.flops), se.expand(self.model_flops + other.model_flops),
                            se.expand(self.comm_bytes + other.comm_bytes), se.expand(self.q_ici + other.q_ici),
                            se.expand(self.q_dcn + other.q_dcn), self.hw)


def over(expr: Expr, name: str) -> str:
    """``expr / name`` printed with the sum kept whole."""
    if expr == 0:
        return "0"
    return f"({text(expr)})/{name}" if expr.is_Add else text(expr / symbol(name))


def step_formula(step: Step, mesh: Mesh, spans: Layout | None = None,
                 sizes: Mapping[str, int] | None = None, nbytes: int | Precision = 2,
                 shared: bool = False) -> StepFormula:
    """The formulas of one step (zeros where a step has no such figure); a step that sends around a ring
    while it computes (ring attention, a collective matmul) has its sends' bytes and bandwidth terms
    (``nbytes``: an element's bytes, :func:`shardc.ring_sends.ring_bytes`; ``shared``: a collective matmul
    whose blocks an earlier step sends, :func:`shardc.ring_sends.shared_rings`)."""
    zero = ZERO
    if step.op is Op.EINSUM:
        flops, model = _einsum(step)
        ring = None
        if step.collective is not None and not shared:
            n = math.prod(_mesh_size(mesh, sizes, a) for a in step.collective.axes)
            assert step.collective.volume is not None
            ring = matmul_ring(step.collective, monomial(step.collective.volume), n)
        return _with_ring(StepFormula(flops, model, zero, zero, zero), ring, mesh, spans, sizes)
    family = of_op(step.fn) if step.op is Op.ELEMENTWISE else None
    if family is not None and family.flops is not None:  # a kernel with matmuls (attention)
        flops, model, _ = family.flops(step, symbol)
        axes = {a.name for a in mesh.axes}
        size = lambda name: _mesh_size(mesh, sizes, name) if name in axes else symbol(name)  # noqa: E731
        ring = family.ring(step, size, ring_bytes(step, nbytes)) if family.ring else None
        return _with_ring(StepFormula(ZERO + flops, ZERO + model, zero, zero, zero), ring, mesh, spans, sizes)
    if not step.is_collective or step.volume is None:
        return StepFormula(zero, zero, zero, zero, zero)
    terms = bandwidth_terms(step.op, monomial(step.volume), step.axes, mesh, symbol, spans, number, sizes, step.routed)
    q = {network: weighted / divisor for network, (weighted, divisor) in terms.items()}
    weighted = number(FACTOR[step.op]) * monomial(step.volume)
    return StepFormula(zero, zero, weighted, q.get("ici", zero), q.get("dcn", zero))


def _mesh_size(mesh: Mesh, sizes: Mapping[str, int] | None, axis: str) -> int:
    """A mesh axis's size (``sizes`` over the mesh's): a number in a ring's formulas, as its steps' count
    is (a zig-zag ring of two devices reorders less than a longer one)."""
    return (sizes or {}).get(axis) or next(a.size for a in mesh.axes if a.name == axis)


def _with_ring(one: StepFormula, ring: RingTransfer | None, mesh: Mesh, spans: Layout | None,
               sizes: Mapping[str, int] | None) -> StepFormula:
    """``one`` with the bytes of a ring's sends (one ``jax.lax.ppermute`` to the neighbour each, as
    :func:`shardc.steptime.ring_time` times them) and their bandwidth terms."""
    if ring is None:
        return one
    weighted, q = ZERO, {"ici": ZERO, "dcn": ZERO}
    for send in ring.sends:
        nbytes = send.elements * send.nbytes
        weighted += send.count * nbytes
        terms = bandwidth_terms(Op.COLLECTIVE_PERMUTE, ZERO + nbytes, ring.axes, mesh, symbol, spans, number, sizes)
        for network, (moved, divisor) in terms.items():
            q[network] += send.count * moved / divisor
    return StepFormula(one.flops, one.model_flops, se.expand(weighted), se.expand(q["ici"]), se.expand(q["dcn"]))


def _einsum(step: Step) -> tuple[Expr, Expr]:
    step = next(s for s in unfused(step) if s.op is Op.EINSUM)  # a collective matmul's FLOPs are its einsum's
    local, model = einsum_flops(((d.name, d.axes) for ref in (*step.operands, step.dst) for d in ref.dims), symbol)
    return ZERO + local, ZERO + model  # a formula even for an einsum of scalars (2)


def phase_formula(steps: tuple[Step, ...], mesh: Mesh, layers: int | str | None | tuple[int | str, ...],
                  spans: Layout | None = None, hw: HardwareSymbols | None = None,
                  sizes: Mapping[str, int] | None = None, nbytes: int | Precision = 2) -> PhaseFormula:
    """The sums of a phase's step formulas, each multiplied by its block's layer count (a number or a
    symbol; ``layers`` one count, or every block's by :attr:`Step.block`); the divisors of the bandwidth
    terms come from the mesh's sizes (``sizes`` over them); ``nbytes``: an element's bytes (or the tensors' types)."""
    parts = [step_formula(s, mesh, spans, sizes, nbytes, shared) for s, shared in zip(steps, shared_rings(steps),
                                                                                      strict=True)]
    each = layers if isinstance(layers, tuple) else (layers if layers is not None else 1,)
    blocks = [symbol(n) if isinstance(n, str) else number(n) for n in each]
    counts = [number(1) if s.once else blocks[s.block] for s in steps]  # outside a `layers` block: once

    def total(values: list[Expr]) -> Expr:
        # expanded: a sum of monomials, as the book writes them
        return se.expand(sum((n * v for n, v in zip(counts, values, strict=True)), ZERO))

    return PhaseFormula(total([p.flops for p in parts]), total([p.model_flops for p in parts]),
                        total([p.weighted for p in parts]), total([p.q_ici for p in parts]),
                        total([p.q_dcn for p in parts]), hw or HardwareSymbols())


def evaluate(expr: Expr, values: Mapping[str, float]) -> float:
    """A formula's value at sizes and hardware figures (every free symbol must be given)."""
    return float(expr.subs({symbol(k): v for k, v in values.items()}))
