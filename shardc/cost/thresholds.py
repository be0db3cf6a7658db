"""Where a phase turns from compute-bound to communication-bound, solved from its formulas.

With every collective overlapping compute (the seeds' verdict), a phase is
compute-bound iff ``flops / C > q_ici / W_ici + q_dcn / W_dcn``.  For one network
that reads ``flops / q > C / W``: the left side is the plan's arithmetic
intensity (FLOPs a byte), a formula in dims and mesh sizes only; the right side
the chip's.  Writing the intensity ``c * M`` with a number c, the sentence is the
seeds' ``B/X > C/W_ici = 2550 (tpu-v5p)``; when M is a model dim over a single
mesh axis it is solved for that axis, ``Y < F/2550``.  When a phase uses both
networks there is one sentence a network, each a necessary condition (the DCN
one is what the seeds quote across pods); the verdict itself adds both terms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardc.cost.formulas import PhaseFormula, symbol
from shardc.cost.hardware import Hardware

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
           token_dims: frozenset[str], sizes: dict[str, int] | None) -> list[Threshold]:
    """The threshold sentences of one phase, one per network its collectives cross."""
    parts = [(net, q) for net, q in (("ici", formula.q_ici), ("dcn", formula.q_dcn)) if q != 0]
    out: list[Threshold] = []
    for network, q in parts:
        label = phase if len(parts) == 1 else f"{phase} ({network.upper()} part)"
        out.append(_one(label, network, formula.flops, q, hw, mesh_axes, token_dims, sizes))
    return out


def _one(label: str, network: str, flops: sympy.Expr, q: sympy.Expr, hw: Hardware,
         mesh_axes: frozenset[str], token_dims: frozenset[str], sizes: dict[str, int] | None) -> Threshold:
    import sympy

    intensity = sympy.factor(sympy.simplify(flops / q))
    w_name = "W_ici" if network == "ici" else "W_dcn"
    chip = hw.intensity_ici if network == "ici" else hw.intensity_dcn
    coeff, rest = intensity.as_coeff_Mul()
    if not _is_monomial(rest) or rest == 1:
        coeff, rest = sympy.Integer(1), intensity
    value = chip / float(coeff)
    rhs_sym = str(symbol("C") / (coeff * symbol(w_name)))
    axis = _single_axis(rest, mesh_axes, token_dims)
    here = _evaluate(rest, sizes)
    where = f"({hw.name})"
    if axis is not None:
        numerator = rest * symbol(axis)
        lhs, relation, rhs = axis, "<", f"{numerator}/{format_number(value)}"
        sentence = (f"{label}: compute-bound iff {axis} < {rhs} "
                    f"(from {rest} > {rhs_sym} = {format_number(value)}, {hw.name})")
        here_axis = None if here is None or sizes is None else float(sizes[axis])
        if here is not None and here_axis is not None:
            limit = here_axis * here / value  # = numerator / value at these sizes
            sentence += f"; here {axis} = {format_number(here_axis)} vs {rhs} = {format_number(limit)}"
        holds = None if here is None else here > value
        return Threshold(label, network, str(intensity), lhs, relation, rhs, value,
                         here_axis, holds, sentence)
    lhs = str(rest)
    sentence = f"{label}: compute-bound iff {lhs} > {rhs_sym} = {format_number(value)} {where}"
    if not rest.free_symbols:  # type: ignore[attr-defined]
        sentence = (f"{label}: {format_number(float(rest))} FLOPs a byte at any size, "
                    f"compute-bound iff that exceeds {rhs_sym} = {format_number(value)} {where}")
    holds = None if here is None else here > value
    if here is not None and rest.free_symbols:  # type: ignore[attr-defined]
        sentence += f"; here {lhs} = {format_number(here)}"
    return Threshold(label, network, str(intensity), lhs, ">", rhs_sym, value, here, holds, sentence)


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
    if not _is_monomial(rest):
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
