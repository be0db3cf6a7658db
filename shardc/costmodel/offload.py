"""Host offload: activations kept for the backward, or the optimizer's state, held in the host's memory.

Two settings a framework offers, each costed at the chip's link to its host (``Hardware.host_bandwidth``,
one way, as pinned copies measure it) and overlapped as the program runs them:

* ``activations`` (MaxText's ``*_offloaded`` remat policies; PyTorch's ``save_on_cpu``): each layer's
  kept values go to the host as the forward makes them and come back as the backward reaches them.
  The device holds two layers' worth: one layer's being written out (read back) while the next is
  made (used).  The copies run on the chip's copy engines beside compute and collectives, so a phase's
  copies hide under the phase's time; what exceeds it is exposed.
* ``optimizer`` (MaxText's ``optimizer_memory_host_offload``): the optimizer's state (Adam's moments,
  fp32 master weights where the accounting keeps them) lives on the host and streams through the chip
  for the update, in under the backward (the update needs it after) and out under the next step's
  forward (nothing reads it before the next update).  DeepSpeed's ZeRO-Offload instead runs the
  update on the host's CPU; its time is the CPU's, which shardc does not model.

``both`` does both, the two sharing the link.  A pipelined spec is not costed with offload here: its
stages hold several microbatches' values, in flight at different ticks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardc.costmodel.memory import Memory
from shardc.errors import ShardcError
from shardc.hardware import Hardware

__all__ = ["OFFLOADS", "Offload", "check_offload", "offload_cost"]

OFFLOADS = ("none", "activations", "optimizer", "both")
IN_FLIGHT_LAYERS = 2  # layers of kept values on the device while the others are on the host


@dataclass(frozen=True)
class Offload:
    """What a step moves over the host link, and what of it compute does not hide."""

    what: str
    activation_bytes: float  # kept values on the host, a device (out in the forward, back in the backward)
    optimizer_bytes: float  # optimizer state on the host, a device (in before the update, out after)
    host_bandwidth: float  # bytes/s one way
    forward_busy_s: float  # the forward's time, which the copies out hide under
    backward_busy_s: float  # the backward's, for the copies in

    @property
    def bytes_each_way(self) -> float:
        return self.activation_bytes + self.optimizer_bytes

    @property
    def seconds(self) -> float:
        """Link time one way (both directions run at once on a duplex link)."""
        return self.bytes_each_way / self.host_bandwidth if self.bytes_each_way else 0.0

    @property
    def exposed_s(self) -> float:
        """Copies out past the forward's time, and copies in past the backward's."""
        return max(0.0, self.seconds - self.forward_busy_s) + max(0.0, self.seconds - self.backward_busy_s)

    def to_json(self) -> dict[str, object]:
        return {"what": self.what, "activation_bytes": self.activation_bytes,
                "optimizer_bytes": self.optimizer_bytes, "host_bandwidth": self.host_bandwidth,
                "seconds_each_way": self.seconds, "exposed_s": self.exposed_s}


def check_offload(what: object, hw: Hardware, pipelined: bool) -> str:
    """``what`` as one of :data:`OFFLOADS`, where the chip has a host link and the spec no pipeline."""
    if not isinstance(what, str) or what not in OFFLOADS:
        raise ShardcError(f"unknown offload {what!r}", fix="use one of " + ", ".join(OFFLOADS))
    if what == "none":
        return what
    if hw.host_bandwidth is None:
        raise ShardcError(f"--offload {what}: {hw.name} has no host link figure",
                          fix="give `host_bandwidth = ...` (bytes/s one way) in a --hardware-file")
    if pipelined:
        raise ShardcError(f"--offload {what}: offload is costed for specs without a pipeline axis",
                          fix="leave --offload out for a pipelined spec")
    return what


def offload_cost(what: str, mem: Memory, forward_busy_s: float, backward_busy_s: float,
                 hw: Hardware) -> tuple[Offload | None, Memory]:
    """The step's host traffic under ``what``, and the memory a device holds then (the rest on the host)."""
    if what == "none" or hw.host_bandwidth is None:
        return None, mem
    activations = what in ("activations", "both")
    a_layer = sum(b for _, b in mem.residuals)
    kept = min(mem.residual_bytes, IN_FLIGHT_LAYERS * a_layer) if activations else mem.residual_bytes
    on_host = mem.residual_bytes - kept
    state = mem.optimizer_bytes if what in ("optimizer", "both") else 0.0
    moved = Offload(what, on_host, state, hw.host_bandwidth, forward_busy_s, backward_busy_s)
    return moved, replace(mem, residual_bytes=kept, optimizer_bytes=mem.optimizer_bytes - state,
                          host_bytes=on_host + state)
