"""The ends' backward under the zero-bubble schedules: the statements after the block (the head) cut
into B and W as the block's backward is, those before it (the embedding) all W, each W at its virtual
stage's W tick; the cost times them so."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import shardc
from shardc.ir.plan import backward_program
from shardc.lowering.codegen import generate
from shardc.lowering.pipeline_grads import split_reductions
from shardc.lowering.pipeline_lowering import lower_pipeline
from shardc.lowering.pipeline_split import split_backward
from shardc.pipeline.backward_split import weight_steps
from shardc.pipeline.boundary import gradient_reductions
from tests.test_plan_sections import MODEL

ZB_MODEL = MODEL.replace("microbatches 2", "microbatches 4\nschedule zb-h1")
EXAMPLES = Path(__file__).parents[1] / "examples"


def _functions(source: str) -> dict[str, list[str]]:
    """Each function of a module's source: its lines (the docstring and the return aside)."""
    return {f.name: [ast.unparse(s) for s in f.body[1:-1]] for f in ast.parse(source).body
            if isinstance(f, ast.FunctionDef)}


def test_the_head_is_cut_into_b_and_w_and_the_embedding_is_all_w() -> None:
    """Under ZB-H1 the module holds the head's B (the block output's gradient, which the last stage's B
    waits for) and W (the output layer's gradient), each line of its backward in one of them; the
    embedding's backward has no B.  Under 1F1B neither is cut."""
    plan = shardc.plan(shardc.parse(ZB_MODEL))
    functions = _functions(lower_pipeline(plan, load=False).source)
    whole, b, w = (functions[f"post_{name}_local"] for name in ("backward", "input_backward", "weight_backward"))
    assert sorted(whole) == sorted(b + w) and b and w
    assert "pre_input_backward_local" not in functions and "pre_weight_backward_local" not in functions
    source = lower_pipeline(plan, load=False).source
    tables = {t.id: [ast.literal_eval(k) for k in n.value.keys if k is not None] for n in ast.parse(source).body
              if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict) for t in n.targets
              if isinstance(t, ast.Name)}
    assert tables["POST_INPUT_BACKWARD_OUT"] == ["dX1", "dLg"]  # the block output's gradient, and what W reads
    assert tables["POST_WEIGHT_BACKWARD_OUT"] == ["dW_out"] and tables["POST_WEIGHT_BACKWARD_IN"] == ["Fn", "dLg"]
    one = shardc.plan(shardc.parse(ZB_MODEL.replace("schedule zb-h1", "schedule 1f1b")))
    assert "post_input_backward_local" not in _functions(lower_pipeline(one, load=False).source)


# Gemma 2's output layer is its embedding, tied: the head's contribution to its gradient is W in both
TIED = {"gemma2_27b.shard": (("mesh X=768, Y=8", "mesh P=4 pipeline, X=24, Y=8"), ("layers 23", "layers 24"),
                             ("hardware tpu-v5p", "hardware tpu-v5p\nmicrobatches 8\nschedule zb-h1"))}


@pytest.mark.parametrize("path", ["pipeline_llama2_13b.shard", "llama3_405b.shard", "gemma2_27b.shard"])
def test_the_program_cuts_the_head_where_the_cost_does(path: str) -> None:
    """The head's W in the program (the steps the block output's gradient does not need) is the cost's W
    of the last chunk (one rule, :mod:`shardc.pipeline.backward_split`; the once-a-step reductions aside)."""
    text = (EXAMPLES / path).read_text()
    for old, new in TIED.get(path, ()):
        text = text.replace(old, new)
    plan = shardc.plan(shardc.parse(re.sub(r"schedule \S+", "schedule zb-h1", text)))
    ends = lower_pipeline(plan, load=False).ends
    assert ends is not None
    after, _, _ = plan.cut.runs("backward", range(len(plan.backward)))
    grads, reduced = weight_steps(plan), gradient_reductions(plan)
    cost_w = sorted(str(plan.backward[i].dst) for i in after if i in grads and i not in reduced)
    each = split_reductions(ends.post).each
    module = generate(each, tuple((a.name, a.size) for a in ends.post.spec.mesh.axes), None)
    output = ends.block.spec.statements[-1].result.name  # the block's output, the head's input
    _, w = split_backward(backward_program(each), module.backward, module.grads[output], frozenset(module.cotangents))
    program_w = sorted(str(each.backward[k].dst) for k, line in enumerate(module.backward.body) if line in w.body)
    assert program_w == cost_w and cost_w


def test_the_cost_runs_the_backward_before_the_block_at_w() -> None:
    """LLaMA 3 405B's embedding backward has a step besides its weight gradient's (the block input's
    gradient gathered): nothing waits for any of it, so it is all W under every schedule (the one B/W rule,
    :mod:`shardc.pipeline.backward_split`, the lowered program's cut); the sum, and the head's times, are
    the same under 1F1B and ZB-H1."""
    text = (EXAMPLES / "llama3_405b.shard").read_text()
    costs = {name: shardc.cost(shardc.plan(shardc.parse(re.sub(r"schedule \S+", f"schedule {name}", text))))
             for name in ("1f1b", "zb-h1")}
    one, zb = (costs[name].pipeline for name in ("1f1b", "zb-h1"))
    assert one is not None and zb is not None
    assert one.first.backward == zb.first.backward == 0 and one.first.weight > 0
    assert zb.first.weight == pytest.approx(one.first.backward + one.first.weight)
    assert zb.last == one.last


@pytest.mark.parametrize("schedule", ["zb-h1", "dualpipe"])
def test_a_recompute_line_under_a_zero_bubble_schedule_lowers_with_its_lines_cut_too(schedule: str) -> None:
    """The backward a `recompute` line makes runs the recomputed forward steps first: B and W are cut from
    those lines and the backward's (DeepSeek-V3's spec under DualPipe failed with "one line a step")."""
    text = MODEL.replace("microbatches 2", f"microbatches 4\nschedule {schedule}") + "recompute gelu, rmsnorm\n"
    plan = shardc.plan(shardc.parse(text))
    assert plan.recomputed
    source = lower_pipeline(plan, load=False).source
    for name in ("input_backward_local", "weight_backward_local", "post_input_backward_local"):
        assert f"def {name}(" in source
