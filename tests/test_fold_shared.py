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
    alias = next(s for s in plan.forward if s.fn == ALIAS and str(s.dst) == "O2[E, S]")
    assert alias.operands == (gather.dst,)
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
    assert [s.op for s in folded] == [Op.COPY, Op.REDUCE_SCATTER, Op.ELEMENTWISE, Op.ELEMENTWISE]
    assert folded[2].fn == ALIAS and folded[2].operands == (part1,) and folded[2].dst == part2  # copied once
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


ONE_EINSUM = "mesh X=8\ndims S=64, E=32, F=16\ndtype f32\nO1[E, F] = A[S_X, E] · W[S_X, F]\n"
TWO_EINSUMS = ONE_EINSUM + "O2[E, F] = A[S_X, E] · W[S_X, F]\n"


@pytest.mark.parametrize("text", [TWO_COPIES, TWO_EINSUMS])
def test_the_repeated_local_step_runs_once(text: str) -> None:
    """The second copy (or einsum) of the same data is the first's result renamed, as XLA's
    common-subexpression pass makes it: no FLOPs, no HBM traffic and no memory of its own (the
    spec without the second statement costs the same)."""
    plan = shardc.plan(shardc.parse(text))
    local = [s for s in plan.forward if s.op in (Op.COPY, Op.EINSUM)]
    assert [s.tensor for s in local] == ["O1"]
    assert next(s for s in plan.forward if s.tensor == "O2" and s.op is Op.ELEMENTWISE).fn == ALIAS
    assert check_plan(plan) == []
    one = shardc.plan(shardc.parse(text.split("O2[")[0]))  # the spec without its second statement
    report, single = shardc.cost(plan), shardc.cost(one)
    assert report.forward.compute_flops == single.forward.compute_flops
    assert report.forward.memory_bytes == single.forward.memory_bytes
    assert report.memory.total_bytes == single.memory.total_bytes


@pytest.mark.slow
def test_xla_runs_the_repeated_einsum_once_as_the_cost_counts() -> None:
    """The lowered forward has one einsum, and XLA's FLOPs of the two-einsum step are the one-einsum
    step's; shardc's forward FLOPs are that einsum's, 2*S/X*E*F."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    from shardc.lowering.api import lower

    def xla_flops(text: str) -> float:
        plan = shardc.plan(shardc.parse(text))
        lowered = lower(plan, sizes=dict(plan.sizes or {}))
        mesh, forward, _ = lowered.namespace.programs()
        args = [jax.ShapeDtypeStruct(lowered.global_shape(b.ref), np.float32,
                                     sharding=NamedSharding(mesh, lowered.namespace.FORWARD_IN[b.key]))
                for b in lowered.module.forward.inputs]
        forward_code = lowered.source.split("def forward_local")[1].split("def backward_local")[0]
        assert forward_code.count("jnp.einsum(") == 1
        return float(forward.lower(*args).compile().cost_analysis()["flops"])

    assert xla_flops(TWO_EINSUMS) == xla_flops(ONE_EINSUM)
    flops = shardc.cost(shardc.plan(shardc.parse(TWO_EINSUMS))).forward.compute_flops
    assert flops == 2 * 64 // 8 * 32 * 16


def test_a_layer_moves_its_own_data_not_a_move_made_once_outside_its_block() -> None:
    """Inside ``layers`` X0 is each layer's input; before the block it is the first's: two values."""
    spec = "mesh X=4\nO1[D, S] = X0[S_X, D]\nlayers 3 {\n  O2[D, S] = X0[S_X, D]\n  X1[S_X, D] = tanh(X0[S_X, D])\n}\n"
    plan = shardc.plan(shardc.parse(spec))
    assert [(s.op, s.once) for s in _collectives(plan.forward)] == [(Op.ALL_GATHER, True), (Op.ALL_GATHER, False)]


def test_a_free_slice_keeps_its_place_outside_the_block() -> None:
    """A slice that replaces a collective after a ``layers`` block (Lg's AllReduce holds the V_X shard the loss
    reads) runs once, as the collective it replaces: the slice was made a block step, the plan's sections did
    not cut and ``shardc lower`` of the pipelined spec raised "a step outside the `layers` block sits among the
    block's steps" (found by a search of chains in blocks, issue 20's point 3)."""
    spec = ("mesh X=2, Y=2\ndims B=16, D=8, F=8, V=16\nconst Tok, Next\nparam W1, W2, W_emb, W_out\n"
            "X0[B_Y, D_X] = embed(Tok[B_Y], W_emb[V_X, D])\nlayers 2 {\n  G[B_Y, F] = X0[B_Y, D_X] · W1[D_X, F]\n"
            "  X1[B_Y, D_X] = X0[B_Y, D_X] + G[B_Y, F] · W2[F, D_X]\n}\nLg[B_Y, V_X] = X1[B_Y, D_X] · W_out[D_X, V]\n"
            "Loss[] = cross_entropy(Lg[B_Y, V_X], Next[B_Y])\n")
    plan = shardc.plan(shardc.parse(spec), collective_matmul=False)
    slices = [s for s in plan.forward if s.op is Op.SLICE]
    assert slices and all(s.once for s in slices)
    assert plan.sections is not None and plan.section("after").forward
