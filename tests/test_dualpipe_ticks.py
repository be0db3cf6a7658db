"""DualPipe's and DualPipeV's lowered tick tables: the cost's simulation's own orders placed a group a
tick (:mod:`shardc.pipeline.ticks`), so an F&B pair's forward and whole backward are issued in one
iteration of the lowered loop, and the loop runs as many ticks as the cost's order placed so."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import shardc
from shardc.lowering.pipeline_lowering import SPLIT_SCHEDULES, lower_pipeline, tick_tables, weight_ticks
from shardc.pipeline.schedules import Phases, Timing, run_orders, simulate
from shardc.pipeline.ticks import tick_table, unit_ticks
from tests.test_pipeline_split import V_SPEC
from tests.test_pipeline_two_way import WHOLE

CASES = [("dualpipe", 2, 4), ("dualpipe", 4, 8), ("dualpipe", 4, 10), ("dualpipe", 8, 20),
         ("dualpipev", 2, 4), ("dualpipev", 4, 8), ("dualpipev", 3, 7)]
# a pair shorter than its ops one after the other: each one's collectives under the other's computation
OVERLAPPED = Timing(1.0, 1.4, 0.6, phases=Phases(((0.4, 1.0),), ((2.0, 0.5),)))


@pytest.mark.parametrize(("schedule", "p", "m"), CASES)
def test_a_pairs_forward_and_backward_sit_in_one_tick(schedule: str, p: int, m: int) -> None:
    """Each F&B pair the cost times as one unit (its ops marked paired) is one row of the lowered tables:
    its F in F_TABLE, its B in B_TABLE and that B's W in W_TABLE at one tick of the device.  The tables
    are the tick table of the cost's orders at the cost's own times (a pair's overlap moves when it runs,
    not the order), and reading them back gives the cost's orders."""
    sim = simulate(schedule, p, m, OVERLAPPED)
    ticks = tick_table(sim)
    assert ticks == unit_ticks(schedule, p, m) and ticks.orders == sim.orders
    tables = (*tick_tables(schedule, p, m), weight_ticks(schedule, p, m))
    assert tables == tuple(ticks.table(kind) for kind in "FBW")
    pairs = [(d, g) for d, order in enumerate(sim.orders) for g in order if {k for k, _, _ in g} == {"F", "B", "W"}]
    assert len(pairs) >= p  # every device runs pairs (DualPipe's steady state)
    assert {(op.kind, op.microbatch, op.chunk) for op in sim.ops if op.paired} == {k for _, g in pairs for k in g}
    table_of = dict(zip("FBW", tables, strict=True))
    for d, group in pairs:
        at = {t for kind, j, c in group for t, row in enumerate(table_of[kind]) if row[d] == c // p * m + j}
        assert len(at) == 1, (d, group, at)


@pytest.mark.parametrize(("schedule", "p", "m"), CASES)
def test_the_tick_count_is_the_walk_of_the_orders_a_group_a_tick(schedule: str, p: int, m: int) -> None:
    """The table is as short as any placement of the orders a group a tick can be: the busiest device
    runs a group every tick, so the loop is shorter than its ops one a tick (what the program ran
    before: the simulation's makespan with a chunk's op a unit).  Each device's groups keep their order,
    each B comes after its F, and each W after its B or in its B's tick (a whole backward)."""
    ticks = unit_ticks(schedule, p, m)
    assert all(any(row) for row in ticks.rows)
    when = {key: t for t, row in enumerate(ticks.rows) for group in row for key in group}
    apart = simulate(schedule, p, m, Timing(*[2.0 if schedule == "dualpipev" else 1.0] * 3))  # a chunk's op: 1
    assert max(len(order) for order in ticks.orders) == len(ticks.rows) < apart.makespan  # the busiest never waits
    for order in ticks.orders:
        for before, group in zip(order, order[1:], strict=False):
            assert when[group[0]] > when[before[0]]
    for t, row in enumerate(ticks.rows):
        for group in row:
            for kind, j, c in group:
                if kind == "W":  # its B ran earlier, or earlier in the same tick's body (a whole backward)
                    assert when["B", j, c] < t or ("B", j, c) in group
                elif kind == "B":
                    assert when["F", j, c] < t


def test_the_lowered_loop_runs_the_costs_ticks() -> None:
    """The example's LLaMA block under DualPipe (P=4, 64 microbatches): the module `shardc lower` writes
    holds the tick table of the orders `shardc cost` simulated, a row a tick, its pairs in single rows."""
    plan = shardc.plan(shardc.parse(V_SPEC.replace("schedule 1f1b", "schedule dualpipe"), "dualpipe"))
    pipe = shardc.cost(plan).pipeline
    assert pipe is not None
    ticks = tick_table(pipe.simulation)
    source = lower_pipeline(plan, load=False).source
    tables = {t.id: ast.literal_eval(n.value) for n in ast.parse(source).body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and t.id in ("F_TABLE", "B_TABLE", "W_TABLE")}
    assert [tables[f"{k}_TABLE"] for k in "FBW"] == [tuple(map(tuple, ticks.table(k))) for k in "FBW"]
    assert len(tables["F_TABLE"]) == len(ticks.rows) == 72
    both = sum(f >= 0 and b >= 0 for f_row, b_row in zip(tables["F_TABLE"], tables["B_TABLE"], strict=True)
               for f, b in zip(f_row, b_row, strict=True))
    assert both == sum(op.paired and op.kind == "F" for op in pipe.simulation.ops)
    # the README's figures: over 4 stages and 8 microbatches 16 ticks, where each op at a tick of its own took 26
    assert len(unit_ticks("dualpipe", 4, 8).rows) == 16
    assert simulate("dualpipe", 4, 8, Timing(1.0, 1.0, 1.0)).makespan == 26


def _inner(eqn: Any) -> Iterator[Any]:
    """The jaxprs an equation holds (a shard_map's, a scan's body, a cond's branches)."""
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "eqns"):
                yield v
            elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                yield v.jaxpr


def _loop_body(jaxpr: Any) -> Any:
    """The body of the program's loop over the ticks (the fori_loop's scan)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            return next(_inner(eqn))
        for inner in _inner(eqn):
            if (found := _loop_body(inner)) is not None:
                return found
    return None


@pytest.mark.slow  # traced only, not run; placing its arguments on the devices compiles
def test_a_ticks_backward_reads_nothing_its_forward_makes(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the loop's body of a whole model under DualPipe, no equation of the stage's B or W reads a value the
    stage's F made at that tick (directly or through the buffers): a pair's forward and backward are free
    for XLA to overlap.  (Reading the residuals after the forward's write, as the body did, made 15 such.)"""
    import jax

    from shardc.lowering.pipeline_runtime import Pipeline
    from shardc.verification.pipeline_verify import draw_cotangent, draw_inputs

    def scoped(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Pipeline, *args: Any) -> Any:
            with jax.named_scope(name):
                return method(self, *args)
        return run

    for name in ("_stage_fwd", "_stage_input_bwd", "_stage_weight_bwd"):
        monkeypatch.setattr(Pipeline, name, scoped(f"tick{name}", getattr(Pipeline, name)))
    lowered = lower_pipeline(shardc.plan(shardc.parse(WHOLE)))
    pipe = lowered.namespace.PIPELINE
    inputs = draw_inputs(lowered, 0, 0)
    args = pipe.arguments(inputs, pipe.ends.cotangent(pipe, inputs, draw_cotangent(lowered, inputs, 0)))
    body = _loop_body(jax.make_jaxpr(pipe.program()[1])(*args).jaxpr)
    made: set[Any] = set()  # values of the tick's forward, or computed from them
    read = []
    for eqn in body.eqns:
        where = str(eqn.source_info.name_stack)
        ins = {v for v in eqn.invars if not hasattr(v, "val")}
        if "bwd" in where:
            read.append(bool(ins & made))
        elif "tick_stage_fwd" in where or ins & made:
            made |= set(eqn.outvars)
    assert made and len(read) > 10 and not any(read)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved 2", "zb-h1", "zbv", "dualpipev", "dualpipe"])
def test_every_schedule_lowers_the_order_the_cost_simulates(schedule: str) -> None:
    """The module `shardc lower` writes runs the tick table of the simulation `shardc cost` steps, at the
    spec's own times: for zbv too, whose greedy order depends on them (here it is not the order found at
    equal times, which the program ran before)."""
    plan = shardc.plan(shardc.parse(V_SPEC.replace("schedule 1f1b", f"schedule {schedule}")))
    report = shardc.cost(plan)
    assert report.pipeline is not None
    sim = report.pipeline.simulation
    tables = _tables(lower_pipeline(plan, load=False).source)
    ticks = tick_table(sim)
    name = schedule.split()[0]
    assert tables[:2] == tuple(tuple(map(tuple, ticks.table(kind))) for kind in "FB")
    assert tables[2] == (tuple(map(tuple, ticks.table("W"))) if name in SPLIT_SCHEDULES else None)
    assert (ticks == unit_ticks(name, sim.stages, sim.microbatches, sim.chunks)) == (name != "zbv")


def test_zbvs_order_at_equal_times_runs_slower_at_the_costs() -> None:
    """Why the program takes zbv's order from the cost's simulation: at T_B = 2 T_F = 2 T_W over 4 stages
    and 8 microbatches the greedy order found at those times takes 37.5 T_F, the one found at equal times
    46.5 T_F run at them; the fixed orders are the same at any times."""
    timing = Timing(1.0, 2.0, 1.0)
    costed, equal = simulate("zbv", 4, 8, timing), unit_ticks("zbv", 4, 8)
    assert costed.orders != equal.orders and tick_table(costed).orders == costed.orders
    chunk = {"F": 0.5, "B": 1.0, "W": 0.5}  # each of a device's two chunks half its stage
    ran = run_orders("zbv", 4, 8, [chunk] * 8, 0.0, equal.orders)
    assert (costed.makespan, max(op.end for op in ran)) == (37.5, 46.5)
    for name in ("1f1b", "interleaved", "zb-h1", "dualpipev"):  # fixed orders: the same at any times
        assert tick_table(simulate(name, 4, 8, timing, 2)) == unit_ticks(name, 4, 8, 2)


def _tables(source: str) -> tuple[Any, ...]:
    """F_TABLE, B_TABLE and W_TABLE as a lowered module writes them."""
    found = {node.targets[0].id: ast.literal_eval(node.value) for node in ast.parse(source).body
             if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
             and node.targets[0].id in ("F_TABLE", "B_TABLE", "W_TABLE")}
    return found["F_TABLE"], found["B_TABLE"], found["W_TABLE"]
