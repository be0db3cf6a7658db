"""The collectives issued ahead at a phase's ends: the gathers its first step waits on and the reductions
after its last have no compute beside them, so the cost exposes them, once a phase (not once a layer)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import shardc
from shardc.costmodel.cost_report import CostReport
from shardc.ir.plan import Op
from shardc.phase_ends import exposed_ends
from shardc.timing import plan_time

# FSDP of one matmul: the forward gathers W, then its only einsum reads it
FSDP = "mesh X=8\ndims B=65536, D=4096, F=16384\nparam W\nOut[B_X, F] = In[B_X, D] · W[D_X, F]\n"
# data parallel, In given no gradient: the backward's one einsum makes dW, all-reduced after it
DP = "mesh X=8\ndims B=65536, D=4096, F=16384\nparam W\nconst In\nOut[B_X, F] = In[B_X, D] · W[D, F]\n"


def _cost(text: str, **options: object) -> CostReport:
    report = shardc.cost(shardc.plan(shardc.parse(text), **options))  # type: ignore[arg-type]
    assert isinstance(report, CostReport)
    return report


def test_the_gather_the_first_einsum_waits_on_is_exposed() -> None:
    """The lowered forward starts with W's gather and its einsum reads the gathered W: nothing runs beside
    the gather, so the forward takes both (it took the einsum alone, the gather counted as hidden)."""
    report = _cost(FSDP)
    gather, einsum = report.forward.rows
    assert gather.op is Op.ALL_GATHER and gather.ahead and einsum.op is Op.EINSUM
    assert report.forward.exposed_ends_s == pytest.approx(gather.comm_s)
    assert report.forward.step_s == pytest.approx(einsum.compute_s + gather.comm_s)
    # the backward's dW comes first, so its gather of W runs beside it; its ReduceScatter is not the last
    # step's, and runs beside dIn's einsum
    assert report.backward.exposed_ends_s == 0.0
    assert report.backward.step_s == pytest.approx(report.backward.compute_s)
    assert plan_time(report.plan).step_s == pytest.approx(report.step.step_s)  # the planner's objective too


def test_a_layers_block_exposes_the_ends_once_not_once_a_layer() -> None:
    """Each layer's gather runs beside the layer before it: only the first layer's is exposed."""
    one, four = _cost(FSDP + "const In\n"), _cost(FSDP + "const In\nlayers 4\n")
    gather = one.forward.rows[0].comm_s
    assert four.forward.exposed_ends_s == pytest.approx(gather)
    assert four.forward.step_s == pytest.approx(4 * one.forward.compute_s + gather)


def test_the_reduction_after_the_last_einsum_is_exposed() -> None:
    """The backward's last step makes dW: its AllReduce, issued once dW is made, runs after the compute."""
    report = _cost(DP + "layers 4\n")
    einsum, reduce = report.backward.rows
    assert einsum.op is Op.EINSUM and reduce.op is Op.ALL_REDUCE and reduce.ahead
    assert report.backward.exposed_ends_s == pytest.approx(reduce.comm_s)
    assert report.backward.step_s == pytest.approx(report.backward.compute_s + reduce.comm_s)


def test_the_books_model_overlaps_every_collective_still() -> None:
    report = _cost(FSDP, model="book")
    assert report.step.exposed_ends_s == 0.0
    assert report.forward.step_s == pytest.approx(max(report.forward.compute_s, report.forward.comm_s))


def test_what_compute_runs_before_a_gather_is_needed_hides_it() -> None:
    """An einsum that does not read the gathered weight, before the one that does: the gather runs beside
    it, and only the part of the gather it does not cover is exposed."""
    (gather, einsum), rows = shardc.plan(shardc.parse(FSDP)).forward, _cost(FSDP).forward.rows
    g, e = rows[0].comm_s, rows[1].compute_s
    before = replace(einsum, operands=einsum.operands[:1], dst=replace(einsum.dst, name="Pre"))
    steps = (before, gather, einsum)
    assert exposed_ends(steps, [e, 0.0, e], [0.0, g, 0.0]) == 0.0
    assert exposed_ends(steps, [g / 4, 0.0, e], [0.0, g, 0.0]) == pytest.approx(g * 3 / 4)
    # no compute at all (ZeRO's optimizer phase): nothing to overlap, the phase takes its collectives anyway
    assert exposed_ends((gather,), [0.0], [g]) == 0.0
