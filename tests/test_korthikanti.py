"""Activation memory of a GPT layer: Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models"), Table 2, as formulas and as numbers.

s sequence, b batch, h hidden, a heads, t tensor-parallel degree; 16-bit activations, the 1-byte
dropout masks, a 4h GeLU MLP.  The spec's dims: S (=T, the key positions), B, D = h, N = a,
H = h/a, F = 4h, and the mesh axis Y = t.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sympy

import shardc
from shardc.costmodel.memory import residual_formula
from shardc.spec.overrides import apply_overrides

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
s, b, h, a, t = sympy.symbols("s b h a t", positive=True)

# (example, --recompute, Table 2's bytes a layer); every figure with --save none, as the paper
# counts a gathered (sequence-parallel) layernorm output as gathered again in the backward
TABLE_2 = [
    ("gpt_layer_tp", "none", s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
    ("gpt_layer_tp_sp", "none", s * b * h * (34 / t + 5 * a * s / (h * t))),
    ("gpt_layer_tp_sp", "selective", 34 * s * b * h / t),
    ("gpt_layer_tp", "full", 2 * s * b * h),
]


def _plan(name: str, recompute: str, **sizes: int) -> shardc.Plan:
    spec = shardc.parse((EXAMPLES / f"{name}.shard").read_text(encoding="utf-8"))
    if sizes:
        spec = apply_overrides(spec, sizes)
    return shardc.plan(spec, save="none", recompute=recompute)


def _as_table_2(formula: str) -> sympy.Expr:
    symbols = {n: sympy.Symbol(n, positive=True) for n in ("B", "S", "T", "D", "N", "H", "F", "Y")}
    expr = sympy.sympify(formula, locals=symbols)
    return sympy.simplify(expr.subs({symbols["T"]: s, symbols["S"]: s, symbols["B"]: b, symbols["F"]: 4 * h,
                                     symbols["H"]: h / a, symbols["N"]: a, symbols["D"]: h, symbols["Y"]: t}))


@pytest.mark.parametrize(("name", "recompute", "paper"), TABLE_2)
def test_table_2_formulas(name: str, recompute: str, paper: sympy.Expr) -> None:
    got = _as_table_2(str(residual_formula(_plan(name, recompute))))
    assert sympy.simplify(got - paper) == 0, got


def test_no_parallelism_is_34_plus_5as_over_h() -> None:
    got = _as_table_2(str(residual_formula(_plan("gpt_layer_tp", "none", Y=1))))
    assert sympy.simplify(got - s * b * h * (34 + 5 * a * s / h)) == 0, got


@pytest.mark.parametrize(("name", "recompute", "paper"), TABLE_2)
def test_table_2_numbers_at_gpt3_sizes(name: str, recompute: str, paper: sympy.Expr) -> None:
    """GPT-3 175B (s=2048, h=12288, a=96) at b=1, t=8: the bytes `shardc cost` reports a layer."""
    plan = _plan(name, recompute)
    report = shardc.cost(plan)
    assert report.memory is not None
    want = float(paper.subs({s: 2048, b: 1, h: 12288, a: 96, t: 8}))
    per_layer = sum(bytes_ for _, bytes_ in report.memory.residuals)
    assert per_layer == pytest.approx(want, rel=1e-12)
