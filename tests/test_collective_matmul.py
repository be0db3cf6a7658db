"""Collective matmul: an einsum with the AllGather before it or the ReduceScatter after it run as a ring of
sends under its block matmuls, planned (the default; ``collective_matmul=False``, ``--no-collective-matmul``:
none), costed, lowered and verified."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

import shardc
from shardc.cli.main import main
from shardc.collectives import Op, collective_time
from shardc.costmodel.cost_report import CostReport
from shardc.ir.plan import Plan, Step, unfused
from shardc.ir.spec import TensorRef
from shardc.planner import collective_matmul
from shardc.planner.check import check_plan
from shardc.planner.collective_matmul import fuse_collective_matmuls
from shardc.step_cost import cost_step
from shardc.timing import plan_links, plan_sizes, plan_time
from shardc.verification.ring_hlo import ring_sends

ROOT = Path(__file__).resolve().parents[1]
CH5 = ROOT / "tests" / "specs" / "book_ch5_fsdp_tp.shard"  # the book's chapter-5 FSDP x TP layer, 64 v5p
GPT_SP = ROOT / "examples" / "gpt_layer_tp_sp.shard"  # Megatron's GPT-3 layer, TP and SP 8, on H100


def _plan(path: Path = CH5, batch: str | None = None, **options: Any) -> Plan:
    text = path.read_text()
    if batch is not None:
        text = text.replace("B=48_000", f"B={batch}")
    return shardc.plan(shardc.parse(text, filename=str(path)), **options)


def _fused(plan: Plan) -> list[tuple[str, Op, str]]:
    return [(phase, s.collective.op, str(s.dst)) for phase, steps in (("forward", plan.forward),
                                                                       ("backward", plan.backward))
            for s in steps if s.collective is not None]


def _cost(plan: Plan) -> CostReport:
    report = shardc.cost(plan)
    assert isinstance(report, CostReport)
    return report


def test_on_by_default_and_the_plan_is_otherwise_the_same() -> None:
    plain, fused = _plan(collective_matmul=False), _plan(collective_matmul=True)
    assert not _fused(plain)
    assert _plan() == fused
    # a gather two einsums read is each one's (dOut's): once in the plain plan
    assert list(dict.fromkeys(p for s in fused.forward for p in unfused(s))) == list(plain.forward)
    assert list(dict.fromkeys(p for s in fused.backward for p in unfused(s))) == list(plain.backward)
    assert check_plan(fused) == []


def test_the_tp_blocks_collectives_run_as_rings_and_their_exposed_time_drops() -> None:
    """The book's chapter-5 layout: the ReduceScatters over Y leaving each tensor-parallel block wait on
    their einsum (critical path); as rings of 3 sends under 4 block matmuls they hide, and so does the
    backward's gather of dOut, in each of the two einsums that read it.  The AllGather of In entering the
    block stays: its gathered value is also kept for the backward (a residual)."""
    plain, fused = _plan(collective_matmul=False), _plan(collective_matmul=True)
    assert _fused(fused) == [("forward", Op.REDUCE_SCATTER, "Out[B_X, D_Y]"),
                             ("backward", Op.ALL_GATHER, "dW_out[F_Y, D]{U_X}"),
                             ("backward", Op.ALL_GATHER, "dTmp[B_X, F_Y]"),
                             ("backward", Op.REDUCE_SCATTER, "dIn[B_X, D_Y]")]
    assert any(s.op is Op.ALL_GATHER and str(s.dst) == "In[B_X, D]" for s in fused.forward)
    before, after = plan_time(plain), plan_time(fused)
    assert after.step_s < before.step_s
    # the ReduceScatter's 273 us were exposed; the ring's sends hide under its block matmuls
    assert before.forward.critical_s == pytest.approx(2 * after.forward.critical_s)
    assert after.backward.critical_s == 0.0 < before.backward.critical_s
    row = next(r for r in _cost(fused).forward.rows if r.ring_steps)
    assert row.ring_steps == 4 and row.ring_axes == ("Y",) and row.exposed_comm_s == 0.0


def test_the_exposed_time_is_what_the_block_matmuls_do_not_hide() -> None:
    """n - 1 sends of one block, each overlapping one of the n block matmuls: exposed (n - 1) * max(0,
    send - block matmul); on Megatron's GPT-3 layer on H100 the attention output's matmul of 8 blocks is
    shorter than a block's send, the MLP's is longer."""
    plan = _plan(GPT_SP, collective_matmul=True)
    sizes = plan_sizes(plan)
    links = plan_links(plan, plan.chip, sizes)[0]
    rows = [r for r in _cost(plan).forward.rows if r.ring_steps]
    assert [r.text.split(" -> ")[-1] for r in rows] == ["A[B, S_Y, D]", "M[B, S_Y, D]"]
    for r in rows:
        block = 2 * 2048 * 12288 / 8  # one block of the partial result: S/Y x D in bf16
        send = collective_time(Op.COLLECTIVE_PERMUTE, block, ("Y",), plan.spec.mesh, sizes, plan.chip, links)
        assert r.transfer_s == pytest.approx(send.seconds)
        assert r.exposed_comm_s == pytest.approx(7 * max(0.0, r.transfer_s - r.compute_s / 8))
    assert rows[0].exposed_comm_s > 0 and rows[1].exposed_comm_s == 0


def test_the_gather_of_the_activation_fuses_where_nothing_else_reads_it() -> None:
    """With nothing gathered kept (``--save none``) the AllGather of In over Y feeds one einsum: forward and
    backward run it as a ring (its dim D free in dW_in, contracted in Tmp), and no critical collective is
    left."""
    fused = _plan(save="none", collective_matmul=True)
    assert _fused(fused) == [("forward", Op.ALL_GATHER, "Tmp[B_X, F_Y]"),
                             ("forward", Op.REDUCE_SCATTER, "Out[B_X, D_Y]"),
                             ("backward", Op.ALL_GATHER, "dW_out[F_Y, D]{U_X}"),
                             ("backward", Op.ALL_GATHER, "dTmp[B_X, F_Y]"),
                             ("backward", Op.ALL_GATHER, "dW_in[D, F_Y]{U_X}"),
                             ("backward", Op.REDUCE_SCATTER, "dIn[B_X, D_Y]")]
    t = plan_time(fused)
    assert t.forward.critical_s == t.backward.critical_s == 0.0
    assert check_plan(fused) == []


def test_a_gathered_value_read_by_two_einsums_runs_a_ring_in_each() -> None:
    """The backward's gathered dOut feeds dW_out's einsum and dTmp's: each runs its own ring from dOut's
    block, and the gather is gone."""
    plain, fused = _plan(collective_matmul=False), _plan(collective_matmul=True)
    gather = next(s for s in plain.backward if s.op is Op.ALL_GATHER and s.axes == ("Y",))
    rings = [s for s in fused.backward if s.collective == gather]
    assert len(rings) == 2 and all(gather.src in s.operands for s in rings)
    assert gather not in fused.backward


def test_einsums_reading_one_gathered_value_send_its_blocks_once() -> None:
    """The two rings on dOut send the same blocks the same way, and the compiled program keeps one chain
    of permutes: the cost charges the first ring with the sends and the second with its block matmuls
    only, and the bytes the cost sends are those of the permutes verify expects in the HLO."""
    plan = _plan(collective_matmul=True)
    report = _cost(plan)
    rows = [r for r in report.backward.rows if r.ring_steps]
    first, second = (r for r in rows if "dOut" in r.text)
    assert (first.ring_shared, second.ring_shared) == (False, True)
    assert first.transfer_s > 0 and first.weighted > 0 and second.compute_s > 0
    assert second.transfer_s == second.exposed_comm_s == second.weighted == second.bandwidth_s == 0.0
    expected = ring_sends(plan.backward, plan_sizes(plan))
    assert len(expected) == sum(not r.ring_shared for r in rows) == 2
    assert math.fsum(r.weighted for r in rows) == sum(s.elements * s.count * 2 for s in expected)  # bf16
    # the planner's objective is the report's
    assert plan_time(plan).backward.critical_s == report.backward.critical_s
    assert plan_time(plan).step_s == pytest.approx(report.step.step_s)
    assert "its blocks are those an earlier ring of this phase sends" in str(report)


def test_the_pass_reads_each_step_a_bounded_number_of_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """Linear in the plan's steps: the pass indexes who reads each value once and updates it as it fuses
    (once it scanned the whole phase for each step, and a 96-layer spec's fusion took seconds)."""
    plain, planned = _plan(save="none", collective_matmul=False), _plan(save="none", collective_matmul=True)
    read: list[Step] = []
    real = collective_matmul._reads

    def counted(step: Step) -> Iterable[TensorRef]:
        read.append(step)
        return real(step)

    monkeypatch.setattr(collective_matmul, "_reads", counted)
    fused = fuse_collective_matmuls(plain)
    assert len(_fused(fused)) == 6  # index kept through six fusions, gathers and scatters
    assert fused == planned
    # each step indexed once, and each fused einsum's steps dropped and added once (a gather's too)
    assert len(read) <= len(plain.forward) + len(plain.backward) + 3 * len(_fused(fused))


def test_a_gathered_value_something_else_reads_stays_gathered() -> None:
    """The sequence-parallel gather of L1 on Megatron's layer feeds Q's einsum and the alias Kx that K's and
    V's read: not only einsums, so it stays."""
    fused = _plan(GPT_SP, collective_matmul=True)
    assert any(s.op is Op.ALL_GATHER and str(s.dst) == "L1[B, S, D]" for s in fused.forward)


def test_kept_apart_where_the_ring_would_be_slower() -> None:
    """At 4 tokens a device the block matmuls are too small to hide a send's latency: the pair stays."""
    plan = _plan(batch="64", strategy="rules", collective_matmul=True)
    assert not _fused(plan)
    gather, einsum = plan.forward[0], plan.forward[2]
    assert gather.src is not None and gather.op is Op.ALL_GATHER and gather.axes == ("Y",)
    assert einsum.operands[0] == gather.dst
    sizes = plan_sizes(plan)
    links = plan_links(plan, plan.chip, sizes)[0]
    ring = Step(einsum.op, einsum.tensor, einsum.dst, operands=(gather.src,) + einsum.operands[1:],
                axes=gather.axes, collective=gather)

    def row(s: Step) -> float:
        r = cost_step(0, s, plan.spec.mesh, sizes, plan.chip, links)
        return r.compute_s + r.exposed_comm_s + (r.comm_s if r.is_collective else 0.0)

    assert row(ring) >= row(gather) + row(einsum)


def test_the_books_model_hides_every_collective_already() -> None:
    assert not _fused(_plan(collective_matmul=True, model="book"))


def test_plan_and_cost_take_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(CH5), "--collective-matmul"]) == 0
    out = capsys.readouterr().out
    assert "Einsum+ReduceScatter_Y Out[B_X, D_Y] = Tmp[B_X, F_Y] · W_out[F_Y, D]" in out
    assert "(collective matmul over Y" in out
    assert main(["cost", str(CH5), "--collective-matmul", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = [r for r in data["forward"]["rows"] if r.get("ring_steps")]
    assert len(rows) == 1 and rows[0]["ring_axes"] == ["Y"] and rows[0]["exposed_comm_s"] == 0.0
    assert main(["cost", str(CH5), "--collective-matmul"]) == 0
    assert "collective matmul over Y: 4 block matmuls" in capsys.readouterr().out
    # on by default; --no-collective-matmul keeps every collective whole
    assert main(["plan", str(CH5)]) == 0
    assert "(collective matmul over Y" in capsys.readouterr().out
    assert main(["plan", str(CH5), "--no-collective-matmul"]) == 0
    assert "collective matmul" not in capsys.readouterr().out


def test_megatron_gpt_layer_exposed_communication_on_h100() -> None:
    """Megatron's GPT-3 layer (TP and SP over 8 H100s, 2048 tokens, hidden 12288): three of the four
    ReduceScatters leaving the tensor-parallel blocks run as rings (the fourth reduces the sum of the Q, K and
    V gradients, no one einsum's), and the backward's gather of dM into the MLP; the exposed communication
    falls from 14% of the step to under 10%."""
    plain, fused = _cost(_plan(GPT_SP, collective_matmul=False)), _cost(_plan(GPT_SP, collective_matmul=True))
    assert plain.step.critical_s / plain.step.step_s > 0.14
    assert fused.step.critical_s / fused.step.step_s < 0.10
    assert fused.step.step_s < plain.step.step_s


@pytest.mark.slow
def test_the_lowered_rings_verify_at_8_devices() -> None:
    from shardc.verification.verify import verify

    report = verify(_plan(save="none", collective_matmul=True), devices=8)
    assert report.ok, [r.tensor for r in report.values if not r.ok] + [r.step for r in report.collectives if not r.ok]
    rings = [r for r in report.collectives if r.kind == "CollectivePermute"]
    n = report.mesh["Y"]
    # the two einsums reading the gathered dOut send its blocks alike: XLA keeps one chain of permutes
    assert n > 1 and len(rings) == 5 and all(r.hlo_op == f"collective-permute x {n - 1}" for r in rings)
    # the forward's only collectives over Y are the rings' permutes (the backward's gathered dOut feeds two)
    assert {r.kind for r in report.collectives if r.phase == "forward" and r.plan_axes == "Y"} == {"CollectivePermute"}


@pytest.mark.slow
def test_a_module_without_the_ring_fails_verify(tmp_path: Path) -> None:
    """The reduce-scatter written back as one collective after the einsum: the values still match, the HLO
    holds no permutes for the ring, and verify says so."""
    from shardc.lowering.api import module_source
    from shardc.verification.verify import verify

    plan = _plan(save="none", collective_matmul=True)
    source, _ = module_source(plan)
    call = "einsum_reducescatter('bf,fd->bd', (Tmp, W_out_1,), 1, 'Y')"
    assert call in source
    edited = source.replace(call, "jax.lax.psum_scatter(jnp.einsum('bf,fd->bd', Tmp, W_out_1), 'Y', "
                                  "scatter_dimension=1, tiled=True)")
    path = tmp_path / "edited.py"
    path.write_text(edited)
    report = verify(plan, devices=8, module=path)
    assert all(r.ok for r in report.values)
    failed = [r for r in report.collectives if not r.ok]
    assert failed and any("sends around the ring" in r.step and "0 of" in r.note for r in failed)
    assert not report.ok


def test_layouts_search_with_collective_matmuls_where_asked(capsys: pytest.CaptureFixture[str]) -> None:
    """`shardc layouts` plans every candidate with them (`--no-collective-matmul`: without): the book's
    chapter-5 layout X=16, Y=4 exposes less of its tensor-parallel communication than without them."""
    from shardc.cli.main import main
    from tests.test_topology import BOOK_CH5

    steps = {}
    for flags in (("--no-collective-matmul",), ()):
        assert main(["layouts", str(BOOK_CH5), "--topology", "4x4x4", "--jobs", "1", "--json", *flags]) == 0
        rows = json.loads(capsys.readouterr().out)["layouts"]
        steps[flags] = next(r["step_s"] for r in rows if r["axes"] == {"X": 16, "Y": 4})
    assert steps[()] < steps[("--no-collective-matmul",)]


def test_compare_counts_each_rings_collective_once() -> None:
    """`shardc compare` sets the plan's collectives beside XLA's partitioner's: a ring moves its collective's
    bytes, and the gather two rings share counts once, so the plan's side is the same with or without rings."""
    from shardc.verification.compare import plan_side

    fused, plain = _plan(), _plan(collective_matmul=False)
    sizes = plan_sizes(plain)
    assert _fused(fused)
    rings, whole = plan_side(fused, sizes), plan_side(plain, sizes)
    assert rings.weighted == whole.weighted
    assert sorted((r.phase, r.kind) for r in rings.rows) == sorted((r.phase, r.kind) for r in whole.rows)
