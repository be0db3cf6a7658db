"""ZeRO (Rajbhandari et al. 2020): the `zero` line, the paper's memory, the optimizer phase, FSDP as stage 3."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import symengine as se
from hypothesis import assume, given
from hypothesis import strategies as st

import shardc
from shardc.costmodel.formulas import symbol
from shardc.costmodel.memory import state_formula
from shardc.ir.localops import UPDATE
from shardc.ir.plan import Op, Plan, Step
from shardc.ir.spec import Zero
from shardc.lowering.replan import unlowered_optimizer
from shardc.planner.check import check_plan
from shardc.planner.plan_text import phase_total, render_text, to_json
from shardc.planner.zero import zero_layout
from shardc.testing import specs
from shardc.timing import plan_time
from tests.test_cli import shardc_cli
from tests.test_plan_sections import MODEL

ROOT = Path(__file__).resolve().parent.parent
DP = "mesh X={n}\n{dims}{zero}Out[B_X, F] = In[B_X, D] · W[D, F]\n"
MLP = ("mesh X=8, Y=2\n{dims}{zero}Tmp[B_X, F_Y] = In[B_X, D] · W_in[D, F_Y]\n"
       "Out[B_X, D] = Tmp[B_X, F_Y] · W_out[F_Y, D]\n")
SIZES = "dims B=1024, D=512, F=2048\n"


def planned(template: str, zero: str = "", dims: str = "", n: int = 8, **options: str) -> Plan:
    text = template.format(n=n, dims=dims, zero=zero + "\n" if zero else "")
    return shardc.plan(shardc.parse(text, "<zero>"), **options)


# --- the line --------------------------------------------------------------------------------------

@pytest.mark.parametrize("line, stage, axes", [("zero 1 over X", 1, ("X",)), ("zero 2 over Y, X", 2, ("Y", "X")),
                                              ("zero 3 over X", 3, ("X",))])
def test_the_zero_line_parses_and_prints_back(line: str, stage: int, axes: tuple[str, ...]) -> None:
    spec = shardc.parse(f"mesh X=2, Y=2\n{line}\nOut[B_X, F] = In[B_X, D] · W[D, F]\n")
    assert spec.zero == Zero(stage, axes)
    assert line in str(spec) and shardc.parse(str(spec)) == spec


@pytest.mark.parametrize("line, message, column", [
    ("zero 4 over X", "ZeRO has stages 1, 2 and 3", 6),
    ("zero 1 over Z", "Z is not a mesh axis", 1),
    ("zero 1 over X, X", "axis X is given twice", 1),
    ("zero 1 X", "syntax error", 8),
])
def test_a_bad_zero_line_is_an_error_with_a_caret_and_a_fix(line: str, message: str, column: int) -> None:
    with pytest.raises(shardc.ShardcError) as err:
        shardc.parse(f"mesh X=2, Y=2\n{line}\nOut[B_X, F] = In[B_X, D] · W[D, F]\n", "z.shard")
    assert message in err.value.message and err.value.fix
    assert err.value.span is not None and (err.value.span.line, err.value.span.column) == (2, column)


def test_zero_over_the_pipeline_axis_is_refused() -> None:
    with pytest.raises(shardc.ShardcError, match="pipeline axis"):
        shardc.parse("mesh P=2 pipeline, X=2\nlayers 4\nzero 1 over P\nOut[B_X, E] = In[B_X, D] · W[D, E]\n")


def test_the_shard_is_the_first_unsharded_dim_its_devices_divide() -> None:
    spec = shardc.parse("mesh X=4, Y=2\ndims B=8, D=6, F=8, E=16\nOut[B_X, E] = In[B_X, D, F] · W[D, F_Y, E]\n")
    w = spec.statements[0].expr.operands[1]  # type: ignore[union-attr]
    assert zero_layout(w, ("X",), spec) == ((), ("Y",), ("X",))  # D=6 does not divide over 4; F is taken
    assert zero_layout(w, ("Y",), spec) is None  # already sharded over Y: left as declared
    assert zero_layout(w, ("X", "Y"), spec) == ((), ("Y",), ("X",))


# --- the ZeRO paper's memory, as formulas and numbers ------------------------------------------------

PSI = symbol("D") * symbol("F")
N = symbol("X")
PAPER = {"": 16 * PSI, "zero 1 over X": 4 * PSI + 12 * PSI / N, "zero 2 over X": 2 * PSI + 14 * PSI / N,
         "zero 3 over X": 16 * PSI / N}


@pytest.mark.parametrize("zero", sorted(PAPER))
def test_state_formulas_are_the_zero_papers(zero: str) -> None:
    """Rajbhandari et al. 2020, Figure 1: (2 + 2 + K)Ψ, 4Ψ + KΨ/N, 2Ψ + 14Ψ/N, 16Ψ/N with K = 12."""
    p = planned(DP, zero)
    total = sum(state_formula(p, "adam16"), se.Integer(0))
    assert se.expand(total - PAPER[zero]) == 0


@pytest.mark.parametrize("zero, gb", [("", 120.0), ("zero 1 over X", 31.4), ("zero 2 over X", 16.6),
                                      ("zero 3 over X", 1.9)])
def test_the_papers_75b_model_on_64_devices(zero: str, gb: float) -> None:
    """Table 1 of the paper: Ψ = 7.5B, N_d = 64, K = 12: 120, 31.4, 16.6 and 1.9 GB a device."""
    dims = "dims B=65536, D=160000, F=46875\n"  # D*F = 7.5e9, D over 64 devices evenly
    m = shardc.cost(planned(DP, zero, dims, n=64), optimizer="adam16").memory
    state = m.param_bytes + m.grad_bytes + m.optimizer_bytes
    assert m.params_total == 7.5e9
    assert round(state / 1e9, 1) == gb
    exact = {"": 16, "zero 1 over X": 4 + 12 / 64, "zero 2 over X": 2 + 14 / 64, "zero 3 over X": 16 / 64}[zero]
    assert state == exact * 7.5e9
    assert (zero or "zero") in shardc.cost(planned(DP, zero, dims, n=64)).render() or not zero


# --- the optimizer phase ---------------------------------------------------------------------------

def collectives(steps: tuple[object, ...]) -> list[tuple[str, str, str]]:
    return [(s.op.value, "".join(s.axes), s.tensor) for s in steps if s.is_collective]  # type: ignore[attr-defined]


def weight_steps(steps: tuple[Step, ...]) -> tuple[Step, ...]:
    return tuple(s for s in steps if s.tensor in ("W_in", "W_out", "dW_in", "dW_out"))


@pytest.mark.parametrize("dims", ["", SIZES])
def test_zero_1_reduce_scatters_then_all_gathers_in_a_third_phase(dims: str) -> None:
    base, zero = planned(MLP, "", dims), planned(MLP, "zero 1 over X", dims)
    assert check_plan(zero) == []
    assert collectives(zero.optimizer) == [("reduce_scatter", "X", "dW_in"), ("all_gather", "X", "W_in"),
                                          ("reduce_scatter", "X", "dW_out"), ("all_gather", "X", "W_out")]
    assert [s.fn for s in zero.optimizer if s.op is Op.ELEMENTWISE] == [UPDATE, UPDATE]
    # the backward no longer all-reduces the weight gradients over X: it leaves them partial sums
    assert collectives(weight_steps(base.backward)) == [("all_reduce", "X", "dW_out"), ("all_reduce", "X", "dW_in")]
    assert not collectives(weight_steps(zero.backward))
    assert {str(g) for g in zero.grads if g.name.startswith("dW")} == {"dW_in[D, F_Y]{U_X}", "dW_out[F_Y, D]{U_X}"}
    # the same bytes as the AllReduces they replace
    assert phase_total(zero.optimizer)[0] == phase_total(weight_steps(base.backward))[0] == "8*D*F/Y"
    assert zero.forward == base.forward


# DeepSeek-V3's layout (benchmarks/runs/deepseek_v3.shard) in small: a param of a few hundred bytes over
# 2 nodes x 64 GPUs, where a ring over node-local Z then X beats one ring of 128 on the H800's latency
HIERARCHICAL = ("mesh X=2 over dcn, Z=64\ndims B=128, S=8, D=128, J=8\nzero 1 over X, Z\ndtype f8\n"
                "hardware h800\nKr[B_XZ, S, J] = A[B_XZ, S, D] · W_kr[D, J]\n")


def test_a_param_gathered_back_in_two_collectives_is_a_sound_plan() -> None:
    p = shardc.plan(shardc.parse(HIERARCHICAL, "<zero>"))
    assert collectives(p.optimizer) == [("reduce_scatter", "X", "dW_kr"), ("reduce_scatter", "Z", "dW_kr"),
                                        ("all_gather", "Z", "W_kr"), ("all_gather", "X", "W_kr")]
    assert check_plan(p) == []
    assert str(p.optimizer[-1].dst) == "W_kr[D, J]"
    # the same gathers stopped one short leave the param on a shard: still caught
    short = replace(p, optimizer=p.optimizer[:-1])
    assert check_plan(short) == ["optimizer: W_kr ends as W_kr[D_X, J], declared W_kr[D, J]"]


@pytest.mark.parametrize("dims", ["", SIZES])
def test_zero_2_reduce_scatters_in_the_backward_and_all_gathers_in_the_third_phase(dims: str) -> None:
    base, zero = planned(MLP, "", dims), planned(MLP, "zero 2 over X", dims)
    assert check_plan(zero) == []
    assert collectives(weight_steps(zero.backward)) == [("reduce_scatter", "X", "dW_out"),
                                                       ("reduce_scatter", "X", "dW_in")]
    assert collectives(zero.optimizer) == [("all_gather", "X", "W_in"), ("all_gather", "X", "W_out")]
    assert {str(g) for g in zero.grads if g.name.startswith("dW")} == {"dW_in[D_X, F_Y]", "dW_out[F_Y, D_X]"}
    both = weight_steps(zero.backward) + zero.optimizer
    assert phase_total(both)[0] == phase_total(weight_steps(base.backward))[0] == "8*D*F/Y"
    assert "gradients made on the shard by the backward" in render_text(zero)


def test_the_optimizer_phase_is_in_the_step_time_cost_reports_and_the_planner_minimises() -> None:
    p = planned(MLP, "zero 1 over X", SIZES)
    report = shardc.cost(p)
    t = plan_time(p)
    assert report.optimizer is not None and report.optimizer.comm_s > 0
    assert t.step_s == pytest.approx(report.step.step_s, rel=1e-12)
    assert t.step_s == pytest.approx(t.forward_s + t.backward_s + report.optimizer.comm_s + t.update_s, rel=1e-12)
    assert t.update_s == pytest.approx(report.step.update_s, rel=1e-12) and t.update_s > 0
    assert report.optimizer.compute_s == 0 and report.optimizer.step_s == report.optimizer.comm_s
    assert t.optimizer_s == pytest.approx(report.optimizer.step_s, rel=1e-12)
    data = report.to_json()
    assert data["zero"] == {"stage": 1, "axes": ["X"]}
    # the gradients' ReduceScatters run in the backward (test below): the optimizer phase all-gathers
    assert data["optimizer"]["comm_bytes_expr"] == "4*D*F/Y"  # type: ignore[index]
    assert "step (forward + backward + optimizer)" in report.render()
    assert "optimizer: no FLOPs to hide the communication behind" in "\n".join(t.sentence for t in report.thresholds)


def test_zero_1_reduce_scatters_in_the_backward_as_zero_2_does_holding_the_whole_gradient() -> None:
    # DeepSpeed's stages 1 and 2 share one bucketed reduction in the backward, Megatron-LM's distributed
    # optimizer (ZeRO-1) reduce-scatters by its DDP's: ZeRO-1 exposes what ZeRO-2 does, its memory its own
    one, two = (shardc.cost(planned(MLP, f"zero {n} over X", SIZES, hardware="h100")) for n in (1, 2))
    assert one.optimizer is not None and two.optimizer is not None
    rs = [r for r in one.backward.rows if r.op is Op.REDUCE_SCATTER]
    assert [r.ahead for r in rs] == [True, True]  # in the backward, off the critical path
    assert one.backward.ahead_s == pytest.approx(two.backward.ahead_s, rel=1e-12)
    assert one.optimizer.comm_s == pytest.approx(two.optimizer.comm_s, rel=1e-12)  # the AllGathers alone
    assert one.step.exposed_comm_s == pytest.approx(two.step.exposed_comm_s, rel=1e-12)
    assert one.memory.grads == 8 * two.memory.grads  # stage 1 still holds every gradient whole
    after = shardc.cost(planned(MLP, "zero 1 over X\ngrad_reduce after-backward", SIZES, hardware="h100"))
    assert after.backward.ahead_s == 0  # exposed there, after the backward's compute
    assert after.backward.critical_s - one.backward.critical_s == pytest.approx(one.backward.ahead_s, rel=1e-9)


def test_shardc_plan_lists_the_optimizer_phase(tmp_path: Path) -> None:
    p = planned(MLP, "zero 2 over X", SIZES)
    text = render_text(p)
    assert "optimizer (zero 2 over X: gradients made on the shard by the backward" in text
    assert "AllGather_X       W_in[D_X, F_Y] -> W_in[D, F_Y]" in text
    data = to_json(p)
    assert [s["op"] for s in data["optimizer"]][:3] == ["slice", "elementwise", "all_gather"]
    assert data["totals"]["optimizer"]["bytes_expr"] == "4*D*F/Y"
    assert data["step_s"] == pytest.approx(plan_time(p).step_s)
    path = tmp_path / "z.shard"
    path.write_text(MLP.format(dims=SIZES, zero="zero 2 over X\n"), encoding="utf-8")
    done = shardc_cli("plan", str(path))
    done.check_returncode()
    out = done.stdout
    assert "optimizer (zero 2 over X" in out and "optimizer " in out.splitlines()[1]


def test_a_param_already_sharded_over_the_axes_has_no_optimizer_steps() -> None:
    fsdp = ("mesh X=8, Y=2\nzero 1 over X\nTmp[B_X, F_Y] = In[B_X, D] · W_in[D_X, F_Y]\n"
            "Out[B_X, D] = Tmp[B_X, F_Y] · W_out[F_Y, D]\n")
    p = shardc.plan(shardc.parse(fsdp))
    assert {s.tensor for s in p.optimizer} == {"W_out", "dW_out"}
    assert check_plan(p) == []


# --- stage 3 is FSDP -------------------------------------------------------------------------------

def test_zero_3_shards_every_param_and_plans_fsdp() -> None:
    p = planned(MLP, "zero 3 over X", SIZES)
    assert check_plan(p) == [] and p.optimizer == ()
    assert str(p.tensor("W_in").ref) == "W_in[D_X, F_Y]" and str(p.tensor("W_out").ref) == "W_out[F_Y, D_X]"
    assert any("shards W_in as W_in[D_X, F_Y]" in n for n in p.notes)
    assert any(op == "all_gather" and "X" in axes and t == "W_in" for op, axes, t in collectives(p.forward))
    assert any(op == "reduce_scatter" and "X" in axes and t == "dW_in" for op, axes, t in collectives(p.backward))
    declared = shardc.plan(shardc.parse(MLP.format(dims=SIZES, zero="").replace("W_in[D, F_Y]", "W_in[D_X, F_Y]")
                                        .replace("W_out[F_Y, D]", "W_out[F_Y, D_X]")))
    assert p.forward == declared.forward and p.backward == declared.backward


# --- lowering: forward and grad without the zero line, the optimizer phase as optimizer_step ---------

def test_forward_and_grad_lower_the_spec_without_the_zero_line() -> None:
    p = planned(MLP, "zero 1 over X")
    alone, note = unlowered_optimizer(p)
    assert note is not None and "without the zero line" in note and "optimizer_step" in note
    assert alone.optimizer == () and alone.spec.zero is None
    assert unlowered_optimizer(planned(MLP, "zero 3 over X")) == (planned(MLP, "zero 3 over X"), None)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_optimizer_step_is_sgd_on_the_shards_then_gathered(stage: int) -> None:
    import numpy as np

    from shardc.lowering.optimizer import LEARNING_RATE

    lowered = shardc.lower(planned(MLP, f"zero {stage} over X"), sizes={"B": 16, "D": 8, "F": 4, "X": 4, "Y": 2})
    assert lowered.module.optimizer is not None and "optimizer_program, optimizer_step = " in lowered.source
    rng = np.random.default_rng(0)
    params = {"W_in": rng.standard_normal((8, 4)), "W_out": rng.standard_normal((4, 8))}
    full = {"dW_in": rng.standard_normal((8, 4)), "dW_out": rng.standard_normal((4, 8))}
    # stage 1 takes the backward's partial sums, stacked over X; stage 2 the reduced gradient on the shard
    grads = {k: np.stack([g / 4] * 4) if stage == 1 else g for k, g in full.items()}
    got = lowered.optimizer_step({k: v.astype(np.float32) for k, v in params.items()},
                                 {k: v.astype(np.float32) for k, v in grads.items()})
    for name in params:
        assert np.allclose(np.asarray(got[name]), params[name] - LEARNING_RATE * full["d" + name], atol=1e-5)
    text = lowered.compiled_text("optimizer")
    assert text.count("reduce-scatter(") == (2 if stage == 1 else 0) and text.count("all-gather(") == 2


@pytest.mark.slow
def test_shardc_verify_checks_the_optimizer_phase_values_and_hlo(tmp_path: Path) -> None:
    path = tmp_path / "z.shard"
    path.write_text("mesh X=4, Y=2\nzero 1 over X\nTmp[B_X, F_Y] = In[B_X, D] · W_in[D, F_Y]\n", encoding="utf-8")
    done = shardc_cli("verify", str(path), "--json")  # in-process, as tests/test_lower.py verifies
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["ok"]
    assert any("optimizer_step" in n for n in report["notes"])
    assert [(r["phase"], r["tensor"], r["ok"]) for r in report["values"] if r["phase"] == "optimizer"] == \
        [("optimizer", "W_in", True)]
    rows = [(r["kind"], r["hlo_op"], r["ok"]) for r in report["collectives"] if r["phase"] == "optimizer"]
    assert rows == [("ReduceScatter", "reduce-scatter", True), ("AllGather", "all-gather", True)]
    lowered = shardc_cli("lower", str(path))
    lowered.check_returncode()
    assert "note: `zero 1 over X`: forward and grad run the spec without the zero line" in lowered.stderr
    assert "def optimizer_local(" in lowered.stdout
    compared = shardc_cli("compare", str(path), "--json")
    compared.check_returncode()
    assert any("without the zero line" in n for n in json.loads(compared.stdout)["notes"])


@pytest.mark.slow
def test_a_pipelined_zero_plan_verifies_its_optimizer_phase_as_a_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a pipeline the optimizer phase is a stage's: lowered without the stage axis, its update
    checked against numpy and its ReduceScatters and AllGathers found in the HLO; a wrong update fails."""
    from shardc.lowering import template
    from shardc.verification.verify import verify

    replicated = MODEL.replace("W_emb[V_Y, D_X]", "W_emb[V_Y, D]").replace("W1[D_X, F_Y]", "W1[D, F_Y]") \
        .replace("W2[F_Y, D_X]", "W2[F_Y, D]").replace("W_out[D_X, V_Y]", "W_out[D, V_Y]")
    spec = shardc.parse(replicated + "zero 1 over X\n")  # the params replicated over X, their state sharded
    report = verify(spec)
    rows = [r for r in report.values if r.phase == "optimizer"]
    assert report.ok and {r.tensor for r in rows} == {"W_emb", "W1", "W2", "W_out"}
    kinds = {(r.kind, r.ok) for r in report.collectives if r.phase == "optimizer"}
    assert kinds == {("ReduceScatter", True), ("AllGather", True)}
    monkeypatch.setattr(template, "LEARNING_RATE", template.LEARNING_RATE * 2)  # the module steps twice as far
    assert not verify(spec).ok


# --- any spec ---------------------------------------------------------------------------------------

@given(specs(max_statements=3), st.sampled_from([1, 2, 3]), st.data())
def test_zero_plans_are_sound_and_costed_as_planned(spec: shardc.Spec, stage: int, data: st.DataObject) -> None:
    axes = [a.name for a in spec.mesh.axes if a.size > 1]
    assume(axes)
    chosen = data.draw(st.lists(st.sampled_from(axes), min_size=1, max_size=len(axes), unique=True))
    zero = replace(spec, zero=Zero(stage, tuple(chosen)))
    try:
        p = shardc.plan(zero)
    except shardc.ShardcError as err:
        assert "smaller than its devices" in err.message  # a param every dim of which is under its ZeRO devices
        return
    assert check_plan(p) == []
    if stage == 3:
        assert p.optimizer == ()
    if p.spec.dims:
        report = shardc.cost(p)
        assert plan_time(p).step_s == pytest.approx(report.step.step_s, rel=1e-9, abs=1e-18)
        base = shardc.cost(shardc.plan(spec)).memory
        state = report.memory.optimizer_bytes
        assert state <= base.optimizer_bytes


# --- ZeRO over axes no dim divides --------------------------------------------------------------------

def test_zero_over_124_nodes_pads_the_dim_that_wastes_least() -> None:
    """FSDP over OPT-175B's 124 nodes (benchmarks/runs/opt_175b.shard): no dim of a 12288-wide weight
    divides over 124, and FSDP pads its flat shards; ZeRO was refused.  The shard is the dim padded least
    (D=12288 to 12400, not H=128 to 248), as any uneven dim is padded."""
    spec = shardc.parse("mesh X=124\ndims B=248, D=12288, N=4, H=128\nzero 3 over X\n"
                        "O[B_X, D] = A[B_X, N, H] · W_o[N, H, D]\n")
    p = shardc.plan(spec)
    assert str(p.spec.statements[0].expr.operands[1]) == "W_o[N, H, D_X]"  # type: ignore[attr-defined]
    assert any("D=12288 over 124 devices is padded to 12400" in n for n in shardc.cost(p).notes)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_padded_zero_1_or_2_shard_is_planned_not_a_crash(stage: int) -> None:
    """BLOOM's spec on 4 stages x 96-way ZeRO-1 (`shardc layouts --chips 384`): its 250880 x 14336 embedding
    divides over neither, so the optimizer's shard is padded, and the search, which knew only the spec's
    own uneven dims, found no move onto it (ValueError: no moves reach ...)."""
    spec = shardc.parse(f"mesh X=3\ndims B=6, D=8, F=10\nzero {stage} over X\n"
                        "O[B_X, F] = A[B_X, D] · W[D, F]\n")
    p = shardc.plan(spec)
    kinds = [s.op.name for s in p.optimizer if s.op.name in ("REDUCE_SCATTER", "ALL_GATHER")]
    assert kinds in (["REDUCE_SCATTER", "ALL_GATHER"], ["ALL_GATHER"])  # stage 2 reduce-scatters in the backward
    assert any("D=8 over 3 devices is padded to 9" in n for n in shardc.cost(p).notes)


def test_a_pipelined_zero_1_reduce_scatters_under_the_last_microbatchs_backward() -> None:
    # Megatron-LM's distributed optimizer under a pipeline: the reduce-scatters with the stage's other
    # once-a-step reductions, under the last microbatch's backward; the optimizer phase all-gathers alone
    text = MODEL.replace("X=2", "X=4")
    for name in ("W_emb[V_Y, D_X]", "W1[D_X, F_Y]", "W2[F_Y, D_X]", "W_out[D_X, V_Y]"):
        text = text.replace(name, name.replace("_X", ""))  # replicated over X: ZeRO shards them
    one, two, after = (shardc.cost(shardc.plan(shardc.parse(text + z), hardware="h100")).pipeline
                       for z in ("zero 1 over X\n", "zero 2 over X\n", "zero 1 over X\ngrad_reduce after-backward\n"))
    assert one is not None and two is not None and after is not None
    assert one.optimizer_s == pytest.approx(two.optimizer_s, rel=1e-12) and one.optimizer_s > 0
    assert one.grad_reduce_s >= two.grad_reduce_s  # the same bytes, ZeRO-1's in their own buckets
    assert one.grad_reduce_exposed_s < one.grad_reduce_s  # hidden in part by the backward
    assert after.grad_reduce_exposed_s == pytest.approx(one.grad_reduce_s, rel=1e-12)  # all exposed
