"""Sums, renames, causal masks and dropout, end to end: plan, backward, cost, lowering, verify."""

from __future__ import annotations

import re

import numpy as np
import pytest

import shardc
from shardc.costmodel.memory import memory
from shardc.ir.localops import ALIAS, NEG, Add, CausalVjp, DropoutMask, DropoutVjp
from shardc.ir.plan import Op, Plan
from shardc.lowering import reference
from shardc.ops import sums
from shardc.ops.masks import keep_mask
from shardc.planner.check import check_plan
from shardc.planner.plan_text import render_text
from shardc.verification.verify import Report, render_report, verify

TWO_PRODUCTS = """\
mesh X=2, Y=4
dims B=4096, D=4096, F=8192, G=8192
O[B_X, D] = A[B_X, F_Y] · W1[F_Y, D] + C[B_X, G_Y] · W2[G_Y, D]
"""

RESIDUAL = """\
mesh X=2, Y=2
H[B_X, F_Y] = gelu(X[B_X, D] · W1[D, F_Y])
Att[B_X, D]{U_Y} = H[B_X, F_Y] · W2[F_Y, D]
R[B_X, D] = X[B_X, D] + Att[B_X, D]{U_Y} - Bias[D]
"""

BIAS = """\
mesh X=2, Y=2
Y[B_X, S, D_Y] = X[B_X, S, D_Y] + Bias[D]
"""

SELF_ATTENTION = """\
mesh X=2, Y=2
dims B=8, S=16, T=16, D=32, N=4, H=8
Kx[B_X, T, D] = X[B_X, S, D]
Q[B_X, S, N_Y, H] = X[B_X, S, D] · Wq[D, N_Y, H]
K[B_X, T, N_Y, H] = Kx[B_X, T, D] · Wk[D, N_Y, H]
Sc[B_X, N_Y, S, T] = Q[B_X, S, N_Y, H] · K[B_X, T, N_Y, H]
"""

MASKS = """\
mesh X=2, Y=2
M[B, N, S_X, T_Y] = causal(Sc[B, N, S_X, T_Y], S, T)
Y[D_XY, S] = dropout(X[S, D_XY], 0.5)
"""


def _plan(text: str) -> Plan:
    plan = shardc.plan(shardc.parse(text))
    assert check_plan(plan) == []
    return plan


def _verified(plan: Plan) -> Report:
    report = verify(plan)
    assert report.ok, render_report(report)
    return report


def _collectives(steps: tuple[object, ...]) -> list[str]:
    return [f"{s.op.title}_{''.join(s.axes)} {s.tensor}" for s in steps if s.is_collective]  # type: ignore[attr-defined]


def test_partial_products_are_added_before_one_reduction() -> None:
    sized = _plan(TWO_PRODUCTS)
    assert _collectives(sized.forward) == ["AllReduce_Y O"]  # not one per product
    unsized = _plan(TWO_PRODUCTS.replace("dims B=4096, D=4096, F=8192, G=8192\n", ""))
    terms = [s for s in unsized.forward if s.op is Op.EINSUM]
    assert [s.dst.unreduced for s in terms] == [("Y",), ("Y",)]  # the products stay partial
    assert {s.tensor for s in unsized.forward if s.is_collective} == {"O"}


@pytest.mark.slow
def test_a_replicated_term_is_added_once_to_partial_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan(RESIDUAL)
    add = next(s for s in plan.forward if s.fn == Add((1, 1, -1)))
    assert add.dst.unreduced == ("Y",)  # X and Bias join the partial sums, one AllReduce after
    assert _collectives(plan.forward) == ["AllReduce_Y R"]
    source = shardc.lower(plan, sizes={"B": 4, "F": 6, "D": 8}).source
    assert "jnp.where(jax.lax.axis_index('Y') == 0, X, 0) + Att" in source
    _verified(plan)
    monkeypatch.setattr(sums, "guard_axes", lambda operand, result: ())  # X and Bias counted twice
    report = verify(plan)
    assert [r.tensor for r in report.values if not r.ok] == ["R"]


def test_the_residual_gradients_add() -> None:
    plan = _plan(RESIDUAL)
    adds = [s for s in plan.backward if isinstance(s.fn, Add)]
    assert [s.tensor for s in adds] == ["dX"]  # the residual's cotangent plus the MLP's dX
    assert any(s.fn == NEG for s in plan.backward)  # d(-Bias) = -dR, summed over B


@pytest.mark.slow
def test_a_broadcast_term_is_sliced_and_its_gradient_is_a_reduction() -> None:
    plan = _plan(BIAS)
    assert [s.op for s in plan.forward] == [Op.SLICE, Op.ELEMENTWISE]  # Bias[D] -> Bias[D_Y], free
    (reduction,) = [s for s in plan.backward if s.op is Op.EINSUM]
    assert str(reduction.dst) == "dBias[D_Y]{U_X}" and reduction.operands[0].name == "dY"
    assert re.search(r"\+ Bias\w*\[None, None, :\]", shardc.lower(plan, sizes={"B": 4, "S": 2, "D": 4}).source)
    _verified(plan)


@pytest.mark.slow
def test_a_rename_is_an_alias() -> None:
    plan = _plan(SELF_ATTENTION)
    text = render_text(plan)
    assert "Kx[B_X, T, D] = X" not in text  # no numbered step in the listing, no FLOPs, no bytes
    assert "= alias           Kx[B_X, T, D] is X[B_X, S, D]   (no data moved)" in text
    (alias,) = [s for s in plan.forward if s.fn == ALIAS]
    assert str(alias.dst) == "Kx[B_X, T, D]" and str(alias.operands[0]) == "X[B_X, S, D]"
    # queries and keys both give a partial dX: added, then one AllReduce
    assert [c for c in _collectives(plan.backward) if c.endswith(" dX") or "dKx" in c] == ["AllReduce_Y dX"]
    sizes = {**plan.spec.sizes, "X": 2, "Y": 2}
    kept = [v for v, _ in memory(plan, sizes, 1, 1e12).residuals]
    assert "X[B_X, S, D]" in kept and not any(v.startswith("Kx") for v in kept)  # one array, counted once
    _verified(plan)


@pytest.mark.slow
def test_a_rename_to_another_sharding_is_an_alias_then_moves() -> None:
    plan = _plan("mesh X=2, Y=2\nKx[B, T_Y, D] = X[B_X, S, D]\nO[B, T_Y, F] = Kx[B, T_Y, D] · W[D, F]\n")
    assert plan.forward[0].fn == ALIAS and str(plan.forward[0].dst) == "Kx[B_X, T, D]"
    moves = [s for s in plan.forward if (s.is_collective or s.op is Op.SLICE) and s.tensor != "O"]
    assert {s.tensor for s in moves} == {"Kx"} and str(moves[-1].dst) == "Kx[B, T_Y, D]"  # X never moves
    _verified(plan)


@pytest.mark.slow
def test_causal_masks_by_global_position_and_dropout_shards_one_global_mask() -> None:
    plan = _plan(MASKS)
    assert [s.fn for s in plan.backward] == [DropoutVjp(0.5), CausalVjp("S", "T")]
    assert plan.nbytes("Y_mask") == 1 and "Y_mask" in {r.name for r in plan.residuals}
    _verified(plan)


@pytest.mark.slow
def test_masks_from_local_positions_fail_verification(monkeypatch: pytest.MonkeyPatch) -> None:
    import jax.numpy as jnp

    from shardc.lowering import runtime

    def local_positions(x, dim, axes):  # type: ignore[no-untyped-def]
        n = x.shape[dim]  # every device's block starts at 0: local, not global, positions
        return jnp.arange(n).reshape([n if d == dim else 1 for d in range(x.ndim)])

    monkeypatch.setattr(runtime, "positions", local_positions)
    report = verify(_plan(MASKS))
    assert {r.tensor for r in report.values if not r.ok} == {"M", "Y", "dSc", "dX"}


def test_dropout_memory_counts_a_one_byte_mask() -> None:
    plan = _plan("mesh X=2\ndims B=8, S=16, D=32\nH[B_X, S, D] = gelu(X[B_X, S, D])\n"
                 "Y[B_X, S, D] = dropout(H[B_X, S, D], 0.1)\n")
    kept = dict(memory(plan, {**plan.spec.sizes, "X": 2}, 1, 1e12).residuals)
    assert kept["Y_mask[B_X, S, D]"] == 8 * 16 * 32 / 2  # one byte an element
    assert kept["X[B_X, S, D]"] == 8 * 16 * 32 / 2 * 2  # bf16


@pytest.mark.slow
def test_nested_dropouts_draw_different_masks_and_verify() -> None:
    spec = shardc.parse("mesh X=2\nY[B_X, D] = gelu(dropout(X[B_X, D], 0.5)) + dropout(X[B_X, D], 0.5)\n")
    masks = [s.fn for s in shardc.plan(spec).forward if isinstance(s.fn, DropoutMask)]
    assert len(set(masks)) == 2  # each dropout of a statement its own salt
    keep = keep_mask((64, 64), ("B", "D"), 12345, 0.5)
    assert 0.45 < keep.mean() < 0.55
    _verified(shardc.plan(spec))


def test_reference_keep_mask_is_order_free() -> None:
    keep = keep_mask((4, 6), ("B", "D"), 7, 0.3)
    assert np.array_equal(keep_mask((6, 4), ("D", "B"), 7, 0.3), keep.T)


CAUSAL_SELF_ATTENTION = """\
mesh X=2, Y=2
Kx[B_X, T, D] = X[B_X, S, D]
Q[B_X, S, N_Y, H] = X[B_X, S, D] · Wq[D, N_Y, H]
K[B_X, T, N_Y, H] = Kx[B_X, T, D] · Wk[D, N_Y, H]
V[B_X, T, N_Y, H] = Kx[B_X, T, D] · Wv[D, N_Y, H]
Sc[B_X, N_Y, S, T] = Q[B_X, S, N_Y, H] · K[B_X, T, N_Y, H]
P[B_X, N_Y, S, T] = softmax(dropout(causal(Sc[B_X, N_Y, S, T], S, T), 0.1) over T)
O[B_X, S, N_Y, H] = P[B_X, N_Y, S, T] · V[B_X, T, N_Y, H]
R[B_X, S, D] = X[B_X, S, D] + O[B_X, S, N_Y, H] · Wo[N_Y, H, D]
"""


@pytest.mark.slow
def test_megatron_causal_self_attention_all_reduces_once_each_way() -> None:
    plan = _plan(CAUSAL_SELF_ATTENTION)
    over_y = [[c for c in _collectives(steps) if c.startswith("AllReduce_Y")]
              for steps in (plan.forward, plan.backward)]
    assert over_y == [["AllReduce_Y R"], ["AllReduce_Y dX_sum"]]  # the residual joins the partial sum; dX of
    _verified(plan)  # queries, keys, values and the residual added before one reduction


@pytest.mark.slow
def test_dropout_draws_its_masks_from_a_key() -> None:
    """forward(inputs, key): another key, other masks; each equals the reference's under that key,
    and so do the planned gradients and jax.grad through the module."""
    import jax

    from shardc.lowering.api import lower
    from shardc.verification.verify import reference_inputs

    spec = shardc.parse("mesh X=2, Y=2\ndims B=8, D=16, F=32\nparam W\n"
                        "H[B_X, F_Y] = dropout(In[B_X, D] · W[D, F_Y], 0.5)\n")
    low = lower(shardc.plan(spec), sizes={"B": 8, "D": 16, "F": 32})
    x = low.random_inputs(0, np.float32)
    wide = reference_inputs(low, x)
    by_key = {k: np.asarray(low.forward(x, k)["H"]) for k in (0, 7)}
    for k, got in by_key.items():
        np.testing.assert_allclose(got, reference.forward(spec, wide, key=k)["H"], atol=1e-5)
    assert ((by_key[0] == 0) != (by_key[7] == 0)).mean() > 0.3  # other masks
    cot = low.random_cotangents(1, np.float32)
    grads = low.grad(x, cot, 7)
    want = reference.backward(spec, wide, {low.module.cotangents[n]: v.astype(np.float64) for n, v in cot.items()},
                              key=7)
    np.testing.assert_allclose(np.asarray(grads[low.module.grads["W"]]), want["W"], atol=1e-5)
    d = jax.grad(lambda w: (low.namespace.forward({"In": x["In"], "W": w}, 7)["H"] * cot["dH"]).sum())(x["W"])
    np.testing.assert_allclose(np.asarray(d), want["W"], atol=1e-5)
