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
  in NVIDIA/nccl-tests issue 175), for every collective as all run as rings there.

Run with ``python benchmarks/collectives_fidelity.py`` from the repository root.
"""

from __future__ import annotations

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
    return out


def main() -> None:
    print(f"{'collective':<14} {'size':>8} {'published':>11} {'predicted':>11} {'ratio':>6}  (bus bandwidth, "
          f"GB/s; {GPUS} H100 in a node unless said)")
    for r in rows():
        print(f"{r.op.title:<14} {r.size >> 20:>5} MB {r.published / 1e9:>11.0f} {r.predicted / 1e9:>11.0f} "
              f"{r.ratio:>6.2f}  {r.note}")


if __name__ == "__main__":
    main()
