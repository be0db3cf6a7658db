"""Microbenchmarks of the chip jax runs on: matmuls, HBM streaming, collectives over its devices.

Each function compiles its program once, runs it once to warm up, then times
``repeats`` runs and keeps the median (a shared machine's outliers are slow runs,
never fast ones).  Sizes are bytes of the arrays as the cost model counts them
(:mod:`shardc.collectives`: V, a collective's volume).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardc.collectives import Op

__all__ = ["Timer", "matmul_rates", "stream_bandwidth", "collective_points", "COLLECTIVE_OPS", "AXIS"]

AXIS = "x"
COLLECTIVE_OPS = (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_REDUCE, Op.ALL_TO_ALL)


@dataclass(frozen=True)
class Timer:
    """How to time one program: ``repeats`` timed runs after one warm-up, the median kept."""

    repeats: int = 5

    def seconds(self, fn: Callable[..., Any], *args: Any) -> float:
        jax.block_until_ready(fn(*args))  # compile and warm up
        runs = []
        for _ in range(self.repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            runs.append(time.perf_counter() - start)
        return float(np.median(runs))


def matmul_rates(sides: Sequence[int], dtype: Any, timer: Timer) -> list[tuple[float, float]]:
    """(FLOPs, FLOP/s) of an ``n x n`` by ``n x n`` matmul on one device, for each side ``n``."""
    rates = []
    for n in sides:
        a = jnp.ones((n, n), dtype)
        b = jnp.ones((n, n), dtype)
        flops = 2.0 * n * n * n
        seconds = timer.seconds(jax.jit(jnp.matmul), a, b)
        rates.append((flops, flops / seconds))
    return rates


def stream_bandwidth(nbytes: int, timer: Timer) -> float:
    """Bytes a second of ``y = 2x + 1`` over an array of ``nbytes`` (f32): one read and one write,
    fused by XLA into one pass, so ``2 * nbytes`` cross the memory bus."""
    x = jnp.ones((max(1, nbytes // 4),), jnp.float32)
    seconds = timer.seconds(jax.jit(lambda v: v * 2.0 + 1.0), x)
    return 2.0 * x.size * 4 / seconds


def _program(op: Op) -> Callable[[jax.Array], jax.Array]:
    if op is Op.ALL_GATHER:
        return lambda x: jax.lax.all_gather(x, AXIS, tiled=True)
    if op is Op.REDUCE_SCATTER:
        return lambda x: jax.lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True)
    if op is Op.ALL_REDUCE:
        return lambda x: jax.lax.psum(x, AXIS)
    if op is Op.ALL_TO_ALL:
        return lambda x: jax.lax.all_to_all(x, AXIS, 0, 0, tiled=True)
    raise ValueError(f"no microbenchmark for {op}")


def _local_elements(op: Op, volume: int, devices: int) -> int:
    """Elements (f32) each device holds before ``op`` for a volume of ``volume`` bytes: the cost
    model's V is the gathered size of an AllGather and an AllToAll, the per-device source of a
    ReduceScatter and an AllReduce (:attr:`shardc.collectives.OpInfo.volume_side`)."""
    per_device = volume // devices if op in (Op.ALL_GATHER, Op.ALL_TO_ALL) else volume
    return max(devices, per_device // 4 // devices * devices)  # a multiple of the devices (scatter, all-to-all)


def collective_points(op: Op, volumes: Sequence[int], devices: Sequence[Any],
                      timer: Timer) -> list[tuple[float, float]]:
    """(V bytes, seconds) of ``op`` over one mesh axis of ``devices``, for each volume."""
    mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
    n = len(devices)
    out_spec = P() if op is Op.ALL_REDUCE else P(AXIS)
    fn = jax.jit(jax.shard_map(_program(op), mesh=mesh, in_specs=P(AXIS), out_specs=out_spec,
                               check_vma=False))
    points = []
    for volume in volumes:
        local = _local_elements(op, volume, n)
        x = jax.device_put(jnp.ones((local * n,), jnp.float32), NamedSharding(mesh, P(AXIS)))
        moved = local * 4 * n if op in (Op.ALL_GATHER, Op.ALL_TO_ALL) else local * 4
        points.append((float(moved), timer.seconds(fn, x)))
    return points


@dataclass(frozen=True)
class Sizes:
    """Sizes to measure: matmul sides, the streamed array's bytes, collective volumes (bytes)."""

    sides: tuple[int, ...]
    stream_bytes: int
    volumes: tuple[int, ...]
    repeats: int


# --quick: seconds on emulated CPU devices; the full run: 4 KB to 1 GB collectives, matmuls to 16384
QUICK = Sizes(sides=(64, 128, 256, 512), stream_bytes=2**24, volumes=tuple(2**k for k in range(12, 23, 2)), repeats=3)
FULL = Sizes(sides=(256, 512, 1024, 2048, 4096, 8192, 16384), stream_bytes=2**30,
            volumes=tuple(2**k for k in range(12, 31, 2)), repeats=10)


def memory_bytes(device: Any) -> float | None:
    """The device's memory as jax reports it; a CPU's, the host's physical memory (None: neither known)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    if limit:
        return float(limit)
    if device.platform == "cpu" and hasattr(os, "sysconf"):
        try:
            return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError):
            return None
    return None
