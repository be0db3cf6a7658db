"""A measured chip: the microbenchmarks' figures as a :class:`~shardc.hardware.Hardware`, and its TOML file.

The figures a measurement gives:

* ``matmul_efficiency``: each matmul's FLOP/s over the peak (the preset's data-sheet
  peak for a chip shardc knows, else the best rate measured, as on a host CPU);
* ``hbm_bandwidth``: the streaming rate of a fused elementwise pass;
* ``ici_bandwidth``: scaled so that shardc's own model of each collective over the
  axis (:func:`shardc.collectives.collective_time`) gives the measured slope; the
  median over AllGather, ReduceScatter, AllReduce and AllToAll is kept, and the file
  lists each collective's measured and predicted time so the spread is visible;
* the latency: on a GPU the base of NCCL's model (``collective_base``: the measured
  latency less NCCL's per-step latencies, the median over the collectives), on a TPU
  ``hop_latency``, the median fitted latency over the ring's hops.

``dcn_bandwidth`` is measured only across processes (a multi-host run); on one host
the base chip's figure is kept and the file says so.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, fields, replace

from shardc.calibrate.fit import Line, efficiency_points, median
from shardc.collectives import NCCL_BASE_S, CollectiveTime, Op, collective_time
from shardc.hardware import PRESETS, Hardware
from shardc.ir.spec import Mesh, MeshAxis
from shardc.topology import resolve_links

__all__ = ["Measurements", "base_chip", "calibrated", "chip_toml", "predicted_seconds"]

AXIS = "x"


@dataclass(frozen=True)
class Measurements:
    """What ``shardc calibrate`` measured on the devices of one host."""

    device_kind: str  # jax's name of the chip ("NVIDIA H200", "TPU v5p", "cpu")
    devices: int
    dtype: str  # the matmuls' element type
    matmul: tuple[tuple[float, float], ...]  # (FLOPs, FLOP/s)
    stream_bandwidth: float  # bytes/s
    collectives: tuple[tuple[Op, Line], ...]  # over one axis of ``devices``
    memory_bytes: float | None  # the device's memory, where jax reports it


# jax's device_kind strings and the preset each is (substrings, lower case; the first match wins)
_KINDS = (("h200", "h200"), ("h100", "h100"), ("h800", "h800"), ("a100", "a100"), ("b200", "b200"),
          ("v5p", "tpu-v5p"), ("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"),
          ("v6 lite", "tpu-v6e"), ("v6e", "tpu-v6e"), ("v4", "tpu-v4p"), ("v3", "tpu-v3"))


def base_chip(device_kind: str) -> Hardware | None:
    """The preset a device kind is (None: a chip without one, such as a host CPU)."""
    kind = device_kind.lower()
    for needle, preset in _KINDS:
        if needle in kind and preset in PRESETS:
            return PRESETS[preset]
    return None


def _time(hw: Hardware, op: Op, nbytes: float, devices: int) -> CollectiveTime:
    """shardc's time for ``op`` moving V = ``nbytes`` over one mesh axis of ``devices`` chips, laid on
    the chip's usual slice or node for that many (:func:`shardc.topology.resolve_links`)."""
    mesh, sizes = Mesh((MeshAxis(AXIS, devices),)), {AXIS: devices}
    links, _ = resolve_links(mesh, sizes, hw)
    return collective_time(op, nbytes, (AXIS,), mesh, sizes, hw, links)


def predicted_seconds(hw: Hardware, op: Op, nbytes: float, devices: int) -> float:
    """shardc's time for ``op`` moving V = ``nbytes`` over one axis of ``devices`` chips."""
    return _time(hw, op, nbytes, devices).seconds


def _link_scale(hw: Hardware, op: Op, line: Line, devices: int) -> float:
    """The factor on ``ici_bandwidth`` that makes the model's slope for ``op`` the measured one."""
    probe = 2.0**30  # any size: the bandwidth term is linear in it
    model = _time(hw, op, probe, devices).bandwidth_s / probe
    return model / line.seconds_per_byte if line.seconds_per_byte > 0 else math.inf


def _generic(m: Measurements) -> Hardware:
    """A chip shardc has no preset for: peak the best matmul rate, one NVLink-like domain of the
    devices measured (every device reaches every other), the links scaled from 1 byte/s."""
    peak = max(rate for _, rate in m.matmul)
    return Hardware(m.device_kind or "chip", peak, 1.0, m.memory_bytes or 1.0, m.stream_bandwidth, 1.0,
                    ici_domain=m.devices, description=f"measured {m.device_kind}")


def calibrated(m: Measurements, name: str | None = None) -> Hardware:
    """The chip with the measured figures in place of the data sheet's (see the module docstring)."""
    known = base_chip(m.device_kind)
    base = known or _generic(m)
    # the measured stream is what an elementwise pass reaches (so at a share of 1); a matmul bound by its bytes
    # keeps the base chip's measured share beside it
    share = base.matmul_hbm_efficiency
    hw = replace(base, name=name or f"{base.name}-measured", description=f"measured on {m.devices} x {m.device_kind}",
                 hbm_bandwidth=m.stream_bandwidth, hbm_efficiency=1.0,
                 matmul_hbm_efficiency=None if share is None else min(1.0, share / base.hbm_efficiency),
                 matmul_efficiency=efficiency_points(m.matmul, base.flops))
    if m.memory_bytes:
        hw = replace(hw, hbm_bytes=m.memory_bytes)
    if m.devices < 2 or not m.collectives:
        return hw
    scales = [_link_scale(hw, op, line, m.devices) for op, line in m.collectives]
    finite = [s for s in scales if math.isfinite(s)]
    if finite:
        hw = replace(hw, ici_bandwidth=hw.ici_bandwidth * median(finite))
    hw = _latency(hw, m)
    return hw if known is not None else replace(hw, dcn_bandwidth=hw.w_ici)


def _latency(hw: Hardware, m: Measurements) -> Hardware:
    """The chip with the latency figure that makes the model's latency of each collective the fitted one
    (the median over the collectives)."""
    if hw.ici_domain is not None:  # a GPU: NCCL's base + steps; the base is what is measured
        base = NCCL_BASE_S if hw.collective_base is None else hw.collective_base
        steps = [_time(hw, op, 1.0, m.devices).latency_s - base for op, _ in m.collectives]
        bases = [line.latency_s - s for (_, line), s in zip(m.collectives, steps, strict=True)]
        return replace(hw, collective_base=max(1e-9, median(bases)))
    per_hop = [line.latency_s / (_time(hw, op, 1.0, m.devices).latency_s / hw.hop_latency) for op, line in
               m.collectives]
    return replace(hw, hop_latency=max(1e-9, median(per_hop)))


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string (escapes included)
    if isinstance(value, tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return repr(float(value)) if isinstance(value, float) else repr(value)


def chip_toml(hw: Hardware, m: Measurements, when: str) -> str:
    """The chip as a hardware file (``--hardware-file``), with what was measured as comments."""
    lines = [f"# shardc calibrate, {when}: {m.devices} x {m.device_kind}",
             f"# matmuls ({m.dtype}): FLOPs -> FLOP/s"]
    lines += [f"#   {flops:.3g} -> {rate:.4g}" for flops, rate in m.matmul]
    lines.append(f"# streaming: {m.stream_bandwidth:.4g} B/s")
    for op, line in m.collectives:
        lines.append(f"# {op.title}: latency {line.latency_s:.3g} s, {line.bandwidth:.4g} B/s; V bytes: "
                     "measured s / shardc s")
        lines += [f"#   {v:.3g}: {t:.3g} / {predicted_seconds(hw, op, v, m.devices):.3g}" for v, t in line.points]
    if base_chip(m.device_kind) is None:
        lines.append("# dcn_bandwidth: not measured (one host); the ICI figure stands in")
    else:
        lines.append("# dcn_bandwidth: not measured (one host); the preset's data-sheet figure")
    for f in fields(Hardware):  # the required figures, and each other one that is not its default
        value = getattr(hw, f.name)
        if value is None or (f.default is not MISSING and value == f.default):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            continue
        lines.append(f"{f.name} = {_value(value)}")
    return "\n".join(lines) + "\n"
