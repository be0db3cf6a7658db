"""--recompute none|selective|full: what the backward keeps (and why), what it recomputes, and its time."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import symengine as se
from hypothesis import given
from hypothesis import strategies as st

import shardc
from shardc.costmodel.formulas import evaluate, text
from shardc.costmodel.memory import residual_formula, residual_table
from shardc.device_pieces import einsum_flops
from shardc.ir.plan import Op, Plan
from shardc.ir.spec import Call, Statement, TensorRef
from shardc.ops.registry import CONTRACT, Node, family_of
from shardc.planner.graph import Graph, build_graph
from shardc.planner.recompute import RECOMPUTE_MODES as RECOMPUTE
from shardc.planner.recompute import attention_region
from shardc.testing import specs
from shardc.timing import plan_sizes, plan_time
from tests.test_cli import shardc_cli

ROOT = Path(__file__).resolve().parent.parent
ATTENTION = """mesh X=2, Y=2
dims B=8, S=64, T=64, N=4, H=16, D=64
Q[B_X, S, N_Y, H] = Xq[B_X, S, D] · W_q[D, N_Y, H]
Sc[B_X, N_Y, S, T] = Q[B_X, S, N_Y, H] · K[B_X, T, N_Y, H]
P[B_X, N_Y, S, T] = exp(Sc[B_X, N_Y, S, T])
O[B_X, S, N_Y, H] = P[B_X, N_Y, S, T] · V[B_X, T, N_Y, H]
Out[B_X, S, D] = O[B_X, S, N_Y, H] · W_o[N_Y, H, D]
"""
MLP = ("mesh X=4, Y=2\ndims B=4096, D=1024, F=4096\n"
       "Tmp[B_X, F_Y] = gelu(In[B_X, D] · W_in[D, F_Y])\nOut[B_X, D] = Tmp[B_X, F_Y] · W_out[F_Y, D]\n")


def planned(text: str, mode: str, save: str = "default") -> Plan:
    return shardc.plan(shardc.parse(text, "<recompute>"), recompute=mode, save=save)


def kept(p: Plan) -> list[str]:
    return [ref.name for ref, _ in residual_table(p)]


# --- the attention-score region ----------------------------------------------------------------------

def test_the_region_is_the_scores_and_what_maps_them_up_to_the_attention_times_v() -> None:
    assert attention_region(build_graph(shardc.parse(ATTENTION))) == {"Sc", "P"}
    assert attention_region(build_graph(shardc.parse(MLP))) == frozenset()  # X · W is never a score


def test_the_region_needs_the_closing_einsum() -> None:
    no_pv = ATTENTION.split("O[B_X")[0]  # scores and softmax stand-in, never contracted with V
    assert attention_region(build_graph(shardc.parse(no_pv.replace("P[B_X", "Pr[B_X")))) == frozenset()


def _node(kind: str, result: str, indices: str, operands: tuple[str, ...], fn: str | None = None) -> Node:
    """A node as the graph makes it: an einsum, or a call of an op family (``fn``, else ``kind``)."""
    dummy = Statement(TensorRef(result, ()), TensorRef(result, ()))
    if kind == "einsum":
        return Node(family_of(CONTRACT), result, tuple(indices), operands, None, dummy)
    family = family_of(fn or kind)
    call = Call(fn or kind, TensorRef(operands[0], ()))
    return Node(family, result, tuple(indices), operands, None, dummy, fn, call=call)


@pytest.mark.parametrize("kinds", [("softmax", None, "dropout", None), ("elementwise", "causal", "dropout", None),
                                   ("elementwise", "softmax", "elementwise", "dropout"),
                                   ("normalize", "softmax", "mask", "causal")])
def test_the_region_grows_through_softmax_causal_and_dropout_by_their_families(kinds: tuple[str, ...]) -> None:
    """The calls whose op family keeps them in the region (softmax, the masks) continue it."""
    first_kind, first_fn, second_kind, second_fn = kinds
    nodes = (_node("einsum", "Q", "BSH", ("X", "Wq")), _node("einsum", "Sc", "BST", ("Q", "K")),
             _node(first_kind, "Pr", "BST", ("Sc",), first_fn), _node(second_kind, "Pd", "BST", ("Pr",), second_fn),
             _node("einsum", "O", "BSH", ("Pd", "V")), _node("einsum", "Out", "BSD", ("O", "Wo")))
    indices = {"X": tuple("BSD"), "Wq": tuple("DH"), "K": tuple("BTH"), "V": tuple("BTH"), "Wo": tuple("HD")}
    indices |= {n.result: n.indices for n in nodes}
    graph = Graph(nodes, {}, indices, frozenset({"Wq", "Wo"}), ("X", "Wq", "K", "V", "Wo"), ("Out",))
    assert attention_region(graph) == {"Sc", "Pr", "Pd"}
    rmsnorm = tuple(_node("normalize", n.result, "".join(n.indices), n.operands, "rmsnorm")
                    if n.result == "Pr" else n for n in nodes)
    # a norm is not part of the region: the chain to the attention times V breaks, so there is none
    assert attention_region(Graph(rmsnorm, {}, indices, graph.params, graph.inputs, graph.outputs)) == set()
    assert all(_scores(f) for f in ("softmax", "dropout", "causal")) and not any(_scores(f) for f in ("rmsnorm", "max"))


def _scores(func: str) -> bool:
    return family_of(func).scores(_node(func, "Pr", "BST", ("Sc",), func))


# --- what each mode keeps ------------------------------------------------------------------------------

def test_none_keeps_what_the_save_policy_keeps_and_says_who_reads_it() -> None:
    p = planned(ATTENTION, "none")
    assert p.recomputed == ()
    assert kept(p) == ["O", "P", "Sc", "Q", "V", "K", "Xq"]
    whys = dict((ref.name, why) for ref, why in residual_table(p))
    assert whys["Sc"].startswith("read by backward step") and "exp_vjp" in whys["Sc"]
    assert whys["Xq"].startswith("layer input, read by backward step")


def test_selective_recomputes_the_scores_and_keeps_their_inputs() -> None:
    p = planned(ATTENTION, "selective")
    assert [(s.op, s.tensor) for s in p.recomputed] == [(Op.EINSUM, "Sc"), (Op.ELEMENTWISE, "P")]
    assert set(kept(p)) == {"O", "Q", "K", "V", "Xq"}
    none, sel = shardc.cost(planned(ATTENTION, "none")).memory, shardc.cost(p).memory
    score = 8 * 4 * 64 * 64 * 2 / 4  # one [B_X, N_Y, S, T] value of bf16 on one device
    assert none.residual_bytes - sel.residual_bytes == 2 * score
    assert [v for v, _ in sel.recomputed] == ["Sc[B_X, N_Y, S, T]", "P[B_X, N_Y, S, T]"]


def test_full_keeps_only_the_layer_inputs() -> None:
    p = planned(ATTENTION, "full")
    table = residual_table(p)
    assert {ref.name for ref, _ in table} == {"Xq", "K", "V"}
    assert all(why.startswith("layer input") for _, why in table)
    assert {s.tensor for s in p.recomputed} == {"Q", "Sc", "P", "O"}


def test_full_reruns_only_what_the_backward_needs() -> None:
    """As jax.checkpoint: the MLP's backward needs Tmp (and gelu's input), not Out: W_out's einsum is not rerun."""
    p = planned(MLP, "full")
    assert [s.tensor for s in p.recomputed if s.op is Op.EINSUM] == ["Tmp_t1"]
    assert kept(p) == ["In"]


# --- the extra FLOPs are in the step time --------------------------------------------------------------

@pytest.mark.parametrize("text", [ATTENTION, MLP])
@pytest.mark.parametrize("mode", ["selective", "full", "dots", "dots-except:W_in"])
def test_recomputed_flops_are_in_the_backward_and_the_step_time(text: str, mode: str) -> None:
    if "W_in" in mode and "W_in" not in text:
        mode = "dots-except:W_q"
    none, again = planned(text, "none"), planned(text, mode)
    cost_none, cost_again = shardc.cost(none), shardc.cost(again)
    extra = math.fsum(einsum_flops(s, plan_sizes(again))[0] for s in again.recomputed if s.op is Op.EINSUM)
    assert cost_again.backward.compute_flops - cost_none.backward.compute_flops == pytest.approx(extra)
    assert plan_time(again).step_s == pytest.approx(cost_again.step.step_s, rel=1e-12)
    assert plan_time(again).backward_compute_s == pytest.approx(cost_again.backward.compute_s, rel=1e-12)
    rows = [r for r in cost_again.backward.rows if r.text.startswith("(recomputed)")]
    assert len(rows) == len(again.recomputed)


def test_full_recompute_of_the_mlp_adds_the_first_einsums_flops() -> None:
    none, full = shardc.cost(planned(MLP, "none")), shardc.cost(planned(MLP, "full"))
    assert full.backward.compute_flops - none.backward.compute_flops == 2 * 4096 * 1024 * 4096 / 8
    assert full.memory.residual_bytes < none.memory.residual_bytes


# --- the command line ------------------------------------------------------------------------------------

def test_cli_plan_and_cost_take_recompute(tmp_path: Path) -> None:
    path = tmp_path / "att.shard"
    path.write_text(ATTENTION, encoding="utf-8")

    def run(*args: str) -> str:
        done = shardc_cli(*args, str(path))
        done.check_returncode()
        return done.stdout

    assert "recomputed in the backward (--recompute selective): Sc, P" in run("plan", "--recompute", "selective")
    assert json.loads(run("plan", "--recompute", "full", "--json"))["recompute"] == "full"
    memory = json.loads(run("cost", "--recompute", "selective", "--json"))["memory"]
    assert memory["recompute"] == "selective"
    assert memory["residual_bytes"] == sum(r["bytes_per_layer"] for r in memory["residuals"])
    assert all(r["why"] for r in memory["residuals"])
    assert [r["value"] for r in memory["recomputed"]] == ["Sc[B_X, N_Y, S, T]", "P[B_X, N_Y, S, T]"]
    text = run("cost", "--recompute", "full")
    assert "kept for the backward, one layer (--recompute full):" in text and "(recomputed)" in text


def test_an_unknown_mode_is_an_error() -> None:
    with pytest.raises(shardc.ShardcError, match="unknown recompute mode"):
        planned(MLP, "some")
    with pytest.raises(shardc.ShardcError, match="'W_gate' is not a param"):
        planned(MLP, "dots-except:W_in,W_gate")
    with pytest.raises(shardc.ShardcError, match="'' is not a param"):
        planned(MLP, "dots-except:")
    with pytest.raises(TypeError, match="recompute must be a str"):
        planned(MLP, 3)  # type: ignore[arg-type]


# --- dots: a matmul-with-a-weight's output kept, the rest rerun --------------------------------------------

def test_dots_keeps_each_weight_matmuls_output_and_reruns_what_maps_it() -> None:
    """JAX's dots_with_no_batch_dims_saveable: gelu's input (the matmul's output) is kept, its output rerun."""
    dots = planned(MLP, "dots")
    assert [s.dst.name for s in dots.recomputed] == ["Tmp"]
    assert "Tmp_t1" in kept(dots) and "Tmp" not in kept(dots)
    cost_none, cost_dots = shardc.cost(planned(MLP, "none")), shardc.cost(dots)
    assert cost_dots.backward.compute_flops == cost_none.backward.compute_flops  # no matmul rerun
    assert cost_dots.memory.residual_bytes < cost_none.memory.residual_bytes


def test_dots_except_a_param_reruns_its_matmul_as_maxtexts_save_dot_except_mlpwi() -> None:
    again = planned(MLP, "dots-except:W_in")
    assert {s.dst.name for s in again.recomputed} == {"Tmp_t1", "Tmp"}
    extra = shardc.cost(again).backward.compute_flops - shardc.cost(planned(MLP, "none")).backward.compute_flops
    assert extra == 2 * 4096 * 1024 * 4096 / 8  # W_in's matmul once more, B*D*F/(X*Y) of it a device
    assert again.recompute == "dots-except:W_in"


def test_dots_keeps_each_layers_input_and_reruns_the_attention_scores() -> None:
    """Under a remat policy a scanned layer keeps its input (the scan's carry); the attention scores, a matmul
    of two activations, are rerun; the MLP's input projections too under dots-except."""
    spec = shardc.parse((ROOT / "examples" / "llama2_13b.shard").read_text(encoding="utf-8"))
    plan = shardc.plan(spec, recompute="dots-except:W_gate,W_up")
    rows = {r["value"]: r for r in shardc.cost(plan).to_json()["memory"]["residuals"]}  # type: ignore[index]
    assert "the layer's input" in rows["X0[B_X, S, D]"]["why"]
    again = {s.dst.name for s in plan.recomputed}
    assert {"Sc", "P", "C", "G_t1", "U"} <= again and not again & {"X0", "Q", "K", "Vl"}
    assert {"Q[B_X, S, N_Y, H]", "K[B_X, T, N_Y, H]"} <= set(rows)


# --- any spec ----------------------------------------------------------------------------------------------

@given(specs(max_statements=3, dims=True), st.sampled_from(["selective", "full", "dots"]),
       st.sampled_from(["default", "none", "all"]))
def test_recompute_keeps_less_and_costs_what_the_planner_minimises(spec: shardc.Spec, mode: str, save: str) -> None:
    none, again = shardc.plan(spec, save=save), shardc.plan(spec, save=save, recompute=mode)
    assert again.recompute == mode
    assert set(again.recomputed) <= set(again.forward)
    # the recomputed steps run from what is kept: each reads a kept value, a param, or an earlier rerun step's
    have = {ref for ref, _ in residual_table(again)} | {i.ref for i in again.tensors if i.role == "param"}
    for step in again.recomputed:
        assert set(step.operands) | ({step.src} if step.src is not None else set()) <= have, step
        have.add(step.dst)
    # and the backward's reads of the forward are all there
    forward_made = {s.dst for s in again.forward}
    assert {r for r in none.residuals if r in forward_made} <= have
    assert plan_time(again).step_s == pytest.approx(shardc.cost(again).step.step_s, rel=1e-9, abs=1e-18)
    if mode == "full":
        inputs = {info.ref for info in again.tensors if info.role == "input"}
        assert {ref for ref, _ in residual_table(again)} <= inputs


def test_the_kept_bytes_as_formulas_and_as_numbers() -> None:
    """What selective drops is exactly the two [B, N, S, T] score tensors (bf16), the 5as/h-like term."""
    symbolic = ATTENTION.replace("dims B=8, S=64, T=64, N=4, H=16, D=64\n", "")
    none, sel, full = (residual_formula(planned(symbolic, mode)) for mode in ("none", "selective", "full"))
    b, n, s, t, h, d, x, y = (se.Symbol(k) for k in "BNSTHDXY")
    assert se.expand(none - sel - 4 * b * n * s * t / (x * y)) == 0
    assert se.expand(full - (2 * b * s * d / x + 4 * b * t * n * h / (x * y))) == 0
    for mode in RECOMPUTE:
        p = planned(ATTENTION, mode)
        m = shardc.cost(p).memory
        assert evaluate(residual_formula(p), plan_sizes(p)) == m.residual_bytes
        assert m.to_json()["residual_bytes_per_layer_expr"] == text(residual_formula(p))


def test_full_recompute_keeps_2sbh_a_layer_as_korthikanti_write_it() -> None:
    """Korthikanti et al. 2022, Table 2: full recompute keeps a layer's 16-bit input, 2sbh, with or
    without tensor parallelism t (the input is replicated over the tensor axis)."""
    tp = ("mesh T=8\nTmp[S, B, F_T] = gelu(In[S, B, H] · W_in[H, F_T])\n"
          "Out[S, B, H] = Tmp[S, B, F_T] · W_out[F_T, H]\n")
    s, b, h = (se.Symbol(k) for k in "SBH")
    full = shardc.plan(shardc.parse(tp), recompute="full")
    assert se.expand(residual_formula(full) - 2 * s * b * h) == 0
    none = shardc.plan(shardc.parse(tp))
    assert text(residual_formula(none)) == "4*B*F*S/T + 2*B*H*S"  # the input, and gelu's input and output


def test_full_recomputation_keeps_each_layers_input_once_a_layer() -> None:
    """Full recomputation checkpoints every layer's input (Korthikanti et al. 2022, section 4.1: 2sbh a
    layer): the block's input is kept once a layer, and the backward reruns the block from it, never
    the embedding before the block."""
    spec = shardc.parse((ROOT / "examples" / "llama2_13b.shard").read_text(encoding="utf-8"))
    plan = shardc.plan(spec, recompute="full")
    memory = shardc.cost(plan).to_json()["memory"]
    rows = {r["value"]: r for r in memory["residuals"]}  # type: ignore[union-attr, index]
    x0 = rows["X0[B_X, S, D]"]
    assert "the layer's input" in x0["why"]
    sizes = dict(spec.dims) | {a.name: a.size for a in spec.mesh.axes}
    layer_input = 2 * sizes["B"] * sizes["S"] * sizes["D"] / sizes["X"]  # bf16, B sharded over X
    assert x0["bytes_per_layer"] == layer_input
    tokens = sum(r["bytes_per_layer"] for name, r in rows.items() if name != "X0[B_X, S, D]")
    assert memory["residual_bytes"] == pytest.approx(40 * layer_input + tokens)
    assert "X0" not in {s.dst.name for s in plan.recomputed}  # the embedding before the block is not rerun
    assert "L1" in {s.dst.name for s in plan.recomputed}  # the block is


# --- what full recomputation reruns of a layered model -------------------------------------------------

LAYERED = """mesh X=2
dims B=64, D=32, F=128, V=48, L=3
param W_in, W_out, W_head
layers L {
  H[B_X, F] = gelu(X0[B_X, D] · W_in[D, F])
  X1[B_X, D] = X0[B_X, D] + H[B_X, F] · W_out[F, D]
}
Out[B_X, V] = X1[B_X, D] · W_head[D, V]
"""


def _flops(text: str, mode: str) -> float:
    return float(shardc.cost(planned(text, mode)).to_json()["step"]["compute_flops"])  # type: ignore[index]


@pytest.mark.parametrize("fusion, rerun", [("xla", ["H_t1"]), ("statement", ["H_t1", "X1_t1"]),
                                           ("none", ["H_t1", "X1_t1"])])
def test_full_reruns_a_layer_as_its_framework_does(fusion: str, rerun: list[str]) -> None:
    """Full recomputation checkpoints the layers; the head after the block keeps what its backward reads
    (the last layer's output X1 among it), so no layer is rerun to remake it.  Under XLA (a JAX program)
    a layer reruns what its backward reads: jax.checkpoint drops the output projection W_out, whose result
    only the residual add reads; PyTorch's checkpoint (fusion statement, fusion none) calls the layer's
    function again, W_out's matmul included.  Each device holds B/X = 32 rows: the rerun adds 2*32*D*F
    FLOPs a layer for W_in, and as much again for W_out where the layer reruns whole."""
    text = f"fusion {fusion}\n" + LAYERED
    p = planned(text, "full")
    assert [s.tensor for s in p.recomputed if s.op is Op.EINSUM] == rerun
    assert not any(s.once for s in p.recomputed)  # neither the head nor the last layer's output is rerun
    assert "X1" in kept(p) and "X0" in kept(p)
    extra = _flops(text, "full") - _flops(text, "none")
    assert extra == 3 * len(rerun) * 2 * 32 * 32 * 128  # L=3 layers, each einsum 2 * (B/X) * D * F
