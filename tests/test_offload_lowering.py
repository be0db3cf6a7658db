"""`shardc lower --offload`: the residuals the backward reads in the host's memory (``pinned_host``), a
ZeRO-1/2 plan's optimizer phase run on the host with its arguments and results there (ZeRO-Offload).

JAX's CPU backend has the memory kinds (``device``, ``pinned_host``, ``unpinned_host``): a program's
arguments and results placed in ``pinned_host`` show in its compiled entry layout as memory space 5
(``S(5)``), and a computation under ``compute_on('device_host')`` carries ``_xla_compute_type="host"``.
On the CPU the host's memory and the device's are the same RAM, so the copies are memcpys; on a GPU the
same program copies over PCIe."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardc
from shardc.cli.main import main
from shardc.errors import ShardcError
from shardc.lowering.api import lower, module_source

ZERO2 = """mesh X=2, Y=2
dims B=8, D=4, F=8
zero 2 over X
In[B_X, D] = In0[B_X, D]
Tmp[B_X, F_Y] = gelu(In[B_X, D] · W_in[D, F_Y])
Out[B_X, D] = Tmp[B_X, F_Y] · W_out[F_Y, D]
"""


def test_the_module_names_what_it_places_on_the_host() -> None:
    source, _ = module_source(shardc.plan(shardc.parse(ZERO2)), "both")
    assert "HOST = frozenset(['In', 'Tmp', 'Tmp_t1'])" in source and "host=HOST)" in source
    assert "OPTIMIZER_OUT), on_host=True)" in source
    plain, _ = module_source(shardc.plan(shardc.parse(ZERO2)))
    assert "HOST" not in plain and "on_host" not in plain


@pytest.mark.parametrize("text, offload, message", [
    (ZERO2.replace("zero 2 over X\n", ""), "optimizer", "only for a ZeRO-1/2 plan"),
    ("mesh P=2 pipeline, X=2\ndims B=8, D=4\nlayers 2\nE2[B_X, D] = gelu(E[B_X, D])\n", "activations",
     "pipelined program is lowered without host offload"),
    (ZERO2, "disk", "unknown offload 'disk'"),
])
def test_what_cannot_be_lowered_to_the_host_is_refused(text: str, offload: str, message: str) -> None:
    with pytest.raises(ShardcError, match=message):
        module_source(shardc.plan(shardc.parse(text)), offload)


@pytest.mark.slow
def test_offloaded_residuals_and_update_give_the_same_values_and_show_in_the_hlo() -> None:
    spec = shardc.parse(ZERO2)
    plain, moved = lower(spec), lower(spec, offload="both")
    inputs, cot = plain.random_inputs(), plain.random_cotangents()
    saved = moved.namespace.run_forward(inputs)
    assert {k for k, v in saved.items() if v.sharding.memory_kind == "pinned_host"} == {"In", "Tmp", "Tmp_t1"}
    assert saved["Out"].sharding.memory_kind == "device"
    results = moved.forward(inputs)
    assert all(v.sharding.memory_kind == "device" for v in results.values())  # returned from the devices
    for name, value in plain.forward(inputs).items():
        np.testing.assert_array_equal(np.asarray(results[name]), np.asarray(value))
    grads, want = moved.grad(inputs, cot), plain.grad(inputs, cot)
    for name, value in want.items():
        np.testing.assert_array_equal(np.asarray(grads[name]), np.asarray(value))

    def loss(lowered: object, params: dict[str, object]) -> object:
        out = lowered.forward({**inputs, **params})["Out"]  # type: ignore[attr-defined]
        return jnp.sum(out * cot["dOut"])

    params = {k: jnp.asarray(v) for k, v in inputs.items() if k.startswith("W")}
    through = jax.grad(lambda p: loss(moved, p))(params)  # jax.grad runs the planned backward from the host
    for name, value in jax.grad(lambda p: loss(plain, p))(params).items():
        np.testing.assert_allclose(np.asarray(through[name]), np.asarray(value), rtol=1e-6)
    forward_hlo = moved.compiled_text("forward")
    assert "S(5)" in forward_hlo.splitlines()[0] and "S(5)" not in plain.compiled_text("forward")

    params = {k: v for k, v in inputs.items() if k.startswith("W")}
    updated, reference = moved.optimizer_step(params, grads), plain.optimizer_step(params, want)
    for name, value in reference.items():
        assert updated[name].sharding.memory_kind == "pinned_host"
        np.testing.assert_array_equal(np.asarray(updated[name]), np.asarray(value))
    update_hlo = moved.compiled_text("optimizer")
    assert "S(5)" in update_hlo.splitlines()[0] and '_xla_compute_type="host"' in update_hlo


def test_shardc_lower_takes_offload(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    path = f"{tmp_path}/zero2.shard"
    with open(path, "w") as f:
        f.write(ZERO2)
    assert main(["lower", path, "--offload", "activations"]) == 0
    source = capsys.readouterr().out
    assert "host=HOST)" in source and "on_host" not in source
    assert main(["lower", path, "--offload", "optimizer"]) == 0
    source = capsys.readouterr().out
    assert "host=HOST)" not in source and "on_host=True" in source
