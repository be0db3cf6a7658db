"""``shardc layouts --knobs``: the product of the knobs' settings, not one knob at a time, and the state bound
that skips settings which cannot fit."""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace
from pathlib import Path

import pytest

import shardc
from shardc.hardware import Hardware, get_hardware
from shardc.ir.spec import Spec, Zero
from shardc.layouts import Layout, Options, Skipped, search_layouts
from shardc.layouts.knobs import search_knobs
from shardc.layouts.rank import evaluate, pairs, prepare, rank, rank_key
from shardc.layouts.templates import Candidate, kept_plans, search_templates

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow  # every test plans and costs each setting of the knobs it searches

# Constructed: 16 MLP layers, data parallel over Z (16) and tensor parallel over Y (4) on 64 TPU v5p
# chips, compute-bound.  Its training state (22 GB a chip) outweighs its activations (7 GB): ZeRO saves
# more memory than full recomputation, and costs less time.
TIGHT = """\
mesh Z=16, Y=4
dims B=64, S=2048, D=8192, F=32768
hardware tpu-v5p
layers 16

H[B_Z, S, F_Y] = gelu(X[B_Z, S, D] · W_in[D, F_Y])
Out[B_Z, S, D] = H[B_Z, S, F_Y] · W_out[F_Y, D]
"""
POLICIES = ("none", "selective", "full", "dots")
STAGES = ("none", "1", "2", "3")
FIXED = frozenset({"Z", "Y"})


def _spec() -> Spec:
    return shardc.parse(TIGHT, "tight.shard")


@functools.cache  # the tests read the chip's own table alike: planned once a process
def _table(hw: Hardware) -> dict[tuple[str, str], Layout]:
    """Every recompute policy and ZeRO stage of the spec, each planned and costed on its own."""
    spec, out = _spec(), {}
    for policy, stage in itertools.product(POLICIES, STAGES):
        zero = None if stage == "none" else Zero(int(stage), ("Z",))
        row = evaluate(replace(spec, zero=zero), Options(hw), policy)
        assert not isinstance(row, str), row
        out[policy, stage] = row
    return out


def _greedy(table: dict[tuple[str, str], Layout]) -> tuple[str, str]:
    """One knob at a time, each from the best setting of those before it: recompute, then ZeRO."""
    policy = min(POLICIES, key=lambda r: rank_key(table[r, "none"]))
    stage = min(STAGES, key=lambda z: rank_key(table[policy, z]))
    return policy, stage


def _search(hbm: float) -> tuple[Layout, dict[str, float]]:
    options = Options(replace(get_hardware("tpu-v5p"), hbm_bytes=hbm), knobs=("recompute", "zero"))
    found = search_layouts([_spec()], options, chips=64, fixed=FIXED)
    assert found.chosen is not None
    return found.chosen, found.stats


def test_the_product_of_the_knobs_finds_what_one_knob_at_a_time_misses() -> None:
    roomy = _table(get_hardware("tpu-v5p"))
    # an HBM that full recomputation alone fits, and no other policy without ZeRO
    hbm = (roomy["full", "none"].memory_bytes + min(roomy[r, "none"].memory_bytes for r in POLICIES if r != "full")) / 2
    table = _table(replace(get_hardware("tpu-v5p"), hbm_bytes=hbm))
    assert [r for r in POLICIES if table[r, "none"].fits] == ["full"]
    greedy = table[_greedy(table)]
    best = min(table.values(), key=rank_key)
    assert best.fits and best.step_s < greedy.step_s  # the one-at-a-time answer is worse here
    chosen, _ = _search(hbm)
    assert chosen.fits and chosen.step_s == best.step_s
    knobs = dict(chosen.knobs)
    assert knobs.get("recompute", "none") != "full" and knobs.get("zero", "none") != "none"
    assert chosen.step_s < greedy.step_s


def test_the_state_bound_skips_only_settings_that_cannot_fit() -> None:
    roomy = _table(get_hardware("tpu-v5p"))
    for stage in STAGES:  # the bound's premise: the training state does not depend on the recompute policy
        assert len({roomy[r, stage].state_bytes for r in POLICIES}) == 1
    # an HBM under the state without ZeRO, over the state and activations of ZeRO 3
    hbm = (roomy["none", "none"].state_bytes + roomy["none", "3"].memory_bytes) / 2
    table = _table(replace(get_hardware("tpu-v5p"), hbm_bytes=hbm))
    assert not any(table[r, "none"].fits for r in POLICIES)
    chosen, stats = _search(hbm)
    assert stats["pruned"] > 0  # the policies without ZeRO: never planned
    best = min(table.values(), key=rank_key)
    assert chosen.fits and chosen.step_s == best.step_s
    assert dict(chosen.knobs).get("zero", "none") != "none"


def test_the_compute_bound_skips_only_schedules_that_cannot_be_chosen() -> None:
    # the pipelined LLaMA at its own layout (P=4 X=8 Y=4): each microbatch count and schedule, with the
    # bounds and without them, choose alike
    spec = shardc.parse((ROOT / "examples" / "pipeline_llama.shard").read_text(encoding="utf-8"), "pipeline.shard")
    options = Options(get_hardware("tpu-v5p"), knobs=("microbatches", "schedule"))
    candidate = prepare(spec, {a.name: a.size for a in spec.mesh.axes})
    assert not isinstance(candidate, Skipped)
    best = [Candidate(candidate, pairs(candidate))]
    with kept_plans():
        rows, _, _ = search_templates(best, options, refine=False)
        assert rows[0].fits
        bounded, _, _, counts = search_knobs(best, rows, options)
        every, _, _, _ = search_knobs(best, rows, options, bounded=False)
    assert counts["pruned"] > 0 and len(bounded) == len(every) - counts["pruned"]
    assert rank([*rows, *bounded])[0] == rank([*rows, *every])[0]
    assert {(r.knobs, r.step_s) for r in bounded} <= {(r.knobs, r.step_s) for r in every}


def test_each_microbatch_count_has_its_stage_planned_at_its_microbatch_size() -> None:
    """A stage is searched at a microbatch's sizes, so the microbatch knob plans each count's stage at its
    own: two FSDP layers pipelined over 2 stages gather W1 and W2 at 2 microbatches of 2048 but move the
    activations at 16 of 256.  Re-costed from one count's plan, the other counts gathered the weights each
    microbatch (the plan made at 2)."""
    text = ("mesh P=2 pipeline, X=4\nlayers 4\nmicrobatches 8\ndims B=4096, D=4096, E=4096\nparam W1, W2\n"
            "H[B_X, E] = In[B_X, D] · W1[D_X, E]\nOut[B_X, D] = H[B_X, E] · W2[E_X, D]\n")
    spec = shardc.parse(text, "fsdp.shard")
    options = Options(get_hardware("tpu-v5p"), knobs=("microbatches",))
    candidate = prepare(spec, {a.name: a.size for a in spec.mesh.axes})
    assert not isinstance(candidate, Skipped)
    with kept_plans():
        rows, _, _, _ = search_knobs([Candidate(candidate, pairs(candidate))], [], options, bounded=False)
    counts = {int(dict(r.knobs)["microbatches"]): r for r in rows}
    assert sorted(counts) == [2, 4, 16, 32]
    gathered = set()
    for m, row in counts.items():
        own = shardc.plan(replace(spec, microbatches=m))
        assert row.planned and row.step_s == pytest.approx(shardc.cost(own).pipeline.step_s, rel=1e-12)  # type: ignore[union-attr]
        gathered |= {m} if any(s.tensor == "W1" for s in own.forward if s.is_collective) else set()
    assert gathered == {2}
