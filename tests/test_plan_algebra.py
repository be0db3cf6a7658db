"""Regressions: the algebra the search must know, and size-1 axes (issue 9, items 4-6, 10, 11, 20)."""

from __future__ import annotations

import pytest

import shardc
from shardc.errors import ShardcError
from shardc.ir.plan import Monomial, Op, Plan, Step
from shardc.ir.spec import Dim, TensorRef
from shardc.planner.check import check_plan
from shardc.planner.fold import fold_redundant


def plan(text: str, **options: str) -> Plan:
    return shardc.plan(shardc.parse(text), **options)


def moves(steps: tuple[Step, ...]) -> list[str]:
    return [f"{s.op.title}_{''.join(s.axes)} {s.src} -> {s.dst}" for s in steps if s.is_collective]


def forward_bytes(p: Plan) -> float:
    sizes = p.size_map
    assert sizes is not None
    return sum(float(s.weighted_volume().evaluate(sizes)) for s in p.forward if s.volume is not None)  # type: ignore[union-attr]


GELU = "mesh X=4\ndims B=1024, D=64, F=4096\nH[B, F] = gelu(In[B_X, D] · W[D, F])\n"


def test_a_function_of_an_einsum_plans_as_the_einsum_then_the_function() -> None:
    """Item 4: f(A · B) gathered the pre-activation, 64x the bytes of the line without f."""
    with_f, without = plan(GELU), plan(GELU.replace("gelu(", "").replace("F])\n", "F]\n"))
    assert moves(with_f.forward) == moves(without.forward) == ["AllGather_X In[B_X, D] -> In[B, D]"]
    assert forward_bytes(with_f) == forward_bytes(without) == 2 * 1024 * 64
    assert check_plan(with_f) == []


def test_nested_functions_keep_the_layout() -> None:
    """Item 4: the layout passes through any number of functions."""
    nested = plan(GELU.replace("gelu(In[B_X, D] · W[D, F])", "tanh(gelu(In[B_X, D] · W[D, F]))"))
    assert moves(nested.forward) == ["AllGather_X In[B_X, D] -> In[B, D]"]
    assert check_plan(nested) == []


def test_an_elementwise_chain_with_permuted_indices_moves_nothing() -> None:
    """Item 5: permuted indices are a local transpose, never an AllToAll."""
    p = plan("mesh X=4\ndims B=1024, F=4096\nH[F_X, B] = tanh(gelu(Z[B, F_X]))\n")
    assert moves(p.forward) == [] and moves(p.backward) == []
    assert check_plan(p) == []


def test_the_cheaper_operand_of_a_product_of_partial_sums_is_reduced() -> None:
    """Item 6: reduce W (D*F), then the result (B*F), not A (B*D): 262 kB, not 33.8 MB."""
    p = plan("mesh X=4\ndims B=4096, D=4096, F=8\nOut[B, F] = A[B, D]{U_X} · W[D, F]{U_X}\n")
    assert moves(p.forward) == ["AllReduce_X W[D, F]{U_X} -> W[D, F]", "AllReduce_X Out[B, F]{U_X} -> Out[B, F]"]
    assert forward_bytes(p) == 4 * 4096 * 8 + 4 * 4096 * 8 == 262144
    assert check_plan(p) == []


TWO_DIMS = "mesh X=2, Y=2\ndims B=64, D=64\nA2[B, D] = A[B_X, D_Y]\n"


def test_a_gather_of_two_dims_is_one_collective() -> None:
    """Item 10: one AllGather over both axes (V/(2W)), not an AllToAll plus an AllGather."""
    p = plan(TWO_DIMS)
    (gather,) = [s for s in p.forward if s.is_collective]
    assert gather.op is Op.ALL_GATHER and gather.axes == ("X", "Y") and gather.dim is None
    assert str(gather.dst) == "A2[B, D]" and forward_bytes(p) == 2 * 64 * 64
    assert check_plan(p) == []


@pytest.mark.slow
def test_a_gather_of_two_dims_lowers_and_verifies() -> None:
    from shardc.verification.verify import render_report, verify

    spec = shardc.parse(TWO_DIMS.replace("A2[B, D]", "A2[B, D_X]"))  # a slice after it, to lower it all
    report = verify(spec)
    assert report.ok, render_report(report)
    report = verify(shardc.parse(TWO_DIMS))
    assert report.ok, render_report(report)
    assert [r.step.split()[0] for r in report.collectives if r.phase == "forward"] == ["AllGather_XY"]


def _ref(name: str, *dims: tuple[str, tuple[str, ...]]) -> TensorRef:
    return TensorRef(name, tuple(Dim(i, axes) for i, axes in dims))


def test_an_all_to_all_followed_by_an_all_gather_folds() -> None:
    src = _ref("A", ("B", ("X",)), ("D", ("Y",)))
    mid = _ref("A", ("B", ()), ("D", ("Y", "X")))
    end = _ref("A", ("B", ()), ("D", ()))
    bytes_ = Monomial.of(2, num=("B", "D"))
    steps = (Step(Op.ALL_TO_ALL, "A", mid, src, ("X",), dim=1, dim2=0, volume=bytes_.scale(1)),
             Step(Op.ALL_GATHER, "A", end, mid, ("Y", "X"), dim=1, volume=bytes_))
    (folded,) = fold_redundant(steps, frozenset({end}))
    assert folded.op is Op.ALL_GATHER and folded.src == src and folded.dst == end
    assert folded.axes == ("X", "Y") and folded.dim is None and folded.volume == bytes_
    # kept when something else reads the AllToAll's result
    assert len(fold_redundant(steps, frozenset({end, mid}))) == 2


def test_partial_sums_written_in_any_axis_order_plan_alike() -> None:
    """Item 20: {U_YX} planned wrongly (the final slice was dropped as dead); {U_XY} worked."""
    text = "mesh X=2, Y=2, Z=2\nOut[B_Z, F]{U_YX} = In[B, D] * W[D, F]\n"
    yx, xy = plan(text), plan(text.replace("U_YX", "U_XY"))
    assert check_plan(yx) == [] and yx.forward == xy.forward
    assert str(yx.forward[-1].dst) == "Out[B_Z, F]{U_XY}"


def test_moves_over_size_one_axes_vanish() -> None:
    """Item 20: a collective over P=1 moves nothing and XLA drops it; the plan must not promise it."""
    p = plan("mesh X=2, P=1\nT2[E, M] = A[M_X, E_P]\nH3[E_X, M] = A[M_X, E_P]\n")
    assert all("P" not in s.axes for s in p.forward + p.backward)
    assert all("P" not in s.dst.sharding_text() for s in p.forward + p.backward)
    assert check_plan(p) == []


MAXTEXT = """mesh data=16, stage=1, fsdp=1, seq=1, tensor=4, expert=1, ctx=1, tt=1
dims B=1024, D=4096, F=16384
H[B_{data,fsdp}, F_{tensor,expert}] = In[B_{data,fsdp}, D_{seq}] · W_in[D_{fsdp,stage}, F_{tensor,expert}]
Out[B_{data,fsdp}, D_{ctx}] = H[B_{data,fsdp}, F_{tensor,expert}] · W_out[F_{tensor,tt}, D_{fsdp}]
"""


def test_size_one_axes_plan_as_if_absent() -> None:
    """Item 11: the 8-axis MaxText-style mesh plans as its 2 axes of size > 1 (a benchmark times it)."""
    eight = plan(MAXTEXT)
    two = plan("""mesh data=16, tensor=4
dims B=1024, D=4096, F=16384
H[B_{data}, F_{tensor}] = In[B_{data}, D] · W_in[D, F_{tensor}]
Out[B_{data}, D] = H[B_{data}, F_{tensor}] · W_out[F_{tensor}, D]
""")
    assert eight.forward == two.forward and eight.backward == two.backward
    assert check_plan(eight) == []


def test_past_the_budget_a_clear_error() -> None:
    with pytest.raises(ShardcError) as err:
        shardc.plan(shardc.parse("mesh X=2, Y=2\ndims B=8, D=8\nOut[B_X, D] = In[B_Y, D]\n"), budget=1)
    assert "gave up" in str(err.value) and err.value.fix and "merge axes" in err.value.fix


SIX = """mesh X=2, Y=2, Z=2, P=2, Q=2, R=2
dims B=4096, D=1024, F=4096
T[B_XYZ, F_PQR] = In[B_XYZ, D] · W_in[D_XYZ, F_PQR]
Out[B_XYZ, D] = T[B_XYZ, F_PQR] · W_out[F_PQR, D_XYZ]
"""


def test_past_four_axes_bonded_axes_move_as_one() -> None:
    """Item 11: 6 axes of size 2 plan (a benchmark times it) with X, Y, Z and P, Q, R each moved as one."""
    from shardc.sharding.unit import bonded_axes

    spec = shardc.parse(SIX)
    assert bonded_axes(spec) == (("X", "Y", "Z"), ("P", "Q", "R"))
    assert bonded_axes(shardc.parse(SIX.replace("D_XYZ]\n", "D_XZY]\n"))) == (("X",), ("Y",), ("Z",), ("P", "Q", "R"))
    four = SIX.replace("X=2, Y=2, Z=2, P=2, Q=2, R=2", "X=2, Y=2, Z=2, P=8").replace("PQR", "P")
    assert bonded_axes(shardc.parse(four)) is None  # up to four axes the search is exact
    six = plan(SIX)
    assert check_plan(six) == []
    steps = [s for s in six.forward + six.backward if s.is_collective or s.op is Op.SLICE]
    assert steps and all(set(s.axes) in ({"X", "Y", "Z"}, {"P", "Q", "R"}, set("XYZPQR")) for s in steps)
