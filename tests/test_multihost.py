"""The lowered module runs unchanged over two processes (CPU, gloo collectives), 4 devices each."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import shardc

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # two interpreters compile and run a lowered module

WORKER = textwrap.dedent('''
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{sys.argv[2]}", num_processes=2, process_id=int(sys.argv[1]))
    assert (jax.device_count(), jax.local_device_count()) == (8, 4)
    import numpy as np
    from jax.experimental import multihost_utils
    sys.path.insert(0, sys.argv[3])
    import lowered_fsdp_tp as mod
    data = np.load(sys.argv[4])
    inputs = {k: data[k] for k in mod.INPUT_DIMS}
    out = mod.forward(inputs)
    grads = mod.grad(inputs, {"dOut": data["dOut"]})
    got = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in {**out, **grads}.items()}
    if jax.process_index() == 0:
        np.savez(sys.argv[5], **got)
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def test_two_processes_run_the_module_unchanged(tmp_path: Path) -> None:
    spec = shardc.parse((ROOT / "examples" / "fsdp_tp.shard").read_text())
    sizes = {"X": 2, "Y": 4, "B": 8, "D": 16, "F": 8}
    (tmp_path / "lowered_fsdp_tp.py").write_text(shardc.lower(shardc.plan(spec), sizes=sizes).source)
    rng = np.random.default_rng(0)
    x, w_in, w_out = (rng.standard_normal(s).astype(np.float32) for s in ((8, 16), (16, 8), (8, 16)))
    d_out = rng.standard_normal((8, 16)).astype(np.float32)
    np.savez(tmp_path / "in.npz", In=x, W_in=w_in, W_out=w_out, dOut=d_out)
    (tmp_path / "worker.py").write_text(WORKER)
    port = str(_free_port())
    args = [str(tmp_path), str(tmp_path / "in.npz"), str(tmp_path / "out.npz")]
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(k), port, *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for k in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    got = np.load(tmp_path / "out.npz")
    tmp = x @ w_in
    d_tmp = d_out @ w_out.T
    want = {"Tmp": tmp, "Out": tmp @ w_out, "dW_out": tmp.T @ d_out, "dW_in": x.T @ d_tmp, "dIn": d_tmp @ w_in.T}
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-4, err_msg=name)
