"""`param_gather overlapped`: ZeRO-1/2's param all-gathers under the next step's first forward (Megatron-LM's
--overlap-param-gather) instead of after the step; the line, its errors, and its cost by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardc
from shardc.costmodel.pipeline_figures import PipelineCost
from shardc.timing import plan_time
from tests.test_cli import shardc_cli

ROOT = Path(__file__).resolve().parent.parent
MLP = ("mesh X=8, Y=2\ndims B=1024, D=512, F=2048\nhardware h100\nzero 1 over X\n{line}"
       "Tmp[B_X, F_Y] = In[B_X, D] · W_in[D, F_Y]\nOut[B_X, D] = Tmp[B_X, F_Y] · W_out[F_Y, D]\n")
PIPE = ("mesh P=2 pipeline, X=2\ndims B=32768, D=256, F=1024\nlayers 4\nmicrobatches 4\nhardware h100\nzero 1 over X\n"
        "{line}param W_in, W_out\nU[B_X, F] = In[B_X, D] · W_in[D, F]\n"
        "Out[B_X, D] = In[B_X, D] + U[B_X, F] · W_out[F, D]\n")


@pytest.mark.parametrize("word", ["overlapped", "exposed"])
def test_the_line_parses_and_prints_back(word: str) -> None:
    spec = shardc.parse(MLP.format(line=f"param_gather {word}\n"))
    assert spec.param_gather == word and f"param_gather {word}\n" in str(spec)
    assert shardc.parse(str(spec)) == spec


@pytest.mark.parametrize("text, message, column", [
    (MLP.format(line="param_gather sometimes\n"), "unknown param_gather `sometimes`", 14),
    (MLP.replace("zero 1 over X\n", "").format(line="param_gather overlapped\n"), "only ZeRO-1 and 2", 1),
    (MLP.replace("zero 1", "zero 3").format(line="param_gather overlapped\n"), "only ZeRO-1 and 2", 1),
])
def test_a_bad_line_is_an_error_with_a_caret_and_a_fix(text: str, message: str, column: int) -> None:
    with pytest.raises(shardc.ShardcError) as err:
        shardc.parse(text)
    assert message in str(err.value) and err.value.span is not None and err.value.span.column == column
    assert err.value.fix


def _costs(template: str) -> tuple[shardc.CostReport, shardc.CostReport]:
    return tuple(shardc.cost(shardc.plan(shardc.parse(template.format(line=line))))  # type: ignore[return-value]
                 for line in ("", "param_gather overlapped\n"))


def test_the_gathers_add_what_the_forward_does_not_hide() -> None:
    # by hand: gathers of g seconds beside a forward of f seconds of compute, the gathers holding a share s of
    # the SMs, end max(f + s g, g) after it starts: they add max(s g, g - f) where they added all of g
    exposed, over = _costs(MLP)
    assert exposed.optimizer is not None and over.optimizer is not None
    g, f = exposed.optimizer.step_s, exposed.forward.compute_s + exposed.forward.memory_s
    s = over.hardware.overlap_share
    assert g > 0 and f > 0 and 0 < s < 1
    assert over.step.step_s == pytest.approx(exposed.step.step_s - g + max(s * g, g - f), rel=1e-12)
    assert over.step.step_s < exposed.step.step_s
    assert plan_time(over.plan).step_s == pytest.approx(over.step.step_s, rel=1e-12)  # the planner weighs it alike
    assert "param_gather overlapped" in over.render()


def test_a_pipeline_hides_them_under_each_stages_first_forward() -> None:
    # every stage's forward of a microbatch outlasts its gathers here, so each adds its share s of them: the
    # busiest stage's, s x the exposed optimizer phase
    exposed, over = (r.pipeline for r in _costs(PIPE))
    assert isinstance(exposed, PipelineCost) and isinstance(over, PipelineCost)
    s = shardc.cost(shardc.plan(shardc.parse(PIPE.format(line="")))).hardware.overlap_share
    assert exposed.optimizer_s > 0
    assert over.optimizer_s == pytest.approx(s * exposed.optimizer_s, rel=1e-12)
    assert over.step_s - exposed.step_s == pytest.approx(over.optimizer_s - exposed.optimizer_s, rel=1e-12)


def test_the_flag_beats_the_spec_line(tmp_path: Path) -> None:
    path = tmp_path / "mlp.shard"
    path.write_text(MLP.format(line="param_gather overlapped\n"), encoding="utf-8")
    runs = [shardc_cli("cost", str(path), *flag) for flag in ([], ["--param-gather", "exposed"])]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    done = [r.stdout for r in runs]
    assert "param_gather overlapped" in done[0] and "param_gather overlapped" not in done[1]


def test_a_zero_2_plan_with_overlapped_gathers_lowers() -> None:
    """Lowering plans the spec again without its zero line: it kept `param_gather overlapped`, which the spec
    without ZeRO refuses, so `shardc lower` said "add `zero 1 over X`" of a spec that had it."""
    from shardc.lowering.replan import unlowered_optimizer

    plan = shardc.plan(shardc.parse(MLP.replace("zero 1", "zero 2").format(line="param_gather overlapped\n")))
    alone, note = unlowered_optimizer(plan)
    assert alone.spec.zero is None and alone.spec.param_gather is None and note is not None
