"""Host offload: activations kept for the backward, or the optimizer's state and update, on the host.

Two settings a framework offers, each costed at the chip's link to its host (``Hardware.host_bandwidth``,
one way, as pinned copies measure it; the link is duplex, so copies out and copies in run at once) and
overlapped as the program runs them:

* ``activations`` (MaxText's ``*_offloaded`` remat policies; PyTorch's ``save_on_cpu``): each layer's
  kept values go to the host as the forward makes them and come back as the backward reaches them.
  The device holds two layers' worth: one layer's being written out (read back) while the next is
  made (used).  The copies run on the chip's copy engines beside compute and collectives, so a phase's
  copies hide under the phase's time; what exceeds it is exposed.
* ``optimizer`` (ZeRO-Offload, Ren et al. 2021, arXiv 2101.06840): the optimizer's state and
  the gradients live on the host, and the update runs there on the CPU (DeepSpeed's CPU-Adam, at
  ``Hardware.host_adam_rate``).  The gradients go out as the backward makes them (under it); the CPU
  updates the state once they are all there, and the updated params (in the params' dtype) come back
  before the next forward: the update and the copy in are exposed, after the backward, and the
  device's own update is gone.  With the paper's one-step delayed parameter update (``delayed``), the
  CPU's update of step i runs beside step i + 1's forward and backward, and only what of it exceeds
  them is exposed.

``both`` does both, the two sharing the link.  A pipelined spec is costed a stage at a time
(:func:`pipeline_offload`): a stage's kept values are those of its microbatches in flight, each
microbatch's going out under its forward and back under its backward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardc.accountings import ACCOUNTINGS
from shardc.costmodel.memory import Memory
from shardc.costmodel.pipeline_figures import PipelineCost
from shardc.errors import ShardcError
from shardc.hardware import Hardware

__all__ = ["OFFLOADS", "IN_FLIGHT_LAYERS", "Offload", "check_offload", "offload_cost", "pipeline_offload"]

OFFLOADS = ("none", "activations", "optimizer", "both")
IN_FLIGHT_LAYERS = 2  # layers of kept values on the device while the others are on the host


@dataclass(frozen=True)
class Offload:
    """What a step moves over the host link, what the host's CPU does, and what of it compute does not hide."""

    what: str
    activation_bytes: float  # kept values moved to the host a step, a device (out in the forward, back in the backward)
    optimizer_bytes: float  # optimizer state on the host, a device (it stays there: the host updates it)
    host_bandwidth: float  # bytes/s one way
    forward_busy_s: float  # the forward's time, which the copies out hide under
    backward_busy_s: float  # the backward's, for the copies in (and the gradients out)
    grad_bytes: float = 0.0  # gradients out to the host under the backward (ZeRO-Offload)
    param_bytes: float = 0.0  # the updated params back from the host after its update
    host_update_s: float = 0.0  # the update on the host's CPU (CPU-Adam)
    delayed: bool = False  # the update one step late, beside the next step's forward and backward

    @property
    def bytes_each_way(self) -> float:
        """The larger of the bytes out and the bytes in, a step."""
        return max(self.activation_bytes + self.grad_bytes, self.activation_bytes + self.param_bytes)

    @property
    def seconds(self) -> float:
        """Link time one way, the busier direction (both directions run at once on a duplex link)."""
        return self.bytes_each_way / self.host_bandwidth

    @property
    def update_chain_s(self) -> float:
        """The host's update then the updated params' copy in: what follows the backward."""
        return self.host_update_s + self.param_bytes / self.host_bandwidth

    @property
    def forward_host(self) -> bool:
        """Whether the copies out take longer than the forward they run beside: the host link sets its time."""
        return self.activation_bytes / self.host_bandwidth > self.forward_busy_s

    @property
    def backward_host(self) -> bool:
        """Whether the copies in (and the gradients out) take longer than the backward they run beside."""
        return max(self.activation_bytes, self.grad_bytes) / self.host_bandwidth > self.backward_busy_s

    @property
    def host_bound(self) -> bool:
        """Whether the host sets part of the step: copies past the compute they run beside, or a host update
        that nothing hides (the bound ``shardc cost`` then gives the step, and a pipeline's stage)."""
        return self.exposed_s > 0

    @property
    def exposed_s(self) -> float:
        """Copies out past the forward's time, copies in (and gradients out) past the backward's, and the
        host's update with its copy in (past the next forward and backward when delayed)."""
        out = self.activation_bytes / self.host_bandwidth
        back = max(self.activation_bytes, self.grad_bytes) / self.host_bandwidth
        update = self.update_chain_s
        if self.delayed:
            update = max(0.0, update - self.forward_busy_s - self.backward_busy_s)
        return max(0.0, out - self.forward_busy_s) + max(0.0, back - self.backward_busy_s) + update

    def to_json(self) -> dict[str, object]:
        return {"what": self.what, "activation_bytes": self.activation_bytes,
                "optimizer_bytes": self.optimizer_bytes, "grad_bytes": self.grad_bytes,
                "param_bytes": self.param_bytes, "host_bandwidth": self.host_bandwidth,
                "seconds_each_way": self.seconds, "host_update_s": self.host_update_s, "delayed": self.delayed,
                "exposed_s": self.exposed_s}


def check_offload(what: object, hw: Hardware) -> str:
    """``what`` as one of :data:`OFFLOADS`, where the chip has the host figures it needs."""
    if not isinstance(what, str) or what not in OFFLOADS:
        raise ShardcError(f"unknown offload {what!r}", fix="use one of " + ", ".join(OFFLOADS))
    if what == "none":
        return what
    if hw.host_bandwidth is None:
        raise ShardcError(f"--offload {what}: {hw.name} has no host link figure",
                          fix="give `host_bandwidth = ...` (bytes/s one way) in a --hardware-file")
    if what in ("optimizer", "both") and hw.host_adam_rate is None:
        raise ShardcError(f"--offload {what}: {hw.name} has no figure for Adam on its host's CPU",
                          fix="give `host_adam_rate = ...` (params/s a chip's share) in a --hardware-file")
    return what


def _optimizer_part(what: str, optimizer_bytes: float, params: float, accounting: str,
                    hw: Hardware) -> tuple[float, float, float, float]:
    """Under ``what``: the optimizer state on the host, the gradients going out a step (in the accounting's
    gradient dtype, else the params'), the params coming back, and the host's update time (all 0 without
    the optimizer offloaded)."""
    if what not in ("optimizer", "both") or hw.host_adam_rate is None:
        return 0.0, 0.0, 0.0, 0.0
    per_param, per_grad, per_state, _ = ACCOUNTINGS.get(accounting, ACCOUNTINGS["adam10"])
    elements = optimizer_bytes / per_state if per_state else params  # the state's elements the host updates
    return optimizer_bytes, elements * (per_grad or per_param), elements * per_param, elements / hw.host_adam_rate


def offload_cost(what: str, mem: Memory, forward_busy_s: float, backward_busy_s: float, hw: Hardware,
                 accounting: str = "adam10", delayed: bool = False) -> tuple[Offload | None, Memory]:
    """The step's host traffic and host update under ``what``, and the memory a device holds then (the rest
    on the host)."""
    if what == "none" or hw.host_bandwidth is None:
        return None, mem
    activations = what in ("activations", "both")
    a_layer = sum(b for _, b in mem.residuals)
    kept = min(mem.residual_bytes, IN_FLIGHT_LAYERS * a_layer) if activations else mem.residual_bytes
    on_host = mem.residual_bytes - kept
    state, grads_out, params_in, update_s = _optimizer_part(what, mem.optimizer_bytes, mem.params, accounting, hw)
    grads = mem.grad_bytes if state else 0.0  # the gradients a device would hold, on the host instead
    moved = Offload(what, on_host, state, hw.host_bandwidth, forward_busy_s, backward_busy_s, grads_out, params_in,
                    update_s, delayed)
    return moved, replace(mem, residual_bytes=kept, optimizer_bytes=mem.optimizer_bytes - state,
                          grad_bytes=mem.grad_bytes - grads, host_bytes=on_host + state + grads)


def pipeline_offload(what: str, pipe: PipelineCost, hw: Hardware, accounting: str = "adam10",
                     delayed: bool = False) -> tuple[PipelineCost, Offload | None]:
    """``pipe`` with each stage under ``what``: a stage's kept values are its microbatches' in flight; with
    activations offloaded it keeps :data:`IN_FLIGHT_LAYERS` layers of one microbatch, and each microbatch
    sends its own out under its forward through the stage and takes them back under its backward (the
    stage's ``m`` forwards and backwards hide them).  The step adds the slowest stage's exposed copies and
    host update; the device's own update is gone where the host updates."""
    if what == "none" or hw.host_bandwidth is None:
        return pipe, None
    m = pipe.pipeline.microbatches
    stages, moved = [], []
    for s in pipe.stages:
        kept, per_microbatch = s.activation_bytes, 0.0
        if what in ("activations", "both") and s.held > 0 and s.layers > 0:
            per_microbatch = s.activation_bytes / s.held
            kept = min(s.activation_bytes, per_microbatch * min(1.0, IN_FLIGHT_LAYERS / s.layers))
        state, grads_out, params_in, update_s = _optimizer_part(what, s.optimizer_bytes, s.params, accounting, hw)
        grads = s.grad_bytes if state else 0.0
        out = per_microbatch * m if kept < s.activation_bytes else 0.0  # every microbatch's, out and back
        moved.append(Offload(what, out, state, hw.host_bandwidth, m * s.forward_s, m * (s.backward_s + s.weight_s),
                             grads_out, params_in, update_s, delayed))
        stages.append(replace(s, activation_bytes=kept, state_bytes=s.state_bytes - state - grads,
                              host_bytes=s.activation_bytes - kept + state + grads, host=moved[-1].host_bound))
    worst = max(moved, key=lambda o: o.exposed_s)
    host = what in ("optimizer", "both")
    return replace(pipe, stages=tuple(stages), offload_s=worst.exposed_s,
                   update_s=0.0 if host else pipe.update_s), worst
