"""A routing's memory against the compiler: ``route_by_choice``'s own arrays (its scan runs along its k
choices and the tokens together), where XLA's buffer assignment puts a route's arrays that die before its
mask, and the gates' exponentials a product of the gates keeps alive."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardc
from shardc.costmodel.fusion_buffers import exponentials as _exponentials
from shardc.costmodel.phase_memory import Buffers, _Copies
from shardc.costmodel.step_order import lifetimes as _lifetimes
from shardc.device_pieces import local_elements
from shardc.ir.localops import Route
from shardc.ir.spec import TensorRef
from shardc.verification.memory_check import XLA_CPU, check_plan_memory, render_memory

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
F32 = 4
ROUTER = ("mesh X=2\ndims G=4, S=24, E=8, C=6, D=6\ndtype f32\nparam W_r\n"
          "Gate[G_X, S, E] = softmax(X[G_X, S, D] · W_r[D, E] over E)\n"
          "Disp[G_X, S, E, C] = route(Gate[G_X, S, E], S, C, 2 over E)\n"
          "Comb[G_X, S, E, C] = Gate[G_X, S, E] * Disp[G_X, S, E, C]\n")


def _routing(text: str, buffers: Buffers) -> tuple[list[float], list[float]]:
    plan = shardc.plan(shardc.parse(text))
    assert plan.sizes is not None
    sizes = dict(plan.sizes)

    def nbytes(ref: TensorRef) -> float:
        return float(local_elements(ref, sizes)) * F32

    (step,) = (s for s in plan.forward if isinstance(s.fn, Route))
    return _Copies(buffers, sizes, nbytes).routing(step)


def test_route_by_choice_holds_its_choices_running_sums() -> None:
    """Token by token a route holds whether each token chose each expert and the running sums (the slots);
    choice by choice the sums run over k = 2 choices a token, twice the gates' shape, and the slot they add
    up to is made beside them, the choices and the top-k's indices (2 a token)."""
    gates = 4 // 2 * 24 * 8 * 4  # int32 per token and expert, on one device
    by_choice = ROUTER.replace("= route(", "= route_by_choice(")
    assert _routing(ROUTER, Buffers()) == ([gates, gates], [])
    assert _routing(by_choice, Buffers()) == ([gates, gates, gates // 8 * 2, 2 * gates], [])
    # XLA CPU scans in blocks of 16: 24 tokens padded to 32; by choice 48 choices, three blocks
    assert _routing(ROUTER, Buffers(scan_block=16)) == ([gates, gates * 32 // 24, gates * 32 // 24], [])
    assert _routing(by_choice, Buffers(scan_block=16)) == ([gates, 2 * gates, 2 * gates], [])
    # the blocks (by choice the sums too) die before the mask is written: in an output's buffer
    assert _routing(ROUTER, XLA_CPU) == ([gates, gates * 32 // 24], [gates * 32 // 24])
    assert _routing(by_choice, XLA_CPU) == ([gates, gates, gates // 8 * 2], [2 * gates, 2 * gates])


def test_a_softmax_a_later_product_reads_keeps_its_exponentials_to_it() -> None:
    """moe_layer.shard's forward: the route reads Gate, then Comb = Gate * Disp does; XLA makes the softmax's
    last division again inside Comb's fusion, so the exponentials live from the softmax to Comb."""
    plan = shardc.plan(shardc.parse((EXAMPLES / "moe_layer.shard").read_text()))
    assert plan.sizes is not None
    steps = plan.forward
    readers, last = _lifetimes(steps)
    names = [s.dst.name for s in steps]
    gate = steps[names.index("Gate")].dst
    nbytes = float(local_elements(gate, dict(plan.sizes))) * F32
    assert _exponentials(steps, readers, last, lambda ref: nbytes, lambda s: [], set(), {}, 0) == [
        (names.index("Gate"), names.index("Comb"), nbytes)]
    before = steps[:names.index("Comb")]
    no_product = _exponentials(before, *_lifetimes(before), lambda ref: nbytes, lambda s: [], set(), {}, 0)
    assert no_product == []  # no product reads it


@pytest.mark.slow
@pytest.mark.parametrize("function", ["route", "route_by_choice"])
def test_moe_layer_forward_temporaries_within_ten_percent(function: str) -> None:
    """XLA's forward peak at verify's sizes: the gates' exponentials, the choices and the slots (or the
    sums) beside the two masks made again for their dots, the scan's arrays in the outputs' buffers (1.43
    before route_by_choice had arrays of its own and those rules; route's 1.04)."""
    text = (EXAMPLES / "moe_layer.shard").read_text().replace("= route(", f"= {function}(")
    check = check_plan_memory(shardc.plan(shardc.parse(text)), 8)
    (forward,) = (r for r in check.rows if r.phase == "forward" and r.category == "temporaries")
    assert forward.ratio is not None and abs(forward.ratio - 1) <= 0.10, render_memory(check)
    assert check.within_target, render_memory(check)
