"""The planner's sums and cotangents: partial terms reduced once, a norm's cotangent reduced where its
backward runs, a sum's aliased cotangents moved once (regressions from PaLM's parallel layer, whose
checkpoint is sharded over the model axis)."""

from __future__ import annotations

import pytest

import shardc
from shardc.collectives import Op
from shardc.ir.plan import Plan

PARALLEL = """mesh X=4, Y=4
dims B=4096, D=4096, F=16384
hardware tpu-v4p
param W1, W2
X1[B_X, D_Y] = X0[B_X, D_Y] + A[B_X, F_Y] · W1[F_Y, D] + C[B_X, F_Y] · W2[F_Y, D]
"""

NORM = """mesh X=4, Y=4
dims B=262144, D=4096, F=16384
hardware tpu-v4p
param W1, W2
layers 2 {
  L[B_X, D] = rmsnorm(X0[B_X, D_Y] over D)
  A[B_X, F_Y] = L[B_X, D] · W1[D_X, F_Y]
  X1[B_X, D_Y] = X0[B_X, D_Y] + A[B_X, F_Y] · W2[F_Y, D_X]
}
"""

TWO_TERMS = """mesh X=4, Y=2
dims B=4096, D=1024, F=4096
hardware tpu-v4p
param W1, W2
Z[B, D_X] = A[B, F_X] · W1[F_X, D] + C[B, F_X] · W2[F_X, D]
"""


def _plan(text: str) -> Plan:
    return shardc.plan(shardc.parse(text))


def _moves(steps: tuple, op: Op, prefix: str) -> list[str]:
    return [str(s.dst) for s in steps if s.op is op and s.tensor.startswith(prefix)]


@pytest.fixture(scope="module")
def parallel() -> Plan:
    return _plan(PARALLEL)


def test_two_partial_products_beside_a_sharded_term_are_reduce_scattered_once(parallel: Plan) -> None:
    """``X + C · W1 + A · W2`` with X sharded as the result: the two partial products are added first
    and reduce-scattered once, then X is added (not each product reduced apart)."""
    assert _moves(parallel.forward, Op.REDUCE_SCATTER, "X1") == ["X1_part[B_X, D_Y]"]
    last = parallel.forward[-1]
    assert last.tensor == "X1" and {o.name for o in last.operands} == {"X1_part", "X0"}


def test_a_norms_cotangent_is_reduced_where_its_backward_runs_sharded() -> None:
    """dL, partial over Y, is reduce-scattered onto D (the norm's backward runs on D_Y, its row sums
    all-reduced), not all-reduced whole and then sliced to the checkpoint's D_Y."""
    plan = _plan(NORM)
    assert not [s for s in plan.backward if s.op is Op.ALL_REDUCE and s.tensor == "dL"]
    vjp = next(s for s in plan.backward if str(s.fn) == "rmsnorm_vjp")
    assert str(vjp.dst) == "dX0_2[B_X, D_Y]"


def test_a_sums_aliased_cotangents_are_gathered_once() -> None:
    """dZ_t1 and dZ_t2 are dZ under two names: gathered once, for the einsums of both."""
    plan = _plan(TWO_TERMS)
    assert len(_moves(plan.backward, Op.ALL_GATHER, "dZ")) == 1
