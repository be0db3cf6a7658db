"""A pipelined plan holding the sequence in zig-zag order across its stages (:mod:`shardc.planner.zigzag_order`):
the data permuted once as it enters the pipeline and the results put back once as they leave, every stage's
ring kernels reordering nothing, the sends between stages carrying the permuted order; planned, costed and
priced so by ``--explain`` and ``shardc layouts``, lowered and verified under 1F1B."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

import shardc
from shardc.hardware import get_hardware
from shardc.ir.localops import Attention
from shardc.ir.plan import Plan, Step
from shardc.layouts import Options, search_layouts
from shardc.lowering.pipeline_lowering import lower_pipeline
from shardc.planner.zigzag_order import sequence_order
from tests.test_zigzag_order import _cost, _kernels_cost, _unheld

# a causal GQA decoder (no MLP: the attention is what matters here), 128K tokens over a context-parallel axis C
# of 4 H100s, 4 layers over 2 pipeline stages under 1F1B: long enough that the zig-zag ring is the fastest form
MODEL = """mesh P=2 pipeline, C=4
dims B=4, S=131072, T=131072, D=1024, G=2, R=4, H=128, V=1024
microbatches 2
schedule 1f1b
hardware h100
const Tok, Next
param W_emb, W_q, W_k, W_v, W_o, W_out

X0[B, S_C, D] = embed(Tok[B, S_C], W_emb[V, D])
layers 4 {
  L1[B, S_C, D] = rmsnorm(X0[B, S_C, D] over D)
  Kx[B, T_C, D] = L1[B, S_C, D]
  Q[B, S_C, G, R, H] = L1[B, S_C, D] · W_q[D, G, R, H]
  K[B, T_C, G, H] = Kx[B, T_C, D] · W_k[D, G, H]
  Vl[B, T_C, G, H] = Kx[B, T_C, D] · W_v[D, G, H]
  A[B, S_C, G, R, H] = attention(Q[B, S_C, G, R, H], K[B, T_C, G, H], Vl[B, T_C, G, H] over T, causal)
  X1[B, S_C, D] = X0[B, S_C, D] + A[B, S_C, G, R, H] · W_o[G, R, H, D]
}
Lg[B, S_C, V] = X1[B, S_C, D] · W_out[D, V]
Loss[] = cross_entropy(Lg[B, S_C, V], Next[B, S_C])
"""

# the same layer as a block alone: its input X enters stage 0, its output Out leaves the last stage
BLOCK = """mesh P=2 pipeline, C=4
dims B=4, S=131072, T=131072, D=1024, G=2, R=4, H=128
layers 4
microbatches 2
schedule 1f1b
hardware h100
param W_q, W_k, W_v, W_o

L1[B, S_C, D] = rmsnorm(X[B, S_C, D] over D)
Kx[B, T_C, D] = L1[B, S_C, D]
Q[B, S_C, G, R, H] = L1[B, S_C, D] · W_q[D, G, R, H]
K[B, T_C, G, H] = Kx[B, T_C, D] · W_k[D, G, H]
Vl[B, T_C, G, H] = Kx[B, T_C, D] · W_v[D, G, H]
A[B, S_C, G, R, H] = attention(Q[B, S_C, G, R, H], K[B, T_C, G, H], Vl[B, T_C, G, H] over T, causal)
Out[B, S_C, D] = X[B, S_C, D] + A[B, S_C, G, R, H] · W_o[G, R, H, D]
"""

SMALL = {"B": 4, "S": 32, "T": 32, "D": 16, "G": 2, "R": 2, "H": 8, "V": 32}


def _kernels(plan: Plan) -> list[Attention]:
    return [s.fn for s in plan.forward + plan.backward if isinstance(s.fn, Attention)]


def _pipeline_step(plan: Plan) -> float:
    report = _cost(plan)
    assert report.pipeline is not None
    return report.pipeline.step_s


def test_a_pipelined_ring_holds_the_zigzag_order_across_its_stages() -> None:
    """Every layer's sequence is sharded over C and nothing but the ring looks at positions, so the pipeline
    holds the zig-zag order from its first stage to its last: the kernels reorder nothing, and the
    pipeline's step is the kernels' reordering sends shorter than with them (each stage's compute the same)."""
    plan = shardc.plan(shardc.parse(MODEL))
    assert plan.spec.mesh.pipeline_axis is not None
    assert _kernels(plan) and all(fn.ring == ("C",) and fn.zigzag and fn.held for fn in _kernels(plan))
    assert sequence_order(plan, {"P": 2, "C": 4}) == (frozenset({"S", "T"}), 8)
    held, reordered = _cost(plan), _cost(_unheld(plan))
    assert held.step.compute_s == reordered.step.compute_s
    saved = reordered.step.exposed_comm_s - held.step.exposed_comm_s
    assert saved > 0 and held.step.step_s == pytest.approx(reordered.step.step_s - saved)
    assert _pipeline_step(plan) < _pipeline_step(_unheld(plan))


def test_a_position_param_keeps_a_pipeline_in_its_own_order() -> None:
    """A learned position embedding is a param with S: the pipeline takes its params stacked by stage as they
    are, so it cannot hold the zig-zag order, and the kernels would reorder at every call (here the
    all-gather form wins); the same spec unpipelined permutes the param with the data and holds it."""
    text = MODEL.replace("param W_emb,", "param W_pos, W_emb,").replace(
        "X0[B, S_C, D] = embed(Tok[B, S_C], W_emb[V, D])",
        "E[B, S_C, D] = embed(Tok[B, S_C], W_emb[V, D])\nX0[B, S_C, D] = E[B, S_C, D] + W_pos[S_C, D]")
    piped = shardc.plan(shardc.parse(text))
    assert _kernels(piped) and not any(fn.held for fn in _kernels(piped))
    assert sequence_order(piped, {"P": 2, "C": 4}) is None
    flat = text.replace("mesh P=2 pipeline, C=4", "mesh C=4").replace("microbatches 2\n", "").replace(
        "schedule 1f1b\n", "")
    assert all(fn.held for fn in _kernels(shardc.plan(shardc.parse(flat))))


def test_explain_prices_the_pipelined_ring_held_and_permuted() -> None:
    """--explain gives the zig-zag ring's price as the pipeline runs it, held, beside its price reordered."""
    plan = shardc.plan(shardc.parse(MODEL), explain=True)
    (choice,) = [c for c in plan.choices if any("zig-zag" in a.description for a in c.alternatives)]
    (chosen,) = [a for a in choice.alternatives if a.chosen]
    assert "zig-zag" in chosen.description and chosen.time is not None
    # what the cost charges the kernels: their rows are a microbatch's (the stage runs 2), --explain's the
    # batch's (one ring's latencies apart: 14 us of 215 ms); the reordering would add 2%
    assert chosen.time == pytest.approx(2 * _kernels_cost(plan), rel=1e-4)
    held, permuted = (float(x) for x in re.findall(r"([\d.e-]+) s held, ([\d.e-]+) s with its blocks reordered",
                                                   choice.reason)[0])
    assert held == pytest.approx(chosen.time, rel=1e-2) and permuted > held


def test_the_lowered_pipeline_permutes_its_data_once_and_its_kernels_reorder_nothing() -> None:
    """The module names the arrays the pipeline takes and gives in zig-zag order: the tokens and targets of
    the whole model (no param), the input, output and their gradients of a block alone; the kernels are
    called held."""
    for text, arrays in ((MODEL, {"Tok", "Next"}), (BLOCK, {"X", "dX", "Out", "dOut"})):
        lowered = lower_pipeline(shardc.plan(shardc.parse(text)), sizes=SMALL, layers=4, load=False)
        namespace: dict[str, object] = {}
        lines = [x for x in lowered.source.splitlines() if x.startswith("SEQUENCE_")]
        exec("\n".join(lines), namespace)  # noqa: S102  # the module's two constants, literals
        assert namespace["SEQUENCE_ZIGZAG"] == {name: (1,) for name in arrays}
        assert namespace["SEQUENCE_CHUNKS"] == 8
        calls = [x for x in lowered.source.splitlines() if "ring_attention" in x and "=" in x]
        assert calls and all("held=True" in x for x in calls)


def test_layouts_price_a_pipelined_ring_held() -> None:
    """`shardc layouts` plans each layout as `shardc plan` does: the pipelined layout's step is the held
    pipeline's, below what the same plan would take reordering at each call."""
    spec = shardc.parse(MODEL)
    search = search_layouts([spec], Options(get_hardware("h100")), chips=8, jobs=1)
    (row,) = [r for r in search.layouts if dict(r.sizes) == {"P": 2, "C": 4}]
    plan = shardc.plan(spec)
    assert row.step_s == pytest.approx(_pipeline_step(plan))
    assert row.step_s < _pipeline_step(_unheld(plan))


@pytest.mark.slow
@pytest.mark.parametrize("text", [MODEL, BLOCK], ids=["model", "block"])
def test_a_pipelined_ring_held_in_zigzag_order_verifies(text: str) -> None:
    """Values and gradients against the numpy reference, and the HLO: the stages' sends and each ring kernel's
    permutes (K and V 3 hops each forward; those and dK, dV 4 hops each backward), none reordering blocks."""
    from shardc.verification.verify import verify

    plan = shardc.plan(shardc.parse(text))
    assert all(fn.held for fn in _kernels(plan))
    report = verify(plan)
    assert report.ok, [r for r in (*report.values, *report.collectives) if not r.ok]
    assert report.mesh == {"P": 2, "C": 4}
    want = {"Loss", "dW_emb", "dW_q", "dW_o", "dW_out"} if text is MODEL else {"Out", "dX", "dW_q", "dW_o"}
    assert want <= {r.tensor for r in report.values}
    rings = [r for r in report.collectives if "sends around the ring" in r.step]
    assert sorted(r.hlo_op for r in rings) == ["collective-permute x 14", "collective-permute x 6"]
    elements = {r.plan_bytes for r in rings}
    permutes = [r for r in report.collectives if r.kind == "CollectivePermute" and r.plan_axes == "C"]
    assert {r.plan_bytes for r in permutes} == elements  # no other permute over C: no reordering's halves


@pytest.mark.slow
@pytest.mark.parametrize("text", [MODEL, BLOCK], ids=["model", "block"])
def test_a_pipelined_balanced_all_gather_held_in_zigzag_order_verifies(text: str) -> None:
    """At 4K tokens the all-gather form balanced in zig-zag chunks wins: each stage gathers K and V along T in
    the held order and masks by the chunks' true positions; values, gradients and the HLO's gathers and
    scatters over C verify, and the same plan masking the held places as if contiguous fails the values."""
    from shardc.verification.verify import verify

    plan = shardc.plan(shardc.parse(text.replace("131072", "4096")))
    kernels = _kernels(plan)
    assert kernels and all(fn.held and fn.zigzag and not fn.ring for fn in kernels)
    report = verify(plan)
    assert report.ok, [r for r in (*report.values, *report.collectives) if not r.ok]
    assert {"all-gather", "reduce-scatter"} <= {r.hlo_op for r in report.collectives if r.plan_axes == "C"}

    def contiguous(steps: tuple[Step, ...]) -> tuple[Step, ...]:  # still held: the data enters permuted
        return tuple(replace(s, fn=replace(s.fn, zigzag=False)) if isinstance(s.fn, Attention) else s
                     for s in steps)

    wrong = replace(plan, forward=contiguous(plan.forward), backward=contiguous(plan.backward),
                    recomputed=contiguous(plan.recomputed))
    assert not verify(wrong).ok
