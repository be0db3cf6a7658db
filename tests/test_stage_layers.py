"""``stage_layers 1, 3, 3, 3``: the layers each pipeline stage holds where not the even split (Megatron-LM's
uneven first and last stages), read by the cost, the lowering and verify alike."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardc
from shardc.errors import ShardcError
from shardc.lowering.pipeline_lowering import lower_pipeline
from shardc.pipeline.block_split import device_blocks, stage_blocks
from shardc.spec.stages import pipeline_of
from shardc.verification.pipeline_verify import run_sizes, run_split, verify_pipeline

SPEC = "mesh P=4 pipeline, X=2\nlayers 10\nstage_layers 1, 3, 3, 3\nmicrobatches 4\ndims B=8, D=4\nparam W\n" \
       "Out[B_X, D] = tanh(In[B_X, D] * W[D])\n"
ROOT = Path(__file__).resolve().parent.parent


def test_the_line_parses_prints_and_splits_the_pipeline() -> None:
    spec = shardc.parse(SPEC)
    assert spec.stage_layers == (1, 3, 3, 3) and "stage_layers 1, 3, 3, 3" in str(spec)
    assert shardc.parse(str(spec)) == spec
    pipe = pipeline_of(spec)
    assert pipe is not None and pipe.stage_layers == (1, 3, 3, 3) and not pipe.even
    report = shardc.cost(shardc.plan(spec))
    assert "10 layers over 4 stages, as `stage_layers` splits them: 1, 3, 3, 3" in report.render()
    assert report.to_json()["pipeline"]["layers"] == [1, 3, 3, 3]


@pytest.mark.parametrize(("line", "message"), [
    ("stage_layers 1, 3, 3", r"gives 3 count\(s\) summing to 7: P has 4 stages and the spec 10 layers"),
    ("stage_layers 0, 4, 3, 3", "stage_layers: size must be positive, not 0"),
    ("stage_layers 1, 3, 3, 3\nschedule interleaved 2", "holds 2 chunks a device"),
])
def test_a_split_that_is_not_the_stages_layers_is_refused_at_its_line(line: str, message: str) -> None:
    with pytest.raises(ShardcError, match=message) as err:
        shardc.parse(SPEC.replace("stage_layers 1, 3, 3, 3", line))
    assert err.value.span is not None and err.value.span.line == 3
    with pytest.raises(ShardcError, match="`stage_layers` needs a pipeline axis"):
        shardc.parse(SPEC.replace("mesh P=4 pipeline, X=2", "mesh P=4, X=2").replace("microbatches 4\n", ""))


def test_the_module_holds_the_split_and_verify_runs_one_like_it() -> None:
    plan = shardc.plan(shardc.parse(SPEC))
    lowered = lower_pipeline(plan, sizes={"X": 1}, load=False)
    assert "\nSTAGE_LAYERS = (1, 3, 3, 3)" in lowered.source
    assert run_split(plan) == (1, 2, 2, 2) and run_sizes(plan, 8)[1] == 7  # uneven still: stage 0 holds one


def test_deepseek_v3_balances_its_ends_against_eight_moe_layers() -> None:
    """The dense layers alone beside the embedding, 2 MoE layers beside the head and the MTP module: under
    DualPipe GPUs 0 and 15 hold both ends, the others 8 MoE layers."""
    path = ROOT / "benchmarks" / "runs" / "deepseek_v3.shard"
    spec = shardc.parse(path.read_text(encoding="utf-8"), filename=str(path))
    pipe = pipeline_of(spec)
    assert pipe is not None and pipe.blocks == (3, 58) and pipe.stage_layers[0] == 3
    assert stage_blocks(pipe)[0] == (3, 0) and stage_blocks(pipe)[-1] == (0, 2)
    assert device_blocks(pipe) == ((3, 2),) + ((0, 8),) * 14 + ((3, 2),)


@pytest.mark.slow
def test_a_given_split_verifies() -> None:
    report = verify_pipeline(shardc.plan(shardc.parse(SPEC)))
    assert report.ok and report.sizes["layers"] == 7
