"""``shardc explain`` on the ops a program writes beside its contractions: a square weight read along
one dim twice, a rotary embedding's halves put back together, sorts, gathers and concatenations the
language has no form for.

Each program builds its mesh over the 8 emulated CPU devices (conftest) and is compiled, not run.
"""

from __future__ import annotations

from typing import Any

import pytest

import shardc
from shardc.explain.explain_report import explain
from tests.test_explain import _arg, _mesh

pytestmark = pytest.mark.slow


def _statements(e: Any) -> list[str]:
    return [f"{s.result} = {s.expr}" for s in shardc.parse(e.spec).statements]


def test_a_square_weight_added_to_its_input_reads_the_product_through_a_rename() -> None:
    """``x + relu(x @ w)``, w[D, D]: w's two dims are two dims of the spec of one size (w[S, T]), and the
    product, of T, is read as x's S through the language's rename before the sum."""
    import jax

    mesh = _mesh((4, 2))
    fn = jax.jit(lambda x, w: x + jax.nn.relu(x @ w))
    e = explain(fn, _arg(mesh, (16, 8), "data"), _arg(mesh, (8, 8), None, "model"))
    spec = shardc.parse(e.spec)
    assert _statements(e) == [
        "Y1[B_{data}, T_{model}] = x[B_{data}, S] · w[S, T_{model}]",
        "H1[B_{data}, T_{model}] = relu(Y1[B_{data}, T_{model}])",
        "C1[B_{data}, S_{model}] = H1[B_{data}, T_{model}]",
        "R1[B_{data}, S_{model}] = x[B_{data}, S] + C1[B_{data}, S_{model}]"], e.spec
    assert spec.sizes["S"] == spec.sizes["T"] == 8
    assert not e.plan and not e.xla
    from shardc.verification.verify import verify

    report = verify(spec)  # the rename holds at verify's sizes too: S and T stay one size
    assert report.ok, [r for r in (*report.values, *report.collectives) if not r.ok]
