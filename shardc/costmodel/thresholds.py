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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardc.costmodel.formulas import PhaseFormula, symbol
from shardc.costmodel.hardware import Hardware

if TYPE_CHECKING:
    import sympy

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
    """
    parts = [(net, q) for net, q in (("ici", formula.q_ici), ("dcn", formula.q_dcn)) if q != 0]
    out: list[Threshold] = []
    for network, q in parts:
        label = phase if len(parts) == 1 else f"{phase} ({network.upper()} part)"
        ctx = _Context(label, network, hw, mesh_axes, token_dims, sizes)
        out.append(_one(ctx, formula.flops, q))
    return out


@dataclass(frozen=True)
class _Context:
    label: str
    network: str
    hw: Hardware
    mesh_axes: frozenset[str]
    token_dims: dict[str, tuple[str, ...]]
    sizes: dict[str, int] | None

    @property
    def w_name(self) -> str:
        return "W_ici" if self.network == "ici" else "W_dcn"

    @property
    def chip(self) -> float:
        return self.hw.intensity_ici if self.network == "ici" else self.hw.intensity_dcn


def _one(ctx: _Context, flops: sympy.Expr, q: sympy.Expr) -> Threshold:
    """Split the intensity into a number times the rest, then pick the sentence's form."""
    import sympy

    intensity = sympy.factor(sympy.cancel(flops / q))  # a ratio of polynomials: cancel is exact and fast
    coeff, rest = intensity.as_coeff_Mul()
    if not _is_monomial(rest) or rest == 1:
        coeff, rest = sympy.Integer(1), intensity
    value = ctx.chip / float(coeff)
    rhs_sym = str(symbol("C") / (coeff * symbol(ctx.w_name)))
    axis = _single_axis(rest, ctx.mesh_axes, frozenset(ctx.token_dims))
    if axis is not None:
        return _axis_form(ctx, intensity, rest, axis, value, rhs_sym)
    here = _evaluate(rest, ctx.sizes)
    holds = None if here is None else here > value
    where = f"({ctx.hw.name})"
    lhs = str(rest)
    if not rest.free_symbols:  # type: ignore[attr-defined]
        sentence = (f"{ctx.label}: {format_number(float(rest))} FLOPs a byte at any size, "
                    f"compute-bound iff that exceeds {rhs_sym} = {format_number(value)} {where}")
        return Threshold(ctx.label, ctx.network, str(intensity), lhs, ">", rhs_sym, value, here, holds,
                         sentence)
    sentence = f"{ctx.label}: compute-bound iff {lhs} > {rhs_sym} = {format_number(value)} {where}"
    solved = _solved(ctx, rest, value) if not _is_monomial(rest) else ""
    sentence += solved
    if here is not None and not solved:
        sentence += f"; here {lhs} = {format_number(here)}"
    return Threshold(ctx.label, ctx.network, str(intensity), lhs, ">", rhs_sym, value, here, holds, sentence)


def _axis_form(ctx: _Context, intensity: sympy.Expr, rest: sympy.Expr, axis: str, value: float,
               rhs_sym: str) -> Threshold:
    """``Y < F/2550``: the intensity is model dims over one mesh axis, solved for the axis."""
    numerator = rest * symbol(axis)
    rhs = f"{numerator}/{format_number(value)}"
    sentence = (f"{ctx.label}: compute-bound iff {axis} < {rhs} "
                f"(from {rest} > {rhs_sym} = {format_number(value)}, {ctx.hw.name})")
    here = _evaluate(rest, ctx.sizes)
    here_axis = None if here is None or ctx.sizes is None else float(ctx.sizes[axis])
    if here is not None and here_axis is not None:
        limit = here_axis * here / value  # = numerator / value at these sizes
        sentence += f"; here {axis} = {format_number(here_axis)} vs {rhs} = {format_number(limit)}"
    holds = None if here is None else here > value
    return Threshold(ctx.label, ctx.network, str(intensity), axis, "<", rhs, value, here_axis, holds,
                     sentence)


def _solved(ctx: _Context, intensity: sympy.Expr, value: float) -> str:
    """``, i.e. B/X > 2550*F/(F - 2550*Y)``: a sum's intensity solved for its one token dim, per device."""
    import sympy

    tokens = [s for s in intensity.free_symbols if s.name in ctx.token_dims]  # type: ignore[attr-defined]
    if len(tokens) != 1:
        return ""
    token = tokens[0]
    whole = abs(value - round(value)) < 1e-9 * value
    number = sympy.Integer(round(value)) if whole else sympy.Float(value, 4)
    # intensity = number is num - number*den = 0; solved by hand when linear in the token dim
    # (sympy.solve gives the same root but imports sympy.physics and takes a third of a second)
    num, den = sympy.fraction(sympy.cancel(intensity))
    poly = sympy.Poly(sympy.expand(num - number * den), token)
    if poly.degree() != 1:
        return ""
    slope, offset = poly.all_coeffs()
    shards = sympy.Mul(*(symbol(a) for a in ctx.token_dims[token.name]))
    per_device = token / shards
    bound = sympy.factor(sympy.cancel(-offset / (slope * shards)))
    text = f", i.e. {per_device} > {bound}"
    here = _evaluate(bound, ctx.sizes)
    if here is not None:
        text += f" = {format_number(here)}" if here > 0 else " (never: the bound is negative)"
    now = _evaluate(per_device, ctx.sizes)
    if now is not None:
        text += f"; here {per_device} = {format_number(now)}"
    return text


def _is_monomial(expr: sympy.Expr) -> bool:
    import sympy

    if expr.is_Symbol:
        return True
    if expr.is_Pow:
        return bool(expr.base.is_Symbol and expr.exp.is_Integer)  # type: ignore[attr-defined]
    if expr.is_Mul:
        return all(_is_monomial(a) for a in expr.args)
    return isinstance(expr, sympy.Integer)


def _single_axis(rest: sympy.Expr, mesh_axes: frozenset[str], token_dims: frozenset[str]) -> str | None:
    """The mesh axis to solve for, when ``rest`` is model dims over exactly one mesh axis."""
    if rest == 0 or not _is_monomial(rest):  # no FLOPs (a copy): nothing to solve for
        return None
    powers = rest.as_powers_dict()
    axes = [s.name for s in powers if s.name in mesh_axes]
    if len(axes) != 1 or powers[symbol(axes[0])] != -1:
        return None
    others = [(s.name, p) for s, p in powers.items() if s.name != axes[0]]
    if not others or any(p < 0 or name in token_dims or name in mesh_axes for name, p in others):
        return None
    return axes[0]


def _evaluate(expr: sympy.Expr, sizes: dict[str, int] | None) -> float | None:
    if sizes is None:
        return None
    free = expr.free_symbols  # type: ignore[attr-defined]
    if any(s.name not in sizes for s in free):
        return None
    return float(expr.subs({s: sizes[s.name] for s in free}))
