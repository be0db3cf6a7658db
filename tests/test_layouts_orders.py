"""``shardc layouts`` searches the order of the mesh axes: which axes run inside a GPU node, or on which
physical axes of a TPU slice, and prints the order it chose."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import shardc
from shardc.cli.main import main
from shardc.hardware import get_hardware
from shardc.layouts import Options
from shardc.layouts.factor import candidates
from shardc.layouts.orders import orders, reorder, search_orders
from shardc.layouts.rank import Skipped, pairs, prepare, rank
from shardc.layouts.templates import Candidate, free_step, kept_plans, recost, search_templates, step_of

ROOT = Path(__file__).resolve().parent.parent
# Megatron's tensor parallelism over Y written first: the devices are numbered node by node and the mesh
# laid on them in its order, so as written Y crosses the two nodes and Z runs inside each.
ACROSS = """\
mesh Y=8, Z=2
dims B=64, S=2048, D=8192, F=32768
hardware a100

H[B_Z, S, F_Y] = gelu(X[B_Z, S, D] · W_in[D, F_Y])
Out[B_Z, S, D] = H[B_Z, S, F_Y] · W_out[F_Y, D]
"""


@pytest.fixture
def across(tmp_path: Path) -> Path:
    path = tmp_path / "tp_across.shard"
    path.write_text(ACROSS, encoding="utf-8")
    return path


def test_tensor_parallelism_written_across_nodes_is_placed_in_a_node(capsys: pytest.CaptureFixture[str],
                                                                      across: Path) -> None:
    args = ["layouts", str(across), "--topology", "2x8", "--set", "Y=8", "--set", "Z=2", "--jobs", "1"]
    assert main([*args, "--json", "--top", "0"]) == 0
    found = json.loads(capsys.readouterr().out)
    chosen = found["chosen"]
    assert chosen["order"] == ["Z", "Y"] and chosen["planned"]
    assert "mesh axis Y (8 GPUs) on 2x8: inside a node (NVLink)" in chosen["placement"]
    written = next(r for r in found["layouts"] if r["order"] == ["Y", "Z"])
    assert any("mesh axis Y (8 GPUs) on 2x8: 4 GPU(s) of a node over 2 node(s)" in n for n in written["placement"])
    assert written["step_s"] > chosen["step_s"]
    # the chosen row is `shardc cost` of the spec written in that order
    spec = shardc.parse(ACROSS, str(across))
    report = shardc.cost(shardc.plan(reorder(spec, ["Z", "Y"]), topology="2x8"))
    assert chosen["step_s"] == pytest.approx(report.step.step_s, rel=1e-12)
    assert main(args) == 0
    assert "chosen mesh order: mesh Z=2, Y=8 (reordered from the spec's Y, Z)" in capsys.readouterr().out


def test_orders_that_lie_alike_are_costed_once(across: Path) -> None:
    options = Options(get_hardware("a100"), topology="2x8")
    spec = shardc.parse(ACROSS, str(across))
    assert [s.mesh.names for s in orders(spec, options)] == [("Y", "Z"), ("Z", "Y")]
    # 16 x 4 on a 4x4x4 slice: two whole physical axes and one, whichever is written first
    tpu = shardc.parse(ACROSS.replace("a100", "tpu-v5p").replace("Y=8, Z=2", "Y=4, Z=16"), "tpu.shard")
    assert len(orders(tpu, Options(get_hardware("tpu-v5p")))) == 1
    # 32 x 2 on it: the axis written last takes its chips first, whole physical axes or a split one
    split = shardc.parse(ACROSS.replace("a100", "tpu-v5p").replace("Y=8, Z=2", "Y=2, Z=32"), "split.shard")
    assert [s.mesh.names for s in orders(split, Options(get_hardware("tpu-v5p")))] == [("Y", "Z"), ("Z", "Y")]
    book = replace(get_hardware("tpu-v5p"), book=True)  # the book's spans: no place to choose
    assert orders(tpu, Options(book)) == [tpu]


def test_the_order_bounds_skip_only_orders_that_cannot_be_chosen() -> None:
    # 512 chips over Z and Y on an 8x8x8 slice, each template planned once: the written order's rows, then
    # the other orders of each layout costed with the same plan, with the bounds and without them
    spec = shardc.parse(ACROSS.replace("a100", "tpu-v5p").replace("Y=8, Z=2", "Y=4, Z=16"), "tpu.shard")
    options = Options(get_hardware("tpu-v5p"))
    found = []
    for sizes in candidates(spec, 512):
        candidate = prepare(spec, sizes)
        if not isinstance(candidate, Skipped):
            found.append(Candidate(candidate, pairs(candidate)))
    with kept_plans():
        rows, _, _ = search_templates(found, options, refine=False)
        bounded, _, _, counts = search_orders(found, rows, options)
        every, _, _, _ = search_orders(found, rows, options, bounded=False)
    assert counts["orders"] == len(every) > len(bounded) and counts["pruned"] == len(every) - len(bounded)
    written = {tuple(sorted(r.sizes)): r for r in rows}
    for row in every:  # the bounds' premises: an order moves no memory and no compute of a plan
        base = written[tuple(sorted(row.sizes))]
        assert row.compute_s == base.compute_s and row.memory_bytes == base.memory_bytes
        assert row.step_s >= row.floor_s
    assert {(r.sizes, r.step_s) for r in bounded} <= {(r.sizes, r.step_s) for r in every}
    best = rank([*rows, *every])[0]
    assert rank([*rows, *bounded])[0] == best and best.sizes not in {r.sizes for r in rows}  # an order wins
    # step_of is the re-costed row's step, split and critical path, without the rest of the report
    c = next(c for c in found if c.sizes == (("Y", 16), ("Z", 32)))
    template = shardc.plan(c.spec)
    other = Candidate(reorder(c.spec, ["Z", "Y"]), (("Z", 32), ("Y", 16)))
    row = recost(template, other, options)
    quick = step_of(template, other, options)
    assert not isinstance(row, str) and quick is not None
    assert quick[0] == pytest.approx(row.step_s, rel=1e-12) and quick[1] == row.split
    assert quick[2] == pytest.approx(row.critical_s, rel=1e-12)


def test_a_pipelines_quick_steps_are_bounds_under_its_row() -> None:
    spec = shardc.parse((ROOT / "examples" / "pipeline_llama.shard").read_text(encoding="utf-8"), "pipeline.shard")
    options = Options(get_hardware("tpu-v5p"))
    candidate = prepare(spec, {"P": 4, "X": 2, "Y": 8})  # on 4x4x4: Y splits an axis, P or X the rest of it
    assert not isinstance(candidate, Skipped)
    template = shardc.plan(candidate)
    others = orders(candidate, options)
    assert len(others) > 1
    free = free_step(template, Candidate(candidate, pairs(candidate)), options)
    assert free is not None and free > 0
    for other in others:
        c = Candidate(other, pairs(other))
        row, quick = recost(template, c, options), step_of(template, c, options)
        assert not isinstance(row, str) and quick is not None
        assert free <= quick[0] <= row.step_s and row.step_s >= row.floor_s


def test_the_chosen_mesh_line_keeps_the_pipeline_and_dcn_axes(capsys: pytest.CaptureFixture[str],
                                                               tmp_path: Path) -> None:
    """The printed mesh line is the spec's at the chosen sizes, `pipeline` and `over dcn` kept (they were dropped:
    pasted back, the line made another spec, with no pipeline and every axis over ICI)."""
    path = tmp_path / "piped.shard"
    path.write_text("mesh P=2 pipeline over dcn, Y=4\ndims B=8, D=256, F=1024\nmicrobatches 2\nhardware tpu-v3\n"
                    "param W_in, W_out\nlayers 2 {\n  H[B, F_Y] = gelu(X0[B, D] · W_in[D, F_Y])\n"
                    "  X1[B, D] = H[B, F_Y] · W_out[F_Y, D]\n}\n", encoding="utf-8")
    assert main(["layouts", str(path), "--jobs", "1"]) == 0
    assert "chosen mesh order: mesh P=2 pipeline over dcn, Y=4 (the spec's order)" in capsys.readouterr().out
