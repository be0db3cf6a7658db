"""DualPipe (DeepSeek-V3's schedule): the repository's device orders, the bubble and memory of the
deepseek-ai/DualPipe README's table, the overlapped F&B pairs, its costing and drawing (its lowered
tick tables: tests/test_dualpipe_ticks.py)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest

import shardc
from shardc.collectives import Op
from shardc.costmodel.section_times import pair_order, part_time
from shardc.errors import ShardcError
from shardc.hardware import get_hardware
from shardc.phase_time import phase_seconds
from shardc.pipeline.bubbles import bubble, held, inflight, sends_per_microbatch
from shardc.pipeline.dualpipe import Group, dualpipe_orders
from shardc.pipeline.pairing import pair_seconds
from shardc.pipeline.schedules import Phases, Timing, device_of, paired_seconds, simulate
from shardc.step_cost import StepCost

EXAMPLE = Path(__file__).parents[1] / "examples" / "pipeline_llama.shard"


def _readme(name: str, p: int, f: float, b: float, w: float, fb: float) -> float:
    """The README's bubble column, B a whole backward (input and weight gradients), F&B a pair."""
    return {"1F1B": (p - 1) * (f + b), "ZB1P": (p - 1) * (f + b - 2 * w),
            "DualPipe": (p / 2 - 1) * (fb + b - 3 * w)}[name]


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 14), (8, 16), (8, 20), (16, 64)])
@pytest.mark.parametrize(("t", "w"), [(1.0, 1.0), (1.0, 0.5), (2.0, 0.2), (1.5, 0.0)])
def test_the_bubble_is_the_readmes(p: int, m: int, t: float, w: float) -> None:
    """T_F = T_B (input gradient) = t, T_W = w <= t, sends free, a pair no shorter than F + B: every
    device idles (p/2-1)(F&B + B - 3W) of the README, B = t + w the whole backward; 1F1B and ZB-H1
    idle its (p-1)(F+B) and (p-1)(F+B-2W), more than DualPipe from p = 4 on."""
    timing = Timing(t, t, w)
    fb, whole = paired_seconds(timing, timing), t + w
    assert fb == pytest.approx(t + whole)  # no split into computation and collectives: nothing hides
    sim = simulate("dualpipe", p, m, timing)
    want = _readme("DualPipe", p, t, whole, w, fb)
    for d in range(p):
        assert sim.makespan - sim.work(d) == pytest.approx(want)
    assert bubble("dualpipe", p, m, timing).idle_s == pytest.approx(want)
    one = simulate("1f1b", p, m, timing).bubble
    zb = simulate("zb-h1", p, m, timing).bubble
    assert one == pytest.approx(_readme("1F1B", p, t, whole, w, fb))
    assert zb == pytest.approx(_readme("ZB1P", p, t, whole, w, fb))
    if p >= 4:
        assert sim.bubble < zb <= one


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (8, 20), (16, 120)])
def test_every_device_holds_p_plus_one_stages_of_activations(p: int, m: int) -> None:
    """The README's activation column: PP + 1 (microbatches of a whole stage) on every device."""
    sim = simulate("dualpipe", p, m, Timing(1.0, 1.3, 0.7))
    assert [sim.peak_inflight(d) for d in range(p)] == [p + 1] * p
    assert inflight("dualpipe", p, m) == p + 1 and held("dualpipe", p, m) == p + 1


@pytest.mark.parametrize(("p", "m"), [(4, 8), (8, 20), (6, 14)])
def test_the_orders_run_each_op_once_on_the_device_that_holds_its_chunk(p: int, m: int) -> None:
    orders = dualpipe_orders(p, m)
    ran = Counter(key for order in orders for group in order for key in group)
    for j in range(m):  # the first half down stages 0..p-1 (chunks 0..p-1), the second half back
        chunks = range(p) if j < m // 2 else range(p, 2 * p)
        assert all(ran[(k, j, c)] == 1 for k in "FBW" for c in chunks)
    assert len(ran) == 3 * m * p
    for d, order in enumerate(orders):
        assert {c for group in order for _, _, c in group} == {d, 2 * p - 1 - d}
        assert all(device_of("dualpipe", c, p) == d for group in order for _, _, c in group)
    assert [device_of("dualpipe", c, 4) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert sends_per_microbatch("dualpipe", p) == p - 1  # each microbatch goes one way


def _waiting(order: list[Group]) -> list[tuple[int, int]]:
    """After each group of a device's order: the weight gradients deferred and not yet run, and the
    microbatches whose activations it holds (forward run, weight gradient not yet)."""
    deferred: set[tuple[int, int]] = set()
    held: set[tuple[int, int]] = set()
    out = []
    for group in order:
        for kind, j, c in group:
            if kind == "F":
                held.add((j, c))
            elif kind == "B" and ("W", j, c) not in group:
                deferred.add((j, c))
            elif kind == "W":
                deferred.discard((j, c))
                held.discard((j, c))
        out.append((len(deferred), len(held)))
    return out


@pytest.mark.parametrize(("p", "m"), [(4, 8), (8, 16), (16, 120)])
def test_at_most_half_rank_plus_one_weight_gradients_wait_and_then_half_the_peak_is_held(p: int, m: int) -> None:
    """DualPipe.step's WeightGradStore: step 3 defers one W and runs it next; step 6 defers from its middle
    iteration on, h + 1 of them (``enable_zb``); step 7 runs one (``_weight_chunk``) and defers one; step 8
    runs the h + 1 left.  So device d (half rank h) has at most h + 1 waiting (8 on DeepSeek-V3's middle
    devices), and while two or more wait it holds at most p / 2 microbatches (against PP + 1 at its peak,
    the test above): what waits for W weighs against half the peak's microbatches."""
    for d, order in enumerate(dualpipe_orders(p, m)):
        h = min(d, p - 1 - d)
        counts = _waiting(order)
        assert max(w for w, _ in counts) == h + 1
        assert max((n for w, n in counts if w >= 2), default=0) <= p // 2


def test_the_steady_state_overlaps_forward_backward_pairs() -> None:
    """Step 4 of the repository's order: m/2 - p + h + 1 iterations of two F&B pairs (h the half
    rank), the middle devices' first pair run apart; step 5 adds p/2 - h - 1 more."""
    p, m = 8, 20
    for d, order in enumerate(dualpipe_orders(p, m)):
        h = min(d, p - 1 - d)
        pairs = sum(1 for group in order if {k for k, _, _ in group} == {"F", "B", "W"})
        assert pairs == 2 * (m // 2 - p + h + 1) + (p // 2 - h - 1) - (d in (p // 2 - 1, p // 2))


def test_a_pair_hides_each_ones_collectives_under_the_others_computation() -> None:
    """F bound by its AllToAll (0.4 computation, then 1.0 of collective), the backward by its computation
    (2.0, then 0.5): apart 1.4 + 2.5 = 3.0 with F's own phase split this way; paired, F computes first, its
    AllToAll runs under the backward's 2.0 and only the backward's last collective, after everything else
    computed, shows: 0.4 + 2.0 + 0.5 = 2.9, so the step shrinks."""
    phases = Phases(((0.4, 1.0),), ((2.0, 0.5),))
    timing = Timing(1.0, 1.4, 0.6, phases=phases)
    assert paired_seconds(timing, timing) == pytest.approx(2.9)
    assert paired_seconds(timing, Timing(1.0, 1.4, 0.6)) == pytest.approx(3.0)  # split unknown: apart
    both = Timing(1.0, 1.4, 0.6, phases=Phases(((1.0, 0.1),), ((2.0, 0.1),)))  # all computation: little to hide
    assert paired_seconds(both, both) == pytest.approx(3.0)
    plain, paired = simulate("dualpipe", 4, 16, Timing(1.0, 1.4, 0.6)), simulate("dualpipe", 4, 16, timing)
    assert paired.makespan < plain.makespan
    assert any(op.paired for op in paired.ops) and paired.ideal < plain.ideal


def test_a_paired_tick_by_hand_with_and_without_the_cores_a_collective_holds() -> None:
    """Figure 4 of DeepSeek-V3's report: the two chunks' computations run one after the other, each one's
    collective under the other's computation.  F: 1.0 of computation, a collective of 0.5, then 0.4;
    the backward: 2.0, a collective of 0.6, then 0.3 (3.7 of computation, apart 4.8).

    Free cores: either chunk first, F's collective hides under the backward's 2.0 and the backward's under
    F's 0.4, 0.2 of it showing: 3.9.  With a collective holding a quarter of the cores (the H800's 20 of 132
    SMs is 0.15): F first, the backward's 2.0 runs 0.5 s beside F's collective, 0.125 s longer (ends at
    3.125); F's 0.4 beside the backward's collective takes 0.4 / 0.75 and ends before it (3.725); the
    backward's 0.3 then: 4.025.  The backward first ends later (4.05), so the pair takes 4.025."""
    forward = Phases(((1.0, 0.5), (0.4, 0.0)), ())
    backward = Phases((), ((2.0, 0.6), (0.3, 0.0)))
    assert pair_seconds(forward, backward) == pytest.approx(3.9)
    held = dataclasses.replace(forward, share=0.25)
    assert pair_seconds(held, backward) == pytest.approx(4.025)
    # F's 1.0 then the backward's 2.0 beside F's 0.5 collective: one phase's rule (shardc.overlap.beside)
    assert phase_seconds(2.0, 0.5, book=False, share=0.25) == pytest.approx(2.125)
    f, b = Timing(1.9, 0.0, phases=held), Timing(0.0, 2.0, 0.9, phases=backward)
    assert paired_seconds(f, b) == pytest.approx(4.025) and paired_seconds(f, b) < 1.9 + 2.9


@pytest.mark.parametrize(("p", "m", "message"), [(3, 12, "even number of stages"), (4, 6, "at least twice"),
                                                  (4, 9, "even number of microbatches")])
def test_dualpipe_refuses_what_its_repository_asserts(p: int, m: int, message: str) -> None:
    with pytest.raises(ShardcError, match=message):
        simulate("dualpipe", p, m, Timing(1.0, 1.0, 1.0))
    text = EXAMPLE.read_text().replace("schedule 1f1b", "schedule dualpipe").replace(
        "mesh P=4 pipeline", f"mesh P={p} pipeline").replace("layers 32", "layers 36").replace(
        "microbatches 64", f"microbatches {m}")
    with pytest.raises(ShardcError, match=message) as err:
        shardc.parse(text, "dualpipe.shard")
    assert err.value.span is not None and err.value.fix


def _cost(schedule: str, extra: str = "") -> dict[str, object]:
    text = EXAMPLE.read_text().replace("schedule 1f1b", f"schedule {schedule}{extra}")
    report = shardc.cost(shardc.plan(shardc.parse(text, str(EXAMPLE))))
    data: dict[str, object] = json.loads(report.json_text())["pipeline"]
    return data


def test_cost_counts_two_stages_of_params_and_p_plus_one_of_activations() -> None:
    """The README's parameter column (2x) and activation column (PP + 1) in the cost report, against
    1F1B's first stage (1x, PP)."""
    one, dual = _cost("1f1b"), _cost("dualpipe")
    ones, duals = one["per_stage"], dual["per_stage"]
    assert isinstance(ones, list) and isinstance(duals, list)
    assert [s["layers"] for s in duals] == [16] * 4 and [s["inflight_microbatches"] for s in duals] == [5] * 4
    for s in duals:
        assert s["state_bytes"] == pytest.approx(2 * ones[0]["state_bytes"])
        assert s["activation_bytes"] == pytest.approx(ones[0]["activation_bytes"] * 5 / 4)
    assert dual["inflight_microbatches"] == 5 and dual["sends_per_microbatch"] == 3
    assert dual["step_s"] < one["step_s"]  # half the fill, and the pairs hide collectives
    # once a step: each device's two stages' gradient reductions, and the swap with device p-1-d that
    # sums the two copies of those stages
    copies = dual["copies_exchange_s"]
    assert isinstance(copies, float) and copies > 0 and "copies_exchange_s" not in one
    assert dual["grad_reduce_s"] == pytest.approx(2 * one["grad_reduce_s"] + copies)


def test_stage_layers_split_the_two_stages_a_device_holds() -> None:
    """DualPipe's chunks are whole stages, so `stage_layers` applies: device d holds stages d, p-1-d."""
    data = _cost("dualpipe", "\nstage_layers 9, 8, 8, 7")
    per_stage = data["per_stage"]
    assert isinstance(per_stage, list)
    assert [s["layers"] for s in per_stage] == [16, 16, 16, 16]
    with pytest.raises(ShardcError, match="schedule zbv holds 2 chunks a device"):
        _cost("zbv", "\nstage_layers 9, 8, 8, 7")


def test_the_gantt_outlines_the_pairs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from shardc.pipeline.gantt import draw

    path = tmp_path / "dualpipe.png"
    draw(simulate("dualpipe", 4, 8, Timing(1.0, 1.0, 1.0)), str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"


# --- DualPipeV: the order cut in half, a V of half-stage chunks ------------------------------------

@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 6), (4, 8), (4, 9), (8, 20)])
@pytest.mark.parametrize(("t", "w"), [(1.0, 1.0), (1.0, 0.5), (2.0, 0.2)])
def test_dualpipev_idles_dualpipes_bubble_over_its_2p_ranks(p: int, m: int, t: float, w: float) -> None:
    """DualPipeV on p devices is the first half of DualPipe on 2p ranks, its chunks half a stage: the
    README's (PP/2-1)(F&B + B - 3W) with PP = 2p in the chunks' times, at T_F = T_B >= T_W."""
    timing = Timing(t, t, w)
    sim = simulate("dualpipev", p, m, timing)
    half = Timing(t / 2, t / 2, w / 2)
    want = _readme("DualPipe", 2 * p, t / 2, (t + w) / 2, w / 2, paired_seconds(half, half))
    for d in range(p):
        assert sim.makespan - sim.work(d) == pytest.approx(want)
    assert bubble("dualpipev", p, m, timing).idle_s == pytest.approx(want)
    # 2p + 1 chunks of half a stage held on every device (the README's PP + 1, PP = 2p chunks)
    assert [sim.peak_inflight(d) for d in range(p)] == [p + 0.5] * p == [held("dualpipev", p, m)] * p


def test_dualpipev_runs_every_microbatch_down_the_v_and_back() -> None:
    p, m = 4, 10
    orders = dualpipe_orders(p, m, v=True)
    ran = Counter(key for order in orders for group in order for key in group)
    assert len(ran) == 3 * m * 2 * p and set(ran.values()) == {1}
    for d, order in enumerate(orders):
        assert {c for group in order for _, _, c in group} == {d, 2 * p - 1 - d}
    assert sends_per_microbatch("dualpipev", p) == 2 * (p - 1)
    with pytest.raises(ShardcError, match="at least twice"):
        simulate("dualpipev", 4, 7, Timing(1.0, 1.0, 1.0))


def test_dualpipev_costs_one_copy_of_the_params_and_p_plus_a_half_in_flight() -> None:
    one, v = _cost("1f1b"), _cost("dualpipev")
    ones, vs = one["per_stage"], v["per_stage"]
    assert isinstance(ones, list) and isinstance(vs, list)
    assert [s["layers"] for s in vs] == [8] * 4 and [s["inflight_microbatches"] for s in vs] == [4.5] * 4
    for s in vs:
        assert s["state_bytes"] == pytest.approx(ones[0]["state_bytes"])
        assert s["activation_bytes"] == pytest.approx(ones[0]["activation_bytes"] * 4.5 / 4)
    assert v["sends_per_microbatch"] == 6 and "copies_exchange_s" not in v  # one copy of each stage
    with pytest.raises(ShardcError, match="schedule dualpipev holds 2 chunks a device"):
        _cost("dualpipev", "\nstage_layers 9, 8, 8, 7")


def test_a_pairs_computation_runs_on_the_cores_its_collectives_leave() -> None:
    """An F&B pair runs each op's collectives under the other's computation, and those collectives hold
    SMs (DeepSeek-V3's all-to-all kernels 20 of the H800's 132): the pair's computation runs that much
    slower, as a phase's beside its ahead collectives does; a chip whose collectives hold no cores pairs
    as before, and the slowdown is at most the share of the collectives' time."""
    text = EXAMPLE.read_text().replace("schedule 1f1b", "schedule dualpipe").replace(
        "hardware tpu-v5p", "hardware h800")
    h800 = get_hardware("h800")
    assert h800.overlap_share == pytest.approx(20 / 132)
    steps = []
    for hw in (h800, dataclasses.replace(h800, collective_sms=None)):
        report = json.loads(shardc.cost(shardc.plan(shardc.parse(text, str(EXAMPLE)), hardware=hw)).json_text())
        steps.append((report["pipeline"]["step_s"], report["step"]["comm_s"]))
    (shared, comm), (free, _) = steps
    assert shared <= free + h800.overlap_share * comm
    # most of the steady state is pairs, whose every collective runs beside the other op's computation: over
    # half the bound (the lone ops' ahead collectives alone slow the step by 0.4% of it)
    assert shared - free > 0.5 * h800.overlap_share * comm


def test_a_device_holds_mostly_its_own_directions_stage() -> None:
    """At its peak (PP + 1 stage-microbatches) device d holds p - h microbatches of the stage its own direction
    enters and h + 1 of the other (h = min(d, p-1-d)): device 0 holds 16 of stage 0 and 1 of stage 15, so
    its memory is 16 of the first stage's microbatches (the embedding's) and 1 of the last's (the head's),
    not 8.5 of each."""
    sim = simulate("dualpipe", 16, 120, Timing(1.0, 1.0, 0.5))
    for d in (0, 3, 7, 12, 15):
        h, own = min(d, 15 - d), d if d < 8 else 31 - d  # a second-half device's own direction is 1
        got = sim.peak_chunks(d, {c: 1.0 for c in range(32)})
        assert sum(got.values()) == 17 and got[own] == 16 - h
    big_head = sim.peak_chunks(0, {0: 1.0, 31: 100.0})  # a heavy last stage: its bytes' peak, not the count's
    assert big_head[31] >= 1 and 100 * big_head[31] + big_head[0] >= 100 + 16


def test_a_pairs_backward_issues_its_alltoall_before_the_weight_gradients() -> None:
    """Figure 4 runs an MLP's weight gradient after its input gradient, once the AllToAll that gradient
    feeds is issued: the chain of a backward (input gradient 1.0, weight gradient 2.0, an AllToAll of
    0.5, then 1.5 of attention's) computes 1.0 before the AllToAll and the 2.0 of the weight gradient
    beside it, where the plan's order would compute 3.0 first."""
    h800 = get_hardware("h800")
    dx, dw, rest = (StepCost(i, Op.EINSUM, "t", "t", compute_s=s) for i, s in ((0, 1.0), (1, 2.0), (3, 1.5)))
    a2a = StepCost(2, Op.ALL_TO_ALL, "t", "t", axes=("Z",), bandwidth_s=0.5)
    rows = pair_order([(dx, False), (dw, True), (a2a, False), (rest, False)])
    assert rows == [dx, a2a, dw, rest]
    part = part_time([dx, a2a, rest], h800, rows)
    assert part.segments == ((1.0, 0.5), (3.5, 0.0)) and part.share == pytest.approx(20 / 132)
    assert part_time([dx, dw, a2a, rest], h800).segments == ((3.0, 0.5), (1.5, 0.0))


@pytest.mark.parametrize(("schedule", "virtual"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1),
                                                   ("zbv", 1)])
def test_only_the_paired_schedules_read_the_chains(schedule: str, virtual: int) -> None:
    """The schedules that run one op at a time take each op's own time: the chains an F&B pair interleaves
    change nothing there (a phase's collectives beside its compute are already in its F, B and W)."""
    chains = Phases(((0.4, 1.0), (0.2, 0.0)), ((2.0, 0.5), (0.1, 0.0)), 0.1, 0.2, 0.25)
    plain, chained = Timing(1.0, 1.4, 0.6), Timing(1.0, 1.4, 0.6, phases=chains)
    assert simulate(schedule, 4, 8, chained, virtual).ops == simulate(schedule, 4, 8, plain, virtual).ops
