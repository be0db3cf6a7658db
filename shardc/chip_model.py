"""A chip as the cost model sees it (:class:`Hardware`): its figures, the rates it reaches, how a framework runs on it.

Every figure is per chip.  ``ici_bandwidth`` is the *one-way* bandwidth of one
link, as the data sheets give it; on a torus the cost model uses
the bidirectional figure ``w_ici = 2 * ici_bandwidth`` for one mesh axis, as the
book does (TPU v5p: 2 * 9e10 = 1.8e11, so C / W_ici = 4.59e14 / 1.8e11 = 2550).  A GPU's
``ici_bandwidth`` is its whole NVLink egress, one way (H100: 450 GB/s), used as is, at the
``ici_efficiency`` NCCL reaches (:attr:`Hardware.w_ici`); where the node's NVSwitches reduce in the
switch (NVLink SHARP), an in-node AllReduce may run at ``nvls_efficiency`` instead (:attr:`Hardware.w_nvls`).
``dcn_bandwidth`` (DCN on TPU, InfiniBand on GPU) is the line rate a chip, and collectives reach
``dcn_efficiency`` of it (:attr:`Hardware.w_dcn`; 1 on TPUs, which have no published figure: the book's
per-chip 6.25e9 gives C / W_dcn = 73,440 on v5p).

Figures beyond the book's (HBM bandwidth, the DCN figure of TPUs other
than v5p) are the public data-sheet numbers, each cited beside its preset; a chip
that differs can be given with ``--hardware-file chip.toml`` using the field
names below as keys.

The rate a chip reaches is not its peak: :attr:`Hardware.matmul_efficiency` is
the fraction of peak a matmul of a given size runs at, points (FLOPs of one
matmul, fraction) from published kernel measurements of the chip, interpolated
in log FLOPs and held flat beyond the first and last point (:meth:`Hardware.efficiency`).
A fused attention kernel (FlashAttention) runs below the chip's matmul rate, and its backward below
its forward: :attr:`Hardware.attention_forward` and :attr:`Hardware.attention_backward` are the
fractions of peak the best widely available kernel of the chip reaches, points (keys a kernel call
attends over, fraction) from published kernel measurements, interpolated alike
(:meth:`Hardware.attention_seconds`); without them the kernel runs at the matmul rate.  A memory-bound
kernel moves its bytes at :attr:`Hardware.hbm_efficiency` of the HBM bandwidth, and a matmul bound by its bytes
(a batched matmul over a head dim) at :attr:`Hardware.matmul_hbm_efficiency` of it, where measured (1 without).
``book=True`` is the book's model: every matmul at peak, elementwise work free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from shardc.errors import ShardcError, clip
from shardc.ir.spec import ATTENTION_KERNELS, FUSIONS, GRAD_REDUCES, PARAM_GATHERS
from shardc.kernel_rates import KERNELS

__all__ = ["Hardware", "BUCKET_BYTES", "MODELS", "check_model", "interpolate"]

# PyTorch DDP's default gradient bucket, bucket_cap_mb=25 (torch.nn.parallel.DistributedDataParallel: MiB)
BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Hardware:
    """One accelerator chip, per-chip figures in bytes, bytes/s and FLOPs/s."""

    name: str
    flops: float  # C: dense bf16 FLOPs/s
    ici_bandwidth: float  # one-way bytes/s of one ICI / NVLink link (per direction)
    hbm_bytes: float
    hbm_bandwidth: float
    dcn_bandwidth: float  # bytes/s per chip over DCN / InfiniBand, used as is
    hop_latency: float = 1e-6  # seconds a hop; bounds the time of small collectives
    ici_domain: int | None = None  # chips reachable over ICI/NVLink (8 per H100 node); None: a pod
    description: str = ""
    torus_side: int | None = None  # chips along one torus axis (16 on TPU pods); None: no torus
    torus_dims: int = 1  # axes of the torus (3 for v4p/v5p, 2 for v5e/v6e)
    # the share of the link figure a large collective reaches (NCCL's bus bandwidth over the data sheet's)
    ici_efficiency: float = 1.0
    # NVLink SHARP: the share of the link figure an in-node AllReduce reduced in the NVSwitches reaches for the
    # V (n+1)/n it moves through each GPU's links; None: no in-switch reduction (collectives.py)
    nvls_efficiency: float | None = None
    dcn_efficiency: float = 1.0  # the share of dcn_bandwidth (the NIC's line rate) a large collective reaches
    flops_f8: float | None = None  # dense fp8 FLOPs/s; None: fp8 runs at the bf16 rate (no fp8 matrix unit)
    # (FLOPs of one matmul, fraction of peak it reaches) measured on the chip, by FLOPs; () = peak always
    matmul_efficiency: tuple[tuple[float, float], ...] = ()
    # the same of fp8 matmuls over the fp8 peak (their kernels scale blocks and promote partial sums, so they
    # reach less of their peak); () = matmul_efficiency's fractions
    matmul_efficiency_f8: tuple[tuple[float, float], ...] = ()
    # (keys a fused attention kernel's call attends over, fraction of peak its forward / backward reaches),
    # by keys; () = the matmul rate (:meth:`attention_seconds`)
    attention_forward: tuple[tuple[float, float], ...] = ()
    attention_backward: tuple[tuple[float, float], ...] = ()
    # the share of hbm_bandwidth a memory-bound kernel reaches, measured: an elementwise pass (a norm, a softmax,
    # a dropout: :meth:`memory_seconds`) and a matmul whose bytes outlast its FLOPs (a batched matmul over a
    # head dim: :meth:`matmul_memory_seconds`; None: hbm_efficiency's)
    hbm_efficiency: float = 1.0
    matmul_hbm_efficiency: float | None = None
    bucket_bytes: float = BUCKET_BYTES  # gradient reductions are issued a bucket of this many bytes at a time
    # a GPU collective's base latency, as `shardc calibrate` measured it; None: NCCL's own (collectives.py)
    collective_base: float | None = None
    sms: int | None = None  # a GPU's streaming multiprocessors
    # the SMs a NCCL collective holds while it runs: one CTA a channel, each on an SM no compute kernel shares;
    # None: overlapped collectives take nothing from the compute (:attr:`overlap_share`)
    collective_sms: int | None = None
    # bytes/s one way between the chip and its host's memory, as pinned copies measure it; None: no figure
    host_bandwidth: float | None = None
    # params/s the host's CPU updates with Adam, one chip's share (the host's rate over the chips it serves);
    # None: no figure (an optimizer offloaded there is refused)
    host_adam_rate: float | None = None
    book: bool = False  # the book's assumptions: spans by ceil(log16 n) unless a TPU slice is given, no efficiency
    # how the framework runs the program on it (the spec's `fusion` and `grad_reduce` lines, or --fusion and
    # --grad-reduce over them; :data:`shardc.ir.spec.FUSIONS`, :data:`shardc.ir.spec.GRAD_REDUCES`); None: the
    # spec's line, else XLA's fusion and reductions overlapped
    fusion: str | None = None
    grad_reduce: str | None = None
    # the fused attention kernel run (the spec's `attention_kernel` line, --attention-kernel): its measured
    # rates replace attention_forward and attention_backward (:meth:`with_attention`); None: the chip's own
    attention_kernel: str | None = None
    # the preset this chip is, where a hardware file starts from one (its `base`, a cluster's network or HBM
    # changed): the kernels measured on that chip (:data:`KERNELS`) run on it; None: its own name's
    chip: str | None = None
    # when ZeRO-1/2's updated params are gathered back (the spec's `param_gather` line, --param-gather;
    # :data:`shardc.ir.spec.PARAM_GATHERS`); None: the spec's line, else after the step, exposed
    param_gather: str | None = None

    @property
    def overlap_share(self) -> float:
        """The share of the chip's cores a collective holds while it runs under compute
        (``collective_sms / sms``): the compute beside it runs that much slower.  0 where either figure is
        missing, and under the book's model."""
        if self.book or not self.sms or not self.collective_sms:
            return 0.0
        return min(1.0, self.collective_sms / self.sms)

    @property
    def fuses(self) -> bool:
        """Whether memory-bound steps fuse as XLA fuses them (else one kernel an op: ``fusion none``); under
        ``fusion statement`` only inside a statement (:attr:`fuses_statements`)."""
        return self.fusion != "none"

    @property
    def native_kernels(self) -> bool:
        """Whether the framework runs its own kernels (``fusion none``: PyTorch's; ``statement``: apex's beside
        them), whose backward reads what autograd saved (a norm's statistics) rather than the plan's values made
        again (:func:`shardc.fusion.saved_statistics`)."""
        return self.fusion in ("none", "statement")

    @property
    def fuses_statements(self) -> bool:
        """Whether a kernel is one statement's memory-bound steps (``fusion statement``: hand-fused kernels,
        nothing fused into a matmul; :func:`shardc.fusion.memory_traffic`)."""
        return self.fusion == "statement"

    @property
    def reruns_layers(self) -> bool:
        """Whether full recomputation reruns each layer whole: a PyTorch program (``fusion none``, ``fusion
        statement``), whose ``torch.utils.checkpoint`` calls the layer's function again; under XLA (a JAX
        program) ``jax.checkpoint`` reruns only what the backward reads (:mod:`shardc.planner.recompute`)."""
        return self.fusion in ("none", "statement")

    @property
    def gathers_under_forward(self) -> bool:
        """Whether ZeRO-1/2's param all-gathers run under the next step's forward (``param_gather overlapped``);
        the book's model overlaps every collective, but has no next step to hide these under."""
        return self.param_gather == "overlapped" and not self.book

    @property
    def reduces_after_backward(self) -> bool:
        """Whether gradient reductions wait for the end of the backward (``grad_reduce after-backward``);
        the book's model overlaps every collective."""
        return self.grad_reduce == "after-backward" and not self.book

    @property
    def reduces_dcn_after_backward(self) -> bool:
        """Whether only the gradient reductions' DCN phase waits for the end of the backward, their ICI phase
        overlapped (``grad_reduce after-backward over dcn``: PaLM's cross-pod transfer, Chowdhery et al. 2022,
        section 4); the book's model overlaps every collective."""
        return self.grad_reduce == "after-backward over dcn" and not self.book

    def spans(self, chips: int) -> int:
        """Torus axes a mesh axis of ``chips`` chips is laid over: ceil(log_side chips), at most the torus's.

        This is the book's M_X: X = 1024 on a 16x16x16 v5p pod spans 3 axes, so its
        collectives have 3 axes' links.  An axis of at most ``torus_side`` chips spans 1.
        """
        if self.torus_side is None or chips <= self.torus_side:
            return 1
        k = math.ceil(math.log(chips) / math.log(self.torus_side) - 1e-9)
        return max(1, min(k, self.torus_dims))

    @property
    def w_ici(self) -> float:
        """The W_ici of the formulas: on a torus, one axis's bidirectional bandwidth (twice the one-way
        link figure); on a GPU, its NVLink egress, one way, at the share collectives reach.

        A GPU's ``ici_bandwidth`` is already the sum over its NVLink links (H100: 18 links, 450 GB/s
        each way), the book's W_GPU egress ("How To Scale Your Model", the GPU chapter: C / W is
        about 2200 on an H100); a ring over the NVSwitch sends (n-1)/n of V out of each GPU
        (:mod:`shardc.collectives`).  The book's assumptions (``book``) leave out the efficiency.
        """
        if self.ici_domain is not None:
            return self.ici_bandwidth * (1.0 if self.book else self.ici_efficiency)
        return 2.0 * self.ici_bandwidth

    @property
    def w_nvls(self) -> float | None:
        """A GPU's NVLink egress at the share an AllReduce reduced in the NVSwitches reaches (NVLink SHARP);
        None where the switches do not reduce, or under the book's assumptions (which know only rings)."""
        if self.book or self.nvls_efficiency is None or self.ici_domain is None:
            return None
        return self.ici_bandwidth * self.nvls_efficiency

    @property
    def w_dcn(self) -> float:
        """A chip's DCN / InfiniBand figure at the share collectives reach (as given under the book's
        assumptions)."""
        return self.dcn_bandwidth * (1.0 if self.book else self.dcn_efficiency)

    @property
    def intensity_ici(self) -> float:
        """C / W_ici: FLOPs a byte over ICI must pay for (2550 on tpu-v5p)."""
        return self.flops / self.w_ici

    @property
    def intensity_dcn(self) -> float:
        return self.flops / self.w_dcn

    def scaled(self, bandwidth: float = 1.0, flops: float = 1.0) -> Hardware:
        """The same chip with every bandwidth (ICI, DCN) and/or FLOPs/s scaled (for what-ifs)."""
        return replace(self, flops=self.flops * flops, ici_bandwidth=self.ici_bandwidth * bandwidth,
                       dcn_bandwidth=self.dcn_bandwidth * bandwidth,
                       flops_f8=None if self.flops_f8 is None else self.flops_f8 * flops)

    def peak(self, dtype: str = "bf16") -> float:
        """Dense FLOPs/s of a matmul in ``dtype``: the fp8 figure for f8 where the chip has one, else C."""
        if dtype == "f8" and self.flops_f8 is not None:
            return self.flops_f8
        return self.flops

    def efficiency(self, flops: float, dtype: str = "bf16") -> float:
        """The fraction of the ``dtype``'s peak a matmul of ``flops`` FLOPs reaches: 1 under the book's model
        or without measurements; else the measured points (the fp8 ones for f8 where the chip has them)
        interpolated in log FLOPs, flat beyond the ends."""
        f8 = dtype == "f8" and self.flops_f8 is not None and bool(self.matmul_efficiency_f8)
        points = self.matmul_efficiency_f8 if f8 else self.matmul_efficiency
        if self.book or not points:
            return 1.0
        return interpolate(points, flops)

    def matmul_seconds(self, flops: float, dtype: str = "bf16") -> float:
        """Seconds of one local einsum of ``flops`` FLOPs: over the dtype's peak times the efficiency."""
        if flops <= 0:
            return 0.0
        return flops / (self.peak(dtype) * self.efficiency(flops, dtype))

    def attention_seconds(self, flops: float, keys: float, backward: bool, dtype: str = "bf16") -> float:
        """Seconds of a fused attention kernel's ``flops`` FLOPs (FlashAttention's count: the unmasked
        blocks, the backward 2.5 times the forward) with ``keys`` keys a call: over the dtype's peak times
        the fraction the chip's kernel reaches at that length, forward or ``backward``; at the matmul rate
        where the chip has no attention figures, and under the book's model."""
        points = self.attention_backward if backward else self.attention_forward
        if flops <= 0:
            return 0.0
        if self.book or not points:
            return self.matmul_seconds(flops, dtype)
        return flops / (self.peak(dtype) * interpolate(points, keys))

    def memory_seconds(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` through HBM in an elementwise kernel (a memory-bound step), at the share
        of the bandwidth such a kernel reaches; 0 under the book's model."""
        if self.book or nbytes <= 0:
            return 0.0
        return nbytes / (self.hbm_bandwidth * self.hbm_efficiency)

    def matmul_memory_seconds(self, nbytes: float) -> float:
        """Seconds a matmul takes to read its operands and write its result, ``nbytes``, through HBM (the
        memory side of its roofline, :func:`shardc.steptime.einsum_time`), at the share of the bandwidth a
        matmul bound by its bytes reaches; 0 under the book's model."""
        if self.book or nbytes <= 0:
            return 0.0
        share = self.hbm_efficiency if self.matmul_hbm_efficiency is None else self.matmul_hbm_efficiency
        return nbytes / (self.hbm_bandwidth * share)

    def with_attention(self, kernel: str) -> Hardware:
        """This chip running the fused attention kernel ``kernel`` (:data:`shardc.ir.spec.ATTENTION_KERNELS`)
        at the rates measured of it on this chip (a preset's table, :data:`KERNELS`)."""
        known = KERNELS.get(self.chip or self.name, {})
        if kernel not in known:
            raise ShardcError(f"no measured rates of attention kernel {clip(repr(kernel))} on {clip(self.name)}",
                              fix=("use one of " + ", ".join(known)) if known else
                              "give attention_forward and attention_backward in a hardware file")
        forward, backward = known[kernel]
        return replace(self, attention_kernel=kernel, attention_forward=forward, attention_backward=backward)

    def configured(self, model: str | None = None, bucket_mb: float | None = None, fusion: str | None = None,
                   grad_reduce: str | None = None, attention_kernel: str | None = None,
                   param_gather: str | None = None) -> Hardware:
        """This chip under a cost model, ``"book"`` (the book's assumptions) or ``"chip"`` (the rates it
        reaches; None keeps the chip's), with gradient buckets of ``bucket_mb`` MiB, the framework's
        ``fusion``, ``grad_reduce`` and ``attention_kernel`` (each None keeps the chip's)."""
        check_model(model)
        hw = self if model is None else replace(self, book=model == "book")
        for flag, value, choices in (("--fusion", fusion, FUSIONS), ("--grad-reduce", grad_reduce, GRAD_REDUCES)):
            if value is not None and value not in choices:
                raise ShardcError(f"{flag} {clip(repr(value))}: unknown", fix="use one of " + ", ".join(choices))
        if fusion is not None or grad_reduce is not None:
            hw = replace(hw, fusion=fusion or hw.fusion, grad_reduce=grad_reduce or hw.grad_reduce)
        if attention_kernel is not None:
            if attention_kernel not in ATTENTION_KERNELS:
                raise ShardcError(f"--attention-kernel {clip(repr(attention_kernel))}: unknown",
                                  fix="use one of " + ", ".join(ATTENTION_KERNELS))
            hw = hw.with_attention(attention_kernel)
        if bucket_mb is not None:
            if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, int | float) or not bucket_mb > 0 \
                    or not math.isfinite(bucket_mb):
                raise ShardcError(f"--bucket-mb {clip(repr(bucket_mb))}: must be a positive number of MiB",
                                  fix="write e.g. --bucket-mb 25 (PyTorch DDP's default)")
            hw = replace(hw, bucket_bytes=float(bucket_mb) * 2**20)
        if param_gather is not None:
            if param_gather not in PARAM_GATHERS:
                raise ShardcError(f"--param-gather {clip(repr(param_gather))}: unknown",
                                  fix="use one of " + ", ".join(PARAM_GATHERS))
            hw = replace(hw, param_gather=param_gather)
        return hw


def interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    """The fraction of ``points`` (x rising, fraction) at ``x``: linear in log x between two points,
    flat beyond the first and last."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + t * (y1 - y0)
    return points[-1][1]


MODELS = ("chip", "book")


def check_model(model: object) -> None:
    """``None``, ``"chip"`` (the chip's measured rates) or ``"book"`` (the book's assumptions)."""
    if model is not None and model not in MODELS:
        raise ShardcError(f"unknown cost model {clip(repr(model))}", fix="use model='chip' or model='book'")
