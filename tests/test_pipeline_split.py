"""ZB-H1 lowered as itself: the block's backward cut into B (the input's gradient) and W (the weights'),
run at the ticks ZB-H1's tick tables give, and verified against the unsharded reference."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import shardc
from shardc.lowering import pipeline_lowering
from shardc.lowering.pipeline_lowering import lower_pipeline, schedule_note, tick_tables, weight_ticks
from shardc.pipeline.schedules import Timing, simulate
from shardc.verification.pipeline_verify import verify_pipeline
from tests.test_plan_sections import MODEL

EXAMPLE = Path(__file__).parents[1] / "examples" / "pipeline_llama.shard"
ZB_MODEL = MODEL.replace("microbatches 2", "microbatches 2\nschedule zb-h1")


def _ticks(table: list[list[int]], stage: int) -> dict[int, int]:
    """Microbatch -> the tick at which ``stage`` runs it in ``table``."""
    return {row[stage]: t for t, row in enumerate(table) if row[stage] >= 0}


@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 8), (4, 5), (3, 9)])
def test_zb_h1_tick_tables_run_b_and_w_apart_in_its_order(p: int, m: int) -> None:
    """Every stage runs F, B and W of every microbatch once each, one op a tick, W after its B (at another
    tick), stage s's W of microbatch j once it has run the B of microbatch j + s (the lag that fills its
    drain): the tables are the simulation's ops, a tick a unit."""
    forward, backward = tick_tables("zb-h1", p, m)
    weight = weight_ticks("zb-h1", p, m)
    assert weight is not None and len(forward) == len(backward) == len(weight)
    sim = simulate("zb-h1", p, m, Timing(1.0, 1.0, 1.0))
    assert len(forward) == sim.makespan
    for s in range(p):
        f, b, w = (_ticks(table, s) for table in (forward, backward, weight))
        assert sorted(f) == sorted(b) == sorted(w) == list(range(m))
        assert all(f[j] < b[j] < w[j] for j in range(m))
        assert all(w[j] > b[min(j + s, m - 1)] for j in range(m))
        ops = [(t, kind) for kind, table in zip("FBW", (f, b, w), strict=True) for t in table.values()]
        assert len({t for t, _ in ops}) == len(ops)  # one op a tick
        assert sorted(ops) == sorted((int(op.start), op.kind) for op in sim.ops if op.device == s)
    assert weight_ticks("1f1b", p, m) is None and schedule_note("zb-h1") is None


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
    runs), or W run at its microbatch's forward tick (before B made what it reads), the block's weight
    gradients are wrong and verify fails."""
    plan = shardc.plan(shardc.parse(ZB_MODEL))
    assert verify_pipeline(plan).ok

    def never(schedule: str, stages: int, microbatches: int) -> list[list[int]]:
        return [[-1] * stages for _ in tick_tables(schedule, stages, microbatches)[0]]

    def early(schedule: str, stages: int, microbatches: int) -> list[list[int]]:
        return tick_tables(schedule, stages, microbatches)[0]  # each W at its microbatch's F tick

    for mutant in (never, early):
        monkeypatch.setattr(pipeline_lowering, "weight_ticks", mutant)
        report = verify_pipeline(plan)
        assert not report.ok and {r.tensor for r in report.values if not r.ok} == {"dW1", "dW2"}, mutant


@pytest.mark.slow
def test_verify_runs_a_written_zb_h1_module_and_refuses_its_w_table_edited(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`verify --module` runs the module's own B and W functions at verify's sizes; a W table that is not
    ZB-H1's (a W moved to another tick) is refused as written for another run."""
    from shardc.cli.main import main

    spec, module = tmp_path / "zb.shard", tmp_path / "zb.py"
    spec.write_text(ZB_MODEL.replace("microbatches 2", "microbatches 4"), encoding="utf-8")
    assert main(["lower", str(spec), "-o", str(module)]) == 0
    source = module.read_text(encoding="utf-8")
    table = source[source.index("W_TABLE = (\n"):]
    edited = table.replace("    (-1, -1),\n", "    (0, -1),\n", 1)
    for text, code in ((source, 0), (source.replace(table, edited), 1)):
        module.write_text(text, encoding="utf-8")
        capsys.readouterr()
        assert main(["verify", str(spec), "--module", str(module)]) == code
        out = "".join(capsys.readouterr())
        assert code == 0 or "its tick tables are not zb-h1's for 2 stages and 4 microbatches" in out, out
