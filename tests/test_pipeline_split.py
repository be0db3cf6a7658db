"""The zero-bubble schedules lowered as themselves: the block's backward cut into B (the input's
gradient) and W (the weights'), run at the ticks ZB-H1's, ZBV's and DualPipeV's tick tables give
(the last two with two chunks a device in a V), and verified against the unsharded reference."""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import shardc
from shardc.lowering import pipeline_lowering
from shardc.lowering.pipeline_lowering import lower_pipeline, tick_tables, weight_ticks
from shardc.pipeline.schedules import Timing, simulate
from shardc.pipeline.ticks import TickTable, tick_table
from shardc.verification.pipeline_verify import run_sizes, verify_pipeline
from tests.test_plan_sections import MODEL

EXAMPLE = Path(__file__).parents[1] / "examples" / "pipeline_llama.shard"
ZB_MODEL = MODEL.replace("microbatches 2", "microbatches 2\nschedule zb-h1")


def _ticks(table: list[list[int]], stage: int) -> dict[int, int]:
    """Microbatch -> the tick at which ``stage`` runs it in ``table``."""
    return {row[stage]: t for t, row in enumerate(table) if row[stage] >= 0}


@pytest.mark.parametrize(("schedule", "p", "m"), [("zb-h1", 2, 2), ("zb-h1", 4, 8), ("zb-h1", 4, 5), ("zb-h1", 3, 9),
                                                  ("zbv", 2, 4), ("zbv", 4, 8), ("zbv", 3, 5),
                                                  ("dualpipev", 2, 4), ("dualpipev", 4, 8), ("dualpipev", 3, 7),
                                                  ("dualpipe", 2, 4), ("dualpipe", 4, 8), ("dualpipe", 4, 10)])
def test_tick_tables_run_b_and_w_apart_in_the_schedules_order(schedule: str, p: int, m: int) -> None:
    """Every stage runs F, B and W of every microbatch through each of its chunks once each, W after its B:
    the tables are the simulation's orders, a group a tick (DualPipe's chunks are whole stages, each
    microbatch through one of them: the first half chunk 0's, the second chunk 1's).  ZB-H1 and ZBV run one
    op a tick, where the simulation at unit times starts it; the DualPipes' F&B pair sits in one tick and
    a whole backward's W at its B's tick (after it in the tick's body), so their tables are shorter than
    that simulation's makespan.  Under ZB-H1 stage s's W of microbatch j waits for the B of microbatch
    j + s (the lag that fills its drain)."""
    forward, backward = tick_tables(schedule, p, m)
    weight = weight_ticks(schedule, p, m)
    chunks = 1 if schedule == "zb-h1" else 2
    sim = simulate(schedule, p, m, Timing(*[float(chunks if schedule != "dualpipe" else 1)] * 3))
    ticks, paired = tick_table(sim), schedule.startswith("dualpipe")
    assert weight is not None and len(forward) == len(backward) == len(weight) == len(ticks.rows)
    assert ticks.orders == sim.orders and (len(forward) < sim.makespan) == paired
    entries = list(range(chunks * m)) if schedule != "dualpipe" else [*range(m // 2), *range(m + m // 2, 2 * m)]
    for s in range(p):
        f, b, w = (_ticks(table, s) for table in (forward, backward, weight))
        assert sorted(f) == sorted(b) == sorted(w) == entries  # entry: chunk x M + microbatch
        assert all(f[e] < b[e] <= w[e] for e in f) and (paired or all(b[e] < w[e] for e in f))
        if schedule == "zb-h1":
            assert all(w[j] > b[min(j + s, m - 1)] for j in range(m))
        ops = [(t, kind) for kind, table in zip("FBW", (f, b, w), strict=True) for t in table.values()]
        assert paired or len({t for t, _ in ops}) == len(ops)  # one op a tick
        assert paired or sorted(ops) == sorted((int(op.start), op.kind) for op in sim.ops if op.device == s)
    assert weight_ticks("1f1b", p, m) is None


def test_the_backward_is_cut_into_b_and_w_each_line_once() -> None:
    """B makes the block input's gradient, W every param's; together they run the whole backward's lines,
    each once; W reads only the forward's saved values and what B hands it (B's values and the cotangent)."""
    plan = shardc.plan(shardc.parse(EXAMPLE.read_text().replace("schedule 1f1b", "schedule zb-h1")))
    source = lower_pipeline(plan, sizes={"X": 2, "Y": 2}, layers=4, microbatches=4, load=False).source
    tree = ast.parse(source)
    functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    tables = {t.id: ast.literal_eval(n.value) if not isinstance(n.value, ast.Dict) else
              [ast.literal_eval(k) for k in n.value.keys if k is not None]
              for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)
              and t.id.endswith(("_IN", "_OUT"))}

    def lines(name: str) -> list[str]:
        return [ast.unparse(s) for s in functions[name].body[1:-1]]  # the docstring and return aside

    whole, b, w = lines("backward_local"), lines("input_backward_local"), lines("weight_backward_local")
    assert sorted(whole) == sorted(b + w) and b and w
    assert tables["INPUT_BACKWARD_OUT"][0] == "dX" and "dX" not in tables["WEIGHT_BACKWARD_OUT"]
    assert sorted(tables["WEIGHT_BACKWARD_OUT"]) == sorted(f"dW_{n}" for n in ("q", "k", "v", "o", "gate", "up",
                                                                               "down"))
    saved = set(tables["FORWARD_IN"]) | set(tables["FORWARD_OUT"])
    handed = set(tables["INPUT_BACKWARD_OUT"])
    assert set(tables["WEIGHT_BACKWARD_IN"]) <= saved | handed
    # B hands on only what W reads: gradients it made (the output's, an intermediate's), not made again
    assert handed - {"dX"} and handed - {"dX"} <= set(tables["WEIGHT_BACKWARD_IN"]) - saved
    assert "W_TABLE = (\n" in source and "lowers as GPipe" not in source


@pytest.mark.slow
def test_zb_h1_verifies_as_itself() -> None:
    """The example's LLaMA layer under ZB-H1: values and HLO (its tick table's loop, one permute each way)."""
    text = EXAMPLE.read_text().replace("schedule 1f1b", "schedule zb-h1")
    report = verify_pipeline(shardc.plan(shardc.parse(text, "zb-h1")), devices=8)
    assert report.ok, [r for r in report.values + report.collectives if not r.ok]
    assert not any("lowers as GPipe" in n for n in report.notes)
    ticks = len(tick_tables("zb-h1", 2, 4)[0])
    loop, down, up = report.collectives[:3]
    assert loop.ok and loop.hlo_op == f"while x [{ticks}]" and ticks != 2 * (4 + 2 - 1)  # not GPipe's or 1F1B's
    assert down.ok and up.ok and down.hlo_op == up.hlo_op == "collective-permute x 1"


@pytest.mark.slow
def test_w_skipped_or_before_its_b_fails_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole model (embedding, block, loss) under ZB-H1 verifies; with its W table emptied (W never
    runs: the block's and the ends' weight gradients, all at W ticks, are wrong), or W run at its
    microbatch's forward tick (before B made what it reads: the block's, and the embedding's, whose
    backward reads the block input's gradient), verify fails."""
    plan = shardc.plan(shardc.parse(ZB_MODEL))
    assert verify_pipeline(plan).ok

    run_ticks = pipeline_lowering.run_ticks
    Key = tuple[str, int, int]  # an op: kind, microbatch, chunk

    def moved(w_at: Callable[[dict[Key, tuple[int, int]], Key], tuple[int, int] | None],
              *args: Any) -> TickTable:
        """The lowered tick table with each W op at ``w_at``'s (tick, device), or nowhere for None."""
        ticks = run_ticks(*args)
        at = {op: (t, d) for t, row in enumerate(ticks.rows) for d, group in enumerate(row) for op in group}
        cells = [[[op for op in group if op[0] != "W"] for group in row] for row in ticks.rows]
        for op in (op for op in at if op[0] == "W"):
            if (where := w_at(at, op)) is not None:
                cells[where[0]][where[1]].append(op)
        return replace(ticks, rows=tuple(tuple(tuple(cell) for cell in row) for row in cells))

    def never(*args: Any) -> TickTable:
        return moved(lambda at, op: None, *args)

    def early(*args: Any) -> TickTable:  # each W at its microbatch's F tick
        return moved(lambda at, op: at[("F", op[1], op[2])], *args)

    for mutant, wrong in ((never, {"dW1", "dW2", "dW_emb", "dW_out"}), (early, {"dW1", "dW2", "dW_emb"})):
        monkeypatch.setattr(pipeline_lowering, "run_ticks", mutant)
        report = verify_pipeline(plan)
        assert not report.ok and {r.tensor for r in report.values if not r.ok} == wrong, mutant


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_verify_runs_a_written_module_and_refuses_its_w_table_edited(
        schedule: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`verify --module` runs the module's own B and W functions at verify's sizes; a W table that is not
    the schedule's (a W moved to another tick) is refused as written for another run."""
    from shardc.cli.main import main

    spec, module = tmp_path / "zb.shard", tmp_path / "zb.py"
    spec.write_text(ZB_MODEL.replace("microbatches 2", "microbatches 4").replace("zb-h1", schedule), encoding="utf-8")
    assert main(["lower", str(spec), "-o", str(module)]) == 0
    source = module.read_text(encoding="utf-8")
    table = source[source.index("W_TABLE = (\n"):]
    edited = table.replace("    (-1, -1),\n", "    (0, -1),\n", 1)
    for text, code in ((source, 0), (source.replace(table, edited), 1)):
        module.write_text(text, encoding="utf-8")
        capsys.readouterr()
        assert main(["verify", str(spec), "--module", str(module)]) == code
        out = "".join(capsys.readouterr())
        assert code == 0 or f"its tick tables are not {schedule}'s for 2 stages and 4 microbatches" in out, out


V_SPEC = EXAMPLE.read_text().replace("mesh P=4 pipeline, X=8, Y=4", "mesh P=4 pipeline, X=8, Y=1")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_the_v_schedules_verify_as_themselves(schedule: str) -> None:
    """ZBV and DualPipeV over 4 stages (8 devices: P=4, X=2): two chunks a device in a V, one layer each,
    F, B and W at their own tables' ticks; activations and cotangents each go down and up (4 permutes)."""
    plan = shardc.plan(shardc.parse(V_SPEC.replace("schedule 1f1b", f"schedule {schedule}"), schedule))
    report = verify_pipeline(plan, devices=8)
    assert report.ok, [r for r in report.values + report.collectives if not r.ok]
    assert report.mesh == {"P": 4, "X": 2, "Y": 1} and report.sizes["layers"] == 8
    assert not any("lowers as GPipe" in n for n in report.notes)
    loop, *permutes = report.collectives[:5]
    sizes, layers, micro = run_sizes(plan, 8)  # zbv's table: the cost's order at verify's sizes
    ticks = lower_pipeline(plan, sizes=sizes, layers=layers, microbatches=micro, load=False).ticks
    assert ticks is not None and loop.hlo_op == f"while x [{len(ticks.rows)}]"
    assert [r.step.split(": ")[1] for r in permutes] == [
        "activations s -> s+1, a microbatch", "activations s+1 -> s, a microbatch",
        "cotangents s -> s+1, a microbatch", "cotangents s+1 -> s, a microbatch"]
    assert all(r.ok and r.hlo_op == "collective-permute x 1" for r in permutes)


@pytest.mark.slow
def test_zbv_verifies_with_its_ends_on_stage_0_and_fails_placed_as_a_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole model under ZBV: the embedding and the loss both on stage 0 (the V's first and last chunk);
    the same tables run with the chunks placed as the interleaved ring fail verify."""
    plan = shardc.plan(shardc.parse(MODEL.replace("microbatches 2", "microbatches 4\nschedule zbv")))
    report = verify_pipeline(plan)
    assert report.ok, [r for r in report.values + report.collectives if not r.ok]
    monkeypatch.setattr(pipeline_lowering, "V_SHAPED", ())
    assert not verify_pipeline(plan).ok


@pytest.mark.slow
def test_a_tied_embedding_under_zbv_needs_no_swap() -> None:
    """ZBV's V puts the embedding and the output layer on stage 0: both contributions to the tied table's
    gradient are summed there, no permute between the end stages (the cost's exchange is 0 too)."""
    from shardc.verification.verify import verify
    from tests.test_pipeline_ends import _tied_text

    plan = shardc.plan(shardc.parse(_tied_text("mesh P=2 pipeline, X=2, Y=2\nschedule zbv\nmicrobatches 4")))
    report = verify(plan)
    assert report.ok, [r for r in report.values + report.collectives if not r.ok]
    assert "dW_emb" in {r.tensor for r in report.values} and not any("tied" in r.step for r in report.collectives)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_a_dropout_block_verifies_with_b_and_w_apart(schedule: str) -> None:
    """A block alone with dropout: W reads the keep-masks the forward saved; under zbv the block's output
    is kept on stage 0 (the V's last chunk) and each chunk draws its layers' masks."""
    from tests.test_pipeline_dropout import SPEC

    report = verify_pipeline(shardc.plan(shardc.parse(SPEC.format(schedule=schedule))), key=3)
    assert report.ok, [r for r in report.values + report.collectives if not r.ok]
