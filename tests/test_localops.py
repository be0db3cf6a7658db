"""The typed local operations of plan steps: every step carries one, never text."""

from __future__ import annotations

import doctest
import typing
from pathlib import Path

import pytest

from shardc.ir import localops
from shardc.ir.localops import Add, DropoutMask, Route
from tests.example_reports import example_plan

EXAMPLES = Path(__file__).parent.parent / "examples"
TYPES = typing.get_args(localops.LocalOp)


def test_docstring_examples() -> None:
    failures, _ = doctest.testmod(localops)
    assert failures == 0


@pytest.mark.parametrize("name", ["attention", "gpt_layer_tp_sp", "moe_transformer", "vocab_parallel", "zero2_dp"])
def test_every_step_of_an_example_carries_a_typed_operation(name: str) -> None:
    plan = example_plan(name)  # shardc.plan of the example, made once a test process
    ops = [s.fn for s in (*plan.forward, *plan.backward, *plan.optimizer) if s.fn is not None]
    assert ops and all(isinstance(op, TYPES) for op in ops)


def test_parameters_are_fields_and_render_as_listed() -> None:
    route = Route("S", "E", "C", 2)
    assert (route.order, route.experts, route.slots, route.k) == ("S", "E", "C", 2)
    assert str(Add((1, 1))) == "add" and str(Add((-1, 1, -1))) == "add-+-"
    assert str(DropoutMask(0.25, 9)) == "dropout_mask(0.25,9)" and DropoutMask(0.25, 9).salt == 9
    assert Route("S", "E", "C", 2) == route and hash(Route("S", "E", "C", 2)) == hash(route)
