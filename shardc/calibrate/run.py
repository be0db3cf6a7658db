"""``shardc calibrate``'s measurement: every microbenchmark on the devices of this host."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from shardc.calibrate.chip import Measurements
from shardc.calibrate.fit import fit_line
from shardc.calibrate.measure import (
    COLLECTIVE_OPS,
    Sizes,
    Timer,
    collective_points,
    matmul_rates,
    memory_bytes,
    stream_bandwidth,
)

__all__ = ["measure"]


def measure(sizes: Sizes, progress: Callable[[str], None] = lambda _: None) -> Measurements:
    """Matmuls on one device (bf16, f32 on a CPU, which has no bf16 matrix unit), streaming, and each
    collective over one axis of all this host's devices (none with one device)."""
    devices = jax.local_devices()
    cpu = devices[0].platform == "cpu"
    dtype = jnp.float32 if cpu else jnp.bfloat16
    timer = Timer(sizes.repeats)
    progress(f"matmuls on {devices[0].device_kind}")
    matmul = matmul_rates(sizes.sides, dtype, timer)
    progress("memory streaming")
    stream = stream_bandwidth(sizes.stream_bytes, timer)
    lines = []
    if len(devices) > 1:
        for op in COLLECTIVE_OPS:
            progress(f"{op.title} over {len(devices)} devices")
            lines.append((op, fit_line(collective_points(op, sizes.volumes, devices, timer))))
    return Measurements(devices[0].device_kind, len(devices), jnp.dtype(dtype).name, tuple(matmul), stream,
                        tuple(lines), memory_bytes(devices[0]))
