"""The emulated CPU devices ``shardc verify`` asks XLA for: its intra-op pool has a worker for each collective
a device can have waiting at once, so that a collective queued on the pool always finds one free (DeepSeek-V3's
verify, 64 devices, aborted in XLA's rendezvous with every one of the 64 workers waiting)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardc.lowering.template import WAITING_COLLECTIVES

_COUNT_WORKERS = (
    "from shardc.cli.lower_cmd import emulate_devices\n"
    "emulate_devices(16)\n"
    "import jax, jax.numpy as jnp\n"
    "jax.jit(lambda x: x + 1)(jnp.ones(2)).block_until_ready()\n"  # XLA's CPU client, its pool, now up
    "tasks = Path('/proc/self/task')\n"
    "print(sum((t / 'comm').read_text().strip() == 'tf_XLAEigen' for t in tasks.iterdir()))\n")


@pytest.mark.slow  # starts an interpreter that imports jax and compiles with XLA (conftest's guard cannot see it)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the threads' names from /proc")
def test_the_emulated_devices_pool_has_a_worker_for_each_collective_a_device_can_wait_at() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
    run = subprocess.run([sys.executable, "-c", "from pathlib import Path\n" + _COUNT_WORKERS], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) == WAITING_COLLECTIVES * 16  # XLA's own: one a device (16), which all waited


def test_a_lowered_modules_header_says_the_pool_it_needs_on_emulated_devices() -> None:
    import shardc
    from shardc.lowering.api import module_source
    spec = shardc.parse((Path(__file__).resolve().parent.parent / "examples" / "fsdp_tp.shard").read_text(), "f")
    source, _ = module_source(shardc.plan(spec))  # mesh X=16, Y=4: 64 devices
    header = source.split('"""')[1]
    assert "xla_force_host_platform_device_count=64" in header and f"NPROC={WAITING_COLLECTIVES * 64}" in header
