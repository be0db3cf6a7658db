"""Fused attention with a second (query, key) pair, MLA's decoupled rotary part (DeepSeek-V2, arXiv 2405.04434,
section 2.1.3): ``attention(Qn, Kn, V, Qr, Kr over T, causal)`` parsed, planned, costed, lowered and verified,
and DeepSeek-V3 (benchmarks/runs/deepseek_v3.shard) written with it fitting its GPUs' 80 GB."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import shardc
from shardc.cli.main import main
from shardc.errors import ShardcError
from shardc.ir.plan import Op, Plan
from shardc.ops.attention_reference import attention_forward, attention_vjp
from shardc.ops.ring_attention import LSE_BYTES
from shardc.spec.attention_call import roles

ROOT = Path(__file__).resolve().parent.parent
SIZES = {"B": 4, "S": 8, "T": 8, "N": 4, "H": 16, "J": 8}
MLA = ("O[{b}, S{s}, N{n}, H] = attention(Qn[{b}, S{s}, N{n}, H], Kn[{b}, T{s}, N{n}, H], V[{b}, T{s}, N{n}, H], "
       "Qr[{b}, S{s}, N{n}, J], Kr[{b}, T{s}, J] over T{flag})\n")
ROLES = roles(("B", "S", "N", "H"), ("B", "T", "N", "H"), ("B", "T", "N", "H"), "T", None,
              ("B", "S", "N", "J"), ("B", "T", "J"))


def _spec(b: str = "B_X", s: str = "", n: str = "_Y", flag: str = ", causal", mesh: str = "X=2, Y=2",
          sizes: dict[str, int] = SIZES) -> shardc.ir.spec.Spec:  # type: ignore[name-defined]
    dims = ", ".join(f"{k}={v}" for k, v in sizes.items())
    return shardc.parse(f"mesh {mesh}\ndims {dims}\ndtype f32\n" + MLA.format(b=b, s=s, n=n, flag=flag))


def _plan(**kw: str) -> Plan:
    return shardc.plan(_spec(**kw))


def test_the_second_pair_has_its_roles_and_the_result_is_vs_head() -> None:
    assert (ROLES.qr, ROLES.kr, ROLES.rope_head, ROLES.batch) == (("B", "S", "N", "J"), ("B", "T", "J"), "J",
                                                                   ("B", "N"))
    assert len(ROLES.operands) == 5 and ROLES.out == ("B", "S", "N", "H")
    assert shardc.plan(_spec()).spec.statements[0].result.indices == ("B", "S", "N", "H")


def test_the_pair_with_a_value_head_of_its_own_gives_vs_head() -> None:
    # a held-out run (GPT-NeoX-20B's rotary on 24 of 96 head dims: Qn.Kn over 72, Qr.Kr over 24, V of 96) was
    # refused: "C has indices B, S, N, H, but `attention` gives B, S, N, E" (the result took Q's head, not V's)
    spec = shardc.parse("mesh X=2, Y=2\ndims B=4, S=8, T=8, N=4, E=6, J=2, H=8\n"
                        "O[B_X, S, N_Y, H] = attention(Qn[B_X, S, N_Y, E], Kn[B_X, T, N_Y, E], V[B_X, T, N_Y, H], "
                        "Qr[B_X, S, N_Y, J], Kr[B_X, T, N_Y, J] over T, causal)\n")
    assert shardc.plan(spec).spec.statements[0].result.indices == ("B", "S", "N", "H")


@pytest.mark.parametrize(("pair", "message"), [
    ("Qr[B, S, N, J]", "takes 3 tensors"),
    ("Qr[B, S, N, J], Kr[B, T, E]", "end with the same head dim"),
    ("Qr[B, S, N, H], Kr[B, T, H]", "head dim H is an index of Q"),
    ("Qr[B, N, S, J], Kr[B, T, J]", "Qr's indices are Q's"),
    ("Qr[B, S, N, J], Kr[B, J]", "Kr runs along the key index T"),
    ("Qr[B, S, N, J], Kr[B, T, S, J]", "Kr's index S is not one of K's"),
])
def test_a_malformed_second_pair_is_a_parse_error(pair: str, message: str) -> None:
    with pytest.raises(ShardcError, match=message):
        shardc.parse(f"mesh X=2\nO[B, S, N, H] = attention(Qn[B, S, N, H], Kn[B, T, N, H], V[B, T, N, H], {pair} "
                     "over T)\n")


def test_the_shared_rotary_key_gradient_is_reduced_over_the_heads_axis() -> None:
    """Kr serves every head: with the heads over Y its gradient is a partial sum over Y, reduced once; the
    per-head operands' are whole."""
    plan = _plan()
    assert not [s for s in plan.forward if s.is_collective]
    reduced = [(s.tensor, s.op, s.axes) for s in plan.backward if s.is_collective]
    assert reduced == [(plan.grad_name("Kr"), Op.ALL_REDUCE, ("Y",))]


def test_the_queries_sharded_gather_all_three_keys_and_no_ring_is_offered() -> None:
    """Sequence over X: Kn, V and Kr gathered along T, their gradients reduce-scattered (the ring passes K
    and V only, so with a second pair it is not a form the planner weighs)."""
    plan = shardc.plan(_spec(b="B_Y", s="_X", n=""), explain=True)
    gathered = sorted(s.tensor for s in plan.forward if s.op is Op.ALL_GATHER)
    assert gathered == ["Kn", "Kr", "V"]
    scattered = sorted(s.tensor for s in plan.backward if s.op is Op.REDUCE_SCATTER)
    assert scattered == sorted(plan.grad_name(x) for x in ("Kn", "Kr", "V"))
    forms = [a.description for c in plan.choices for a in c.alternatives]
    assert "moved to N (AllToAll in and out, as Ulysses)" in " ".join(forms) and not [f for f in forms if "ring" in f]
    single = shardc.plan(shardc.parse("mesh X=2, Y=2\ndims B=4, S=8, T=8, N=4, H=16\ndtype f32\nO[B_Y, S_X, N, H] = "
                                      "attention(Qn[B_Y, S_X, N, H], Kn[B_Y, T_X, N, H], V[B_Y, T_X, N, H] over T, "
                                      "causal)\n"), explain=True)  # without the pair the ring is weighed
    assert [a for c in single.choices for a in c.alternatives if "ring" in a.description]


@pytest.mark.parametrize("causal", [False, True])
def test_flops_count_both_score_terms_and_causal_runs_half(causal: bool) -> None:
    b, s, t, n, h, j = (SIZES[i] for i in "BSTNHJ")
    report = shardc.cost(_plan(flag=", causal" if causal else ""))
    scores, values = 2 * b * s * t * n * (h + j), 2 * b * s * t * n * h  # Q·K + Qr·Kr over heads of H + J; P·V
    half = 2 if causal else 1
    assert report.forward.compute_flops == (scores + values) / half / 4  # over X*Y
    assert report.backward.compute_flops == (3 * scores + 2 * values) / half / 4
    assert report.step.model_flops == 3 * (scores + values)


def test_the_residuals_are_the_five_operands_the_output_and_the_logsumexp() -> None:
    report = shardc.cost(_plan())
    b, s, t, n, h, j = (SIZES[i] for i in "BSTNHJ")
    assert dict(report.memory.residuals) == {
        "O[B_X, S, N_Y, H]": b * s * n * h, "O_lse[B_X, S, N_Y]": b * s * n / 4 * LSE_BYTES,
        "Qn[B_X, S, N_Y, H]": b * s * n * h, "Kn[B_X, T, N_Y, H]": b * t * n * h, "V[B_X, T, N_Y, H]": b * t * n * h,
        "Qr[B_X, S, N_Y, J]": b * s * n * j, "Kr[B_X, T, J]": b * t * j * 2}  # f32 over 4 devices; Kr over X only


def _concatenated(xs: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[Qn, Qr], [Kn, Kr] (Kr broadcast over the heads) and V: the implementations' 192-wide heads."""
    q, k, v, qr, kr = xs
    wide = np.broadcast_to(kr[:, :, None, :], (*kr.shape[:2], k.shape[2], kr.shape[-1]))
    return np.concatenate([q, qr], -1), np.concatenate([k, wide], -1), v


def test_the_reference_is_attention_of_the_concatenated_heads_and_its_gradient_is_exact() -> None:
    rng = np.random.default_rng(0)
    xs = tuple(rng.standard_normal(shape) for shape in ((2, 5, 3, 4), (2, 5, 3, 4), (2, 5, 3, 4), (2, 5, 3, 2),
                                                         (2, 5, 2)))
    d = rng.standard_normal((2, 5, 3, 4))
    joined = roles(("B", "S", "N", "H"), ("B", "T", "N", "H"), ("B", "T", "N", "E"), "T")
    assert np.allclose(attention_forward(ROLES, True, *xs[:3], np, *xs[3:]),
                       attention_forward(joined, True, *_concatenated(xs), np))
    eps, grads = 1e-6, attention_vjp(ROLES, True, *xs[:3], d, np, *xs[3:])
    for which, g in enumerate(grads):
        bumped = [x.copy() for x in xs]
        at = (0, 1, 1, 1)[:xs[which].ndim]
        bumped[which][at] += eps
        slope = np.sum((attention_forward(ROLES, True, *bumped[:3], np, *bumped[3:])
                        - attention_forward(ROLES, True, *xs[:3], np, *xs[3:])) * d)
        assert slope / eps == pytest.approx(g[at], rel=1e-4, abs=1e-6)


@pytest.mark.slow
def test_the_blockwise_kernel_with_the_pair_matches_the_reference() -> None:
    from shardc.lowering.runtime import attention_rope, attention_rope_grads

    rng = np.random.default_rng(1)
    xs = tuple(rng.standard_normal(shape).astype(np.float32) for shape in
               ((2, 16, 3, 8), (2, 16, 3, 8), (2, 16, 3, 8), (2, 16, 3, 4), (2, 16, 4)))
    d = rng.standard_normal((2, 16, 3, 8)).astype(np.float32)
    subs = ("bsnh", "btnh", "btnh", "bsnh", "bsnj", "btj")
    out, lse = attention_rope(*xs, subs, "t", ("s", ()))  # 16 keys: two blocks of 8
    assert np.allclose(out, attention_forward(ROLES, True, *xs[:3], np, *xs[3:]), atol=1e-5)
    got = attention_rope_grads(*xs, out, lse, d, subs, "t", ("s", ()))
    for g, want in zip(got, attention_vjp(ROLES, True, *xs[:3], d, np, *xs[3:]), strict=True):
        assert g.shape == want.shape and np.allclose(g, want, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["heads", "context", "ulysses"])
def test_the_pair_verifies_against_the_reference_values_and_hlo(case: str) -> None:
    from shardc.verification.memory_check import render_memory
    from shardc.verification.verify import verify

    long = {"B": 4, "S": 16384, "T": 16384, "N": 8, "H": 64, "J": 32}
    specs = {"heads": _spec(), "context": _spec(b="B_Y", s="_X", n=""),
             "ulysses": _spec(b="B", s="_X", n="", mesh="X=4", sizes=long)}
    report = verify(specs[case])
    assert report.ok, [r for r in (*report.values, *report.collectives) if not r.ok]
    assert {r.tensor for r in report.values} == {"O", "dQn", "dKn", "dV", "dQr", "dKr"}
    ops = sorted(r.hlo_op for r in report.collectives)
    expected = {"heads": ["all-reduce"], "context": ["all-gather"] * 3 + ["reduce-scatter"] * 3,
                "ulysses": ["all-to-all"] * 12}  # Qn, Kn, V, Qr, Kr, dO in; O, dQn, dKn, dV, dQr, dKr out
    assert ops == expected[case]
    # the lowered kernel's concatenated heads counted among its buffers: the memory XLA assigns, within 10%
    if case == "ulysses":  # the largest arrays: the lowered kernel's concatenated heads and their gradients are
        # counted among its buffers, so its memory is XLA's buffer assignment's within 10% (without them, 0.71)
        assert report.memory_check is not None and report.memory_check.within_target, \
            render_memory(report.memory_check)


def test_deepseek_v3_with_fused_mla_holds_no_scores_in_its_working_set(capsys: pytest.CaptureFixture[str],
                                                                        deepseek_v3_plan: Plan) -> None:
    """The published layout, the report's optimizer state, recomputation and BF16 attention core: no S x T
    value kept or made (the fused kernels hold no scores), so a tick's working set is the MoE layer's
    dispatch gradients and the recomputed up-projections, under 3.5 GB with the values in BF16 (the S x T
    scores written as einsums made it 14.3 GB in BF16); on the GPUs holding the ends it is the two heads'
    (the main one's and the MTP module's), whose BF16 logits are 1.06 GB a microbatch each, and their
    gradients."""
    path = ROOT / "benchmarks" / "runs" / "deepseek_v3.shard"
    assert main(["cost", str(path), "--recompute", "selective", "--optimizer", "mixed14", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    stages = report["pipeline"]["per_stage"]
    assert max(s["working_bytes"] for s in stages[1:-1]) < 3.5e9
    ends = (stages[0]["working_bytes"], stages[-1]["working_bytes"])
    assert ends[0] == ends[1] < 6 * 4096 * 129280 * 2  # a few of the heads' [S, V] BF16 arrays
    for s in stages:  # the stage's memory is its parts, nothing else
        parts = s["state_bytes"] + s["activation_bytes"] + s["gathered_bytes"] + s["working_bytes"]
        assert s["memory_bytes"] == pytest.approx(parts + s["accumulator_bytes"])
    plan = deepseek_v3_plan  # the same file planned at recompute="selective" (conftest)
    assert not [s for s in (*plan.forward, *plan.backward) if {"S", "T"} <= set(s.dst.indices)]
