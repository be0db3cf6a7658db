"""``shardc verify FILE --module MOD.py`` of a pipelined spec: the module `shardc lower` wrote for it,
written at the spec's sizes, runs at verify's; an edit of its code fails the values or the HLO, an
edit of its tables or tick tables is refused as written for another run, never a traceback."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardc.cli.main import main
from shardc.pipeline.ticks import unit_ticks
from tests.test_plan_sections import MODEL

pytestmark = pytest.mark.slow  # every test here lowers, compiles and runs a pipelined module

# 8 layers in 8 microbatches as written; verify runs 2P = 4 layers in 4
SPEC = MODEL.replace("microbatches 2", "microbatches 8").replace("layers 4 {", "layers 8 {")

# (the line edited, its replacement): each must fail verify
MUTANTS = {
    "the embedding's gradient scaled": (
        "    dW_emb = vocab_scatter(Tok, dX0, W_emb.shape[0], ('Y',))",
        "    dW_emb = vocab_scatter(Tok, dX0, W_emb.shape[0], ('Y',)) * 1.1"),
    "the once-a-step reduce-scatter as a local slice": (
        "    dW1 = jax.lax.psum_scatter(dW1_1, 'X', scatter_dimension=0, tiled=True)",
        "    dW1 = jax.lax.dynamic_slice_in_dim(2 * dW1_1, jax.lax.axis_index('X') * (dW1_1.shape[0] // 2), "
        "dW1_1.shape[0] // 2, 0)"),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The spec's file and the module `shardc lower` wrote for it."""
    folder = tmp_path_factory.mktemp("pipelined")
    spec, module = folder / "model.shard", folder / "model.py"
    spec.write_text(SPEC, encoding="utf-8")
    assert main(["lower", str(spec), "-o", str(module)]) == 0
    return spec, module.read_text(encoding="utf-8")


def _verify(capsys: pytest.CaptureFixture[str], spec: Path, source: str) -> tuple[int, str]:
    module = spec.with_name("given.py")
    module.write_text(source, encoding="utf-8")
    capsys.readouterr()
    code = main(["verify", str(spec), "--module", str(module)])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out + err


def test_the_module_lower_wrote_runs_at_verifys_sizes(written: tuple[Path, str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    spec, source = written
    code, out = _verify(capsys, spec, source)
    assert code == 0, out
    assert "the module run is " in out
    assert ("was written for the mesh P=2, X=2, Y=2 with 8 layers and 8 microbatches; verify runs it at the mesh "
            "P=2, X=2, Y=2 with 4 layers and 4 microbatches") in out


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_an_edit_of_the_modules_code_fails(written: tuple[Path, str], capsys: pytest.CaptureFixture[str],
                                           mutant: str) -> None:
    spec, source = written
    line, edited = MUTANTS[mutant]
    assert source.count(line) == 1, f"the module no longer has {line!r}"
    code, out = _verify(capsys, spec, source.replace(line, edited))
    assert code == 1 and "verification FAILED" in out, out


@pytest.mark.parametrize(("edit", "message"), [
    (("    (0, -1),\n", "    (1, -1),\n"), "its tick tables are not 1f1b's for 2 stages and 8 microbatches"),
    (("PARAMS = ('W1', 'W2')", "PARAMS = ('W2', 'W1')"), "written for another spec or plan: its PARAMS is"),
    (("LAYERS = 8 ", "LAYERS = 1 "), "are not P's stages with a layer each at least"),
    (("def post_backward_local(", "def post_backward_local_(", ), "does not load: KeyError: 'post_backward_local'"),
])
def test_an_edit_of_its_tables_is_refused(written: tuple[Path, str], capsys: pytest.CaptureFixture[str],
                                          edit: tuple[str, str], message: str) -> None:
    spec, source = written
    assert edit[0] in source, f"the module no longer has {edit[0]!r}"
    code, out = _verify(capsys, spec, source.replace(edit[0], edit[1], 1))
    assert code == 1 and message in out, out


def test_a_zbv_module_runs_its_costed_order_and_a_tick_table_broken_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A zbv module, whose tick tables hold the greedy order the cost found at the spec's times (not one
    verify can find again at its own sizes), runs; its tables with a W moved before its B are refused."""
    spec, module = tmp_path / "zbv.shard", tmp_path / "zbv.py"
    spec.write_text(SPEC + "\nschedule zbv", encoding="utf-8")
    assert main(["lower", str(spec), "-o", str(module)]) == 0
    source = module.read_text(encoding="utf-8")
    code, out = _verify(capsys, spec, source)
    assert code == 0, out
    head, rows = source.split("W_TABLE = (\n", 1)
    _, rest = rows.split("\n", 1)
    broken = head + "W_TABLE = (\n" + "    (0, -1),\n" + rest  # a W at tick 0, before any B
    code, out = _verify(capsys, spec, broken)
    assert code == 1 and "its tick tables are not zbv's for 2 stages and 8 microbatches at its RUN_SIZES" in out, out
    # every op once in an order its reads allow, but not the order the cost found at the module's sizes
    unit = unit_ticks("zbv", 2, 8)
    other = source
    for kind in "FBW":
        rows = "".join(f"    {tuple(row)!r},\n" for row in unit.table(kind))
        other = re.sub(rf"{kind}_TABLE = \(\n(    .*\n)*\)", f"{kind}_TABLE = (\n{rows})", other, count=1)
    assert other != source
    code, out = _verify(capsys, spec, other)
    assert code == 1 and "its tick tables are not zbv's for 2 stages and 8 microbatches at its RUN_SIZES" in out, out
    code, out = _verify(capsys, spec, source.replace("RUN_SIZES = {'B': 16,", "RUN_SIZES = {'B': 0,", 1))
    assert code == 1 and "its RUN_SIZES {'B': 0," in out and "are not sizes of the spec's dims" in out, out
    code, out = _verify(capsys, spec, source.replace("RUN_SIZES = {'B': 16,", "RUN_SIZES = {'B': 12,", 1))
    assert code == 1 and "its tick tables are not zbv's for 2 stages and 8 microbatches at its RUN_SIZES" in out, out
