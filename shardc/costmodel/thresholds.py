"""Where a phase turns from compute-bound to communication-bound, solved from its formulas.

With every collective overlapping compute (the book's verdict), a phase is
compute-bound iff ``flops / C > q_ici / W_ici + q_dcn / W_dcn``.  For one network
that reads ``flops / q > C / W``: the left side is the plan's arithmetic
intensity (FLOPs a byte), a formula in dims and mesh sizes only; the right side
the chip's.  Writing the intensity ``c * M`` with a number c, the sentence is the
the book's ``B/X > C/W_ici = 2550 (tpu-v5p)``; when M is a model dim over a single
mesh axis it is solved for that axis, ``Y < F/2550``.  When a phase uses both
networks there is one sentence a network, each a necessary condition (the DCN
one is what the book quotes across pods); the verdict itself adds both terms.
A phase with no FLOPs (only moves) is communication-bound at any size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

import symengine as se

from shardc.costmodel.formulas import Expr, HardwareSymbols, PhaseFormula, number, product, symbol, text
from shardc.hardware import Hardware

__all__ = ["Threshold", "derive", "format_number"]


@dataclass(frozen=True)
class Threshold:
    phase: str
    network: str  # "ici" or "dcn"
    intensity: str  # FLOPs a byte of the plan, e.g. "B/X"
    lhs: str  # the side compared, e.g. "B/X" or "Y"
    relation: str  # ">" or "<"
    rhs: str  # e.g. "C/W_ici" or "F/2550"
    value: float  # the chip's figure the intensity must exceed, divided by the coefficient
    here: float | None  # lhs at the report's sizes
    holds: bool | None  # compute-bound for this network's traffic at the report's sizes
    sentence: str

    def to_json(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in ("phase", "network", "intensity", "lhs", "relation", "rhs",
                                              "value", "here", "holds", "sentence")}


def format_number(x: float) -> str:
    """2550, 850, 73440, 5.42, 1.2e+07: integers shown whole below 1e6, else 3 figures."""
    if x != 0 and abs(x - round(x)) < 1e-9 * abs(x) and abs(x) < 1e6:
        return str(int(round(x)))
    return f"{x:.3g}"


def derive(phase: str, formula: PhaseFormula, hw: Hardware, mesh_axes: frozenset[str],
           token_dims: dict[str, tuple[str, ...]], sizes: dict[str, int] | None) -> list[Threshold]:
    """The threshold sentences of one phase, one per network its collectives cross.

    ``token_dims`` maps each batch/token dim to the mesh axes sharding it in the
    spec's input, so a solved bound can be printed per device (``B/X > ...``).
    ``sizes`` may lack some or all dims: the sentences then carry no ``here``.
    """
    parts = [(net, q) for net, q in (("ici", formula.q_ici), ("dcn", formula.q_dcn)) if q != 0]
    out: list[Threshold] = []
    for network, q in parts:
        label = phase if len(parts) == 1 else f"{phase} ({network.upper()} part)"
        ctx = _Context(label, network, hw, formula.hw, mesh_axes, token_dims, sizes)
        out.append(_one(ctx, formula.flops, q))
    return out


@dataclass(frozen=True)
class _Context:
    label: str
    network: str
    hw: Hardware
    names: HardwareSymbols
    mesh_axes: frozenset[str]
    token_dims: dict[str, tuple[str, ...]]
    sizes: dict[str, int] | None

    @property
    def w_name(self) -> str:
        return self.names.ici if self.network == "ici" else self.names.dcn

    @property
    def chip(self) -> float:
        return self.hw.intensity_ici if self.network == "ici" else self.hw.intensity_dcn


def cancelled(expr: Expr) -> Expr:
    """``expr`` as ``c * P / Q``: P, Q polynomials with no common monomial or numeric factor.

    symengine has no ``cancel``; a cost ratio needs only the content (the number and
    the monomial that divide every term) taken out of each side, and equal sides cancelled.
    """
    num, den = (se.expand(side) for side in se.expand(expr).as_numer_denom())
    if num == 0:
        return se.Integer(0)
    c_num, c_den = _content(num), _content(den)
    p, q = se.expand(num / c_num), se.expand(den / c_den)
    if p == q:
        p = q = se.Integer(1)
    return c_num / c_den * p / q


def _content(poly: Expr) -> Expr:
    """The positive number and the monomial that divide every term of a nonzero polynomial."""
    terms = poly.args if poly.is_Add else (poly,)
    coeffs = [Fraction(str(t)) if t.is_Number else _coefficient(t) for t in terms]
    powers = [t.as_powers_dict() for t in terms]
    common = set.intersection(*({k for k in p if not k.is_Number} for p in powers))
    content = number(Fraction(math.gcd(*(c.numerator for c in coeffs)), math.lcm(*(c.denominator for c in coeffs))))
    for name in common:
        content *= name ** min(p[name] for p in powers)
    return content


def _is_monomial(expr: Expr) -> bool:
    num, den = expr.as_numer_denom()
    return not se.expand(num).is_Add and not se.expand(den).is_Add


def _coefficient(mono: Expr) -> Fraction:
    """The number of a monomial: 3/2 of ``3*B/(2*X)``."""
    [(_, coeff)] = mono.as_coefficients_dict().items()
    return Fraction(str(coeff))


def _one(ctx: _Context, flops: Expr, q: Expr) -> Threshold:
    """Split the intensity into a number times the rest, then pick the sentence's form."""
    intensity = cancelled(flops / q)
    plain = text(symbol(ctx.names.flops) / symbol(ctx.w_name))
    if intensity == 0:
        sentence = (f"{ctx.label}: no FLOPs to hide the communication behind: communication-bound "
                    f"at any size")
        return Threshold(ctx.label, ctx.network, "0", "0", ">", plain, ctx.chip, 0.0,
                         False if ctx.sizes is not None else None, sentence)
    coeff, rest = Fraction(1), intensity
    if _is_monomial(intensity) and intensity.free_symbols:
        coeff = _coefficient(intensity)
        rest = intensity / number(coeff)
    value = ctx.chip / float(coeff)
    rhs_sym = text(symbol(ctx.names.flops) / (number(coeff) * symbol(ctx.w_name)))
    axis = _single_axis(rest, ctx.mesh_axes, frozenset(ctx.token_dims))
    if axis is not None:
        return _axis_form(ctx, intensity, rest, axis, value, rhs_sym)
    here = _evaluate(rest, ctx.sizes)
    holds = None if here is None else here > value
    where = f"({ctx.hw.name})"
    lhs = text(rest)
    if not rest.free_symbols:
        sentence = (f"{ctx.label}: {format_number(float(rest))} FLOPs a byte at any size, "
                    f"compute-bound iff that exceeds {rhs_sym} = {format_number(value)} {where}")
        return Threshold(ctx.label, ctx.network, text(intensity), lhs, ">", rhs_sym, value, here, holds,
                         sentence)
    sentence = f"{ctx.label}: compute-bound iff {lhs} > {rhs_sym} = {format_number(value)} {where}"
    solved = _solved(ctx, rest, value) if not _is_monomial(rest) else ""
    sentence += solved
    if here is not None and not solved:
        sentence += f"; here {lhs} = {format_number(here)}"
    return Threshold(ctx.label, ctx.network, text(intensity), lhs, ">", rhs_sym, value, here, holds, sentence)


def _axis_form(ctx: _Context, intensity: Expr, rest: Expr, axis: str, value: float,
               rhs_sym: str) -> Threshold:
    """``Y < F/2550``: the intensity is model dims over one mesh axis, solved for the axis."""
    numerator = rest * symbol(axis)
    rhs = f"{text(numerator)}/{format_number(value)}"
    sentence = (f"{ctx.label}: compute-bound iff {axis} < {rhs} "
                f"(from {text(rest)} > {rhs_sym} = {format_number(value)}, {ctx.hw.name})")
    here = _evaluate(rest, ctx.sizes)
    here_axis = None if here is None or ctx.sizes is None else float(ctx.sizes[axis])
    if here is not None and here_axis is not None:
        limit = here_axis * here / value  # = numerator / value at these sizes
        sentence += f"; here {axis} = {format_number(here_axis)} vs {rhs} = {format_number(limit)}"
    holds = None if here is None else here > value
    return Threshold(ctx.label, ctx.network, text(intensity), axis, "<", rhs, value, here_axis, holds,
                     sentence)


def _solved(ctx: _Context, intensity: Expr, value: float) -> str:
    """``, i.e. B/X > 2550*F/(F - 2550*Y)``: a sum's intensity solved for its one token dim, per device."""
    tokens = [str(s) for s in intensity.free_symbols if str(s) in ctx.token_dims]
    if len(tokens) != 1 or not math.isfinite(value):
        return ""
    token = symbol(tokens[0])
    whole = value < 1e6 and abs(value - round(value)) < 1e-9 * value  # 2550, 1275, 73440 as they are
    exact = number(Fraction(round(value)) if whole else Fraction(Decimal(f"{value:.4g}")))
    # intensity = exact is num - exact*den = 0, solved when linear in the token dim
    num, den = intensity.as_numer_denom()
    zero = se.expand(num - exact * den)
    slope = se.diff(zero, token)
    if slope == 0 or token in slope.free_symbols:
        return ""
    offset = se.expand(zero.subs({token: 0}))
    shards = product(ctx.token_dims[tokens[0]])
    per_device = token / shards
    bound = cancelled(-offset / (slope * shards))
    # num/den > exact is slope*token + offset > 0 times den's sign: the token's side flips where that is negative
    sign = _evaluate(slope * den, ctx.sizes)
    relation = "<" if sign is not None and sign < 0 else ">"
    out = f", i.e. {text(per_device)} {relation} {text(bound)}"
    here = _evaluate(bound, ctx.sizes)
    if here is not None:  # a token count is positive: above a bound <= 0 always, below one never
        verdict = "always" if relation == ">" else "never"
        out += f" = {format_number(here)}" if here > 0 else f" ({verdict}: the bound is not positive)"
    now = _evaluate(per_device, ctx.sizes)
    if now is not None:
        out += f"; here {text(per_device)} = {format_number(now)}"
    return out


def _single_axis(rest: Expr, mesh_axes: frozenset[str], token_dims: frozenset[str]) -> str | None:
    """The mesh axis to solve for, when ``rest`` is model dims over exactly one mesh axis."""
    if not _is_monomial(rest):
        return None
    powers = {str(k): int(p) for k, p in rest.as_powers_dict().items() if not k.is_Number}
    axes = [name for name in powers if name in mesh_axes]
    if len(axes) != 1 or powers[axes[0]] != -1:
        return None
    others = [(name, p) for name, p in powers.items() if name != axes[0]]
    if not others or any(p < 0 or name in token_dims or name in mesh_axes for name, p in others):
        return None
    return axes[0]


def _evaluate(expr: Expr, sizes: dict[str, int] | None) -> float | None:
    """``expr`` at ``sizes`` (None when a size is missing or the value is not finite)."""
    if sizes is None or any(str(s) not in sizes for s in expr.free_symbols):
        return None
    value = expr.subs({symbol(k): se.Integer(v) for k, v in sizes.items()})
    return float(value) if value.is_Number and value.is_finite else None  # not zoo (a zero denominator)
