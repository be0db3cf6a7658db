"""Fused attention, ``attention(Q, K, V over T[, causal])``: parsed, planned, costed, lowered and verified."""

from __future__ import annotations

import doctest
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import shardc
from shardc.costmodel.cost_report import CostReport
from shardc.costmodel.symbolic import cost_formulas
from shardc.errors import ShardcError
from shardc.ir.localops import Attention
from shardc.ir.plan import Op, Plan
from shardc.ops.attention_reference import attention_forward, attention_vjp
from shardc.ops.ring_attention import LSE_BYTES
from shardc.planner.zigzag_order import holds
from shardc.spec import attention_call
from shardc.spec.attention_call import roles

ROOT = Path(__file__).resolve().parent.parent
SIZES = {"B": 4, "S": 8, "T": 8, "N": 4, "G": 2, "R": 2, "H": 16}


def _spec(q: str, k: str, v: str, out: str, flag: str = ", causal", dtype: str = "f32", mesh: str = "X=2, Y=2"):
    dims = ", ".join(f"{n}={s}" for n, s in SIZES.items())
    return shardc.parse(f"mesh {mesh}\ndims {dims}\ndtype {dtype}\n"
                        f"{out} = attention({q}, {k}, {v} over T{flag})\n")


def _mha(flag: str = ", causal") -> Plan:
    return shardc.plan(_spec("Q[B_X, S, N_Y, H]", "K[B_X, T, N_Y, H]", "V[B_X, T, N_Y, H]", "O[B_X, S, N_Y, H]",
                             flag))


def _cost(plan: Plan) -> CostReport:
    report = shardc.cost(plan)
    assert isinstance(report, CostReport)
    return report


def test_each_index_has_a_role_for_multi_head_grouped_and_multi_query_attention() -> None:
    assert doctest.testmod(attention_call).failed == 0
    mha = roles(("B", "S", "N", "H"), ("B", "T", "N", "H"), ("B", "T", "N", "H"), "T")
    assert (mha.batch, mha.queries, mha.query, mha.head, mha.rows) == (("B", "N"), ("S",), "S", "H", ("B", "S", "N"))
    mqa = roles(("B", "S", "N", "H"), ("B", "T", "H"), ("B", "T", "E"), "T")
    assert (mqa.batch, mqa.queries, mqa.value_head, mqa.out) == (("B",), ("S", "N"), "E", ("B", "S", "N", "E"))


@pytest.mark.parametrize(("call", "message"), [
    ("attention(Q[B, S, N, H], K[B, T, N, H], V[B, T, N, H] over T, causl)", "takes one flag, causal"),
    ("attention(Q[B, S, N, H], K[B, T, N, H], V[B, T, N, H])", "takes 3 tensors and `over` an index"),
    ("attention(Q[B, S, N, H], K[B, T, N, H] over T)", "takes 3 tensors"),
    ("attention(Q[B, S, N, H], K[B, T, N, H], V[B, T, N, H] over S)", "key index S must be an index of K"),
    ("attention(Q[B, S, N, E], K[B, T, N, H], V[B, T, N, H] over T)", "end with the same head dim"),
    ("attention(Q[B, S, N, H], K[B, T, N, H], V[B, T, H] over T)", "index N must be in Q and V too"),
    ("attention(Q[B, S, N, H], K[B, T, N, H], V[B, T, N, E, H] over T)", "V's index E is not one of K's"),
])
def test_a_malformed_attention_call_is_a_parse_error(call: str, message: str) -> None:
    with pytest.raises(ShardcError, match=message.replace("(", r"\(").replace("`", ".")):
        shardc.parse(f"mesh X=2\nO[B, S, N, H] = {call}\n")


def test_the_result_has_qs_indices_with_vs_head_dim() -> None:
    with pytest.raises(ShardcError, match="gives B, S, N, H"):
        shardc.parse("mesh X=2\nO[B, S, N] = attention(Q[B, S, N, H], K[B, T, N, H], V[B, T, N, H] over T)\n")


@pytest.mark.parametrize(("q", "k", "out"), [
    ("Q[B_X, S, N, H_Y]", "K[B_X, T, N, H_Y]", "O[B_X, S, N, H]"),
    ("Q[B_X, S, N, H]", "K[B_X, T, N, H]", "O[B_X, S, N, H_Y]"),
])
def test_a_sharded_head_dim_is_refused_with_what_to_do(q: str, k: str, out: str) -> None:
    with pytest.raises(ShardcError, match="head dim H sharded") as err:
        shardc.plan(_spec(q, k, k.replace("K", "V"), out))
    assert err.value.fix and "shard the heads" in err.value.fix


def test_the_queries_sharded_gather_k_and_v_and_reduce_scatter_their_gradients() -> None:
    """Context parallelism, the all-gather form: K and V gathered along T before the kernel, on the critical
    path; dK and dV partial over the queries' axis, reduce-scattered back onto T; Q never moves."""
    plan = shardc.plan(_spec("Q[B_Y, S_X, N, H]", "K[B_Y, T_X, N, H]", "V[B_Y, T_X, N, H]", "O[B_Y, S_X, N, H]"))
    gathers = [(s.op, s.tensor, s.axes, s.ahead) for s in plan.forward if s.is_collective]
    assert gathers == [(Op.ALL_GATHER, "K", ("X",), False), (Op.ALL_GATHER, "V", ("X",), False)]
    reduced = [(s.op, s.tensor, str(s.dst)) for s in plan.backward if s.is_collective]
    assert reduced == [(Op.REDUCE_SCATTER, plan.grad_name("K"), "dK[B_Y, T_X, N, H]"),
                       (Op.REDUCE_SCATTER, plan.grad_name("V"), "dV[B_Y, T_X, N, H]")]


def test_at_long_sequences_the_planner_moves_the_sequence_axes_to_the_heads_with_alltoalls() -> None:
    """Ulysses' form: S's axis moved onto the heads (AllToAll of Q, K, V in, of O out), balanced causal blocks,
    chosen over gathering K and V (the all-gather form's last device runs 15/16 of its blocks)."""
    spec = shardc.parse("mesh X=8\ndims B=8, S=32768, T=32768, N=32, H=128\nO[B, S_X, N, H] = "
                        "attention(Q[B, S_X, N, H], K[B, T_X, N, H], V[B, T_X, N, H] over T, causal)\n")
    plan = shardc.plan(spec, explain=True)
    moves = [(s.op, s.tensor, str(s.dst)) for s in plan.forward if s.is_collective]
    assert moves == [(Op.ALL_TO_ALL, "Q", "Q[B, S, N_X, H]"), (Op.ALL_TO_ALL, "K", "K[B, T, N_X, H]"),
                     (Op.ALL_TO_ALL, "V", "V[B, T, N_X, H]"), (Op.ALL_TO_ALL, "O", "O[B, S_X, N, H]")]
    (choice,) = plan.choices
    forms = {a.description.split(" (")[0]: a for a in choice.alternatives}
    assert forms["S's X moved to N"].chosen and forms["S over X, K and V gathered along T"].time is not None
    assert forms["S over X, K and V gathered along T"].time > forms["S's X moved to N"].time
    b, s, t, n, h = 8, 32768, 32768, 32, 128
    assert _cost(plan).forward.compute_flops == 4 * b * s * t * n * h / 8 / 2


def test_causal_context_parallel_blocks_are_balanced_only_in_zigzag_order() -> None:
    """Gathering K and V, contiguous blocks of queries leave the last of 2 devices 3/4 of its S x T share, which
    sets the time; the plan holds the sequence in zig-zag chunks instead, where every device runs half."""
    plan = shardc.plan(_spec("Q[B_Y, S_X, N, H]", "K[B_Y, T, N, H]", "V[B_Y, T, N, H]", "O[B_Y, S_X, N, H]"))
    b, s, t, n, h = (SIZES[i] for i in "BSTNH")
    assert holds(plan) and _cost(plan).forward.compute_flops == 4 * b * s * t * n * h / 4 / 2
    contiguous = replace(plan, forward=tuple(replace(step, fn=replace(step.fn, zigzag=False, held=False))
                                             if isinstance(step.fn, Attention) else step for step in plan.forward))
    assert _cost(contiguous).forward.compute_flops == 4 * b * s * t * n * h / 4 * 3 / 4  # the last of 2: 3/4


def test_batch_and_heads_sharded_need_no_collective() -> None:
    plan = _mha()
    assert not any(s.is_collective for s in plan.forward + plan.backward)
    assert [s.tensor for s in plan.forward] == ["O", "O_lse"]


@pytest.mark.parametrize("causal", [False, True])
def test_flops_are_the_two_matmuls_and_causal_runs_half_of_them(causal: bool) -> None:
    """Per device: Q·K and P·V, 2·B·S·T·N·H each over the 4 devices, halved when causal (the unmasked
    blocks); model FLOPs: the whole S x T either way; the backward 2.5 x on the chip, 2 x in the model."""
    report = _cost(_mha(", causal" if causal else ""))
    b, s, t, n, h = (SIZES[i] for i in "BSTNH")
    whole = 4 * b * s * t * n * h
    device = whole / 4 / (2 if causal else 1)
    assert report.forward.compute_flops == device and report.forward.model_flops == whole
    assert report.backward.compute_flops == 2.5 * device and report.backward.model_flops == 2 * whole
    assert report.step.compute_s > 0


def test_grouped_query_flops_count_every_query_head() -> None:
    plan = shardc.plan(_spec("Q[B_X, S, G, R_Y, H]", "K[B_X, T, G, H]", "V[B_X, T, G, H]", "O[B_X, S, G, R_Y, H]"))
    b, s, t, g, r, h = (SIZES[i] for i in "BSTGRH")
    assert _cost(plan).forward.compute_flops == 4 * b * s * t * g * r * h / 4 / 2


def test_the_cost_formula_without_sizes_counts_the_matmuls() -> None:
    spec = shardc.parse("mesh X=2, Y=2\nO[B_X, S, N_Y, H] = attention(Q[B_X, S, N_Y, H], K[B_X, T, N_Y, H], "
                        "V[B_X, T, N_Y, H] over T, causal)\n")
    report = cost_formulas(shardc.plan(spec))
    text = str(report)
    assert "compute 2*B*H*N*S*T/(X*Y) FLOPs a device" in text and "compute 5*B*H*N*S*T/(X*Y)" in text
    kernel = report.to_json()["forward"]["rows"][0]  # type: ignore[index]
    assert kernel["flops_expr"] == "2*B*H*N*S*T/(X*Y)" and kernel["time_s_expr"] == "2*B*H*N*S*T/(C*X*Y)"


def test_the_residuals_are_q_k_v_the_output_and_a_float32_row_logsumexp() -> None:
    report = _cost(_mha())
    b, s, t, n, h = (SIZES[i] for i in "BSTNH")
    kept = dict(report.memory.residuals)
    assert kept == {"O[B_X, S, N_Y, H]": b * s * n * h, "O_lse[B_X, S, N_Y]": b * s * n / 4 * LSE_BYTES,
                    "Q[B_X, S, N_Y, H]": b * s * n * h, "K[B_X, T, N_Y, H]": b * t * n * h,
                    "V[B_X, T, N_Y, H]": b * t * n * h}  # f32: 4 bytes an element over 4 devices


def test_a_fused_layer_keeps_no_scores_and_runs_less_than_the_einsum_layer() -> None:
    """The LLaMA layer written with einsums and a causal softmax, and with attention: the same model
    FLOPs, no S x T residual, half the attention matmuls on the chip."""
    einsums, fused = (_cost(shardc.plan(shardc.parse((ROOT / "examples" / f).read_text(encoding="utf-8"))))
                      for f in ("llama_layer_fsdp_tp.shard", "llama_layer_flash.shard"))
    assert fused.step.model_flops == einsums.step.model_flops
    assert fused.step.compute_flops < einsums.step.compute_flops and fused.step.step_s < einsums.step.step_s
    scores = [v for v, _ in einsums.memory.residuals if "S" in v and "T" in v]
    assert scores and not [v for v, _ in fused.memory.residuals if ", S" in v and ", T" in v]
    assert fused.memory.residual_bytes < einsums.memory.residual_bytes


def test_grouped_query_gradients_of_k_and_v_are_reduced_over_the_query_heads_axis() -> None:
    plan = shardc.plan(_spec("Q[B_X, S, G, R_Y, H]", "K[B_X, T, G, H]", "V[B_X, T, G, H]", "O[B_X, S, G, R_Y, H]"))
    reduced = [(s.tensor, s.axes) for s in plan.backward if s.op is Op.ALL_REDUCE]
    assert reduced == [(plan.grad_name("K"), ("Y",)), (plan.grad_name("V"), ("Y",))]


def test_the_reference_is_the_softmax_of_the_scores_times_v_and_its_gradient_is_exact() -> None:
    r = roles(("B", "S", "N", "H"), ("B", "T", "N", "H"), ("B", "T", "N", "H"), "T")
    rng = np.random.default_rng(0)
    q, k, v, d = (rng.standard_normal((2, 5, 3, 4)) for _ in range(4))
    s = np.einsum("bsnh,btnh->bnst", q, k) / 2.0
    s = np.where(np.arange(5)[None, None, None, :] > np.arange(5)[None, None, :, None], -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert np.allclose(attention_forward(r, True, q, k, v, np), np.einsum("bnst,btnh->bsnh", p, v))
    eps, grads = 1e-6, attention_vjp(r, True, q, k, v, d, np)
    for which, g in enumerate(grads):
        xs = [q, k, v]
        bumped = xs[which].copy()
        bumped[0, 1, 2, 3] += eps
        xs[which] = bumped
        slope = (np.sum(attention_forward(r, True, *xs, np) * d) - np.sum(attention_forward(r, True, q, k, v, np) * d))
        assert slope / eps == pytest.approx(g[0, 1, 2, 3], rel=1e-4, abs=1e-6)


def _fused_pipeline() -> shardc.ir.spec.Spec:  # type: ignore[name-defined]
    """examples/pipeline_llama.shard (4 stages, 1F1B, verified in float64) with its attention fused."""
    text = (ROOT / "examples" / "pipeline_llama.shard").read_text(encoding="utf-8")
    einsums = ("Sc[B_X, N_Y, S, T] = Qr[B_X, S, N_Y, H] · Kr[B_X, T, N_Y, H]\n"
               "Pr[B_X, N_Y, S, T] = softmax(causal(Sc[B_X, N_Y, S, T], S, T) over T)\n"
               "C[B_X, S, N_Y, H] = Pr[B_X, N_Y, S, T] · V[B_X, T, N_Y, H]\n")
    assert einsums in text
    return shardc.parse(text.replace(einsums, "C[B_X, S, N_Y, H] = attention(Qr[B_X, S, N_Y, H], Kr[B_X, T, N_Y, H], "
                                              "V[B_X, T, N_Y, H] over T, causal)\n"))


@pytest.mark.slow
def test_the_blockwise_kernel_matches_the_reference_over_several_key_blocks() -> None:
    from shardc.lowering.runtime import attention, attention_grads

    r = roles(("B", "S", "G", "R", "H"), ("B", "T", "G", "H"), ("B", "T", "G", "H"), "T")
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 16, 2, 2, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 16, 2, 8)).astype(np.float32) for _ in range(2))
    d = rng.standard_normal(q.shape).astype(np.float32)
    subs = ("bsgrh", "btgh", "btgh", "bsgrh")
    out, lse = attention(q, k, v, subs, "t", ("s", ()))  # 16 keys: two blocks of 8
    assert np.allclose(out, attention_forward(r, True, q, k, v, np), atol=1e-5)
    scores = np.einsum("bsgrh,btgh->bsgrt", q, k) / np.sqrt(8)
    scores = np.where(np.arange(16) > np.arange(16)[None, :, None, None, None], -np.inf, scores)
    assert np.allclose(lse, np.log(np.exp(scores).sum(-1)), atol=1e-5)
    for got, want in zip(attention_grads(q, k, v, out, lse, d, subs, "t", ("s", ())),
                         attention_vjp(r, True, q, k, v, d, np), strict=True):
        assert np.allclose(got, want, atol=1e-4)


@pytest.mark.slow
def test_the_steps_of_one_kernel_run_it_once() -> None:
    """The output and its logsumexp, and dQ, dK and dV, are each a step of their own, one call each, as the
    lowered module writes them: the program runs one loop for the forward and one for the backward."""
    import jax
    import jax.numpy as jnp

    from shardc.lowering.runtime import attention, attention_grads

    subs = ("bsnh", "btnh", "btnh", "bsnh")

    def steps(q: jax.Array, k: jax.Array, v: jax.Array, d: jax.Array) -> tuple[jax.Array, ...]:
        out, lse = attention(q, k, v, subs, "t", ("s", ()))[0], attention(q, k, v, subs, "t", ("s", ()))[1]
        return out, *(attention_grads(q, k, v, out, lse, d, subs, "t", ("s", ()))[i] for i in range(3))

    x = jnp.ones((2, 64, 2, 8))
    assert jax.jit(steps).lower(x, x, x, x).compile().as_text().count(" while(") == 2


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mha", "gqa", "mqa", "context", "ulysses", "layer", "pipeline"])
def test_attention_verifies_against_the_reference_values_and_hlo(case: str) -> None:
    from shardc.verification.verify import verify

    specs = {
        "mha": _spec("Q[B_X, S, N_Y, H]", "K[B_X, T, N_Y, H]", "V[B_X, T, N_Y, H]", "O[B_X, S, N_Y, H]"),
        "gqa": _spec("Q[B_X, S, G, R_Y, H]", "K[B_X, T, G, H]", "V[B_X, T, G, H]", "O[B_X, S, G, R_Y, H]"),
        "mqa": _spec("Q[B_X, S, N_Y, H]", "K[B_X, T, H]", "V[B_X, T, H]", "O[B_X, S, N_Y, H]", "", "bf16"),
        "ulysses": shardc.parse("mesh X=4\ndims B=4, S=16384, T=16384, N=8, H=64\ndtype f32\nO[B, S_X, N, H] = "
                                "attention(Q[B, S_X, N, H], K[B, T_X, N, H], V[B, T_X, N, H] over T, causal)\n"),
        "context": _spec("Q[B_Y, S_X, G, R, H]", "K[B_Y, T_X, G, H]", "V[B_Y, T_X, G, H]", "O[B_Y, S_X, G, R, H]"),
        "layer": shardc.parse((ROOT / "examples" / "llama_layer_flash.shard").read_text(encoding="utf-8")),
        "pipeline": _fused_pipeline(),
    }
    report = verify(specs[case])
    assert report.ok, [r for r in (*report.values, *report.collectives) if not r.ok]
    assert {r.tensor for r in report.values} >= ({"Out"} if case in ("layer", "pipeline") else {"O"})
    if case in ("gqa", "mqa"):  # dK and dV partial over the query heads' axis, reduced once each
        assert sum(r.hlo_op == "all-reduce" and r.ok for r in report.collectives) == 2
    if case == "context":  # K and V gathered, their gradients reduce-scattered
        assert sorted(r.hlo_op for r in report.collectives) == ["all-gather"] * 2 + ["reduce-scatter"] * 2
    if case == "ulysses":  # Q, K, V and dO to the heads; O, dQ, dK, dV back
        assert [r.hlo_op for r in report.collectives] == ["all-to-all"] * 8
