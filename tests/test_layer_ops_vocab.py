"""Vocabulary ops: Megatron's vocab-parallel embedding and cross entropy, planned, lowered and verified."""

from __future__ import annotations

import numpy as np
import pytest

import shardc
from shardc.costmodel.memory import memory
from shardc.device_pieces import step_volume
from shardc.ir.localops import Combine, Vocab
from shardc.ir.plan import Op, Plan, Step
from shardc.lowering.api import lower
from shardc.lowering.reference import backward as ref_backward
from shardc.lowering.reference import forward as ref_forward
from shardc.planner.check import check_plan
from shardc.timing import plan_sizes
from shardc.verification.verify import render_report, verify

EMBED = "mesh X=4\ndims B=8, S=1024, V=32768, D=4096\nE[B, S, D] = embed(Tok[B, S], W_emb[V_X, D])\n"
LOSS = "mesh X=4, Y=2\ndims B=8, S=1024, V=32768\nL[] = cross_entropy(Lg[B_Y, S, V_X], Tok[B_Y, S])\n"


def _plan(text: str) -> Plan:
    p = shardc.plan(shardc.parse(text))
    assert check_plan(p) == []
    return p


def _collectives(steps: tuple[Step, ...]) -> list[Step]:
    return [s for s in steps if s.is_collective]


def test_vocab_parallel_embedding_is_a_local_lookup_then_one_reduction() -> None:
    p = _plan(EMBED)
    (local,) = [s for s in p.forward if s.fn is Vocab.EMBED]
    assert str(local.dst) == "E[B, S, D]{U_X}"  # a partial sum over V's axis
    assert [(s.op, str(s.volume)) for s in _collectives(p.forward)] == [(Op.ALL_REDUCE, "2*B*D*S")]
    assert _collectives(p.backward) == []  # the scatter-add needs nothing dE does not
    assert [g.name for g in p.grads] == ["dW_emb"]  # token ids have no gradient
    sp = _plan(EMBED.replace("E[B, S, D]", "E[B, S_X, D]"))  # sequence parallel: scatter onto S
    assert [s.op for s in _collectives(sp.forward)] == [Op.REDUCE_SCATTER]
    assert [(s.op, s.tensor) for s in _collectives(sp.backward)] == [(Op.ALL_GATHER, "dE")]


def test_embedding_with_the_vocabulary_replicated_is_a_plain_take() -> None:
    p = _plan("mesh X=4\ndims B=8, S=16, V=64, D=32\nE[B_X, S, D] = embed(Tok[B_X, S], W_emb[V, D])\n")
    assert _collectives(p.forward) == []
    assert [s.op for s in _collectives(p.backward)] == [Op.ALL_REDUCE]  # data parallel: dW_emb over X
    assert "jnp.take(W_emb, Tok, axis=0)" in lower(p).source


def test_vocab_parallel_cross_entropy_moves_tokens_not_logits() -> None:
    p = _plan(LOSS)
    fwd = _collectives(p.forward)
    assert [(s.op, s.fn, s.axes, str(s.volume)) for s in fwd] == [
        (Op.ALL_REDUCE, Combine.MAX, ("X",), "2*B*S/Y"), (Op.ALL_REDUCE, None, ("X",), "2*B*S/Y"),
        (Op.ALL_REDUCE, None, ("X",), "2*B*S/Y"), (Op.ALL_REDUCE, None, ("Y",), "2")]
    assert not any(s.tensor == "Lg" for s in _collectives(p.forward + p.backward))  # never gathered
    assert all("V" not in s.volume.symbols() for s in fwd if s.volume is not None)  # O(tokens), not O(tokens * V)
    assert _collectives(p.backward) == []  # (softmax - onehot) / tokens, local to each V shard
    sizes = p.size_map or {}
    moved = sum(step_volume(s, sizes) for s in fwd)
    assert moved == 3 * 2 * 8 * 1024 / 2 + 2 < 2 * 8 * 1024 * 32768 / 8  # far below one gather of the logits
    assert {r.name for r in p.residuals} >= {"L_lse"}


def test_the_loss_backward_reads_logits_statistics_and_ids() -> None:
    p = _plan(LOSS)
    (step,) = [s for s in p.backward if s.fn is Vocab.CE_VJP]
    assert [o.name for o in step.operands] == ["Lg", "L_lse", "Tok", "dL"]
    mem = memory(p, plan_sizes(p), 1, 96e9)
    kept = dict(mem.residuals)
    assert "L_lse[B_Y, S]" in kept and kept["L_lse[B_Y, S]"] == 2 * 8 * 1024 / 2  # rows x 1, bf16
    assert "Lg[B_Y, S, V_X]" in kept


def test_the_reference_gradients_are_derivatives() -> None:
    rng = np.random.default_rng(1)
    spec = shardc.parse("mesh X=2\nL[] = cross_entropy(Lg[B, V, S], Tok[S, B])\n")
    lg = rng.standard_normal((2, 5, 3))
    tok = rng.integers(0, 5, (3, 2)).astype(np.float64)
    grad = ref_backward(spec, {"Lg": lg, "Tok": tok}, {"L": np.float64(1.0)})
    assert set(grad) == {"Lg"}
    eps = 1e-6
    for idx in np.ndindex(lg.shape):
        h = np.zeros_like(lg)
        h[idx] = eps
        up = ref_forward(spec, {"Lg": lg + h, "Tok": tok})["L"]
        down = ref_forward(spec, {"Lg": lg - h, "Tok": tok})["L"]
        assert abs((up - down) / (2 * eps) - grad["Lg"][idx]) < 1e-6
    emb = shardc.parse("mesh X=2\nE[S, D] = embed(Tok[S], W_emb[V, D])\n")
    w = rng.standard_normal((4, 3))
    ids = np.array([1, 3, 1])
    d = rng.standard_normal((3, 3))
    g = ref_backward(emb, {"Tok": ids, "W_emb": w}, {"E": d})["W_emb"]
    assert np.allclose(g[1], d[0] + d[2]) and np.allclose(g[3], d[1]) and not g[0].any()


def test_lowering_is_one_line_a_step() -> None:
    source = lower(_plan(LOSS), sizes={"B": 4, "S": 8, "V": 64}).source
    assert "vocab_pick(Lg, Tok, 2, ('X',))" in source
    assert "vocab_ce_grad(Lg, L_lse, Tok, dL, 2, ('X',), ('Y',))" in source
    assert "jax.lax.pmax(L_max, 'X')" in source


VERIFY = [
    EMBED.replace("S=1024, V=32768, D=4096", "S=16, V=128, D=32"),
    "mesh X=4\ndims B=8, S=64, V=1024, D=64\nE[B, S_X, D] = embed(Tok[B, S], W_emb[V_X, D])\n",
    "mesh X=2, Y=2\ndims B=8, S=16, V=128, D=32\nE[D, B_Y, S] = embed(Tok[B_Y, S], W_emb[V_X, D])\n",
    LOSS.replace("S=1024, V=32768", "S=16, V=256"),
    "mesh X=2, Y=2\ndims B=8, S=16, V=128, D=32\nL[] = cross_entropy(H[B_Y, S, D] · W_out[D, V_X], Tok[S, B_Y])\n",
    "mesh X=2, Y=2\ndims B=8, S=16, V=128, D=32\n"
    "E[B_Y, S, D] = embed(Tok[B_Y, S], W_emb[V_X, D])\n"
    "N[B_Y, S, D] = rmsnorm(E[B_Y, S, D] over D)\n"
    "L[] = cross_entropy(N[B_Y, S, D] · W_out[D, V_X], Tok[B_Y, S])\n",
]


@pytest.mark.slow
@pytest.mark.parametrize("text", VERIFY)
def test_lowered_values_and_collectives_verify(text: str) -> None:
    report = verify(shardc.parse(text))
    assert report.ok, render_report(report)
