"""The params' gather type, ``param_gather ... in T`` (or ``--param-gather-dtype``): torchao's float8 all-gather
under FSDP2 casts each weight's shard to float8 before the gather, so every AllGather of a param moves T's
bytes an element (shardc.planner.graph: Graph.gathered_bytes, the one rule the search, the plan's volumes,
the plan check and the gathered weights' memory read), and the scales' amaxes are all-reduced once a step
(shardc/gather_scales.py).  Nothing else moves; the lowered module gathers in the params' type, and says so."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import shardc
from shardc.cli.main import main
from shardc.costmodel.memory import peak_weights
from shardc.gather_scales import AMAX_BYTES, scale_reduction
from shardc.ir.plan import Plan
from shardc.ir.spec import DType
from shardc.layer_counts import block_counts
from shardc.planner.check import check_plan
from shardc.quantize import quantize_passes
from shardc.timing import plan_sizes, plan_time
from shardc.verification.hlo import Collective
from shardc.verification.report import gather_note, match_collectives

SIZES = {"B": 64, "D": 256, "F": 512, "X": 4, "Y": 2}
# FSDP (ZeRO-3) over X (4 devices), the MLP's hidden dim over Y (2)
SPEC = ("mesh X=4, Y=2\ndims B=64, D=256, F=512\nhardware a100\nzero 3 over X\n"
        "Tmp[B_X, F_Y] = In[B_X, D] · W_in[D, F_Y]\nOut[B_X, D] = Tmp[B_X, F_Y] · W_out[F_Y, D]\n")


def _moves(plan: Plan) -> dict[tuple[str, str, str], int]:
    """Every collective of the plan, (phase, op, tensor) -> its bytes at the spec's sizes."""
    return {(phase, s.op.value, s.tensor): int(s.volume.evaluate(SIZES))
            for phase in ("forward", "backward", "optimizer") for s in getattr(plan, phase)
            if s.is_collective and s.volume is not None}


@pytest.fixture(scope="module")
def plans() -> dict[str | None, Plan]:
    """The spec planned with each gather type, and without one (each param's own, bf16)."""
    spec = shardc.parse(SPEC)
    return {kind: shardc.plan(replace(spec, param_gather_dtype=None if kind is None else DType(kind)))
            for kind in (None, "bf16", "f8")}


def test_f8_gathers_move_half_the_bf16_bytes_and_nothing_else_moves(plans: dict[str | None, Plan]) -> None:
    bf16, f8 = _moves(plans[None]), _moves(plans["f8"])
    gathered = 256 * 512 // 2  # a device's gathered W_in[D, F_Y] (and W_out[F_Y, D]): D x F / Y elements
    for key in (("forward", "all_gather", "W_in"), ("forward", "all_gather", "W_out"),
                ("backward", "all_gather", "W_in"), ("backward", "all_gather", "W_out")):
        assert (bf16[key], f8[key]) == (2 * gathered, gathered)
    assert {k: v for k, v in f8.items() if k[1] != "all_gather"} == {k: v for k, v in bf16.items()
                                                                     if k[1] != "all_gather"}
    assert _moves(plans["bf16"]) == bf16  # the params' own type: the plan without the line
    assert check_plan(plans["f8"]) == []  # the plan check replays the gathers at the gather type too


def test_the_gathered_weights_are_held_in_the_gather_type(plans: dict[str | None, Plan]) -> None:
    names = {"W_in", "W_out"}
    peaks = [peak_weights(p, p.forward, names, SIZES) for p in (plans[None], plans["f8"])]
    assert peaks == [2 * 256 * 512 // 2, 256 * 512 // 2]  # the forward's largest gathered weight, bf16 then f8
    report = shardc.cost(plans["f8"])
    assert report.memory.gathered_bytes <= shardc.cost(plans[None]).memory.gathered_bytes
    assert report.to_json()["param_gather_dtype"] == "f8"
    assert shardc.cost(plans[None]).to_json()["param_gather_dtype"] is None
    assert any("4 all-gathers of params move f8" in n for n in report.notes)


def test_float8_gathers_all_reduce_their_scales_once_a_step(plans: dict[str | None, Plan]) -> None:
    # torchao's precompute_float8_dynamic_scale_for_fsdp: one float32 amax a weight, one AllReduce over the
    # axes the weights are gathered over, after the update
    plan = plans["f8"]
    counts = block_counts(plan, plan_sizes(plan))
    assert scale_reduction(plan, counts) == (2.0 * AMAX_BYTES, ("X",))
    assert scale_reduction(plans["bf16"], counts) == (0.0, ())  # a plain cast: no scale
    assert plan_time(plan).update_s > plan_time(plans[None]).update_s


@pytest.mark.parametrize("line", ["param_gather in f8", "param_gather exposed in f8", "param_gather in bf16"])
def test_the_line_round_trips_through_the_printer(line: str) -> None:
    spec = shardc.parse(SPEC + line + "\n")
    assert spec.param_gather_dtype is DType(line.split()[-1])
    assert line in str(spec).splitlines() and shardc.parse(str(spec)) == spec


@pytest.mark.parametrize(("line", "column", "message"), [
    ("param_gather in f64", 17, "unknown param gather type `f64`"),
    ("param_gather sometimes in f8", 14, "unknown param_gather `sometimes`"),
    ("param_gather in f32", 1, "wider than the params' bf16"),
    ("param_gather in", 16, ""),  # no type: a syntax error after `in`
    ("param_gather in f8 in f8", 20, ""),
])
def test_a_bad_param_gather_line_is_an_error_at_its_word(line: str, column: int, message: str) -> None:
    with pytest.raises(shardc.ShardcError, match=message or None) as err:
        shardc.parse(SPEC + line + "\n", filename="mlp.shard")
    span = err.value.span
    assert span is not None and (span.line, span.column, span.filename) == (7, column, "mlp.shard")


def test_the_flag_sets_the_type_and_a_wider_one_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "mlp.shard"
    path.write_text(SPEC + "param_gather in f8\n", encoding="utf-8")
    assert main(["cost", str(path), "--json", "--param-gather-dtype", "bf16"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = [r["volume_bytes"] for r in out["forward"]["rows"] if r.get("op") == "all_gather"]
    assert out["param_gather_dtype"] == "bf16" and rows == [2 * 256 * 512 / 2] * 2
    assert main(["cost", str(path), "--param-gather-dtype", "f32"]) != 0
    assert "wider than the params' bf16" in capsys.readouterr().err


def test_verify_and_lower_say_the_module_gathers_in_the_params_type(plans: dict[str | None, Plan]) -> None:
    assert gather_note(plans[None].spec) == []
    (note,) = gather_note(plans["f8"].spec)
    assert "gathers each param in its own type" in note


def test_verify_matches_a_param_gather_by_its_elements_at_the_gather_type(plans: dict[str | None, Plan]) -> None:
    """The module's HLO gathers W_in's elements in its own type (float32 at verify's sizes); the plan's row, in
    f8, matches them counted at 1 byte each (Plan.moved_nbytes), and would not at the param's own bytes."""
    plan = plans["f8"]
    steps = tuple(s for s in plan.forward if s.is_collective)
    found = [Collective(s.op, s.op.value.replace("_", "-"), s.axes,  # the elements each step moves
                        int(s.volume.evaluate(SIZES)) // plan.moved_nbytes(s), "f32", "") for s in steps]
    rows = match_collectives("forward", steps, list(found), SIZES, 2, element=plan.moved_nbytes)
    assert [r.ok for r in rows] == [True] * len(steps) and len(steps) == 3
    wrong = match_collectives("forward", steps, list(found), SIZES, 2, element=lambda s: plan.nbytes(s.tensor))
    assert [r.ok for r in wrong] == [s.tensor == "Out" for s in steps]  # the gathers' bytes differ


def test_a_float8_gemm_reading_a_float8_gathered_weight_quantizes_its_shard() -> None:
    """Under `gemm f8` a GEMM quantizes a gathered weight at each use; gathered in f8, the weight arrives as the
    GEMM's input and the cast ran on the shard before the gather (torchao's fsdp_pre_all_gather)."""
    spec = shardc.parse(SPEC + "gemm f8\n")
    passed: dict[DType | None, set[str]] = {}
    for kind in (None, DType.F8):
        plan = shardc.plan(replace(spec, param_gather_dtype=kind))
        passed[kind] = {str(p.ref) for p in quantize_passes(plan, plan.forward) if p.ref.name.startswith("W")}
    assert passed[None] == {"W_in[D, F_Y]", "W_out[F_Y, D]"}  # the gathered weights
    assert passed[DType.F8] == {"W_in[D_X, F_Y]", "W_out[F_Y, D_X]"}  # their shards


def test_only_fsdp_gathers_over_the_zero_axes_move_the_gather_type(plans: dict[str | None, Plan]) -> None:
    """torchao casts FSDP's gathers; a weight the plan gathers over another axis (a tensor-parallel one) moves its
    own type (shardc.spec.walk.gather_nbytes_of, which the search reads too)."""
    plan = plans["f8"]
    gather = next(s for s in plan.forward if s.op.value == "all_gather" and s.tensor == "W_in")
    assert (gather.axes, plan.moved_nbytes(gather)) == (("X",), 1)
    assert plan.moved_nbytes(replace(gather, axes=("Y",))) == plan.moved_nbytes(replace(gather, axes=("X", "Y"))) == 2
    by_hand = shardc.plan(shardc.parse(SPEC.replace("zero 3 over X\n", "").replace("W_in[D, F_Y]", "W_in[D_X, F_Y]")
                                       + "param_gather in f8\n"))
    assert _moves(by_hand)[("forward", "all_gather", "W_in")] == 2 * 256 * 512 // 2  # no zero line: its own type
    assert any("no all-gather of a param over the ZeRO axes" in n for n in shardc.cost(by_hand).notes)
