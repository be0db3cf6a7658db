"""One einsum time (:func:`shardc.steptime.einsum_time`): the larger of its FLOPs at the rate the chip
reaches and its bytes over HBM, read alike by the planner's search and by ``shardc cost``."""

from __future__ import annotations

import dataclasses

import pytest

import shardc
from shardc.collectives import Op
from shardc.hardware import PRESETS
from shardc.ir.plan import Plan
from shardc.steptime import einsum_time

H100 = PRESETS["h100"]
# attention's scores: a head dim of 64 contracted, an S x T block written, so their bytes outlast their FLOPs
SCORES = ("mesh X=4\ndims B=8, N=16, S=4096, T=4096, H=64\n"
          "Sc[B, N_X, S, T] = Q[B, N_X, S, H] · K[B, N_X, T, H]\n")
# a norm's weight: its gradient contracts the batch and the sequence into D values, a pass over two
# activations for few FLOPs
NORM_WEIGHT = "mesh Y=4, X=8\ndims B=64, S=4096, D=4096\nN[B_Y, S, D] = E[B_Y, S, D] * W_norm[D]\n"


def test_an_einsum_takes_the_larger_of_its_flops_and_its_bytes() -> None:
    flops, few, many = 2.0**36, 2.0**20, 2.0**34
    compute = H100.matmul_seconds(flops)
    assert einsum_time(flops, few, False, H100).seconds == compute
    assert einsum_time(flops, few, False, H100).memory_s == 0
    bound = einsum_time(flops, many, False, H100)
    assert H100.matmul_hbm_efficiency is not None  # a matmul bound by its bytes moves them at its share
    assert bound.compute_s == compute and bound.seconds == pytest.approx(
        many / (H100.hbm_bandwidth * H100.matmul_hbm_efficiency), rel=1e-12)
    # a product (a multiply, elementwise): its bytes alone, at an elementwise pass's share
    assert einsum_time(flops, many, True, H100).seconds == pytest.approx(
        many / (H100.hbm_bandwidth * H100.hbm_efficiency), rel=1e-12)
    book = dataclasses.replace(H100, book=True)
    assert einsum_time(flops, many, False, book).seconds == flops / H100.flops  # at peak, bytes free


def test_the_search_prices_a_byte_bound_einsum_as_cost_reports_it() -> None:
    """The time ``--explain`` shows for the configuration the search took (no communication: the
    einsum's time alone) is the step ``shardc cost`` reports, bytes included, in each phase."""
    p = shardc.plan(shardc.parse(SCORES), hardware="h100", explain=True)
    report = shardc.cost(p)
    rows = [r for r in report.forward.rows + report.backward.rows if r.op is Op.EINSUM]
    assert len(rows) == len(p.choices) == 3
    for row, choice in zip(rows, p.choices, strict=True):
        (chosen,) = [a for a in choice.alternatives if a.chosen]
        assert chosen.description == "no communication"
        assert row.memory_s > row.compute_s > 0  # byte-bound
        assert chosen.time == pytest.approx(row.compute_s + row.memory_s, rel=1e-12)


def _weight_gradient(p: Plan) -> str:
    (step,) = [s for s in p.backward if s.op is Op.EINSUM and s.dst.name == "dW_norm"]
    return " · ".join(str(o) for o in step.operands)


def test_the_roofline_changes_what_the_search_takes() -> None:
    """The norm weight's gradient, byte-bound: on its FLOPs alone (a chip whose HBM were free) the search
    reduces it over Y only, every X device reading both whole activations; at the H100's HBM bandwidth it
    slices them over X first (B or D: either way each device reads an eighth), and reduces or gathers
    after.  The plan that sees the bytes is the faster one on the H100."""
    spec = shardc.parse(NORM_WEIGHT)
    seen = shardc.plan(spec, hardware="h100")
    blind = shardc.plan(spec, hardware=dataclasses.replace(H100, hbm_bandwidth=1e30))
    assert _weight_gradient(seen) in ("E[B_Y, S, D_X] · dN[B_Y, S, D_X]", "E[B_YX, S, D] · dN[B_YX, S, D]")
    assert _weight_gradient(blind) == "E[B_Y, S, D] · dN[B_Y, S, D]"
    faster, slower = shardc.cost(seen).step.step_s, shardc.cost(blind, hardware="h100").step.step_s
    assert faster < 0.75 * slower
