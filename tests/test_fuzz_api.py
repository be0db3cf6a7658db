"""Misused public functions: ``parse``, ``plan``, ``cost``, ``lower`` and ``verify`` answer, or raise a
ShardcError, or a TypeError that names the argument; no other exception escapes them.

Each call gets every argument of its signature, and the keyword options its pass takes,
either a right value or a wrong one: None, a bool, a huge or negative or NaN number, a
huge string, a name XLA cannot take, a mapping with bad keys or values, the IR of another
pass.  A TypeError Python raises while binding the call (too many positional arguments)
is Python's own; one raised inside shardc must name the argument it is about.  ``lower``
and ``verify`` run up to the point where jax would start (the device check, the lowered
module's loading, the run), which is where their argument checks end.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import shardc
from shardc.errors import ShardcError
from shardc.verification import verify as verify_module

ROOT = Path(__file__).resolve().parent.parent
TP = "mesh X=4\ndims B=64, D=32, F=16\nOut[B_X, F] = In[B_X, D] · W[D, F]\n"
PIPE = ("mesh P=2 pipeline, X=2\ndims B=8, D=4, F=4\nlayers 2\nmicrobatches 2\nparam W1, W2\n"
        "H[B_X, F] = X[B_X, D] · W1[D, F]\nOut[B_X, D] = H[B_X, F] · W2[F, D]\n")
SPEC = shardc.parse(TP)
PLAN = shardc.plan(SPEC)
PIPE_SPEC = shardc.parse(PIPE)
PIPE_PLAN = shardc.plan(PIPE_SPEC)
# a ZeRO-2 optimizer phase, a routed MoE layer, dropout: the examples whose plans have the most kinds of step
EXAMPLES = [shardc.parse((ROOT / "examples" / f"{name}.shard").read_text(encoding="utf-8"), f"{name}.shard")
            for name in ("zero2_dp", "moe_layer", "gpt_layer_tp")]
EXAMPLE_PLANS = [shardc.plan(spec) for spec in EXAMPLES]

FUNCTIONS: dict[str, Callable[..., Any]] = {"parse": shardc.parse, "plan": shardc.plan, "cost": shardc.cost,
                                            "lower": shardc.lower, "verify": verify_module.verify}
# the keyword options each function passes on to its pass, beside its own parameters
OPTIONS = {"plan": ["strategy", "hardware", "spans", "recompute", "budget", "explain", "gradients"],
           "cost": ["mfu", "optimizer", "hardware_file", "spans"],
           "lower": ["save", "strategy", "hardware", "recompute"]}
GOOD: dict[str, list[object]] = {
    "text": [TP, PIPE], "filename": [None, "f.shard"], "spec": [SPEC, PIPE_SPEC, *EXAMPLES],
    "plan": [PLAN, PIPE_PLAN, *EXAMPLE_PLANS], "plan_or_spec": [SPEC, PLAN, PIPE_PLAN, *EXAMPLE_PLANS],
    "save": ["default", "none", "all"], "strategy": ["auto", "rules"],
    "hardware": [None, "tpu-v5p"], "spans": [None, {"X": 2}], "recompute": ["none", "full"],
    "sizes": [None, {"B": 64}, {"X": 2}], "mfu": [None, 0.4], "optimizer": ["adam10"], "hardware_file": [None],
    "devices": [None, 8, 4], "seed": [0, 3], "budget": [1000], "explain": [False], "gradients": [None]}
HOSTILE: list[object] = [
    None, True, 0, -1, 2.5, math.nan, math.inf, 10**30, -(10**30), "", "x" * (1 << 21), "Ω", "a\u2028b", "a`",
    b"mesh X=2", [1], (), {}, {"B": -1}, {"B": None}, {"B": 2.5}, {"B": 10**30}, {"Ω": 2}, {1: 2}, {"X": "2"},
    {"B": math.nan}, object(), SPEC, PLAN, "tpu-v5p", "/dev/zero", "/nonexistent.toml"]


class _WouldRunJax(BaseException):
    """Raised where lower or verify would start jax: every argument check is behind it."""


def _stop(*args: object, **kwargs: object) -> None:
    raise _WouldRunJax


PATCHES = ["shardc.lowering.api.check_devices", "shardc.lowering.pipeline_lowering.check_devices",
           "shardc.verification.verify.lower", "shardc.verification.verify.verify_pipeline"]


def argument(name: str) -> st.SearchStrategy[object]:
    good = GOOD.get(name, [])
    hostile = st.sampled_from(HOSTILE)
    return st.one_of(st.sampled_from(good), st.sampled_from(good), hostile) if good else hostile


@st.composite
def calls(draw: st.DrawFn) -> tuple[str, tuple[object, ...], dict[str, object]]:
    """A function, some of its parameters by position, the others and some of its options by keyword."""
    name = draw(st.sampled_from(sorted(FUNCTIONS)))
    params = [p for p in inspect.signature(FUNCTIONS[name]).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    positional = draw(st.integers(0, len(params)))
    args = tuple(draw(argument(p.name)) for p in params[:positional])
    keywords = [p.name for p in params[positional:]] + OPTIONS.get(name, [])
    keywords += ["bogus"] if draw(st.integers(0, 9)) == 0 else []  # Python refuses it before shardc runs
    chosen = draw(st.lists(st.sampled_from(keywords), unique=True, max_size=4)) if keywords else []
    return name, args, {k: draw(argument(k)) for k in chosen}


def call(name: str, args: tuple[object, ...], kwargs: dict[str, object]) -> str:
    """What the call did: "returned", "ShardcError", "would run jax", or "TypeError (binding)"; a TypeError
    raised inside shardc must name an argument of the call, and any other exception fails the test."""
    function = FUNCTIONS[name]
    names = set(inspect.signature(function).parameters) | set(kwargs) | set(OPTIONS.get(name, []))
    patches = [mock.patch(target, _stop) for target in PATCHES]
    for p in patches:
        p.start()
    try:
        function(*args, **kwargs)
    except ShardcError as err:
        assert str(err)
        return "ShardcError"
    except TypeError as err:
        if err.__traceback__ is not None and err.__traceback__.tb_next is None:
            return "TypeError (binding)"  # Python's own: the call does not fit the signature
        assert any(n in str(err) for n in names), (name, args, kwargs, err)
        return "TypeError"
    except _WouldRunJax:
        return "would run jax"
    finally:
        for p in patches:
            p.stop()
    return "returned"


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_misuse_raises_only_shardc_errors_or_type_errors_naming_the_argument(
        call_: tuple[str, tuple[object, ...], dict[str, object]]) -> None:
    name, args, kwargs = call_
    event(f"{name}: {call(name, args, kwargs)}")


# what the fuzzing found: each an AttributeError or a TypeError naming nothing before --------------

def test_verify_checks_its_arguments_before_planning() -> None:
    """verify(None), verify(b"...") raised AttributeError from the planner; a str as sizes, a TypeError
    naming no argument; a negative seed, numpy's ValueError."""
    for bad in (None, b"mesh X=2", TP):
        assert call("verify", (bad,), {}) == "TypeError"
    with pytest.raises(TypeError, match="plan_or_spec must be a Plan or a Spec, not NoneType"):
        verify_module.verify(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sizes must be a dict"):
        verify_module.verify(SPEC, sizes="tpu-v5p")  # type: ignore[arg-type]
    with pytest.raises(ShardcError, match="seed = -1 is negative"):
        verify_module.verify(SPEC, seed=-1)
    with pytest.raises(TypeError, match="seed must be an int, not float"):
        verify_module.verify(PLAN, seed=2.5)  # type: ignore[arg-type]


def test_plan_checks_the_gradient_names_it_is_given() -> None:
    """gradients=nan raised AttributeError inside the graph builder; a name outside the grammar would
    reach the lowered module as a variable."""
    with pytest.raises(TypeError, match="gradients must be a dict"):
        shardc.plan(SPEC, gradients=math.nan)
    with pytest.raises(TypeError, match="gradients must map str to str"):
        shardc.plan(SPEC, gradients={"In": 3})
    with pytest.raises(ShardcError, match="cannot name a gradient"):
        shardc.plan(SPEC, gradients={"In": "a\u2028"})
    assert shardc.plan(SPEC, gradients={"In": "gIn"}).grad_name("In") == "gIn"
