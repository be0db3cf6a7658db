"""Collective times shardc predicts beside published measurements: the bus bandwidth nccl-tests reports.

nccl-tests reports, for a collective of ``size`` bytes taking ``time``, the algorithm bandwidth
``size / time`` and the bus bandwidth, which is what one link carries and so comparable across
GPU counts: ``algbw * (n-1)/n`` for AllGather and ReduceScatter, ``algbw * 2(n-1)/n`` for AllReduce
(nccl-tests' PERFORMANCE.md).  Each row here is one such collective over the GPUs of one H100 node
(a mesh axis of 8 on the 1x8 cluster), timed by :func:`shardc.collectives.collective_time` as
``shardc cost`` times it, turned into a bus bandwidth the same way, beside the published figure:

- ring collectives inside an 8xH100 node reach about 370 GB/s bus bandwidth, NVLink's 450 GB/s
  line rate less NCCL's protocol overhead: "you can observe [it] as BusBw when running
  non-allreduce operations, or when running with NCCL_ALGO=RING" (an NCCL maintainer,
  NVIDIA/nccl-tests issue 212); the book's own 8xH100 AllReduce with SHARP off reaches the same
  ("How To Scale Your Model", the GPU chapter);
- an AllReduce with NVLink SHARP (NVLS, NCCL's default on an H100 node) reaches about 480 GB/s bus
  bandwidth at large sizes (the same answer; NVIDIA's GTC talk S62129); shardc's preset takes
  its NVLS rate from that figure, so the rows of other GPU counts check the model's (n+1)/n traffic:
  with NCCL_ALGO=NVLS on 2 to 8 GPUs of an H100 node the bus bandwidth at 2-4 GB is 365-370 GB/s up
  to 4 GPUs (NCCL keeps the ring's rate there), then 420, 440, 460 and 480 GB/s (NVIDIA/nccl issue
  1455);
- across two nodes (16 GPUs) a ring's bus bandwidth is bounded by the nodes' 8 InfiniBand NICs, each
  carrying one ring's share: 46-48 GB/s a 400 Gb/s NDR NIC (an NCCL maintainer, NVIDIA/nccl-tests
  issue 290), so about 8 x 47 = 376 GB/s.  That row is derived from the per-NIC figure, not a
  published run;
- inside an 8xA100 node (NVLink 3, 300 GB/s each way, no NVLink SHARP) NCCL reaches about 230 GB/s
  bus bandwidth at large sizes (an NCCL maintainer, NVIDIA/nccl-tests issue 149; 232.5 GB/s measured
  in NVIDIA/nccl-tests issue 175), for every collective as all run as rings there;
- 8 H800 (NVLink cut to 200 GB/s each way): AllReduce with NVLS 215 GB/s (NVIDIA/nccl issue 1374), the figure
  the preset's NVLS rate is taken from; and DeepEP's MoE dispatch and combine (deepseek-ai/DeepEP's README,
  "Normal kernels with NVLink and RDMA forwarding", H800 with a 400 Gb/s CX7 NIC a GPU: DeepSeek-V3's setting,
  4096 tokens of 7168, top-8 of 256 experts in at most 4 node groups, FP8 dispatch, BF16 combine).  DeepEP
  reports a "bottleneck bandwidth": the bytes its test counts over the time, a token once for each GPU
  (inside a node) or node (across, over RDMA) it goes to, its own GPU's or node's included (tests/
  test_intranode.py and test_internode.py); the rows take that count's expectation under its uniform routing
  over shardc's time for the same dispatch, as shardc prices an MoE dispatch (an AllToAll of k copies of each
  token, node-limited across nodes).  Across nodes (EP 16-64) they agree; inside one node shardc moves all 8
  copies a token where DeepEP sends one to each of the 5.3 GPUs it reaches, 1.5 times the bytes, at 160 GB/s
  where DeepEP's NVLink traffic runs at 134-138 (7/8 of its count: the rest stays on its GPU), so about 0.8;
- 8 B200 (NVLink 5): AllReduce with NVLS "830+" GB/s (NVIDIA/nccl issue 1807), the preset's NVLS figure; held
  out, 8 B300 on the same NVLink 5 and NVSwitch: 695 GB/s with rings, 845 with NVLS (NVIDIA/nccl issue 2140),
  beside the B200 preset's ring (NCCL's own 40.1 GB/s a link) and NVLS.

Run with ``python benchmarks/collectives_fidelity.py`` from the repository root.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's shardc, not an installed one

from shardc.collectives import Op, collective_time  # noqa: E402
from shardc.hardware import get_hardware  # noqa: E402
from shardc.ir.spec import Mesh, MeshAxis  # noqa: E402
from shardc.topology import resolve_links  # noqa: E402

RING_BUSBW = 370e9  # bytes/s: NCCL's ring collectives in an 8xH100 node (NVIDIA/nccl-tests issue 212)
TWO_NODE_BUSBW = 8 * 47e9  # bytes/s: 8 NDR NICs a node at 46-48 GB/s each (NVIDIA/nccl-tests issue 290)
A100_BUSBW = 230e9  # bytes/s: NCCL in an 8xA100 node (NVIDIA/nccl-tests issue 149)
NVLS_ALLREDUCE_BUSBW = 480e9  # bytes/s: AllReduce with NVLink SHARP on 8 H100 (GTC talk S62129)
# AllReduce bus bandwidth with NCCL_ALGO=NVLS on 2..8 GPUs of an H100 node, 2-4 GB (NVIDIA/nccl issue 1455)
NVLS_BY_GPUS = {2: 367e9, 3: 367e9, 4: 367e9, 5: 420e9, 6: 440e9, 7: 460e9, 8: 480e9}
H800_NVLS_BUSBW = 215e9  # bytes/s: AllReduce with NVLink SHARP on 8 H800 (NVIDIA/nccl issue 1374)
B200_NVLS_BUSBW = 830e9  # bytes/s: AllReduce on 8 B200, NCCL 2.27 (NVIDIA/nccl issue 1807)
B300_RING_BUSBW, B300_NVLS_BUSBW = 695e9, 845e9  # 8 B300, NVLS off and on (NVIDIA/nccl issue 2140)
# DeepEP's normal kernels on H800 (its README): GPUs, dispatch and combine bottleneck bandwidth, bytes/s
DEEPEP = ((8, 153e9, 158e9), (16, 43e9, 43e9), (32, 58e9, 57e9), (64, 51e9, 50e9))
TOKENS, HIDDEN, TOPK, EXPERTS, GROUPS_LIMIT = 4096, 7168, 8, 256, 4
FP8_BYTES = 1 + 4 / 128  # an FP8 element with its share of a 1x128 block's float scale, as DeepEP counts it
SIZES = (64 << 20, 256 << 20, 1 << 30, 4 << 30)  # 64 MB and up
GPUS = 8


@dataclass(frozen=True)
class Row:
    op: Op
    size: int  # bytes, as nccl-tests counts them (AllGather: the output; ReduceScatter: the input)
    published: float  # bus bandwidth, bytes/s
    predicted: float  # bus bandwidth from shardc's time
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.predicted / self.published


def bus_factor(op: Op, n: int) -> float:
    """nccl-tests' busbw / algbw: (n-1)/n, twice that for AllReduce."""
    return (2 if op is Op.ALL_REDUCE else 1) * (n - 1) / n


def predicted_busbw(op: Op, size: int, chip: str = "h100", gpus: int = GPUS) -> float:
    """The bus bandwidth of shardc's time for one collective of ``size`` bytes over ``gpus`` GPUs (one mesh
    axis, on the chip's usual cluster: one node up to 8, then whole nodes)."""
    hw = get_hardware(chip)
    mesh = Mesh((MeshAxis("X", gpus),))
    links, _ = resolve_links(mesh, {"X": gpus}, hw)
    seconds = collective_time(op, float(size), ("X",), mesh, {"X": gpus}, hw, links).seconds
    return size / seconds * bus_factor(op, gpus)


def _reached(groups: int, per_group: int) -> float:
    """Expected groups (GPUs or nodes) of ``per_group`` experts each that TOPK distinct experts drawn uniformly
    from ``groups`` of them reach."""
    total = groups * per_group
    return groups * (1 - math.comb(total - per_group, TOPK) / math.comb(total, TOPK))


def deepep_rows() -> list[Row]:
    """DeepEP's dispatch (FP8) and combine (BF16) on 8 to 64 H800s beside shardc's time for the same MoE
    dispatch, as DeepEP counts bandwidth: its bytes a GPU (a token once for each GPU it reaches inside one
    node, else once for each node, over RDMA) over the time."""
    hw = get_hardware("h800")
    out = []
    for gpus, *published in DEEPEP:
        nodes = gpus // 8
        limit = min(nodes, GROUPS_LIMIT)  # DeepEP's test: one expert group a node, min(nodes, 4) of them
        reached = _reached(8, EXPERTS // 8) if nodes == 1 else _reached(limit, EXPERTS // nodes)
        mesh = Mesh((MeshAxis("X", gpus),))
        links, _ = resolve_links(mesh, {"X": gpus}, hw)
        for (name, element), busbw in zip((("dispatch", FP8_BYTES), ("combine", 2.0)), published, strict=True):
            volume = gpus * TOPK * TOKENS * HIDDEN * element  # each GPU's k copies of its tokens, times the group
            routed = (TOPK, limit, nodes) if nodes > 1 else None
            seconds = collective_time(Op.ALL_TO_ALL, volume, ("X",), mesh, {"X": gpus}, hw, links, routed).seconds
            counted = TOKENS * reached * HIDDEN * element
            where = "NVLink" if nodes == 1 else "RDMA"
            out.append(Row(Op.ALL_TO_ALL, int(counted), busbw, counted / seconds,
                           f"DeepEP {name}, {gpus} H800 ({where}; its count, not bus bandwidth)"))
    return out


def rows() -> list[Row]:
    out = []
    for op in (Op.ALL_GATHER, Op.REDUCE_SCATTER):
        for size in SIZES:
            out.append(Row(op, size, RING_BUSBW, predicted_busbw(op, size), "ring"))
    out += [Row(Op.ALL_REDUCE, size, NVLS_ALLREDUCE_BUSBW, predicted_busbw(Op.ALL_REDUCE, size), "NVLink SHARP")
            for size in SIZES]
    out += [Row(Op.ALL_REDUCE, 2 << 30, busbw, predicted_busbw(Op.ALL_REDUCE, 2 << 30, gpus=gpus),
                f"{gpus} GPUs of a node, NVLS or ring") for gpus, busbw in NVLS_BY_GPUS.items()]
    out += [Row(op, 1 << 30, TWO_NODE_BUSBW, predicted_busbw(op, 1 << 30, gpus=2 * GPUS),
                "2 nodes, 16 GPUs; derived from the per-NIC figure")
            for op in (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_REDUCE)]
    out += [Row(op, size, A100_BUSBW, predicted_busbw(op, size, chip="a100"), "8 A100 in a node, ring")
            for op in (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_REDUCE) for size in (1 << 30, 4 << 30)]
    out.append(Row(Op.ALL_REDUCE, 4 << 30, H800_NVLS_BUSBW, predicted_busbw(Op.ALL_REDUCE, 4 << 30, chip="h800"),
                   "8 H800 in a node, NVLink SHARP"))
    out += deepep_rows()
    out.append(Row(Op.ALL_REDUCE, 4 << 30, B200_NVLS_BUSBW, predicted_busbw(Op.ALL_REDUCE, 4 << 30, chip="b200"),
                   "8 B200 in a node, NVLink SHARP"))
    out += [Row(op, 4 << 30, busbw, predicted_busbw(op, 4 << 30, chip="b200"), f"held out: 8 B300's {how}")
            for op, busbw, how in ((Op.ALL_GATHER, B300_RING_BUSBW, "ring AllReduce beside B200's ring"),
                                   (Op.ALL_REDUCE, B300_NVLS_BUSBW, "NVLS AllReduce beside B200's"))]
    return out


def main() -> None:
    print(f"{'collective':<14} {'size':>8} {'published':>11} {'predicted':>11} {'ratio':>6}  (bus bandwidth, "
          f"GB/s; {GPUS} H100 in a node unless said)")
    for r in rows():
        print(f"{r.op.title:<14} {r.size >> 20:>5} MB {r.published / 1e9:>11.0f} {r.predicted / 1e9:>11.0f} "
              f"{r.ratio:>6.2f}  {r.note}")


if __name__ == "__main__":
    main()
