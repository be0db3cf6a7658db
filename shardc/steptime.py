"""How one local einsum is timed, beneath :mod:`shardc.step_cost` and the planner's search.

:mod:`shardc.step_cost` times a plan's einsums with these; the planner's einsum search
(:meth:`shardc.sharding.layout.CostContext.einsum_seconds`) prices each configuration it
weighs with the same functions, so the search and ``shardc cost`` share one model.  They live apart from
:mod:`shardc.step_cost` because that module reads the op families (their HBM traffic),
which themselves plan through the search.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from shardc.collectives import Layout, Op, collective_time
from shardc.hardware import Hardware
from shardc.ir.spec import Mesh

__all__ = ["EinsumTime", "einsum_time", "einsum_bytes", "Send", "RingTransfer", "RingTime", "ring_time",
           "hidden_from"]


@dataclass(frozen=True)
class EinsumTime:
    """A local einsum's time on the chip: ``compute_s`` its FLOPs at the rate the chip reaches, and
    ``memory_s`` the time its HBM bytes take beyond that (0 where its FLOPs outlast its bytes)."""

    compute_s: float
    memory_s: float

    @property
    def seconds(self) -> float:
        """The einsum's time: the larger of its FLOPs' time and its bytes' time (its roofline)."""
        return self.compute_s + self.memory_s


def einsum_time(flops: float, nbytes: float, product: bool, hw: Hardware, dtype: str = "bf16") -> EinsumTime:
    """The time of a local einsum of ``flops`` FLOPs a device that moves ``nbytes`` bytes through HBM.

    A matmul takes the larger of its FLOPs at the rate the chip reaches on a matmul of that size and its
    bytes at the share of the HBM bandwidth a matmul bound by its bytes reaches (the roofline, Williams et al.
    2009; :meth:`shardc.hardware.Hardware.matmul_memory_seconds`): attention's scores over a small head
    dim, or a small expert's matmul, are bound by their bytes.  An elementwise product (``product``: no
    index contracted) runs as a multiply, memory-bound, its bytes alone.  The book's model runs every
    einsum at peak and moves bytes for free (:meth:`shardc.hardware.Hardware.memory_seconds`).
    """
    if product and not hw.book:
        return EinsumTime(0.0, hw.memory_seconds(nbytes))
    compute = hw.matmul_seconds(flops, dtype)
    return EinsumTime(compute, max(0.0, hw.matmul_memory_seconds(nbytes) - compute))


def einsum_bytes(operands: Iterable[float], result: float) -> float:
    """The HBM bytes of a local einsum before fusion: it reads its operands and writes its result
    (a matmul's operands come from HBM; what fusion saves a product depends on its neighbours in the
    program, :func:`shardc.fusion.memory_traffic`)."""
    return math.fsum((*operands, result))


@dataclass(frozen=True)
class Send:
    """One array a kernel sends to its neighbour along a ring (``jax.lax.ppermute``): its elements a
    device, bytes an element, how many times a kernel sends it, and whether a ring step's compute runs
    meanwhile (``hidden``: K and V on their way to the next step) or nothing does (before or after the
    ring: a zig-zag reordering, the last hop of dK and dV home)."""

    elements: float
    nbytes: int
    count: int
    hidden: bool = True


@dataclass(frozen=True)
class RingTransfer:
    """The sends of a kernel whose compute is cut into ``steps`` equal steps around a ring over ``axes``
    (ring attention): each step but the last sends the ``hidden`` arrays on while it computes; ``tokens``
    is the length of the block a step computes with, per device (the key block)."""

    axes: tuple[str, ...]
    steps: int
    tokens: int
    sends: tuple[Send, ...]

    @property
    def step_bytes(self) -> float:
        """The bytes each ring step sends while it computes."""
        return math.fsum(s.elements * s.nbytes for s in self.sends if s.hidden)


@dataclass(frozen=True)
class RingTime:
    """A ring's transfer against its compute: each step's transfer, the part of the transfers no
    compute hides, the block length (tokens a device) from which a step's compute hides its transfer, and
    all its sends together: their bytes and their bandwidth time (what the cost formulas give)."""

    transfer_s: float
    exposed_s: float
    hidden_from: float
    sent_bytes: float = 0.0
    bandwidth_s: float = 0.0


def ring_time(ring: RingTransfer, compute_s: float, mesh: Mesh, sizes: Mapping[str, int], hw: Hardware,
              spans: Layout | None = None) -> RingTime:
    """Ring attention's exposed communication (Liu et al. 2023, section 3): the kernel's ``compute_s`` in
    ``steps`` equal steps, each but the last overlapping the send of the next step's block to the
    neighbour, so a step takes max(its compute, its transfer) and the exposed time is ``(steps - 1) *
    max(0, transfer - compute / steps)``, plus the sends nothing overlaps.  A step's compute grows as the
    square of the block length and its transfer linearly, so the transfer hides from ``tokens * transfer
    / step compute`` tokens a device on (the paper's block size c >= F / B, in this chip's rates)."""
    def seconds(nbytes: float) -> float:
        return collective_time(Op.COLLECTIVE_PERMUTE, nbytes, ring.axes, mesh, sizes, hw, spans).seconds

    def bandwidth(nbytes: float) -> float:
        return collective_time(Op.COLLECTIVE_PERMUTE, nbytes, ring.axes, mesh, sizes, hw, spans).bandwidth_s

    transfer = seconds(ring.step_bytes)
    step = compute_s / ring.steps
    # the sends are point-to-point (NCCL send/recv to one neighbour): the SMs they hold beside the compute are
    # not measured (the chip's collective_sms are a node's collective channels, shardc.overlap), none charged
    exposed = (ring.steps - 1) * max(0.0, transfer - step)
    exposed += math.fsum(seconds(s.elements * s.nbytes) * s.count for s in ring.sends if not s.hidden)
    sent = math.fsum(s.elements * s.nbytes * s.count for s in ring.sends)
    busy = math.fsum(bandwidth(s.elements * s.nbytes) * s.count for s in ring.sends)
    return RingTime(transfer, exposed, hidden_from(ring.tokens, transfer, step), sent, busy)


def hidden_from(tokens: float, comm_s: float, compute_s: float) -> float:
    """The block length, in tokens a device, from which ``compute_s`` hides ``comm_s``, both taken at
    ``tokens`` a device: attention's compute grows as the square of the tokens and a transfer of K and V
    (or Q, K, V and O) linearly, so they meet at ``tokens * comm / compute`` (the ring attention paper's
    block size c >= F / B, in this chip's rates); inf where nothing computes."""
    return tokens * comm_s / compute_s if compute_s > 0 else math.inf
