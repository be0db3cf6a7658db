"""``route_by_choice``: route's top-k routing with the experts' slots taken choice by choice.

GShard's top-2 (Lepikhin et al. 2020) counts the second experts' slots after every first one, and
flaxformer's masked router gives all tokens' first choices their slots before any second choice; the
language's ``route`` seats a token's k choices at once, tokens in order.  The two differ only where a
capacity binds, and only for k > 1.
"""

from __future__ import annotations

import numpy as np
import pytest

import shardc
from shardc.ir.localops import Route
from shardc.ops.route_code import route_forward
from shardc.verification.verify import render_report, verify
from tests.test_moe import SMALL

BY_CHOICE = SMALL.replace("= route(", "= route_by_choice(")


def test_route_by_choice_by_hand() -> None:
    """Token 0 picks experts 0 then 1, token 1 picks 1 then 2, one slot each: token by token, token 0's
    second choice takes expert 1's slot; choice by choice, token 1's first choice does."""
    gates = np.array([[0.6, 0.3, 0.1], [0.1, 0.6, 0.3]])  # [S, E]
    token_order = route_forward(gates, 0, 1, 1, 2, np)[..., 0]
    by_choice = route_forward(gates, 0, 1, 1, 2, np, by_choice=True)[..., 0]
    np.testing.assert_array_equal(token_order, [[1, 1, 0], [0, 0, 1]])
    np.testing.assert_array_equal(by_choice, [[1, 0, 0], [0, 1, 1]])
    one = np.random.default_rng(0).normal(size=(3, 6, 4))
    np.testing.assert_array_equal(route_forward(one, 1, 2, 2, 1, np), route_forward(one, 1, 2, 2, 1, np,
                                                                                   by_choice=True))  # k = 1: alike


def test_route_by_choice_plans_as_route_does() -> None:
    """The same steps and moves as route (E and S whole for the count), its step's operation marked."""
    plain, ranked = (shardc.plan(shardc.parse(text)) for text in (SMALL, BY_CHOICE))
    assert [(s.op, s.tensor, s.axes) for s in plain.forward] == [(s.op, s.tensor, s.axes) for s in ranked.forward]
    (step,) = [s for s in ranked.forward if isinstance(s.fn, Route)]
    assert step.fn == Route("S", "E", "C", 2, True) and str(step.fn) == "route_by_choice(S,E,C,2)"
    assert shardc.cost(plain).json_text() == shardc.cost(ranked).json_text().replace("route_by_choice", "route")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_route_topk_by_choice_matches_the_reference(seed: int) -> None:
    import jax.numpy as jnp

    from shardc.lowering.runtime import route_topk

    gates = np.round(np.random.default_rng(seed).normal(size=(2, 6, 4)), 1)  # rounded: ties happen
    got = np.asarray(route_topk(jnp.asarray(gates, jnp.float32), 2, 2, 1, 2, by_choice=True))
    np.testing.assert_array_equal(got, route_forward(gates.astype(np.float32), 1, 2, 2, 2, np, by_choice=True))


@pytest.mark.slow
def test_a_layer_routed_choice_by_choice_verifies() -> None:
    """The lowered module's mask (``route_topk(..., by_choice=True)``) against the reference's, sharded."""
    report = verify(shardc.parse(BY_CHOICE))
    assert report.ok, render_report(report)
