"""The measured rates of the chips' kernels: each preset's matmul curve (fraction of peak by a matmul's
FLOPs), its fused attention kernels' forward and backward (fraction of peak by the keys a call
attends over), the share of its HBM bandwidth its memory-bound kernels reach (elementwise kernels, and
matmuls whose bytes outlast their FLOPs), and the share of its links' figures its collectives reach (NCCL's
rings and NVLink SHARP inside a node, an InfiniBand rail across) with the cores they hold, each from a cited
published measurement.  :mod:`shardc.hardware` builds its presets on them;
:meth:`shardc.hardware.Hardware.efficiency` and :meth:`shardc.hardware.Hardware.attention_seconds` interpolate them.
"""

from __future__ import annotations

import math

__all__ = ["GPU_HBM_SHARE", "GPU_MATMUL_HBM_SHARE",
           "H100_MATMULS", "HOPPER_F8_MATMULS", "B200_MATMULS", "A100_MATMULS", "TPU_MATMULS",
           "H100_ATTENTION_FORWARD", "H100_ATTENTION_BACKWARD", "A100_ATTENTION_FORWARD", "A100_ATTENTION_BACKWARD",
           "B200_ATTENTION_FORWARD", "B200_ATTENTION_BACKWARD", "KERNELS", "NCCL_H100", "NCCL_A100", "NCCL_B200",
           "NVLINK_H800", "NVLS_H100", "NVLS_H800", "NVLS_B200", "NCCL_NDR", "NCCL_HDR", "NCCL_CHANNELS", "DEEPEP_SMS"]


def _points(peak: float, measured: tuple[tuple[int, int, int, int, float], ...]) -> tuple[tuple[float, float], ...]:
    """(FLOPs, fraction of ``peak``) of measured matmuls given as (batch, m, n, k, achieved FLOPs/s)."""
    return tuple(sorted((2.0 * b * m * n * k, rate / peak) for b, m, n, k, rate in measured))


def _averaged(peak: float, classes: tuple[tuple[tuple[int, int, int, int, float], ...], ...]
              ) -> tuple[tuple[float, float], ...]:
    """One point a class of measured matmuls (batch, m, n, k, FLOPs/s): their FLOPs' geometric mean and
    the mean of their fractions of ``peak``.  A table whose rows at one m span several times the FLOPs
    with rates tens of percent apart by n and k has no single curve in FLOPs; its mean per m has."""
    out = []
    for rows in classes:
        flops = [2.0 * b * m * n * k for b, m, n, k, _ in rows]
        out.append((math.exp(math.fsum(map(math.log, flops)) / len(flops)),
                    math.fsum(rate for *_, rate in rows) / (len(rows) * peak)))
    return tuple(sorted(out))


# H100 SXM (sm_90), bf16, measured by the OpenXLA authors: the default matmul performance table of XLA's
# GPU cost model (xla/service/gpu/model/matmul_interpolator_data.h, "sm_90", bf16xbf16->bf16 entries).
# The same die (GH100) runs the H200 and the H800.
H100_MATMULS = _points(9.89e14, ((1, 256, 512, 256, 1.1459846994535e13), (1, 1024, 1024, 512, 1.45572373101952e14),
                                  (4, 1024, 1024, 1024, 4.89845722627737e14), (1, 2048, 2048, 2048, 6.3198459329017e14),
                                  (1, 4096, 4096, 4096, 7.83328793548203e14),
                                  (2, 4096, 4096, 4096, 8.0767101419194e14)))
# H800 (GH100, the H100's die), fp8 with DeepSeek-V3's fine-grained scaling (1x128 and 128x128 blocks,
# partial sums promoted on the CUDA cores): DeepGEMM's README (github.com/deepseek-ai/DeepGEMM, "Performance",
# NVCC 12.8), every shape of DeepSeek-V3's layers: its normal GEMMs at M = 64, 128 and 4096, and its grouped
# GEMMs for MoE (contiguous layout, as a training forward runs them) with 4096 or 8192 rows a group, averaged
# by M (:func:`_averaged`) over the 1,979 TFLOPS dense fp8 peak.  Large fp8 matmuls reach 56% of it where
# bf16 ones reach 80% of theirs.
HOPPER_F8_MATMULS = _averaged(1.979e15, (
    ((1, 64, 2112, 7168, 206e12), (1, 64, 24576, 1536, 289e12), (1, 64, 32768, 512, 219e12),
     (1, 64, 7168, 16384, 336e12), (1, 64, 4096, 7168, 287e12), (1, 64, 7168, 2048, 295e12)),
    ((1, 128, 2112, 7168, 352e12), (1, 128, 24576, 1536, 535e12), (1, 128, 32768, 512, 358e12),
     (1, 128, 7168, 16384, 645e12), (1, 128, 4096, 7168, 533e12), (1, 128, 7168, 2048, 510e12)),
    ((1, 4096, 2112, 7168, 1058e12), (1, 4096, 24576, 1536, 990e12), (1, 4096, 32768, 512, 590e12),
     (1, 4096, 7168, 16384, 1358e12), (1, 4096, 4096, 7168, 1304e12), (1, 4096, 7168, 2048, 1025e12),
     (4, 8192, 4096, 7168, 1297e12), (4, 8192, 7168, 2048, 1099e12), (8, 4096, 4096, 7168, 1288e12),
     (8, 4096, 7168, 2048, 1093e12))))
# B200 (sm_100), bf16, the same XLA table ("sm_100" entries of xla/backends/gpu/cost_model/
# matmul_interpolator_data.h), over the HGX B200's dense bf16 peak.
B200_MATMULS = _points(2.25e15, ((1, 256, 256, 256, 6.765006451612e12), (1, 512, 512, 512, 4.8480306303052e13),
                                  (1, 1024, 1024, 4096, 6.75256237088279e14),
                                  (1, 2048, 2048, 2048, 9.85762519164562e14),
                                  (1, 4096, 4096, 4096, 1.416867213789406e15)))
# A100 SXM: two measurements of large matmuls, averaged as one class (:func:`_averaged`): the maximum achievable
# matmul FLOPs of Stas Bekman's ml-engineering (compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS
# comparison table": 267.9 TFLOPS, the best shape of a search, 6912x16384x2048, the fastest of 100 runs, CUDA
# 12.1), and cuBLAS on 8192^3 with normally distributed inputs, 257 TFLOPS (Horace He, "Strangely, Matrix
# Multiplications on GPUs Run Faster When Given 'Predictable' Data", thonking.ai, 2024: the A100 holds its
# 400 W limit by lowering its clock, more so on random data than on the zeros or integers benchmarks often
# use, as a training step's data is).  Their mean is 84.2% of 312 TFLOPS.
A100_MATMULS = _averaged(3.12e14, (((1, 6912, 16384, 2048, 2.679e14), (1, 8192, 8192, 8192, 2.57e14)),))
# TPU v5e, bf16: XLA's jnp.matmul in the JAX Pallas TPU matmul guide (docs/pallas/tpu/matmul.ipynb, "XLA
# matmul": 4096^3 84.33%, 8192^3 92.30% of 197 TFLOPS).  Its 1024^3 point (9.1%) times one Python dispatch
# per matmul, which a compiled training step does not pay, so it is left out.  No such measurement of
# v4, v5p or v6e is cited (Cloud TPU's pages and the TPU v4 paper give peaks, MaxText and PaLM whole-model
# MFU); they use v5e's (the same 128x128 MXU design, v6e's 256x256).  benchmarks/fidelity.py's v4 and v5p
# runs come out 12-15% fast with it, their compute at 92% of peak where the published MFU implies about 78%.
TPU_MATMULS = _points(1.97e14, ((1, 4096, 4096, 4096, 1.6613153396399134e14),
                                 (1, 8192, 8192, 8192, 1.8182317539503744e14)))


def _kernel(peak: float, measured: tuple[tuple[int, float], ...]) -> tuple[tuple[float, float], ...]:
    """(keys, fraction of ``peak``) of a fused attention kernel measured as (sequence length, FLOPs/s), its
    FLOPs counted as FlashAttention's benchmarks count them (4 B S^2 N H a forward, halved where causal, the
    backward 2.5 times the forward): the count :mod:`shardc.ops.attention_cost` prices."""
    return tuple((float(keys), rate / peak) for keys, rate in measured)


# The attention kernel each GPU preset runs: the fastest widely available one for the chip, head dim 128.
# H100 SXM: FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608, section 4.1, the figures "Attention forward
# speed, head dim 128 (H100 80GB SXM5)", causal, and "Attention backward speed, head dim 128", the paper's
# backward figures being without the mask), TFLOP/s by sequence length 512..16k, batch x length 16k tokens;
# at 1k and over it is ahead of cuDNN's, at 512 within 8% of it (cuDNN 315 forward, 305 backward).  The H200 and
# the H800 run the same die and kernel.
H100_ATTENTION_FORWARD = _kernel(9.89e14, ((512, 292e12), (1024, 423e12), (2048, 521e12), (4096, 579e12),
                                            (8192, 602e12), (16384, 616e12)))
H100_ATTENTION_BACKWARD = _kernel(9.89e14, ((512, 316e12), (1024, 424e12), (2048, 501e12), (4096, 542e12),
                                             (8192, 559e12), (16384, 561e12)))
# A100 SXM: FlashAttention-2 with the causal mask a training step runs, head dim 128, 32 heads, 16K tokens at
# 1K and 4K at 4K: 143.70 and 156.27 TFLOP/s forward (liangan1/GPU_travel, performance/flash-attn/README.md,
# flash-attention's CUDA kernels on SM80; the same repository measures the A100's clock falling from 1410 to
# about 1200 MHz under its power limit as the kernel runs, as it does through a training step).  FlashAttention-2's
# paper (Dao 2023, arXiv 2307.08691, sections 1 and 4.1) gives its best settings only ("up to 73% of the
# theoretical max throughput in the forward pass, and up to 63% ... in the backward pass": long sequences, no
# mask), so the backward is the measured forward times that ratio, 63/73, as no causal backward on A100 is cited.
A100_ATTENTION_FORWARD = _kernel(3.12e14, ((1024, 143.70e12), (4096, 156.27e12)))
A100_ATTENTION_BACKWARD = tuple((keys, fraction * 63 / 73) for keys, fraction in A100_ATTENTION_FORWARD)
# B200 (sm_100): FlashAttention-4, the CuTe DSL kernel of the flash-attention repository (Dao-AILab/
# flash-attention pull request 2280, its benchmark: head dim 128, causal, sequence length 8192, batch 4):
# forward 1418.1 TFLOP/s, backward 1208.6 (the 2-CTA path), over the HGX B200's dense bf16 peak.
B200_ATTENTION_FORWARD = _kernel(2.25e15, ((8192, 1418.1e12),))
B200_ATTENTION_BACKWARD = _kernel(2.25e15, ((8192, 1208.6e12),))
# TPUs: no published per-chip measurement of the Pallas flash or splash attention kernels is cited, so their
# attention runs at the matmul rate (no attention points).
# FlashAttention-2 on Hopper, head dim 128, causal: from 4K to 64K tokens PyTorch's SDPA (its flash backend,
# FlashAttention-2) as NVIDIA's cudnn-frontend measured it on the H100's compute (benchmark/benchmark_results.csv
# and its README, clocks locked at 1980 MHz, 16 heads, bf16, causal rows): forward 314-345 TFLOP/s, backward
# 249-323.  Below 4K the FlashAttention-3 paper's FlashAttention-2 bars (its figures named above): causal
# forward; its backward bars are without the mask, so they are taken at the causal share of the no-mask
# backward the cudnn-frontend rows measure at 4K (248.76 / 287.36).
CAUSAL_BACKWARD_SHARE = 248.76 / 287.36
H100_FLASH2_FORWARD = _kernel(9.89e14, ((512, 191e12), (1024, 260e12), (2048, 298e12), (4096, 314.06e12),
                                         (8192, 325.14e12), (16384, 324.77e12), (32768, 345.30e12),
                                         (65536, 342.65e12)))
H100_FLASH2_BACKWARD = _kernel(9.89e14, ((512, 214e12 * CAUSAL_BACKWARD_SHARE),
                                          (1024, 260e12 * CAUSAL_BACKWARD_SHARE),
                                          (2048, 291e12 * CAUSAL_BACKWARD_SHARE), (4096, 248.76e12),
                                          (8192, 277.44e12), (16384, 305.18e12), (32768, 317.28e12),
                                          (65536, 323.16e12)))
HOPPER_KERNELS = {"flash3": (H100_ATTENTION_FORWARD, H100_ATTENTION_BACKWARD),
                   "flash2": (H100_FLASH2_FORWARD, H100_FLASH2_BACKWARD)}
# The attention kernels a preset has measured rates of, by the `attention_kernel` line's name: (forward,
# backward) points as attention_forward and attention_backward take them; the first is the preset's own.
KERNELS: dict[str, dict[str, tuple[tuple[tuple[float, float], ...], tuple[tuple[float, float], ...]]]] = {
    "h100": HOPPER_KERNELS, "h200": HOPPER_KERNELS, "h800": HOPPER_KERNELS,
    "a100": {"flash2": (A100_ATTENTION_FORWARD, A100_ATTENTION_BACKWARD)},
    "b200": {"flash4": (B200_ATTENTION_FORWARD, B200_ATTENTION_BACKWARD)},
}


# GPUs, memory-bound kernels, as measured on A100: the FlashAttention paper's benchmark of standard attention (Dao et
# al. 2022, arXiv 2205.14135, appendix E.6: one A100 40GB, FP16, batch 16, 8 heads of dim 64, random Q, K and V;
# Tables 15 and 18, "PyTorch Attention", no mask, at sequence length 2048: 6.56 ms forward with dropout 0.1, 4.32 ms
# without). The run is eager PyTorch: a batched matmul writes the 16 x 8 x 2048 x 2048 scores, a softmax reads them
# and writes the probabilities, a dropout reads those and writes its output and a mask of bools, a batched matmul
# reads them with V.  The two forwards differ by the dropout alone (5 bytes an element of the scores: FP16 in, FP16
# out, a 1-byte mask) over 2.24 ms, which gives the share of the HBM bandwidth (1,555 GB/s, the A100 40GB data sheet)
# an elementwise pass reaches; the softmax (4 bytes an element) at that share leaves the two batched matmuls the rest
# of 4.32 ms for their bytes (each reads or writes the scores' 2 bytes an element, and Q and K, or V and the output:
# 33.6 MB each), which gives the share a matmul reaches whose bytes outlast its FLOPs (at the large-matmul rate each
# would take 0.26 ms, not 1.26): a head dim of 64 or 128 against 2048 keys is such a matmul.  The A100 80GB's HBM2e
# (2,039 GB/s) is taken to reach the same shares, no such measurement of it being cited.  The same tables' backward
# (Tables 16 and 19: softmax's backward, a dropout's, four batched matmuls) is a held-out check of both shares
# (tests/test_memory_rates.py).  Hopper (H100, H200, H800) takes the same shares: they predict the FlashAttention-3
# paper's standard attention forward on H100 SXM5 (Shah et al. 2024, arXiv 2407.08608, section 4.1, its figures
# "Attention forward speed, head dim 64" and "head dim 128", without the mask: 16K tokens a call, 2048 hidden, 52-73
# and 74-139 TFLOP/s from 512 to 8K tokens) at 0.80-1.04 of the measured time from 1K tokens on (0.84 and 0.67 at
# 512), where the data sheet's 3.35 TB/s gives 0.43-0.69; the H200's HBM3e is taken to reach them too, unmeasured.
# No such measurement of the B200 is cited.
_FA_SCORES = 16 * 8 * 2048 * 2048  # elements of the scores
_FA_QKV = 16 * 8 * 2048 * 64 * 2  # bytes of Q, K, V or the output
_A100_40GB_HBM = 1.555e12
GPU_HBM_SHARE = 5 * _FA_SCORES / ((6.56e-3 - 4.32e-3) * _A100_40GB_HBM)
_FA_SOFTMAX_S = 4 * _FA_SCORES / (GPU_HBM_SHARE * _A100_40GB_HBM)
GPU_MATMUL_HBM_SHARE = 2 * (2 * _FA_SCORES + 2 * _FA_QKV) / ((4.32e-3 - _FA_SOFTMAX_S) * _A100_40GB_HBM)


# --- Collectives: the share of a link figure each reaches, and the cores it holds ---

# NCCL's measured AllReduce bus bandwidth inside an 8xH100 node, SHARP off, is close to 370 GB/s of
# NVLink's 450 GB/s each way ("How To Scale Your Model", the GPU chapter, its empirical AllReduce
# figure); the H200 has the same NVLink 4 and NVSwitch
NCCL_H100 = 370e9 / 450e9
# 8 A100 SXM over NVSwitch 2 (NVLink 3, 300 GB/s each way): AllReduce bus bandwidth "should reach 230 GB/s"
# at 8 GB, 12 links at 25 GB/s line rate each carrying about 20 GB/s of 128-byte payloads, 240 GB/s, less
# other bottlenecks (an NCCL maintainer, NVIDIA/nccl-tests issue 149); 232.5 GB/s measured on one node
# (NVIDIA/nccl-tests issue 175).  No NVLS on A100, so every in-node collective runs at this ring rate
NCCL_A100 = 230e9 / 300e9


def _nvls_share(bus_bandwidth: float, gpus: int, link: float) -> float:
    """The share of a GPU's NVLink egress ``link`` that NVLink SHARP reaches, from the AllReduce bus
    bandwidth nccl-tests reports for it on ``gpus`` GPUs of a node.

    nccl-tests reports busbw = algbw * 2(n-1)/n whatever the algorithm (its PERFORMANCE.md).  With
    NVLS each GPU sends all V into the switches' reducing loads and its reduced 1/n to their multicast
    store, and takes as much back: V (n+1)/n each way, so the links run at algbw * (n+1)/n.
    """
    algbw = bus_bandwidth * gpus / (2 * (gpus - 1))
    return algbw * (gpus + 1) / gpus / link


# AllReduce with NVLink SHARP (NVLS, NCCL's default on an NVSwitch 3 node): 480 GB/s bus bandwidth on
# 8 H100 (NVIDIA's GTC talk S62129, as quoted in NVIDIA/nccl issue 1374; 476 GB/s measured
# "looks to be in the expected range for H100", an NCCL maintainer, NVIDIA/nccl-tests issue 290), so
# 68.6% of the links; the H200 has the same NVLink 4 and NVSwitch.  The A100's NVSwitch 2 does not
# reduce (NVLS needs NVSwitch 3, Hopper and later).
NVLS_H100 = _nvls_share(480e9, 8, 450e9)
# 8 H800: 215 GB/s AllReduce bus bandwidth with NVLS (measured, NVIDIA/nccl issue 1374), 69.1% of 200 GB/s
NVLS_H800 = _nvls_share(215e9, 8, 200e9)
# H800 (8 NVLinks, 200 GB/s each way): DeepSeek's own measurement, 160 GB/s one way ("NVLink offers a bandwidth of
# 160 GB/s", DeepSeek-V3 technical report, arXiv 2412.19437, section 3.2.2; "400GB/s is the two-way theoretical
# figure, 160GB/s our one-way measurement", a DeepSeek author in deepseek-ai/DeepSeek-V3 issue 28; "the actual
# achievable bandwidth peaks at approximately 160GB/s", a DeepEP author in deepseek-ai/DeepEP issue 16), 80% of it
NVLINK_H800 = 160e9 / 200e9
# B200 (NVLink 5: 18 links, 50 GB/s each way): NCCL's own effective figure a link, 40.1 GB/s (NVIDIA/nccl
# src/graph/topo.h, SM100_NVLINK_BW: its Hopper figure, 20.6 of 25 GB/s a link over 18 links, is the 370 GB/s
# measured on H100; "maxBw 721.8" in the log of 8 B200, NVIDIA/nccl issue 1807); 8 B300 on the same NVLink 5
# measured 695 GB/s ring AllReduce bus bandwidth (NVIDIA/nccl issue 2140, benchmarks/collectives_fidelity.py)
NCCL_B200 = 40.1e9 / 50e9
# 8 B200 with NCCL 2.27: AllReduce "830+" GB/s bus bandwidth (NVIDIA/nccl issue 1807), above the 722 a ring can
# reach there, so NVLS, NCCL's default on an NVSwitch node; 8 B300 measured 845 with NVLS (issue 2140)
NVLS_B200 = _nvls_share(830e9, 8, 900e9)
# NCCL's share of an InfiniBand NIC's line rate, one rail a GPU: "For NDR @ 400Gbps you should see
# 46-48GB/s per NIC" (an NCCL maintainer, NVIDIA/nccl-tests issue 290, rings across nodes), 47 of 50 GB/s
NCCL_NDR = 47e9 / 50e9
# 200 Gb/s HDR: 24 GB/s a NIC ("~160GB/s intra-node and 24GB/s inter-node" at 8 GB, an NCCL
# maintainer, NVIDIA/nccl issue 412; a DGX A100's 8 HDR NICs measure 192 GB/s AllReduce bus bandwidth,
# NVIDIA/nccl issue 812), 24 of 25 GB/s
NCCL_HDR = 24e9 / 25e9
# The SMs NCCL holds while a collective runs: one CTA a channel, on an SM no compute kernel shares ("NCCL CTAs
# won't share an SM with compute kernels", an NCCL maintainer, NVIDIA/nccl issue 689), and a node of 8 GPUs
# over NVSwitch runs 24 channels: A100 ("Channel 00/24", the NCCL log in NVIDIA/nccl issue 578) and H100 (12
# rings found for 8 GPUs, duplicated to 24 channels, NCCL 2.19's log in NVIDIA/nccl issue 1367).  Across nodes
# alone NCCL holds fewer (16 SMs for a DGX's 8 NICs, issue 689); the node's 24 are used for every collective.
NCCL_CHANNELS = 24
# On the H800 (the H100's die, its 132 SMs) the one published figure: DeepSeek-V3's all-to-all kernels "only
# 20 SMs are sufficient to fully utilize the bandwidths of IB and NVLink" (DeepSeek-V3 technical report,
# arXiv 2412.19437, section 3.2.2); no NCCL log of an H800 node is cited
DEEPEP_SMS = 20
