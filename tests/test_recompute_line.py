"""A spec's ``recompute`` line: functions, params (their products) and tensors the backward makes again
whatever the ``--recompute`` policy, as DeepSeek-V3 recomputes its RMSNorms and MLA up-projections."""

from __future__ import annotations

import pytest

import shardc
from shardc.costmodel.memory import residual_table
from shardc.errors import ShardcError
from shardc.ir.plan import Plan

LAYER = """mesh X=2
dims B=8, D=16, F=32, Q=8
param W_dq, W_uq, W_o
recompute rmsnorm, W_uq
L[B_X, D] = rmsnorm(X[B_X, D] over D)
Cq[B_X, Q] = L[B_X, D] · W_dq[D, Q]
U[B_X, F] = silu(Cq[B_X, Q] · W_uq[Q, F])
Y[B_X, D] = U[B_X, F] · W_o[F, D]
"""


def _plan(text: str, recompute: str = "none") -> Plan:
    return shardc.plan(shardc.parse(text), recompute=recompute)


def _kept(p: Plan) -> set[str]:
    return {ref.name for ref, _ in residual_table(p)}


def test_the_line_round_trips_and_lines_add_up() -> None:
    spec = shardc.parse(LAYER.replace("recompute rmsnorm, W_uq\n", "recompute rmsnorm\nrecompute W_uq\n"))
    assert spec.recompute == ("rmsnorm", "W_uq")
    assert "recompute rmsnorm, W_uq\n" in str(spec)
    assert shardc.parse(str(spec)) == spec


def test_named_values_are_recomputed_under_any_policy() -> None:
    plain = _plan(LAYER.replace("recompute rmsnorm, W_uq\n", ""))
    assert {"L", "U_t1"} <= _kept(plain) and not plain.recomputed
    lean = _plan(LAYER)
    # the norm's output and the product reading W_uq are made again from what stays: X, Cq
    assert {"L", "U_t1"} & _kept(lean) == set()
    assert {"L", "U_t1"} <= {s.tensor for s in lean.recomputed}
    assert {"X", "Cq", "U"} <= _kept(lean)
    dots = _plan(LAYER, "dots")  # dots keeps every product with a weight, but the line's
    assert "U_t1" not in _kept(dots) and "Cq" in _kept(dots)


def test_a_tensor_and_its_rename_go_together() -> None:
    text = LAYER.replace("recompute rmsnorm, W_uq", "recompute L").replace(
        "Cq[B_X, Q] = L[B_X, D] · W_dq[D, Q]", "Lk[B_X, E] = L[B_X, D]\nCq[B_X, Q] = Lk[B_X, E] · W_dq[E, Q]")
    text = text.replace("dims B=8, D=16", "dims B=8, D=16, E=16")
    p = _plan(text)
    assert {"L", "Lk"} & _kept(p) == set()
    assert "X" in _kept(p)


@pytest.mark.parametrize(("line", "message", "column"), [
    ("recompute rmsnorm, W_up", "recompute W_up: not a function the spec calls, a param or a computed tensor", 20),
    ("recompute gelu", "recompute gelu: not a function the spec calls", 11),
    ("recompute W_uq, W_uq", "recompute W_uq is listed twice", 17),
])
def test_recompute_errors_point_at_the_name(line: str, message: str, column: int) -> None:
    with pytest.raises(ShardcError) as err:
        shardc.parse(LAYER.replace("recompute rmsnorm, W_uq", line))
    assert message in err.value.message
    assert err.value.span is not None and (err.value.span.line, err.value.span.column) == (4, column)


def test_the_lowered_backward_makes_them_again_and_the_forward_hands_on_only_what_is_kept() -> None:
    from shardc.lowering.api import module_source

    source, _ = module_source(_plan(LAYER))
    head = source[source.index("def backward_local("):].splitlines()[0]
    arguments = {a.strip() for a in head[head.index("(") + 1:head.index(")")].split(",")}
    assert {"X", "Cq", "U"} <= arguments and not {"L", "U_t1"} & arguments
    body = source[source.index("def backward_local("):]
    assert "    L = " in body and "    U_t1 = jnp.einsum" in body


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_recomputing_plan_verifies_values_and_hlo(recompute: str) -> None:
    from shardc.verification.verify import render_report, verify

    # D over Y: the recomputed norm all-reduces its row statistics again, in the backward's HLO
    text = LAYER.replace("mesh X=2", "mesh X=2, Y=2").replace("[B_X, D]", "[B_X, D_Y]").replace("[D, Q]", "[D_Y, Q]")
    p = _plan(text, recompute)
    assert any(s.is_collective for s in p.recomputed)
    report = verify(p)
    assert report.ok, render_report(report)
