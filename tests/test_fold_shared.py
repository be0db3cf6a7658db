"""One collective where the same data is moved the same way twice: plan, cost and verify agree with XLA.

Two local einsums of one value into one layout (``O1[E, S_X] = A[S_X, E]`` and
``O2[E, S_X] = A[S_X, E]``) make the same data; XLA's common-subexpression pass merges
them and then the collectives of their results, so the plan moves the data once and the
second result is a new name for the first's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import shardc
from shardc.cli.main import main
from shardc.ir.localops import ALIAS
from shardc.ir.plan import Op, Step
from shardc.ir.spec import Dim, TensorRef
from shardc.planner.check import check_plan
from shardc.planner.fold import fold_redundant

TWO_COPIES = "mesh X=8\ndims E=16, S=64\nO1[E, S] = A[S_X, E]\nO2[E, S] = A[S_X, E]\n"

# One spec per collective kind, each moving a copy of A the same way twice.
EACH_KIND = {
    "AllGather": "mesh X=8\nO1[E, S] = A[S_X, E]\nO2[E, S] = A[S_X, E]\n",
    "AllToAll": "mesh X=8\nO1[E_X, S] = A[S_X, E]\nO2[E_X, S] = A[S_X, E]\n",
    "AllReduce": "mesh X=4\nO1[E, S] = A[S, E]{U_X}\nO2[E, S] = A[S, E]{U_X}\n",
    "ReduceScatter": "mesh X=4\nO1[E_X, S] = A[S, E]{U_X}\nO2[E_X, S] = A[S, E]{U_X}\n",
    # two einsums of the same operands: their partial sums are one value, reduced once
    "AllReduce of einsums": "mesh X=4\nY1[B, F] = X[B, D_X] · W[D_X, F]\nY2[B, F] = X[B, D_X] · W[D_X, F]\n",
}


def _collectives(steps: tuple[Step, ...]) -> list[Step]:
    return [s for s in steps if s.is_collective]


def test_the_two_copies_are_gathered_once() -> None:
    plan = shardc.plan(shardc.parse(TWO_COPIES))
    (gather,) = _collectives(plan.forward)
    assert gather.op is Op.ALL_GATHER and str(gather.dst) == "O1[E, S]"
    alias = next(s for s in plan.forward if s.tensor == "O2" and s.fn == ALIAS)
    assert alias.operands == (gather.dst,) and str(alias.dst) == "O2[E, S]"
    assert check_plan(plan) == []


def test_the_cost_counts_the_gathered_bytes_once() -> None:
    report = shardc.cost(shardc.plan(shardc.parse(TWO_COPIES)))
    # one AllGather of A's E*S bf16 elements: V = 2*E*S bytes
    assert report.forward.comm_bytes == 2 * 16 * 64
    assert [r.op for r in report.forward.rows if r.is_collective] == [Op.ALL_GATHER]


@pytest.mark.parametrize("kind", sorted(EACH_KIND))
def test_every_collective_kind_moving_one_value_twice_runs_once(kind: str) -> None:
    plan = shardc.plan(shardc.parse(EACH_KIND[kind]))
    assert len(_collectives(plan.forward)) == 1, kind
    assert check_plan(plan) == []


def test_a_copy_into_another_layout_is_other_data_and_moved_again() -> None:
    """``O2[E_X, S]`` is not ``O1[E, S]`` sliced from the same copy: each keeps its own move."""
    plan = shardc.plan(shardc.parse("mesh X=8\nO1[E, S] = A[S_X, E]\nO2[E_X, S] = A[S_X, E]\n"))
    assert sorted(s.op.title for s in _collectives(plan.forward)) == ["AllGather", "AllToAll"]


def _ref(name: str, *dims: tuple[str, tuple[str, ...]], unreduced: tuple[str, ...] = ()) -> TensorRef:
    return TensorRef(name, tuple(Dim(i, axes) for i, axes in dims), unreduced)


def test_the_fold_shares_a_moved_gradient_in_the_backward_too() -> None:
    """The pass is the same in both phases: two copies of a cotangent reduced alike reduce once."""
    d_out = _ref("dO", ("S", ()), ("E", ()), unreduced=("X",))
    part1, part2 = _ref("dA_1", ("E", ()), ("S", ()), unreduced=("X",)), \
        _ref("dA_2", ("E", ()), ("S", ()), unreduced=("X",))
    done1, done2 = _ref("dA_1", ("E", ("X",)), ("S", ())), _ref("dA_2", ("E", ("X",)), ("S", ()))
    steps = (Step(Op.COPY, "dA_1", part1, operands=(d_out,)),
             Step(Op.REDUCE_SCATTER, "dA_1", done1, part1, ("X",), dim=0),
             Step(Op.COPY, "dA_2", part2, operands=(d_out,)),
             Step(Op.REDUCE_SCATTER, "dA_2", done2, part2, ("X",), dim=0))
    folded = fold_redundant(steps, frozenset({done1, done2}))
    assert [s.op for s in folded] == [Op.COPY, Op.REDUCE_SCATTER, Op.COPY, Op.ELEMENTWISE]
    assert folded[-1].fn == ALIAS and folded[-1].operands == (done1,) and folded[-1].dst == done2


@pytest.mark.slow
def test_verify_passes_the_two_copies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The compiled HLO has one all-gather; the plan must promise one (it promised two before)."""
    path = tmp_path / "two_copies.shard"
    path.write_text(EACH_KIND["AllGather"], encoding="utf-8")
    status = main(["verify", str(path)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "MISMATCH" not in out and out.count("AllGather_X") == 1


def test_a_layer_moves_its_own_data_not_a_move_made_once_outside_its_block() -> None:
    """Inside ``layers`` X0 is each layer's input; before the block it is the first's: two values."""
    spec = "mesh X=4\nO1[D, S] = X0[S_X, D]\nlayers 3 {\n  O2[D, S] = X0[S_X, D]\n  X1[S_X, D] = tanh(X0[S_X, D])\n}\n"
    plan = shardc.plan(shardc.parse(spec))
    assert [(s.op, s.once) for s in _collectives(plan.forward)] == [(Op.ALL_GATHER, True), (Op.ALL_GATHER, False)]
