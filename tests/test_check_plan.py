"""The plan checker catches broken plans, and its work (and the fold pass's) grows linearly with the plan.

Work is counted as Python function calls (``sys.setprofile``), never as seconds: the
count is the same on a busy machine and an idle one.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import pytest

import shardc
from shardc.ir.plan import Op, Plan, Step
from shardc.ir.spec import Dim, TensorRef
from shardc.planner.check import check_plan
from shardc.planner.fold import fold_redundant

MLP = ("mesh X=8, Y=2\n{zero}dims B=1024, D=512, F=2048\nTmp[B_X, F_Y] = In[B_X, D] · W_in[D, F_Y]\n"
       "Out[B_X, D] = Tmp[B_X, F_Y] · W_out[F_Y, D]\n")


def _plan(zero: str = "") -> Plan:
    return shardc.plan(shardc.parse(MLP.format(zero=zero + "\n" if zero else "")))


def deep(layers: int) -> str:
    """An FSDP + TP MLP block written out ``layers`` times, every weight its own param."""
    lines = ["mesh X=4, Y=2", "dims B=1024, D=256, F=1024"]
    prev = "H0"
    for k in range(1, layers + 1):
        lines.append(f"T{k}[B_X, F_Y] = {prev}[B_X, D_Y] · W_in{k}[D_X, F_Y]")
        lines.append(f"H{k}[B_X, D_Y] = T{k}[B_X, F_Y] · W_out{k}[F_Y, D_X]")
        prev = f"H{k}"
    return "\n".join(lines) + "\n"


def calls(work: Callable[[], object]) -> int:
    """How many Python functions ``work`` calls: a count of its work that no machine load changes."""
    count = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal count
        if event == "call":
            count += 1

    sys.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(None)
    return count


# --- it still catches what it should -------------------------------------------------------------

def test_a_sound_plan_has_no_problems() -> None:
    for zero in ("", "zero 1 over X", "zero 2 over X", "zero 3 over X"):
        assert check_plan(_plan(zero)) == []


def test_a_step_reading_a_value_nothing_made_is_caught() -> None:
    p = _plan()
    made = p.forward[0].dst  # Tmp, which the second einsum reads
    broken = dataclasses.replace(p, forward=p.forward[1:])
    assert f"forward 1: reads {made}, which is not held" in check_plan(broken)


def test_a_gradient_the_backward_never_makes_is_caught() -> None:
    p = _plan()
    grad = next(g for g in p.grads if g.name == "dW_in")
    broken = dataclasses.replace(p, backward=tuple(s for s in p.backward if s.dst != grad))
    assert f"backward never makes {grad}" in check_plan(broken)


def test_a_collective_with_a_wrong_volume_is_caught() -> None:
    p = _plan()
    k = next(i for i, s in enumerate(p.backward) if s.is_collective)
    step = p.backward[k]
    assert step.volume is not None
    wrong = dataclasses.replace(step, volume=step.volume * step.volume)
    broken = dataclasses.replace(p, backward=p.backward[:k] + (wrong,) + p.backward[k + 1:])
    assert any(f"volume {wrong.volume}, expected {step.volume}" in problem for problem in check_plan(broken))


def test_an_optimizer_gather_to_the_wrong_layout_is_caught() -> None:
    p = _plan("zero 1 over X")
    k = next(i for i, s in enumerate(p.optimizer) if s.op is Op.ALL_GATHER)
    step = p.optimizer[k]
    declared = p.tensor(step.tensor).ref
    broken = dataclasses.replace(p, optimizer=p.optimizer[:k] + (dataclasses.replace(step, dst=step.src),)
                                 + p.optimizer[k + 1:])
    assert any(f"{step.tensor} ends as {step.src}, declared {declared}" in problem for problem in check_plan(broken))


def test_an_updated_param_never_gathered_back_is_caught() -> None:
    p = _plan("zero 1 over X")
    gathered = {s.tensor for s in p.optimizer if s.op is Op.ALL_GATHER}
    name = sorted(gathered)[0]
    broken = dataclasses.replace(p, optimizer=tuple(s for s in p.optimizer
                                                    if not (s.op is Op.ALL_GATHER and s.tensor == name)))
    assert f"optimizer: the updated {name} is never gathered back" in check_plan(broken)


# --- and does work linear in the plan ------------------------------------------------------------

def test_checking_twice_the_layers_is_twice_the_work() -> None:
    small, big = (shardc.plan(shardc.parse(deep(n))) for n in (8, 16))
    assert check_plan(small) == [] and check_plan(big) == []
    steps = len(big.forward + big.backward) / len(small.forward + small.backward)
    work = calls(lambda: check_plan(big)) / calls(lambda: check_plan(small))
    assert steps == pytest.approx(2, rel=0.1)
    assert work < 1.15 * steps  # a set rebuilt per gradient would make it about 4


def _all_to_alls(n: int) -> list[Step]:
    """``n`` AllToAlls, each read by the einsum after it: nothing folds, every AllToAll is looked at."""
    steps = []
    for k in range(n):
        src = TensorRef(f"A{k}", (Dim("B", ("X",)), Dim("D", ())))
        dst = TensorRef(f"A{k}", (Dim("B", ()), Dim("D", ("X",))))
        steps.append(Step(Op.ALL_TO_ALL, f"A{k}", dst, src, ("X",), dim=1, dim2=0))
        out = TensorRef(f"O{k}", (Dim("B", ()), Dim("D", ("X",))))
        steps.append(Step(Op.EINSUM, f"O{k}", out, operands=(dst,)))
    return steps


def test_folding_twice_the_all_to_alls_is_twice_the_work() -> None:
    small, big = _all_to_alls(100), _all_to_alls(200)
    keep = frozenset(s.dst for s in big if s.op is Op.EINSUM)  # what the phase hands on
    assert fold_redundant(tuple(big), keep) == tuple(big)
    work = calls(lambda: fold_redundant(tuple(big), keep)) / calls(lambda: fold_redundant(tuple(small), keep))
    assert work < 2.3  # scanning every later step for each AllToAll's readers would make it about 4
