"""The gradient reductions' element size as the framework runs them: the spec's ``grad_reduce ... in T`` (or
``--grad-reduce-dtype``) says the type, else its ``optimizer`` line's accounting does (shardc/accountings.py:
``REDUCE_DTYPES``, DeepSpeed's pipeline engine under BF16_Optimizer reducing an fp32 gradient buffer), else
each param's own; an fp32 reduction makes the params' gradients 4 bytes an element, so their AllReduce /
ReduceScatter volumes double; nothing else moves, and no other accounting changes a plan."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import shardc
from shardc.accountings import ACCOUNTINGS, REDUCE_DTYPES, reduce_dtype
from shardc.cli.main import main
from shardc.hardware import get_hardware
from shardc.ir.plan import Plan
from shardc.ir.spec import DType
from shardc.layouts import Options, search_layouts
from shardc.timing import plan_time
from tests.test_cli import shardc_cli

ROOT = Path(__file__).resolve().parent.parent
# data parallel over X (4 devices), the MLP's hidden dim over Y (2)
SPEC = ("mesh X=4, Y=2\ndims B=64, D=256, F=512\nhardware a100\n"
        "Tmp[B_X, F_Y] = In[B_X, D] · W_in[D, F_Y]\nOut[B_X, D] = Tmp[B_X, F_Y] · W_out[F_Y, D]\n")


def _moves(plan: Plan) -> dict[tuple[str, str, str], int]:
    """Every collective of the plan, (phase, op, tensor) -> its bytes at the spec's sizes."""
    sizes = {"B": 64, "D": 256, "F": 512, "X": 4, "Y": 2}
    return {(phase, s.op.value, s.tensor): int(s.volume.evaluate(sizes))
            for phase in ("forward", "backward", "optimizer") for s in getattr(plan, phase)
            if s.is_collective and s.volume is not None}


@pytest.fixture(scope="module")
def plans() -> dict[str | None, Plan]:
    spec = shardc.parse(SPEC)
    return {name: shardc.plan(replace(spec, optimizer=name)) for name in (None, *ACCOUNTINGS)}


@pytest.fixture(scope="module")
def in_f32() -> Plan:
    """The spec with `grad_reduce in f32` and no optimizer line (FSDP2's reduce_dtype float32)."""
    return shardc.plan(shardc.parse(SPEC.replace("hardware a100", "hardware a100\ngrad_reduce in f32")))


def test_bf16_optimizers_gradient_all_reduces_move_fp32_by_hand(plans: dict[str | None, Plan]) -> None:
    # each device's gradient of W_in[D, F_Y] is D x F / Y = 256 x 512 / 2 elements, all-reduced over X: 2 bytes an
    # element as the param's bf16, 4 as BF16_Optimizer's fp32 buffer (_bf16_reduce_grads); the activations'
    # all-reduces over Y (B / X x D, bf16) do not move
    local = 256 * 512 // 2
    plain, fp32 = _moves(plans[None]), _moves(plans["bf16opt20"])
    assert plain[("backward", "all_reduce", "dW_in")] == 2 * local
    assert fp32[("backward", "all_reduce", "dW_in")] == 4 * local
    assert fp32[("backward", "all_reduce", "dW_out")] == 4 * local
    assert fp32[("forward", "all_reduce", "Out")] == plain[("forward", "all_reduce", "Out")] == 2 * 64 // 4 * 256
    assert {k: v for k, v in fp32.items() if "dW" not in k[2]} == {k: v for k, v in plain.items() if "dW" not in k[2]}


@pytest.mark.parametrize("name", sorted(set(ACCOUNTINGS) - set(REDUCE_DTYPES)))
def test_an_accounting_reducing_in_the_params_dtype_changes_no_plan(plans: dict[str | None, Plan], name: str) -> None:
    assert plans[name].element_bytes == plans[None].element_bytes == ()
    assert _moves(plans[name]) == _moves(plans[None])


def test_zero_1s_gradient_reduce_scatters_move_fp32_and_the_param_gathers_bf16() -> None:
    spec = shardc.parse(SPEC.replace("hardware", "zero 1 over X\nhardware"))
    plain, fp32 = (_moves(shardc.plan(replace(spec, optimizer=name))) for name in (None, "bf16opt20"))
    local = 256 * 512 // 2
    assert (plain[("optimizer", "reduce_scatter", "dW_in")], fp32[("optimizer", "reduce_scatter", "dW_in")]) == \
        (2 * local, 4 * local)
    assert fp32[("optimizer", "all_gather", "W_in")] == plain[("optimizer", "all_gather", "W_in")] == 2 * local


def test_the_optimizer_line_round_trips_and_names_the_costs_accounting(plans: dict[str | None, Plan]) -> None:
    spec = shardc.parse(SPEC + "optimizer bf16opt20\n")
    assert spec.optimizer == "bf16opt20" and "optimizer bf16opt20" in str(spec)
    assert shardc.parse(str(spec)) == spec
    assert shardc.cost(plans["bf16opt20"]).memory.accounting == "bf16opt20"
    assert shardc.cost(plans[None]).memory.accounting == "adam10"  # no line: the default


def test_an_unknown_optimizer_name_is_an_error_at_its_word() -> None:
    with pytest.raises(shardc.ShardcError) as err:
        shardc.parse(SPEC + "optimizer adam99\n", filename="mlp.shard")
    text = str(err.value)
    assert "mlp.shard:6:11" in text and "unknown optimizer `adam99`" in text
    assert all(f"`optimizer {name}`" in err.value.fix for name in ACCOUNTINGS)


def test_costing_under_another_reduction_size_than_planned_is_refused(plans: dict[str | None, Plan]) -> None:
    with pytest.raises(shardc.ShardcError) as err:
        shardc.cost(plans[None], optimizer="bf16opt20")
    assert "optimizer bf16opt20" in err.value.fix
    assert shardc.cost(plans[None], optimizer="mixed18").memory.accounting == "mixed18"  # the same reductions


def test_the_cli_flag_overrides_the_specs_line(tmp_path: Path) -> None:
    path = tmp_path / "mlp.shard"
    path.write_text(SPEC + "optimizer bf16opt20\n", encoding="utf-8")

    def reduced(*flags: str) -> tuple[str, list[float]]:
        done = shardc_cli("cost", str(path), "--json", *flags)
        done.check_returncode()
        report = json.loads(done.stdout)
        rows = sorted(r["volume_bytes"] for r in report["backward"]["rows"] if r.get("op") == "all_reduce")
        return report["memory"]["accounting"], rows

    local, d_in = 256 * 512 / 2, 64 / 4 * 256 * 2  # a gradient's piece; dIn[B_X, D]'s all-reduce over Y, bf16
    assert reduced() == ("bf16opt20", [d_in, 4 * local, 4 * local])
    assert reduced("--optimizer", "adam10") == ("adam10", [d_in, 2 * local, 2 * local])


def test_the_planners_step_time_counts_the_update_under_the_specs_accounting(plans: dict[str | None, Plan]) -> None:
    # the planner's objective (shardc.timing.plan_time) costs the update as `shardc cost` does: under the spec's line
    mixed = plan_time(plans["mixed18"]).update_s
    assert mixed == plan_time(plans[None], optimizer="mixed18").update_s > plan_time(plans[None]).update_s > 0


def test_a_library_layouts_search_counts_with_the_spec_s_accounting() -> None:
    """Options() names no accounting: a search over a spec with an `optimizer` line counts with it (as
    `shardc layouts` does), not adam10, which the plan's doubled reductions would refuse."""
    spec = shardc.parse("optimizer bf16opt20\n" + SPEC)
    found = search_layouts([spec], Options(get_hardware("a100")), jobs=1)
    assert found.options.optimizer == "bf16opt20" and found.layouts


def test_a_grad_reduce_in_f32_line_doubles_the_gradient_reductions_alone(plans: dict[str | None, Plan],
                                                                         in_f32: Plan) -> None:
    local = 256 * 512 // 2  # a device's piece of W_in's gradient, all-reduced over X
    plain, fp32 = _moves(plans[None]), _moves(in_f32)
    assert (plain[("backward", "all_reduce", "dW_in")], fp32[("backward", "all_reduce", "dW_in")]) == \
        (2 * local, 4 * local)
    assert fp32[("backward", "all_reduce", "dW_out")] == 4 * local
    assert {k: v for k, v in fp32.items() if "dW" not in k[2]} == {k: v for k, v in plain.items() if "dW" not in k[2]}
    assert fp32 == _moves(plans["bf16opt20"])  # bf16opt20's default is the same f32 reduction: one rule


def test_the_spec_s_reduction_type_wins_over_the_accounting_s_default() -> None:
    spec = shardc.parse(SPEC + "optimizer bf16opt20\ngrad_reduce in bf16\n")
    assert _moves(shardc.plan(spec)) == _moves(shardc.plan(replace(spec, optimizer=None)))
    assert _moves(shardc.plan(spec))[("backward", "all_reduce", "dW_in")] == 2 * 256 * 512 // 2


@pytest.mark.parametrize(("line", "timing", "kind"), [
    ("grad_reduce in f32", None, DType.F32),
    ("grad_reduce after-backward in f32", "after-backward", DType.F32),
    ("grad_reduce after-backward over dcn in bf16", "after-backward over dcn", DType.BF16),
    ("grad_reduce overlapped", "overlapped", None),
])
def test_the_grad_reduce_line_parses_and_round_trips(line: str, timing: str | None, kind: DType | None) -> None:
    spec = shardc.parse(SPEC + line + "\n")
    assert (spec.grad_reduce, spec.grad_reduce_dtype) == (timing, kind)
    assert line in str(spec).splitlines() and shardc.parse(str(spec)) == spec


@pytest.mark.parametrize(("line", "column", "message"), [
    ("grad_reduce in f64", 16, "unknown gradient reduction type `f64`"),
    ("grad_reduce sometimes in f32", 13, "unknown grad_reduce `sometimes`"),
    ("grad_reduce overlapped over dcn in f32", 13, "only `over dcn`"),
    ("grad_reduce in", 15, ""),  # no type: a syntax error after `in`
    ("grad_reduce in f32 in f32", 20, ""),
])
def test_a_bad_grad_reduce_line_is_an_error_at_its_word(line: str, column: int, message: str) -> None:
    with pytest.raises(shardc.ShardcError, match=message or None) as err:
        shardc.parse(SPEC + line + "\n", filename="mlp.shard")
    span = err.value.span
    assert span is not None and (span.line, span.column) == (6, column)


def test_cost_reports_the_reduction_type_and_the_flag_overrides_the_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], in_f32: Plan, plans: dict[str | None, Plan]) -> None:
    report = shardc.cost(in_f32)
    assert report.to_json()["grad_reduce_dtype"] == "f32"
    assert any("gradient reductions in f32" in n for n in report.notes)
    assert shardc.cost(in_f32, optimizer="bf16opt20").memory.accounting == "bf16opt20"  # the same reductions
    assert shardc.cost(plans[None]).to_json()["grad_reduce_dtype"] is None  # each param's own
    path = tmp_path / "mlp.shard"
    path.write_text(str(in_f32.spec), encoding="utf-8")
    assert main(["cost", str(path), "--json", "--grad-reduce-dtype", "bf16"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = sorted(r["volume_bytes"] for r in out["backward"]["rows"] if r.get("op") == "all_reduce")
    assert out["grad_reduce_dtype"] == "bf16" and rows == [64 / 4 * 256 * 2, 256 * 512, 256 * 512]


# the published runs whose framework's code says the reduction type (each spec cites it): torchtitan's FSDP2 in
# fp32, Megatron-LM under bf16 (StarCoder) in fp32, BLOOM's BF16_Optimizer in fp32 (its accounting's default),
# Megatron-LM's 2021 runs (--fp16) in the params'
FRAMEWORK_RUNS = {**dict.fromkeys(("torchtitan_llama3_8b", "torchtitan_llama3_8b_cp", "torchtitan_llama3_70b",
                                   "torchtitan_llama3_405b", "starcoder_15b", "bloom_176b"), "f32"),
                  **dict.fromkeys(("gpt3_175b_megatron", "megatron_1_7b", "megatron_7_5b", "megatron_18_4b",
                                   "megatron_145_6b", "megatron_310_1b", "megatron_1t"), None)}


@pytest.mark.parametrize(("name", "kind"), sorted(FRAMEWORK_RUNS.items()))
def test_the_runs_reduce_their_gradients_as_their_framework_s_code_says(name: str, kind: str | None) -> None:
    path = ROOT / "benchmarks" / "runs" / f"{name}.shard"
    spec = shardc.parse(path.read_text(encoding="utf-8"), filename=str(path))
    written = spec.grad_reduce_dtype
    assert reduce_dtype(None if written is None else written.value, spec.optimizer) == kind
    assert (written is None) == (name == "bloom_176b" or kind is None)  # bf16opt20's f32 is its default, unwritten
