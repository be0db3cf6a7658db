"""Reductions over a named index: softmax, rmsnorm, layernorm, sort, sum, mean, max, logsumexp.

Planned forward and backward (gather the reduced index, or all-reduce per-row
statistics, whichever the objective says), lowered, and verified against numpy.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardc
from shardc.device_pieces import step_volume
from shardc.ir.localops import Combine, Row, Vocab
from shardc.ir.plan import Op, Plan, Step
from shardc.ir.spec import Spec
from shardc.lowering.api import lower
from shardc.lowering.reference import backward as ref_backward
from shardc.lowering.reference import forward as ref_forward
from shardc.ops.reductions import REDUCTIONS
from shardc.ops.row_plans import FORWARD
from shardc.ops.rows_backward import BACKWARD
from shardc.planner.check import check_plan
from shardc.planner.plan_text import render_explain
from shardc.spec.walk import calls
from shardc.testing import specs
from shardc.timing import plan_time
from shardc.verification.verify import render_report, verify

BIG = "mesh X=4\ndims B=8, N=32, S=2048, T=2048\nP[B, N, S, T_X] = softmax(Sc[B, N, S, T_X] over T)\n"
TINY = "mesh X=4\ndims B=2, N=2, S=4, T=8\nP[B, N, S, T_X] = softmax(Sc[B, N, S, T_X] over T)\n"


def _collectives(steps: tuple[Step, ...]) -> list[Step]:
    return [s for s in steps if s.is_collective]


def _plan(text: str, **options: object) -> Plan:
    p = shardc.plan(shardc.parse(text), **options)  # type: ignore[arg-type]
    assert check_plan(p) == []
    return p


def test_softmax_over_a_sharded_index_all_reduces_two_statistics_per_row() -> None:
    p = _plan(BIG)
    fwd = _collectives(p.forward)
    assert [(s.op, s.fn, s.axes) for s in fwd] == [(Op.ALL_REDUCE, Combine.MAX, ("X",)), (Op.ALL_REDUCE, None, ("X",))]
    # each statistic: one value per row (B*N*S rows, none sharded), in the spec's dtype
    assert [str(s.volume) for s in fwd] == ["2*B*N*S", "2*B*N*S"]
    sizes = p.size_map or {}
    assert sum(step_volume(s, sizes) for s in fwd) == 2 * 2 * 8 * 32 * 2048
    bwd = _collectives(p.backward)  # dX = P * (dP - sum(dP * P)): one row sum
    assert [(s.op, str(s.volume)) for s in bwd] == [(Op.ALL_REDUCE, "2*B*N*S")]
    assert not any(s.op is Op.ALL_GATHER for s in p.forward + p.backward)


def test_the_choice_is_the_objectives_and_explain_shows_both() -> None:
    for text, winner in ((BIG, "row statistics"), (TINY, "AllGather_X")):
        p = _plan(text, explain=True)
        (choice,) = [c for c in p.choices if c.phase == "forward"]
        chosen = [a for a in choice.alternatives if a.chosen]
        assert len(chosen) == 1 and winner in chosen[0].description, choice
        times = [a.time for a in choice.alternatives if a.time is not None]
        assert chosen[0].time == min(times)
        texts = " | ".join(a.description for a in choice.alternatives)
        assert "AllGather_X" in texts and "2 row statistics AllReduce_X" in texts
        assert "softmax(Sc[B, N, S, T_X] over T)" in render_explain(p)
    # with few rows the latency of two AllReduces outweighs one small AllGather
    tiny = _plan(TINY)
    assert [s.op for s in _collectives(tiny.forward)] == [Op.ALL_GATHER]


def test_the_gathered_statistics_plan_is_dearer_by_the_cost_model() -> None:
    """Forcing the gather (a layout with T whole) costs more step time than the plan's choice."""
    chosen = plan_time(_plan(BIG)).forward_s
    gathered = plan_time(_plan(BIG.replace("P[B, N, S, T_X]", "P[B, N, S, T]"))).forward_s
    assert gathered > chosen


def test_rmsnorm_and_layernorm_statistics() -> None:
    rms = _plan("mesh X=4\ndims B=8, S=2048, D=8192\nY[B, S, D_X] = rmsnorm(X[B, S, D_X] over D)\n")
    assert [(s.op, s.tensor, str(s.volume)) for s in _collectives(rms.forward)] == [
        (Op.ALL_REDUCE, "Y_ms", "2*B*S")]
    # the backward makes ms again from X (a norm keeps only its input), then mean(dY * Y)
    assert [str(s.volume) for s in _collectives(rms.backward)] == ["2*B*S", "2*B*S"]
    ln = _plan("mesh X=4\ndims B=8, S=2048, D=8192\nY[B, S, D_X] = layernorm(X[B, S, D_X] over D)\n")
    assert [s.tensor for s in _collectives(ln.forward)] == ["Y_mean", "Y_var"]
    assert len(_collectives(ln.backward)) == 4  # mean and var again, then mean(dY) and mean(dY * Y)
    # what the layer keeps of a norm is its input (Korthikanti et al. 2022): no statistics, no output
    assert not {r.name for r in ln.residuals} & {"Y", "Y_mean", "Y_var"}


def test_sum_over_a_sharded_index_is_a_partial_sum() -> None:
    kept = _plan("mesh X=4\ndims B=8, D=64\nM[B]{U_X} = sum(X[B, D_X] over D)\n")
    assert _collectives(kept.forward) == []  # reduced later, or never
    reduced = _plan("mesh X=4\ndims B=8, D=64\nM[B] = sum(X[B, D_X] over D)\n")
    assert [(s.op, str(s.volume)) for s in _collectives(reduced.forward)] == [(Op.ALL_REDUCE, "2*B")]
    scattered = _plan("mesh X=4\ndims B=8, D=64\nM[B_X] = mean(X[B, D_X] over D)\n")
    assert [s.op for s in _collectives(scattered.forward)] == [Op.REDUCE_SCATTER]
    # partial sums pass through a sum: no reduction of X first
    passed = _plan("mesh X=2, Y=2\ndims B=8, D=64\nM[B]{U_XY} = sum(X[B, D_X]{U_Y} over D)\n")
    assert _collectives(passed.forward) == []


def test_a_sum_of_a_sum_all_reduces_the_smaller_tensor() -> None:
    """A sum's partial sums read by a sum alone are handed on unreduced: the scalar is all-reduced (as XLA
    does), not the vector before it; nested or as a statement of its own.  A max is no sum: its input is
    reduced first, as is a sum read twice, and an intermediate declared with mesh axes keeps them."""
    def reduced(text: str) -> list[tuple[str, str]]:
        return [(s.tensor, str(s.volume)) for s in _collectives(_plan("mesh d=8\ndims B=16, S=8\n" + text).forward)]

    assert reduced("M2[] = sum(sum(X[B_d, S] over B) over S)\n") == [("M2", "2")]
    assert reduced("M1[S] = sum(X[B_d, S] over B)\nM2[] = mean(M1[S] over S)\n") == [("M2", "2")]
    assert reduced("M1[S] = sum(X[B_d, S] over B)\nM2[] = max(M1[S] over S)\n") == [("M1", "2*S")]
    assert reduced("M1[S] = sum(X[B_d, S] over B)\nM2[] = sum(M1[S] over S)\nM3[] = max(M1[S] over S)\n") \
        == [("M1", "2*S")]
    # declared with an axis, M1 is made so; here from X gathered once (M1 whole, then sliced), which M2 reads
    # whole: one collective, not M1's ReduceScatter and M2's AllReduce (6 us forward before, 3 us now)
    kept = _plan("mesh d=8\ndims B=16, S=8\nM1[S_d] = sum(X[B_d, S] over B)\nM2[] = sum(M1[S_d] over S)\n")
    assert "M1[S_d]" in [str(s.dst) for s in kept.forward] and len(_collectives(kept.forward)) == 1
    text = render_explain(_plan("mesh d=8\ndims B=16, S=8\nM1[S_d] = sum(X[B_d, S] over B)\n"
                                "M2[] = sum(M1[S_d] over S)\n", explain=True))
    assert "why: least time with what M2 moves after it" in text
    # --explain: the inner sum's reduction ranked as its reader's, which weighs it against its own
    text = render_explain(_plan("mesh d=8\ndims B=16, S=8\nM2[] = sum(sum(X[B_d, S] over B) over S)\n", explain=True))
    assert "AllReduce_d (its reader's)" in text and "AllReduce_d of the input" in text


def test_an_einsum_read_by_a_sum_alone_all_reduces_the_sum() -> None:
    """An einsum's partial sums read by one sum alone are handed on: the sum over F is all-reduced (B elements),
    not the product (B x F); nested or as a statement of its own.  Read twice, or declared with an axis, the
    product is made as before (as declared, B over X, no partial sums)."""
    def reduced(text: str) -> list[tuple[str, str]]:
        head = "mesh X=8\ndims B=4096, D=4096, F=4096\n"
        return [(s.tensor, str(s.volume)) for s in _collectives(_plan(head + text).forward)]

    assert reduced("Y[B, F] = A[B, D_X] · W[D_X, F]\nZ[B] = sum(Y[B, F] over F)\n") == [("Z", "2*B")]
    assert reduced("Z[B] = mean(A[B, D_X] · W[D_X, F] over F)\n") == [("Z", "2*B")]
    assert reduced("Y[B, F] = A[B, D_X] · W[D_X, F]\nZ[B] = sum(Y[B, F] over F)\nZ2[B] = max(Y[B, F] over F)\n") \
        == [("Y", "2*B*F")]
    declared = _plan("mesh X=8\ndims B=4096, D=4096, F=4096\nY[B_X, F] = A[B, D_X] · W[D_X, F]\n"
                     "Z[B] = sum(Y[B_X, F] over F)\n")
    assert [str(s.dst) for s in declared.forward if s.tensor == "Y"] == ["Y[B_X, F]"]


def test_explain_shows_an_einsums_readers_moves_as_theirs() -> None:
    """--explain lists a handed-on einsum option's later reduction, counted in its time, as its reader's (the
    sum's case): it listed only the operand moves, "no communication" for the chosen one."""
    text = render_explain(_plan("mesh X=8\ndims B=4096, D=4096, F=4096\nY[B, F] = A[B, D_X] · W[D_X, F]\n"
                                "Z[B] = sum(Y[B, F] over F)\n", explain=True))
    chosen = next(line for line in text.splitlines() if line.lstrip().startswith("*") and "coll." in line)
    assert "AllReduce_X (its reader's)   [4*B]" in chosen and "1 coll." in chosen


def test_a_nonlinear_function_of_partial_sums_reduces_its_input_first() -> None:
    p = _plan("mesh X=2, Y=2\ndims B=8, D=64\nP[B, D_X] = softmax(X[B, D_X]{U_Y} over D)\n")
    first = _collectives(p.forward)[0]
    assert first.tensor == "X" and first.op in (Op.ALL_REDUCE, Op.REDUCE_SCATTER) and "Y" in first.axes
    with pytest.raises(shardc.ShardcError, match="partial sums"):
        shardc.parse("mesh X=2\nP[B, D]{U_X} = softmax(A[B, F_X] · W[F_X, D] over D)\n")


def test_without_dims_the_statistics_win_at_proxy_sizes() -> None:
    p = _plan("mesh X=4\nM[B] = logsumexp(X[B, D_X] over D)\n", explain=True)
    assert [s.tensor for s in _collectives(p.forward)] == ["M_max", "M_sum"]
    assert "no sizes" in render_explain(p)


@pytest.mark.slow
def test_max_lowers_to_pmax() -> None:
    p = _plan("mesh X=4\ndims B=8, D=64\nM[B] = max(X[B, D_X] over D)\n")
    (step,) = _collectives(p.forward)
    assert step.fn is Combine.MAX
    source = lower(p).source
    assert "jax.lax.pmax(" in source and "jnp.max(X, axis=1)" in source


def test_one_readable_line_a_step() -> None:
    source = lower(_plan(TINY)).source
    line = next(x for x in source.splitlines() if "jax.nn.softmax(" in x)
    assert "jax.nn.softmax(Sc_1, axis=3)" in line and "# P[B, N, S, T]  [B, N, S, T] = [2, 2, 4, 8]" in line
    big = lower(_plan(BIG), sizes={"B": 2, "N": 2, "S": 4, "T": 8}).source
    assert "jax.lax.pmax(P_max, 'X')" in big
    assert "= jnp.exp(Sc - jnp.expand_dims(P_max_1, 3)) / jnp.expand_dims(P_sum_1, 3)" in big


def test_reference_matches_finite_differences() -> None:
    """The numpy reference's closed-form gradients are the derivatives of its forward."""
    rng = np.random.default_rng(0)
    for func in ("softmax", "rmsnorm", "layernorm", "sort", "sum", "mean", "max", "logsumexp"):
        out = "Y[B, D]" if func in ("softmax", "rmsnorm", "layernorm", "sort") else "Y[B]"
        spec = shardc.parse(f"mesh X=2\n{out} = {func}(X[B, D] over D)\n")
        x = rng.standard_normal((3, 5))
        d = rng.standard_normal((3, 5) if "D" in out else (3,))
        grad = ref_backward(spec, {"X": x}, {"Y": d})["X"]
        eps = 1e-6
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            h = np.zeros_like(x)
            h[idx] = eps
            up = ref_forward(spec, {"X": x + h})["Y"]
            down = ref_forward(spec, {"X": x - h})["Y"]
            numeric[idx] = np.sum((up - down) * d) / (2 * eps)
        assert np.allclose(grad, numeric, atol=1e-6), func


VERIFY = [
    BIG.replace("N=32, S=2048, T=2048", "N=4, S=64, T=64").replace("B=8", "B=4"),
    "mesh X=4\ndims B=8, N=32, S=256, T=256\nP[B, N, S, T_X] = softmax(Sc[B, N, S, T_X] over T)\n",
    "mesh X=2, Y=2\ndims B=8, S=512, D=4096\nY[B_Y, S, D_X] = layernorm(X[B_Y, S, D_X] over D)\n",
    "mesh X=2, Y=2\ndims B=8, S=512, D=4096\nY[S, B_Y, D_X] = rmsnorm(X[B_Y, S, D_X] over D)\n",
    "mesh X=2, Y=2\ndims B=8, D=64, F=32\nM[B_X] = max(A[B_X, D] · W[D, F_Y] over F)\n",
    "mesh X=2, Y=2\ndims B=8, D=64\nM[B]{U_XY} = sum(X[B, D_X]{U_Y} over D)\n",
    "mesh X=4\ndims B=8, D=64\nM[B_X] = mean(X[B, D_X] over D)\n",
    # partial sums handed on through a mean and a sum, all-reduced once as a scalar
    "mesh X=2, Y=2\ndims B=8, S=8, T=4\nM1[S, T] = sum(X[B_X, S_Y, T] over B)\nM2[T] = mean(M1[S, T] over S)\n"
    "M3[] = sum(M2[T] over T)\n",
    # an einsum's partial sums handed on through a sum and a mean, all-reduced once as a scalar
    "mesh X=2, Y=2\ndims B=8, D=64, F=32\nP[B, F] = A[B_Y, D_X] · W[D_X, F]\nM1[B] = sum(P[B, F] over F)\n"
    "M2[] = mean(M1[B] over B)\n",
    # a sum's gradient spread along a sharded dim, read by a map's vjp (jax.vjp refused it as not varying)
    "mesh X=2\ndims B=16, D=4\nH[B_X, D] = gelu(I[B_X, D])\nM[] = mean(sum(H[B_X, D] over D) over B)\n",
    "mesh X=4\ndims B=8, D=4096\nM[B] = logsumexp(X[B, D_X] over D)\n",
    "mesh X=2, Y=2\ndims B=8, E=8, D=4\nS1[B_X, E_Y] = sort(In[B_X, D] · W[D, E_Y] over E)\n"
    "Out[B_X, D] = S1[B_X, E_Y] · W2[E_Y, D]\n",
    "mesh X=4\ndims B=8192, E=65536\nY[B, E_X] = sort(X[B, E_X] over E)\n",  # AllToAlls, E whole between
    # a scale is an einsum with batch index D; reductions nest inside products and reductions
    "mesh X=2, Y=2\ndims B=8, S=64, D=1024\nY[B_Y, S, D_X] = rmsnorm(X[B_Y, S, D_X] over D) * W_g[D_X]\n"
    "M[B_Y] = mean(softmax(Y[B_Y, S, D_X] over D) · W_p[D_X] over S)\n",
]


@pytest.mark.slow
@pytest.mark.parametrize("text", VERIFY)
def test_lowered_values_and_collectives_verify(text: str) -> None:
    report = verify(shardc.parse(text))
    assert report.ok, render_report(report)


@pytest.mark.slow
def test_verifies_under_every_residual_policy() -> None:
    text = "mesh X=4\ndims B=8, S=512, D=4096\nY[B, S, D_X] = layernorm(X[B, S, D_X] over D)\n"
    for save in ("none", "all"):
        report = verify(shardc.parse(text), save=save)
        assert report.ok, render_report(report)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(specs(max_devices=8, max_statements=3, layer_ops=True), st.sampled_from(["default", "none", "all"]))
def test_random_layer_op_specs_round_trip_and_plan_soundly(spec: Spec, save: str) -> None:
    assert shardc.parse(str(spec)) == spec
    p = shardc.plan(spec, save=save)
    assert check_plan(p) == []
    names = {c.func for s in spec.statements for c in calls(s.expr)}
    if names & {"embed", "cross_entropy"}:  # token ids never get a gradient
        assert not any(g.name.startswith("dTok") for g in p.grads)


@pytest.mark.slow
def test_recomputed_plans_with_reductions_verify() -> None:
    text = ("mesh X=2, Y=2\ndims B=8, S=64, D=1024\nY[B_Y, S, D_X] = rmsnorm(X[B_Y, S, D_X] over D) * W_g[D_X]\n"
            "M[B_Y] = mean(softmax(Y[B_Y, S, D_X] over D) · W_p[D_X] over S)\n")
    for mode in ("selective", "full"):
        p = shardc.plan(shardc.parse(text), recompute=mode)
        assert check_plan(p) == []
        report = verify(p)
        assert report.ok, render_report(report)


def test_every_reduction_is_planned_from_the_family_tables() -> None:
    # each function the family claims has its row of the forward table and of the backward one, and
    # neither table plans a function the family does not claim
    assert set(FORWARD) == set(BACKWARD) == set(REDUCTIONS.calls)
    # only a linear reduction needs no statistic, or one whose index is whole on a device (a sort)
    assert all(f.linear == (not f.stats) for f in FORWARD.values() if not f.whole)
    assert all(FORWARD[fn].whole == BACKWARD[fn].whole for fn in FORWARD)


def test_a_sort_gathers_its_sharded_index_and_is_local_along_a_whole_one() -> None:
    """A row's order needs all of it: no per-row statistic to all-reduce, so a sharded E is gathered
    (forward, and the cotangent backward), or its axis moved onto another index; along a whole E both
    are one local map."""
    spec = shardc.parse("mesh X=4\ndims B=8, E=64\nY[B, E_X] = sort(X[B, E_X] over E)\n")
    assert shardc.parse(str(spec)) == spec
    p = _plan(str(spec))
    assert [(s.op, s.tensor, s.axes) for s in _collectives(p.forward)] == [(Op.ALL_GATHER, "X", ("X",))]
    assert [(s.op, s.tensor, s.axes) for s in _collectives(p.backward)] == [(Op.ALL_GATHER, "dY", ("X",))]
    # at sizes where bytes outweigh latency, E's axis moves onto B and back (two AllToAlls, half the bytes)
    big = _plan("mesh X=4\ndims B=8192, E=65536\nY[B, E_X] = sort(X[B, E_X] over E)\n")
    assert [(s.op, s.tensor) for s in _collectives(big.forward)] == [(Op.ALL_TO_ALL, "X"), (Op.ALL_TO_ALL, "Y")]
    assert [s.op for s in _collectives(big.backward)] == [Op.ALL_TO_ALL] * 2
    local = _plan("mesh X=4\nY[B_X, E] = sort(X[B_X, E] over E)\n")
    assert not _collectives(local.forward) and not _collectives(local.backward)
    with pytest.raises(shardc.ShardcError, match="`sort` gives B, E"):
        shardc.parse("mesh X=4\nY[B_X] = sort(X[B_X, E] over E)\n")


def test_a_local_map_is_written_by_its_value() -> None:
    # the plan's listing, its JSON and the generated code name a reduction's, a vocabulary op's and a combiner's
    # local map by its value, through str() and f-strings alike (padded too)
    for named in (*Row, *Vocab, *Combine):
        assert str(named) == f"{named}" == named.value and f"{named:>24}" == f"{named.value:>24}"
