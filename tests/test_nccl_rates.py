"""The rates NCCL reaches on GPU clusters, against the published figures each preset cites: NVLink SHARP
AllReduces inside a node, and InfiniBand rails across nodes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from shardc.chip_choice import load_hardware_file
from shardc.collectives import Op, collective_time
from shardc.hardware import Hardware, get_hardware
from shardc.ir.spec import Mesh, MeshAxis
from shardc.topology import resolve_links

GB = 1e9


def _busbw(op: Op, hw: Hardware, sizes: dict[str, int], axis: str, topology: tuple[int, int],
           size: float = 4 * 2**30) -> float:
    """nccl-tests' bus bandwidth of shardc's time for one collective of ``size`` bytes over ``axis``:
    algbw x (n-1)/n, twice that for AllReduce (nccl-tests' PERFORMANCE.md)."""
    mesh = Mesh(tuple(MeshAxis(a, n) for a, n in sizes.items()))
    links, _ = resolve_links(mesh, sizes, hw, topology)
    n = sizes[axis]
    seconds = collective_time(op, size, (axis,), mesh, sizes, hw, links).seconds
    return size / seconds * (2 if op is Op.ALL_REDUCE else 1) * (n - 1) / n


def _in_node(op: Op, chip: str, gpus: int) -> float:
    return _busbw(op, get_hardware(chip), {"X": gpus}, "X", (1, gpus))


def test_an_allreduce_in_an_h100_node_runs_at_nvlink_sharps_published_bus_bandwidth() -> None:
    # 480 GB/s on 8 H100 (NVIDIA GTC talk S62129), the figure the preset's NVLS rate is taken from
    assert _in_node(Op.ALL_REDUCE, "h100", 8) == pytest.approx(480 * GB, rel=0.01)
    assert _in_node(Op.ALL_REDUCE, "h200", 8) == pytest.approx(480 * GB, rel=0.01)
    # 215 GB/s on 8 H800 (NVIDIA/nccl issue 1374)
    assert _in_node(Op.ALL_REDUCE, "h800", 8) == pytest.approx(215 * GB, rel=0.01)
    # AllGather and ReduceScatter stay rings: 370 GB/s (NVIDIA/nccl-tests issue 212)
    for op in (Op.ALL_GATHER, Op.REDUCE_SCATTER):
        assert _in_node(op, "h100", 8) == pytest.approx(370 * GB, rel=0.01)


def test_h800_and_b200_links_run_at_their_own_measured_shares() -> None:
    """H800: the 160 GB/s one way DeepSeek measured of its 200 (deepseek-ai/DeepSeek-V3 issue 28, DeepEP issue
    16), not the H100's 370 of 450; B200: NCCL's own 40.1 GB/s a link of 50 (its src/graph/topo.h), and NVLS at
    the 830 GB/s AllReduce bus bandwidth measured on 8 B200 (NVIDIA/nccl issue 1807)."""
    for op in (Op.ALL_GATHER, Op.REDUCE_SCATTER):
        assert _in_node(op, "h800", 8) == pytest.approx(160 * GB, rel=0.01)
        assert _in_node(op, "b200", 8) == pytest.approx(18 * 40.1 * GB, rel=0.01)
    assert _in_node(Op.ALL_REDUCE, "b200", 8) == pytest.approx(830 * GB, rel=0.01)
    assert get_hardware("h800").ici_efficiency != get_hardware("h100").ici_efficiency


def test_collectives_in_an_a100_node_run_at_the_bus_bandwidth_nccl_reaches_there() -> None:
    """8 A100 SXM over NVLink 3 (300 GB/s each way): about 230 GB/s AllReduce bus bandwidth at large sizes
    (an NCCL maintainer, NVIDIA/nccl-tests issue 149), the A100's own figure, not the H100's 370 of 450."""
    a100 = get_hardware("a100")
    assert a100.ici_efficiency == pytest.approx(230 / 300) and a100.w_ici == pytest.approx(230 * GB)
    assert a100.ici_efficiency != get_hardware("h100").ici_efficiency
    for op in (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_REDUCE):
        assert _in_node(op, "a100", 8) == pytest.approx(230 * GB, rel=0.01)


@pytest.mark.parametrize(("gpus", "busbw"), [(2, 367), (3, 367), (4, 367), (5, 420), (6, 440), (7, 460)])
def test_nvls_on_fewer_gpus_follows_its_n_plus_1_over_n_traffic(gpus: int, busbw: float) -> None:
    """Held out: the preset's NVLS rate is from 8 GPUs; NCCL_ALGO=NVLS on 2..7 GPUs of an H100 node
    measured 365-370 GB/s up to 4 (NCCL keeps the ring's rate) then 420, 440, 460 (NVIDIA/nccl issue
    1455, read off to about 10 GB/s)."""
    assert _in_node(Op.ALL_REDUCE, "h100", gpus) == pytest.approx(busbw * GB, abs=10 * GB)


def test_chips_without_in_switch_reduction_and_the_book_run_allreduce_as_a_ring() -> None:
    a100 = _in_node(Op.ALL_REDUCE, "a100", 8)
    assert get_hardware("a100").nvls_efficiency is None  # NVSwitch 2 does not reduce
    assert a100 == pytest.approx(_in_node(Op.ALL_GATHER, "a100", 8), rel=1e-3)  # less latency
    book = dataclasses.replace(get_hardware("h100"), book=True)
    assert book.w_nvls is None
    ring = _busbw(Op.ALL_REDUCE, book, {"X": 8}, "X", (1, 8))
    assert ring == pytest.approx(_busbw(Op.ALL_GATHER, book, {"X": 8}, "X", (1, 8)), rel=1e-3)


@pytest.mark.parametrize(("chip", "per_nic"), [("h100", 47), ("h200", 47), ("h800", 47), ("b200", 47),
                                               ("a100", 24)])
def test_a_ring_across_nodes_reaches_what_nccl_measures_a_nic(chip: str, per_nic: float) -> None:
    """One GPU of each of 2 nodes: the ring crosses one InfiniBand rail, 46-48 GB/s a 400 Gb/s NDR NIC
    (NVIDIA/nccl-tests issue 290), 24 GB/s a 200 Gb/s HDR one (NVIDIA/nccl issue 412)."""
    hw = get_hardware(chip)
    sizes = {"N": 2, "G": 8}
    for op in (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_REDUCE):
        assert _busbw(op, hw, sizes, "N", (2, 8)) == pytest.approx(per_nic * GB, abs=1 * GB)
    assert dataclasses.replace(hw, book=True).w_dcn == hw.dcn_bandwidth  # the book: the line rate


def test_tpu_dcn_is_used_as_given() -> None:
    for name in ("tpu-v4p", "tpu-v5e", "tpu-v5p", "tpu-v6e"):
        hw = get_hardware(name)
        assert hw.w_dcn == hw.dcn_bandwidth and hw.w_nvls is None


def test_a_hardware_file_takes_the_nvls_and_network_shares(tmp_path: Path) -> None:
    chip = tmp_path / "chip.toml"
    chip.write_text('flops = 9.89e14\nici_bandwidth = 4.5e11\nhbm_bytes = 80e9\ndcn_bandwidth = 5e10\n'
                    'ici_domain = 8\nici_efficiency = 0.8\nnvls_efficiency = 0.7\ndcn_efficiency = 0.9\n',
                    encoding="utf-8")
    hw = load_hardware_file(str(chip))
    assert hw.w_nvls == pytest.approx(0.7 * 4.5e11) and hw.w_dcn == pytest.approx(4.5e10)
    # 8 GPUs: NVLS moves 9/8 V at 315 GB/s, the ring 2 x 7/8 V at 360 GB/s
    assert _busbw(Op.ALL_REDUCE, hw, {"X": 8}, "X", (1, 8)) == pytest.approx(315e9 * 8 / 9 * 14 / 8, rel=1e-3)
