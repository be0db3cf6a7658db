"""DualPipe's and DualPipeV's lowered tick tables: the cost's simulation's own orders placed a group a
tick (:mod:`shardc.pipeline.ticks`), so an F&B pair's forward and whole backward are issued in one
iteration of the lowered loop, and the loop runs as many ticks as the cost's order placed so."""

from __future__ import annotations

import ast

import pytest

import shardc
from shardc.lowering.pipeline_lowering import lower_pipeline, tick_tables, weight_ticks
from shardc.pipeline.schedules import Phases, Timing, simulate
from shardc.pipeline.ticks import tick_table, unit_ticks
from tests.test_pipeline_split import V_SPEC

CASES = [("dualpipe", 2, 4), ("dualpipe", 4, 8), ("dualpipe", 4, 10), ("dualpipe", 8, 20),
         ("dualpipev", 2, 4), ("dualpipev", 4, 8), ("dualpipev", 3, 7)]
# a pair shorter than its ops one after the other: each one's collectives under the other's computation
OVERLAPPED = Timing(1.0, 1.4, 0.6, phases=Phases(0.4, 1.0, 2.0, 0.5))


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
    """The table is as short as the orders allow: every row runs something, and each group's tick is
    the first after its device's previous group and every op it reads; the busiest device runs a group
    every tick, so the loop is shorter than its ops one a tick (what the program ran before: the
    simulation's makespan with a chunk's op a unit)."""
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
