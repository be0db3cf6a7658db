"""Random valid specs on meshes of up to 8 devices lower, run and verify."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

import shardc
from shardc.spec.walk import calls
from shardc.testing import specs
from shardc.verification.verify import render_report, verify

pytestmark = pytest.mark.slow  # every test lowers, compiles and runs random specs


# compiling dominates (about a second an example), so few examples; deadline off
@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(specs(max_devices=8, max_statements=3))
def test_random_specs_lower_run_and_verify(spec: shardc.ir.spec.Spec) -> None:  # type: ignore[name-defined]
    report = verify(shardc.plan(spec))
    text = render_report(report)
    assert all(r.ok for r in report.values), text
    # every planned collective is in the HLO with the planned kind, axes and bytes, and no other
    assert all(r.ok for r in report.collectives), text


# the transformer-layer ops too: reductions over an index, embed and cross_entropy
@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(specs(max_devices=8, max_statements=3, layer_ops=True))
def test_random_specs_with_layer_ops_lower_run_and_verify(spec: shardc.ir.spec.Spec) -> None:  # type: ignore[name-defined]
    report = verify(shardc.plan(spec))
    text = render_report(report)
    assert all(r.ok for r in report.values), text
    assert all(r.ok for r in report.collectives), text


# route (top-k routing with capacity) in every spec, and the combine and dispatch that read its mask
@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(specs(max_devices=8, max_statements=3, routes=True))
def test_random_specs_with_routes_lower_run_and_verify(spec: shardc.ir.spec.Spec) -> None:  # type: ignore[name-defined]
    assert any(c.func == "route" for s in spec.statements for c in calls(s.expr))
    report = verify(shardc.plan(spec))
    text = render_report(report)
    assert all(r.ok for r in report.values), text
    assert all(r.ok for r in report.collectives), text
