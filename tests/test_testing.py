"""shardc.testing's strategies: what they draw (route, its combine and dispatch), and what they keep valid."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis.errors import NoSuchExample

import shardc
from shardc.errors import LAYERS_FEED, ShardcError, Span
from shardc.ir.spec import Call, Contract, DType, Spec, TensorRef
from shardc.spec.parser import parse, parse_unchecked
from shardc.spec.validate import validate
from shardc.spec.walk import calls, leaves
from shardc.testing import specs

ROOT = Path(__file__).resolve().parent.parent
# the first example found, unshrunk (shrinking a spec takes minutes), the same on every run
FIND = settings(max_examples=500, database=None, derandomize=True, phases=[Phase.generate],
                suppress_health_check=[HealthCheck.too_slow])


def _routes(spec: Spec) -> list[Call]:
    return [c for s in spec.statements for c in calls(s.expr) if c.func == "route"]


def _masks(spec: Spec) -> list[tuple[Call, str]]:
    """Each route statement's call and mask (its result's name)."""
    return [(s.expr, s.result.name) for s in spec.statements if isinstance(s.expr, Call) and s.expr.func == "route"]


def _reads(spec: Spec) -> list[tuple[set[str], tuple[str, ...]]]:
    """Each product statement's operand names and result indices."""
    return [({r.name for r in leaves(s.expr)}, s.result.indices) for s in spec.statements
            if isinstance(s.expr, Contract)]


def _combines(spec: Spec) -> bool:  # Comb[G, S, E, C] = Gate * Disp
    return any(isinstance(c.arg, TensorRef) and names == {c.arg.name, mask}
               for c, mask in _masks(spec) for names, _ in _reads(spec))


def _dispatches(spec: Spec) -> bool:  # In[G, E, C, D] = Disp[G, S, E, C] · X[G, S, D]: the token order S summed
    return any(mask in names and c.names[0] not in indices
               for c, mask in _masks(spec) for names, indices in _reads(spec))


def test_the_layer_ops_strategy_of_the_verify_property_draws_routes() -> None:
    # tests/test_verify_props.py draws specs(max_devices=8, max_statements=3, layer_ops=True)
    spec = find(specs(max_devices=8, max_statements=3, layer_ops=True), lambda s: bool(_routes(s)), settings=FIND)
    assert _routes(spec) and spec.dtype is DType.F32


def test_routes_draw_the_combine_and_the_dispatch_of_a_mask() -> None:
    assert _combines(find(specs(max_statements=4, routes=True), _combines, settings=FIND))
    assert _dispatches(find(specs(max_statements=4, routes=True), _dispatches, settings=FIND))


def test_routes_off_draws_none() -> None:
    with pytest.raises(NoSuchExample):
        find(specs(layer_ops=True, routes=False), lambda s: bool(_routes(s)),
             settings=settings(FIND, max_examples=100))


@settings(max_examples=40)
@given(specs(routes=True, max_statements=3))
def test_route_specs_round_trip_compute_in_f32_and_k_fits_the_experts(spec: Spec) -> None:
    assert parse(str(spec)) == spec and str(parse(str(spec))) == str(spec)
    assert _routes(spec) and spec.dtype is DType.F32
    for call in _routes(spec):  # a fresh capacity index; k whole, at most the experts' size when dims are drawn
        assert call.names[1] not in {i for r in leaves(call.arg) for i in r.indices}
        assert call.numbers[0] >= 1 and (not spec.sizes or call.numbers[0] <= spec.sizes[call.over or ""])
        assert not spec.sizes or call.names[1] in spec.sizes


FEED = """mesh X=2
layers 4
H[B_X, D] = gelu(In[B_X, D])
"""


def _feed_error(spec: Spec) -> bool:
    """Whether validating ``spec`` fails on its ``layers`` feed: the error kind shardc.testing reads
    to drop a ``layers`` line rather than reject the whole draw."""
    try:
        validate(spec)
    except ShardcError as err:
        return err.kind == LAYERS_FEED
    return False


def test_a_layers_feed_error_has_its_kind_and_no_other_error_has() -> None:
    with pytest.raises(ShardcError) as err:
        shardc.parse(FEED.replace("H[B_X, D]", "H[B, D_X]"))  # the next layer's In[B_X, D] is sharded otherwise
    assert err.value.kind == LAYERS_FEED and err.value.with_span(Span(1, 1)).kind == LAYERS_FEED
    with pytest.raises(ShardcError) as err:
        # no output has In's indices to feed it
        shardc.parse(FEED.replace("H[B_X, D]", "H[B_X, F]").replace("gelu(In[B_X, D])", "In[B_X, D] · W[D, F]"))
    assert err.value.kind == LAYERS_FEED
    assert not _feed_error(shardc.parse(FEED)) and _feed_error(parse_unchecked(FEED.replace("H[B_X, D]", "H[B, D_X]")))
    # another error of a `layers` spec, whose message names `layers`, is not the feed's: the strategy
    # rejects that draw instead of dropping the `layers` line
    other = parse_unchecked(FEED.replace("layers 4", "layers L"))
    with pytest.raises(ShardcError) as err:
        validate(other)
    assert "layers" in err.value.message and err.value.kind is None and not _feed_error(other)


README = (ROOT / "README.md").read_text(encoding="utf-8")
# A machine far slower than this one: in a fresh interpreter (the conftest's profiles are not loaded
# there), hypothesis's defaults with a deadline of 1 ms, which any example that plans exceeds; loaded
# explicitly, so a CI variable (hypothesis's own ci profile has no deadline) cannot hide it.
# 10 examples, the same on every run.
SLOW_MACHINE = """from datetime import timedelta
from hypothesis import settings
settings.register_profile("slow_machine", deadline=timedelta(milliseconds=1), max_examples=10,
                          derandomize=True, database=None)
settings.load_profile("slow_machine")
"""


def test_the_readme_snippets_cover_every_python_block() -> None:
    """tests/test_cli.py runs the first snippet, tests/test_explain.py the one of ``shardc.explain``, the test
    below every one that uses hypothesis."""
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert len(blocks) == 3 and "hypothesis" not in blocks[0] and "shardc.testing" in blocks[1], \
        "a new README snippet needs a test that runs it as written"
    assert "shardc.explain(" in blocks[2]


@pytest.mark.parametrize("block", [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if "hypothesis" in b])
def test_the_readme_example_of_shardc_testing_runs_on_a_slow_machine(block: str, tmp_path: Path) -> None:
    """The snippet as written, in a fresh interpreter, passes even where every example overruns the deadline."""
    script = tmp_path / "testing_example.py"
    script.write_text(SLOW_MACHINE + block, encoding="utf-8")
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
