"""The emulated CPU devices ``shardc verify`` asks XLA for: its intra-op pool has a worker for each collective
a device can have waiting at once, so that a collective queued on the pool always finds one free (DeepSeek-V3's
verify, 64 devices, aborted in XLA's rendezvous with every one of the 64 workers waiting)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardc.cli.lower_cmd import _WAITING_COLLECTIVES

_COUNT_WORKERS = (
    "from shardc.cli.lower_cmd import emulate_devices\n"
    "emulate_devices(16)\n"
    "import jax, jax.numpy as jnp\n"
    "jax.jit(lambda x: x + 1)(jnp.ones(2)).block_until_ready()\n"  # XLA's CPU client, its pool, now up
    "tasks = Path('/proc/self/task')\n"
    "print(sum((t / 'comm').read_text().strip() == 'tf_XLAEigen' for t in tasks.iterdir()))\n")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the threads' names from /proc")
def test_the_emulated_devices_pool_has_a_worker_for_each_collective_a_device_can_wait_at() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
    run = subprocess.run([sys.executable, "-c", "from pathlib import Path\n" + _COUNT_WORKERS], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) == _WAITING_COLLECTIVES * 16  # XLA's own: one a device (16), which all waited
