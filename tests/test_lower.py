"""Lowering: every example runs, matches the numpy reference and the plan's collectives."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shardc
from shardc.cli.main import main
from shardc.errors import ShardcError
from shardc.ir.plan import Monomial
from shardc.verification.memory_check import TARGET, MemoryCheck, render_memory
from shardc.verification.verify import Report, render_report, verify
from tests.example_reports import example_report

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.shard"))


def spec_of(path: Path) -> shardc.ir.spec.Spec:  # type: ignore[name-defined]
    return shardc.parse(path.read_text(), filename=str(path))


def report_of(path: Path) -> Report:
    return example_report(path.stem)  # one verification an example a test process: compiling is the slow part


def _within_the_tests_devices(spec: shardc.ir.spec.Spec) -> tuple[shardc.ir.spec.Spec, list[str]]:  # type: ignore[name-defined]
    """The spec with its major axes beside the stages set to 1, in mesh order, until every other axis runs
    at 2 or more on the devices the tests emulate (LLaMA 3's 128K stage: P, X, C and Y need 16; its data
    axis X goes, its context, tensor and pipeline axes stay); the axes dropped."""
    import jax

    from shardc.spec.overrides import apply_overrides

    dropped: list[str] = []
    while 2 ** sum(a.size > 1 for a in spec.mesh.axes) > jax.device_count():  # each axis at 2, stages too
        axis = next(a.name for a in spec.mesh.axes if a.size > 1 and not a.pipeline)
        spec, dropped = apply_overrides(spec, {axis: 1}), [*dropped, axis]
    return spec, dropped


@pytest.fixture(scope="module")
def fsdp_tp() -> shardc.lowering.api.Lowered:  # type: ignore[name-defined]
    from shardc.lowering.sizes import small_sizes

    plan = shardc.plan(spec_of(ROOT / "examples" / "fsdp_tp.shard"))
    return shardc.lower(plan, sizes=small_sizes(plan, 8))


def test_the_required_examples_exist() -> None:
    names = {p.stem for p in EXAMPLES}
    assert {"dp", "fsdp", "tp", "fsdp_tp", "attention", "multiaxis", "braced", "alltoall", "moe_layer",
            "moe_transformer"} <= names


# the examples with a category of the memory check still outside 10% of XLA's at verify's sizes (issue 22), each
# its temporaries, where XLA's memory scheduler (the least peak of its list, DFS and post-order schedules) runs the
# steps in another order than the plan's: fsdp_tp's forward (1.18: W_out's ring blocks sliced only after In's
# gather is copied out and freed) and backward (0.87), residual_blocks' backward (1.16: the deferred weight
# gradients' combined AllReduce run right after dE's AllReduce, not at the end), gpt_layer_tp's and
# gpt_layer_tp_sp's backward (1.16)
OUTSIDE = {"fsdp_tp", "gpt_layer_tp", "gpt_layer_tp_sp", "residual_blocks"}


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_verifies(path: Path) -> None:
    spec, dropped = _within_the_tests_devices(spec_of(path))
    report = report_of(path) if not dropped else verify(spec)
    assert report.ok, render_report(report)
    assert dropped in ([], ["X"])  # only LLaMA 3's 128K stage needs more than 8 devices, its data axis set to 1
    phases = {r.phase.split()[0] for r in report.values}  # "forward f32": a row checked again in float32
    assert {"forward", "backward"} <= phases <= {"forward", "backward", "optimizer"}
    # the same verification's memory against XLA's buffer assignment (issue: within 10% on every example,
    # the fullest stage's for a pipeline), at verify's sizes
    check = report.memory_check
    assert check is not None
    if isinstance(check, MemoryCheck):
        assert check.within_target, render_memory(check)
        if path.stem not in OUTSIDE:  # every category too, where XLA reports it
            assert all(r.ratio is None or abs(r.ratio - 1) <= TARGET for r in check.rows), render_memory(check)
    else:
        assert check.ratio is not None and abs(check.ratio - 1) <= TARGET, check.notes


@pytest.mark.slow
def test_the_alltoall_example_really_moves_an_axis() -> None:
    kinds = {r.hlo_op for r in report_of(ROOT / "examples" / "alltoall.shard").collectives}
    assert "all-to-all" in kinds


@pytest.mark.slow
def test_source_is_readable_one_line_a_step(fsdp_tp) -> None:  # type: ignore[no-untyped-def]
    source = fsdp_tp.source
    ast.parse(source)
    import inspect

    from shardc.lowering import driver

    assert "check_vma=False" not in source + inspect.getsource(driver)
    assert "PROGRAM = Program(" in source and "jax.custom_vjp" in inspect.getsource(driver.Program)
    body = source[source.index("def forward_local"):source.index("# ---- backward")]
    assert "jax.lax.all_gather(In, 'Y', axis=1, tiled=True" in body
    # the ReduceScatter leaving the block runs as a ring under its block matmuls (a collective matmul)
    assert "Out = einsum_reducescatter('bf,fd->bd', (Tmp, W_out_1,), 1, 'Y')" in body
    assert "jnp.einsum('bd,df->bf', In_1, W_in_1)" in body
    steps = [line for line in body.splitlines()
             if " = jax.lax." in line or "jnp.einsum" in line or "einsum_reducescatter(" in line]
    assert len(steps) == len(fsdp_tp.plan.forward)
    assert all("  # " in line for line in steps)  # each commented with the tensor it makes
    assert "# Out[B_X, D_Y]" in body and "{U_Y}" not in body  # the ring's partial sums never make a whole value


@pytest.mark.slow
def test_forward_returns_every_result_and_grad_every_param(fsdp_tp) -> None:  # type: ignore[no-untyped-def]
    inputs = fsdp_tp.random_inputs()
    out = fsdp_tp.forward(inputs)
    assert set(out) == {"Tmp", "Out"}
    grads = fsdp_tp.grad(inputs, fsdp_tp.random_cotangents())
    assert set(grads) == {"dW_in", "dW_out", "dIn"}
    assert grads["dW_in"].shape == inputs["W_in"].shape


@pytest.mark.slow
def test_jax_grad_of_forward_runs_the_planned_backward(fsdp_tp, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import jax
    import jax.numpy as jnp

    inputs = fsdp_tp.random_inputs()
    cot = fsdp_tp.random_cotangents()
    planned = fsdp_tp.grad(inputs, cot)
    module = fsdp_tp.namespace
    run_backward, calls = module.run_backward, []

    def counted(*args):  # type: ignore[no-untyped-def]
        calls.append(1)
        return run_backward(*args)

    def no_transpose(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a loss on the outputs needs no JAX transpose")

    monkeypatch.setattr(module.PROGRAM, "run_backward", counted)
    monkeypatch.setattr(module.jax, "vjp", no_transpose)
    auto = jax.grad(lambda i: jnp.sum(fsdp_tp.forward(i)["Out"] * cot["dOut"]))(inputs)
    monkeypatch.undo()
    assert calls == [1]
    for name in ("W_in", "W_out", "In"):
        np.testing.assert_allclose(np.asarray(auto[name]), np.asarray(planned[fsdp_tp.plan.grad_name(name)]),
                                   rtol=1e-5)


def _fsdp_tp_loss(i, cot):  # type: ignore[no-untyped-def]
    """The same statements in plain jnp: a loss on the intermediate Tmp as well as on Out."""
    import jax.numpy as jnp

    tmp = jnp.einsum("bd,df->bf", i["In"], i["W_in"])
    out = jnp.einsum("bf,fd->bd", tmp, i["W_out"])
    return jnp.sum(out * cot["dOut"]) + jnp.sum(jnp.sin(tmp))


@pytest.mark.slow
def test_jax_grad_through_an_intermediate_and_every_input(fsdp_tp) -> None:  # type: ignore[no-untyped-def]
    """Cotangents of a result a later statement reads still reach the inputs."""
    import jax
    import jax.numpy as jnp

    inputs = {k: jnp.asarray(v) for k, v in fsdp_tp.random_inputs().items()}
    cot = fsdp_tp.random_cotangents()

    def loss(i):  # type: ignore[no-untyped-def]
        results = fsdp_tp.forward(i)
        return jnp.sum(results["Out"] * cot["dOut"]) + jnp.sum(jnp.sin(results["Tmp"]))

    auto = jax.grad(loss)(inputs)
    want = jax.grad(_fsdp_tp_loss)(inputs, cot)
    for name in ("W_in", "W_out", "In"):
        np.testing.assert_allclose(np.asarray(auto[name]), np.asarray(want[name]), rtol=2e-4, atol=1e-5)
    only_tmp = jax.grad(lambda w: jnp.sum(fsdp_tp.forward({**inputs, "W_in": w})["Tmp"]))(inputs["W_in"])
    expect = jax.grad(lambda w: jnp.sum(jnp.einsum("bd,df->bf", inputs["In"], w)))(inputs["W_in"])
    np.testing.assert_allclose(np.asarray(only_tmp), np.asarray(expect), rtol=2e-4, atol=1e-5)


@pytest.mark.slow
def test_jit_grad_through_a_result_read_later() -> None:
    """Attention: Scores is read later, so its own cotangent comes from JAX's transpose;
    Kt and V, though neither params nor the first input, get planned gradients."""
    import jax
    import jax.numpy as jnp

    lowered = shardc.lower(spec_of(ROOT / "examples" / "attention.shard"))
    inputs = {k: jnp.asarray(v) for k, v in lowered.random_inputs().items()}

    def loss(results):  # type: ignore[no-untyped-def]
        return jnp.sum(results["Ctx"] ** 2) + jnp.sum(jnp.cos(results["Scores"]))

    def reference(i):  # type: ignore[no-untyped-def]
        scores = jnp.einsum("bhse,bhte->bhst", i["Q"], i["Kt"])
        ctx = jnp.einsum("bhst,bhte->bhse", jnp.exp(scores), i["V"])
        return loss({"Ctx": ctx, "Scores": scores})

    got = jax.jit(jax.grad(lambda i: loss(lowered.forward(i))))(inputs)
    want = jax.grad(reference)(inputs)
    for name in ("Q", "Kt", "V"):
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), rtol=2e-4, atol=1e-4)


@pytest.mark.slow
def test_an_input_of_partial_sums_is_taken_stacked_and_differentiated() -> None:
    import jax
    import jax.numpy as jnp

    lowered = shardc.lower(spec_of(ROOT / "examples" / "partial_input.shard"))
    inputs = {k: jnp.asarray(v) for k, v in lowered.random_inputs().items()}
    assert inputs["In"].shape[0] == 4  # one partial sum per device along Y
    got = jax.grad(lambda i: jnp.sum(lowered.forward(i)["Out"] ** 2))(inputs)

    def reference(i):  # type: ignore[no-untyped-def]
        return jnp.sum(jnp.einsum("bd,df->bf", i["In"].sum(axis=0), i["W"]) ** 2)

    want = jax.grad(reference)(inputs)
    for name in ("In", "W"):
        assert got[name].shape == inputs[name].shape
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), rtol=2e-4, atol=1e-4)


@pytest.mark.slow
def test_partial_sums_over_axes_written_in_any_order_verify() -> None:
    """{U_YX} and {U_XY} are one value: the lowering keys values with their axes sorted."""
    spec = shardc.parse("mesh X=2, Y=4\ndims N=8\nOut[N_Y] = B[]{U_YX} · E[]{U_XY} · A[N_{Y,X}]\n")
    report = verify(spec)
    assert report.ok, render_report(report)


def test_a_mesh_larger_than_the_devices_says_how_to_emulate() -> None:
    spec = shardc.parse("mesh X=64\nOut[B_X, F] = In[B_X, D] · W[D, F]\n")
    with pytest.raises(ShardcError) as err:
        shardc.lower(spec)
    assert "--xla_force_host_platform_device_count=64" in str(err.value)


@pytest.mark.slow
def test_a_wrong_volume_is_a_mismatch(fsdp_tp) -> None:  # type: ignore[no-untyped-def]
    from shardc.errors import InternalError
    from shardc.verification.hlo import collectives
    from shardc.verification.verify import match_collectives

    plan = fsdp_tp.plan
    steps = list(plan.forward)
    k = next(i for i, s in enumerate(steps) if s.is_collective)
    steps[k] = dataclasses.replace(steps[k], volume=steps[k].volume * Monomial.of(2))
    with pytest.raises(InternalError, match="volume"):  # the plan checker sees it first
        verify(dataclasses.replace(plan, forward=tuple(steps)))
    found = collectives(fsdp_tp.compiled_text("forward"), fsdp_tp.module.mesh)
    rows = match_collectives("forward", tuple(steps), found, fsdp_tp.sizes, plan.spec.dtype.nbytes)
    assert [r.note for r in rows if not r.ok] == ["bytes differ"]


@pytest.mark.slow
def test_cli_verify_json_and_compare(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(ROOT / "examples" / "tp.shard"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["collectives"]
    assert main(["compare", str(ROOT / "examples" / "fsdp.shard"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["volume_ratio"] <= 1.0


@pytest.mark.slow
def test_cli_lower_writes_a_module_that_runs(tmp_path: Path) -> None:
    out = tmp_path / "tp_module.py"
    path = str(ROOT / "examples" / "tp.shard")
    assert main(["lower", path, "--set", "B=8", "--set", "D=8", "--set", "F=16", "-o", str(out)]) == 0
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "dW_in" in run.stdout
