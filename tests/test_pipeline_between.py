"""Several `layers` blocks under a pipeline: a statement between two blocks is refused at validation, with its
place (each command exits 2 with the span, never an internal error); blocks that follow one another, open or
close the spec, or number three plan and cost."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardc
from shardc.cli.main import main
from shardc.errors import ShardcError
from shardc.pipeline.boundary import batch_dim
from tests.test_layers_pipeline import MODEL  # two blocks between an embedding and a loss, as lowered

# a norm between a dense stack and the next stack, as a user writes it (issue 21's reproduction)
MIDP = """mesh P=2 pipeline, X=2
dims B=4096, D=4096, F=16384, M=5
param W1, W2, V1, V2
E0[B_X, D] = In[B_X, D]
layers 3 {
  H[B_X, F] = gelu(E0[B_X, D] · W1[D, F])
  E1[B_X, D] = E0[B_X, D] + H[B_X, F] · W2[F, D]
}
N1[B_X, D] = rmsnorm(E1[B_X, D] over D)
layers M {
  G[B_X, F] = gelu(N1[B_X, D] · V1[D, F])
  E2[B_X, D] = N1[B_X, D] + G[B_X, F] · V2[F, D]
}
Out[B_X, D] = E2[B_X, D]
"""
SMALL = {"B=4096, D=4096, F=16384": "B=64, D=32, F=64"}


def _small(text: str) -> str:
    for old, new in SMALL.items():
        text = text.replace(old, new)
    return text


def test_a_statement_between_pipelined_blocks_is_refused_at_its_line() -> None:
    with pytest.raises(ShardcError, match="N1 is computed between two `layers` blocks") as err:
        shardc.parse(MIDP)
    span = err.value.span
    assert span is not None and (span.line, span.column) == (9, 1)
    assert "last statement of the block before" in (err.value.fix or "")


@pytest.mark.parametrize("argv", [["plan"], ["cost"], ["cost", "--json"], ["lower"], ["layouts"]])
def test_every_command_refuses_it_with_the_span(argv: list[str], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`shardc cost` stopped with "a step outside the `layers` block sits among the block's steps ... a planner
    bug"; every command now exits 2 at the statement."""
    path = tmp_path / "midp.shard"
    path.write_text(MIDP)
    assert main([argv[0], str(path), *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert f"{path}:9:1: error: N1 is computed between" in err
    assert "planner bug" not in err and "internal" not in err


def test_unpipelined_it_runs_once_between_the_blocks() -> None:
    """The same spec with the pipeline axis at 1 (pipelining off) plans and costs: the norm runs once."""
    plan = shardc.plan(shardc.parse(_small(MIDP.replace("P=2", "P=1"))))
    norm = [s for s in plan.forward if s.tensor == "N1"]
    assert norm and all(s.once for s in norm)
    assert shardc.cost(plan).pipeline is None


@pytest.mark.parametrize("blocks", [2, 3])
def test_blocks_that_follow_one_another_cost(blocks: int) -> None:
    """Directly after one another (two or three blocks), every layer over the two stages."""
    text = _small(MIDP).replace("N1[B_X, D] = rmsnorm(E1[B_X, D] over D)\n", "").replace("N1[", "E1[")
    if blocks == 3:
        text = text.replace("param W1, W2", "param U1, U2, W1, W2").replace("E0[B_X, D] = In[B_X, D]\n", (
            "E[B_X, D] = In[B_X, D]\nlayers 2 {\n  J[B_X, F] = gelu(E[B_X, D] · U1[D, F])\n"
            "  E0[B_X, D] = E[B_X, D] + J[B_X, F] · U2[F, D]\n}\n"))
    report = shardc.cost(shardc.plan(shardc.parse(text)))
    assert report.pipeline is not None
    assert report.pipeline.pipeline.blocks == (2,) * (blocks == 3) + (3, 5)


# a block that opens the spec reads its input itself: the microbatches cut that input's batch dim
OPENING = """mesh P=2 pipeline, X=2
dims B=64, D=32, F=64
param W0, U0
layers 4 {
  H0[B_X, F] = gelu(In[B_X, D] · W0[D, F])
  E1[B_X, D] = In[B_X, D] + H0[B_X, F] · U0[F, D]
}
Out[B_X, D] = rmsnorm(E1[B_X, D] over D)
"""


def test_a_block_opening_the_spec_cuts_its_inputs_batch_dim() -> None:
    """It stopped with "a pipeline needs a batch dim ...; every input dim is a param's" (and no span): the
    block's input was sought among activations only."""
    plan = shardc.plan(shardc.parse(OPENING))
    assert batch_dim(plan.spec, plan.tensors) == "B"
    assert shardc.cost(plan).pipeline is not None


def test_no_batch_dim_is_refused_at_the_block() -> None:
    text = OPENING.replace("dims B=64, ", "dims ").replace("B_X, ", "").replace("param W0, U0", "param W0, U0, In")
    with pytest.raises(ShardcError, match="needs a batch dim") as err:
        shardc.cost(shardc.plan(shardc.parse(text)))
    assert err.value.span is not None and err.value.span.line == 4


NORM = "Fn[B_X, S, D] = rmsnorm(X2[B_X, S, D] over D)"
READS = {  # a read past the block of a value the stage after it does not receive: (old, new, line, column)
    # a dead end after the output makes it the one handed on: the norm read X2, a value inside
    # (`shardc cost` stopped with "a step outside the `layers` block sits among the block's steps")
    "dead end": ("  X2[B_X, S, D] = X1[B_X, S, D] + G[B_X, S, K] · V2[K, D]\n",
                 "  X2[B_X, S, D] = X1[B_X, S, D] + G[B_X, S, K] · V2[K, D]\n  Z[B_X, S, D] = gelu(X2[B_X, S, D])\n",
                 16, 25),
    "inner value": (NORM, NORM + " + G[B_X, S, K] · V2[K, D]", 15, 49),  # cost: the same InternalError
    # the first block's output read after the second (`shardc lower`: "the backward reads dX1_1 ...")
    "earlier block": (NORM, "Fn[B_X, S, D] = rmsnorm(X2[B_X, S, D] + X1[B_X, S, D] over D)", 15, 41),
}


@pytest.mark.parametrize("case", READS)
def test_a_block_value_read_past_what_the_stages_hand_on_is_refused(case: str) -> None:
    old, new, line, column = READS[case]
    assert old in MODEL
    with pytest.raises(ShardcError, match="is read past the `layers") as err:
        shardc.parse(MODEL.replace(old, new))
    assert err.value.span is not None and (err.value.span.line, err.value.span.column) == (line, column)
    shardc.cost(shardc.plan(shardc.parse(MODEL.replace(old, new).replace("P=2", "P=1"))))  # unpipelined: fine

