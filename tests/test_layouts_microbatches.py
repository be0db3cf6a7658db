"""``shardc layouts`` holds a pipelined spec's microbatch size, not its count, as frameworks do (Megatron-LM's
``--micro-batch-size`` with the global batch): a layout of another data-parallel size runs another count."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import shardc
from shardc.hardware import get_hardware
from shardc.layouts import Options, search_layouts
from shardc.layouts.layout_search import LayoutSearch
from shardc.layouts.microbatches import held_of, microbatch_size
from shardc.layouts.rank import Layout, prepare

ROOT = Path(__file__).resolve().parent.parent
# P=4 stages, 4-way data parallel (X), 16 microbatches of B=64: 1 sequence a data-parallel device a microbatch
SPEC = shardc.parse((ROOT / "tests" / "specs" / "pipeline_mlp.shard").read_text(encoding="utf-8"),
                    "pipeline_mlp.shard")
SPEC = replace(SPEC, dims=tuple((k, 64 if k == "B" else v) for k, v in SPEC.dims))


def _prepared(**sizes: int) -> shardc.ir.spec.Spec:  # type: ignore[name-defined]
    made = prepare(SPEC, {"P": 4, "X": 4, "Y": 4} | sizes)
    assert isinstance(made, shardc.ir.spec.Spec)
    return made


def test_the_microbatch_size_is_held_where_the_count_would_be() -> None:
    assert microbatch_size(SPEC) == 1
    assert _prepared().microbatches == 16  # the spec's own layout keeps its count
    assert _prepared(P=2, Y=8).microbatches == 16  # the same data-parallel size: the same count
    assert _prepared(X=8, Y=2).microbatches == 8  # 16 x 4 / 8: 8 microbatches of 8, one a device
    assert _prepared(X=2, Y=8).microbatches == 32
    assert microbatch_size(_prepared(X=8, Y=2)) == 1


def test_a_size_that_does_not_divide_falls_back_to_the_nearest_count() -> None:
    held = held_of(replace(SPEC, dims=tuple((k, 48 if k == "B" else v) for k, v in SPEC.dims), microbatches=12))
    assert held is not None and held.size == 1
    count, why = held.at({"P": 4, "X": 16, "Y": 1})  # 48 / 16 = 3 a device: 3 microbatches hold the size
    assert count == 3 and "held" in why
    count, why = held.at({"P": 4, "X": 32, "Y": 1})  # 1.5 would hold it; 48 over 32 devices is padded whole
    assert count == 2 and "nearest count" in why and "1.5" in why
    assert held.at({"P": 4, "X": 4, "Y": 4}) == (12, "microbatches 12: the spec's own, at its own layout")
    assert Fraction(48, 12 * 4) == held.size


def test_a_data_parallel_size_the_count_refused_is_ranked_at_the_held_size() -> None:
    # 128 chips with P and Y kept: X=8, whose 4 a microbatch (64 / 16) 8 devices would split, refused before
    found = search_layouts([SPEC], Options(get_hardware("tpu-v5p")), chips=128, fixed=frozenset({"P", "Y"}))
    assert not found.skipped and [dict(r.sizes) for r in found.layouts] == [{"P": 4, "X": 8, "Y": 4}]
    row = found.layouts[0]
    assert "pipeline: 4 stages, 8 microbatches, 1f1b; step = the simulated schedule" in row.notes
    assert any(n.startswith("microbatches 8: the spec's microbatch size held") for n in row.notes)
    own = search_layouts([SPEC], Options(get_hardware("tpu-v5p")), chips=64, fixed=frozenset({"P", "Y"}))
    assert "microbatches 16: the spec's own, at its own layout" in own.layouts[0].notes


def test_the_reason_says_where_the_specs_own_layout_ranks_and_why() -> None:
    def row(x: int, y: int, step: float, comm: float) -> Layout:
        return Layout("pipeline_mlp.shard", (("P", 4), ("X", x), ("Y", y)), step, step - comm, comm, comm, "compute",
                      0.5, None, (), 1e9, 2e9)

    rows = (row(8, 2, 1.0, 0.1), row(2, 8, 1.1, 0.2), row(4, 4, 1.2, 0.3))  # the spec's own (X=4, Y=4) third
    search = LayoutSearch(64, Options(get_hardware("tpu-v5p")), rows, (), {}, written=(("pipeline_mlp.shard",
                                                                                       SPEC.mesh),))
    assert ("the spec's own layout is #3: pipeline_mlp.shard P=4 X=4 Y=4 at 1.2 s vs 1 s (compute-bound, "
            "communication 300 ms vs 100 ms, memory 1 GB vs 1 GB), compute 900 ms vs 900 ms") in search.reason()
    assert "own layout" not in replace(search, layouts=rows[::-1]).reason()  # chosen: nothing to say
