"""The hardware presets (the chips' data-sheet figures, each cited beside its preset), the chip a name
picks, and checks of the spans a mesh's axes take on a chip.  What a chip is to the cost model, and a
user's own chip from a TOML file, are :mod:`shardc.chip_model`'s :class:`Hardware`.
"""

from __future__ import annotations

from collections.abc import Mapping

from shardc.chip_model import BUCKET_BYTES, MODELS, Hardware, check_model
from shardc.errors import ShardcError, clip
from shardc.ir.spec import Mesh, Network
from shardc.kernel_rates import (
    A100_ATTENTION_BACKWARD,
    A100_ATTENTION_FORWARD,
    A100_MATMULS,
    B200_ATTENTION_BACKWARD,
    B200_ATTENTION_FORWARD,
    B200_MATMULS,
    DEEPEP_SMS,
    GPU_HBM_SHARE,
    GPU_MATMUL_HBM_SHARE,
    H100_ATTENTION_BACKWARD,
    H100_ATTENTION_FORWARD,
    H100_MATMULS,
    HOPPER_F8_MATMULS,
    KERNELS,
    NCCL_A100,
    NCCL_B200,
    NCCL_CHANNELS,
    NCCL_H100,
    NCCL_HDR,
    NCCL_NDR,
    NVLINK_H800,
    NVLS_B200,
    NVLS_H100,
    NVLS_H800,
    TPU_MATMULS,
)

__all__ = ["Hardware", "PRESETS", "KERNELS", "DEFAULT", "BUCKET_BYTES", "MODELS", "check_model", "get_hardware",
           "default_spans", "check_spans", "check_hardware_arg"]

DEFAULT = "tpu-v5p"


# The host link (PCIe Gen5 x16 on H100, H200 and H800 SXM; Gen4 x16 on A100 SXM), one way, as NVIDIA's
# nvbandwidth measures pinned copies by the copy engines: 57 GB/s host to device on H100 (NVIDIA/nvbandwidth
# issue 6), 52.8 GB/s device to host on 8 H100s (issue 24), the slower taken; 25.1 GB/s host to device on
# A100-SXM4 (issue 42).  TPU hosts and B200 have no figure cited here.
_HOST_PCIE5 = 5.28e10
_HOST_PCIE4 = 2.51e10

# Adam on the host's CPU, as ZeRO-Offload runs it (DeepSpeed's CPU-Adam, AVX-512, fp32): Ren et al. 2021,
# "ZeRO-Offload: Democratizing Billion-Scale Model Training" (arXiv 2101.06840), its evaluation's table of Adam
# latency: CPU-Adam 2.57 s for 10 billion parameters on a DGX-2's host (two 24-core Xeon Platinum 8168), 3.9e9
# params/s for the whole host.  A node's GPUs share it (each process updates its own shard on its share of the
# cores), so a GPU of an 8-GPU node gets an eighth; the newer hosts of H100/H200/H800 nodes are taken at the
# paper's rate (no measured figure cited here).
_HOST_ADAM = 1e10 / 2.57
_HOST_ADAM_8 = _HOST_ADAM / 8

PRESETS: dict[str, Hardware] = {
    h.name: h
    for h in (
        # TPU C, ICI, HBM: the book's table ("How To Scale Your Model", chapter 2); DCN 6.25e9 a chip is the
        # book's v5p figure.  No TPU before v7 has an fp8 matrix unit (JAX's Pallas TPU info,
        # jax/_src/pallas/mosaic/tpu_info.py: fp8 "Not Available" on v4, v5e and v5p, v6e's fp8 rate
        # equal to its bf16 rate), so f8 runs at C.
        # TPU v3 (Cloud TPU's v3 page; Jouppi et al. 2020, CACM): 123 TFLOPS bf16 and 32 GiB at 900 GB/s a chip (two
        # cores of 16 GiB, each its own JAX device: a mesh here counts chips), pods of 1024 on a 2D torus, 32x32 (the
        # book's table: ICI 1e11 a link one way; its 1.4e14 FLOP/s is not the data sheet's).  No v3 DCN figure is
        # published: the book's v5p one, as on v4p.  A slice wraps a full 32-chip axis only (the book's 2D-torus rule).
        Hardware("tpu-v3", 1.23e14, 1e11, 32 * 2**30, 9e11, 6.25e9, description="TPU v3, 2D torus, 2 cores a chip",
                 torus_side=32, torus_dims=2, matmul_efficiency=TPU_MATMULS),
        Hardware("tpu-v4p", 2.75e14, 4.5e10, 32e9, 1.2e12, 6.25e9, description="TPU v4p, 3D torus",
                 torus_side=16, torus_dims=3, matmul_efficiency=TPU_MATMULS),
        # DCN: Cloud TPU's v5e page, 6.4 Tbps of data-center network a 256-chip pod (2 x 100 Gbps NICs a
        # host of 8 chips): 25 Gbps = 3.125e9 bytes/s a chip
        Hardware("tpu-v5e", 1.97e14, 4.5e10, 16e9, 8.1e11, 3.125e9, description="TPU v5e, 2D torus",
                 torus_side=16, torus_dims=2, matmul_efficiency=TPU_MATMULS),
        Hardware("tpu-v5p", 4.59e14, 9e10, 96e9, 2.8e12, 6.25e9, description="TPU v5p, 3D torus",
                 torus_side=16, torus_dims=3, matmul_efficiency=TPU_MATMULS),
        # DCN: Cloud TPU's v6e page, 25.6 Tbps a 256-chip pod (4 x 200 Gbps NICs a host of 8 chips):
        # 100 Gbps = 1.25e10 bytes/s a chip
        Hardware("tpu-v6e", 9.2e14, 9e10, 32e9, 1.64e12, 1.25e10, description="TPU v6e, 2D torus",
                 torus_side=16, torus_dims=2, matmul_efficiency=TPU_MATMULS),
        # GPUs: ici_bandwidth is half the data sheet's total bidirectional NVLink figure (H100 900 GB/s),
        # dcn_bandwidth the node's InfiniBand NIC a GPU (DGX H100: 8 ConnectX-7 at 400 Gb/s = 5e10 B/s).
        # H100 SXM data sheet: 989 TFLOPS bf16 and 1,979 fp8 dense (half the sparsity figures), 80 GB, 3.35 TB/s.
        Hardware("h100", 9.89e14, 4.5e11, 80e9, 3.35e12, 5e10, ici_domain=8, ici_efficiency=NCCL_H100,
                 nvls_efficiency=NVLS_H100, dcn_efficiency=NCCL_NDR, host_bandwidth=_HOST_PCIE5,
                 host_adam_rate=_HOST_ADAM_8,
                 description="H100 SXM: NVLink within a node of 8, InfiniBand across",
                 flops_f8=1.979e15, matmul_efficiency=H100_MATMULS, matmul_efficiency_f8=HOPPER_F8_MATMULS,
                 attention_forward=H100_ATTENTION_FORWARD, attention_backward=H100_ATTENTION_BACKWARD,
                 hbm_efficiency=GPU_HBM_SHARE, matmul_hbm_efficiency=GPU_MATMUL_HBM_SHARE,
                 sms=132, collective_sms=NCCL_CHANNELS),  # 132 SMs: NVIDIA's H100 architecture whitepaper, SXM5
        # H200 data sheet: the H100's compute (its 132 SMs) with 141 GB of HBM3e at 4.8 TB/s
        Hardware("h200", 9.89e14, 4.5e11, 141e9, 4.8e12, 5e10, ici_domain=8, ici_efficiency=NCCL_H100,
                 nvls_efficiency=NVLS_H100, dcn_efficiency=NCCL_NDR, host_bandwidth=_HOST_PCIE5,
                 host_adam_rate=_HOST_ADAM_8,
                 description="H200: an H100 with 141 GB HBM3e", flops_f8=1.979e15, matmul_efficiency=H100_MATMULS,
                 matmul_efficiency_f8=HOPPER_F8_MATMULS, attention_forward=H100_ATTENTION_FORWARD,
                 attention_backward=H100_ATTENTION_BACKWARD, hbm_efficiency=GPU_HBM_SHARE,
                 matmul_hbm_efficiency=GPU_MATMUL_HBM_SHARE,
                 sms=132, collective_sms=NCCL_CHANNELS),
        # A100 80GB SXM data sheet: 312 TFLOPS bf16 dense, no fp8, 2,039 GB/s HBM2e, NVLink 600 GB/s in all;
        # DGX A100: 8 ConnectX-6 HDR InfiniBand at 200 Gb/s, one a GPU (2.5e10 B/s)
        Hardware("a100", 3.12e14, 3e11, 80e9, 2.039e12, 2.5e10, ici_domain=8, ici_efficiency=NCCL_A100,
                 dcn_efficiency=NCCL_HDR, host_bandwidth=_HOST_PCIE4, host_adam_rate=_HOST_ADAM_8,
                 description="A100 SXM 80 GB: NVLink within a node of 8, HDR InfiniBand across",
                 matmul_efficiency=A100_MATMULS, attention_forward=A100_ATTENTION_FORWARD,
                 attention_backward=A100_ATTENTION_BACKWARD, hbm_efficiency=GPU_HBM_SHARE,
                 matmul_hbm_efficiency=GPU_MATMUL_HBM_SHARE,
                 sms=108, collective_sms=NCCL_CHANNELS),  # 108 SMs: NVIDIA's A100 architecture whitepaper
        # H800 SXM: the H100's die and HBM with NVLink cut to 400 GB/s in all, at the 160 GB/s one way DeepSeek
        # measured (NVLINK_H800); InfiniBand 50 GB/s a GPU (DeepSeek-V3 technical report, section 3.2.2: "IB
        # (50 GB/s)"), a 400 Gb/s NDR NIC at NCCL's share.  DeepEP's dispatch and combine on 8 to 64 H800s are
        # benchmarks/collectives_fidelity.py's check of both.  NCCL's channels on its fewer NVLinks are not cited,
        # so the SMs a collective holds are DeepSeek's all-to-all kernels' (DEEPEP_SMS); the B200's are not cited
        Hardware("h800", 9.89e14, 2e11, 80e9, 3.35e12, 5e10, ici_domain=8, ici_efficiency=NVLINK_H800,
                 nvls_efficiency=NVLS_H800, dcn_efficiency=NCCL_NDR, host_bandwidth=_HOST_PCIE5,
                 host_adam_rate=_HOST_ADAM_8,
                 description="H800 SXM: an H100 with 400 GB/s NVLink", flops_f8=1.979e15,
                 matmul_efficiency=H100_MATMULS, matmul_efficiency_f8=HOPPER_F8_MATMULS,
                 attention_forward=H100_ATTENTION_FORWARD, attention_backward=H100_ATTENTION_BACKWARD,
                 hbm_efficiency=GPU_HBM_SHARE, matmul_hbm_efficiency=GPU_MATMUL_HBM_SHARE,
                 sms=132, collective_sms=DEEPEP_SMS),
        # NVLink 5 at NCCL's own effective figure a link (NCCL_B200), AllReduce with NVLS at the rate measured on
        # 8 B200 (NVLS_B200)
        # HGX B200 data sheet, a GPU: FP16/BF16 4.5 PFLOPS and FP8 9 PFLOPS with sparsity (dense half),
        # 180 GB HBM3e at 7.7 TB/s, NVLink 5 1.8 TB/s in all; DGX B200: 8 ConnectX-7 at 400 Gb/s
        Hardware("b200", 2.25e15, 9e11, 180e9, 7.7e12, 5e10, ici_domain=8, ici_efficiency=NCCL_B200,
                 nvls_efficiency=NVLS_B200, dcn_efficiency=NCCL_NDR,
                 description="B200 (HGX): NVLink 5 within a node of 8, InfiniBand across", flops_f8=4.5e15,
                 matmul_efficiency=B200_MATMULS, attention_forward=B200_ATTENTION_FORWARD,
                 attention_backward=B200_ATTENTION_BACKWARD),
    )
}

def get_hardware(name: str) -> Hardware:
    """A preset by name (case-insensitive, ``_`` or ``-``); the error lists the presets."""
    key = name.strip().lower().replace("_", "-")
    if key in PRESETS:
        return PRESETS[key]
    raise ShardcError(f"unknown hardware {name!r}",
                      fix="use one of " + ", ".join(PRESETS) + ", or --hardware-file chip.toml")


def default_spans(mesh: Mesh, hw: Hardware, sizes: dict[str, int] | None = None) -> dict[str, int]:
    """Each ICI mesh axis's torus axes on this chip (:meth:`Hardware.spans`); DCN axes have none."""
    given = sizes or {}
    return {a.name: hw.spans(given.get(a.name, a.size)) for a in mesh.axes if a.network is not Network.DCN}


def check_spans(mesh: Mesh, spans: Mapping[str, int] | None) -> None:
    """Spans given over the chip's defaults: each names a mesh axis and is a whole number >= 1 (not a
    boolean) of physical axes of 2 chips or more, so at most log2 of the axis's devices.

    The one check of spans: the CLI's ``--spans``, the planner, ``cost`` and the formulas call it.
    """
    for axis, k in (spans or {}).items():
        if axis not in mesh.names:
            raise ShardcError(f"--spans {clip(str(axis))}: not a mesh axis", fix="use one of " + ", ".join(mesh.names))
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ShardcError(f"--spans {axis}={clip(repr(k))}: must be a whole number >= 1",
                              fix="write e.g. --spans X=3")
        size = mesh.axis(axis).size
        if k > 1 and 2 ** min(k, 64) > size:
            raise ShardcError(f"--spans {axis}={clip(str(k))}: an axis of {size} chips spans at most "
                              f"{max(1, size.bit_length() - 1)} physical axes (each has 2 chips or more)",
                              fix=f"write e.g. --spans {axis}=1")


def check_hardware_arg(hardware: object) -> None:
    """``None``, a preset name or a :class:`shardc.hardware.Hardware`."""
    if hardware is None or isinstance(hardware, Hardware):
        return
    if not isinstance(hardware, str):
        raise TypeError(f"hardware must be a preset name, a Hardware or None, not {type(hardware).__name__}")
    if not hardware.strip():
        raise ShardcError("hardware is an empty name", fix="name a preset (see `shardc hardware`), or pass None")
