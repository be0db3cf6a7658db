"""The framework's own kernels, priced as they run: a norm's saved statistics (written forward, read back, held
between as residuals) under `fusion none` (PyTorch's ``native_layer_norm``) and `fusion statement` (apex's
``FusedLayerNorm``), and PyTorch's cross-entropy backward, two kernels.  Every figure is summed by hand on a
tiny spec: 16 rows a device (B=8 over X=2, S=4), D=16, V=64, bf16."""

from __future__ import annotations

import pytest

import shardc
from shardc.costmodel.cost_report import CostReport

SPEC = ("mesh X=2\ndims B=8, S=4, D=16, V=64\nhardware h100\n{line}const Tok, Next\nparam W_emb, W_out\n"
        "X0[B_X, S, D] = embed(Tok[B_X, S], W_emb[V, D])\n"
        "L1[B_X, S, D] = layernorm(X0[B_X, S, D] over D)\n"
        "Lg[B_X, S, V] = L1[B_X, S, D] · W_out[D, V]\n"
        "Loss[] = cross_entropy(Lg[B_X, S, V], Next[B_X, S])\n")
ROWS = 8 // 2 * 4
ACT = ROWS * 16 * 2  # X0, L1, dL1 or dX0 on a device
LOGITS = ROWS * 64 * 2  # Lg or dLg
IDS = ROWS * 4  # Next, int32
STAT = ROWS * 4  # a row statistic, float32
NORM = ("row_mean", "row_meandev", "layernorm_apply", "row_meandot", "layernorm_vjp")


@pytest.fixture(scope="module")
def reports() -> dict[str, CostReport]:
    lines = {"xla": "", "none": "fusion none\n", "statement": "fusion statement\n"}
    return {k: shardc.cost(shardc.plan(shardc.parse(SPEC.format(line=line)))) for k, line in lines.items()}


def _bytes(report: CostReport, start: str) -> tuple[float, float]:
    return tuple(sum(r.memory_bytes for r in rows if r.text.startswith(start))  # type: ignore[return-value]
                 for rows in (report.forward.rows, report.backward.rows))


def test_a_layer_norm_kernel_reads_x_once_and_passes_its_statistics_to_its_backward(
        reports: dict[str, CostReport]) -> None:
    """PyTorch's ``native_layer_norm`` and apex's ``FusedLayerNorm`` read X once and write Y, the mean and the
    rstd; the backward reads dY, X, the mean and the rstd and writes dX.  Apex's kernel was priced as the
    spec's steps, X read three times forward (2112 bytes) and six back (5344)."""
    for fusion in ("none", "statement"):
        assert _bytes(reports[fusion], NORM) == (ACT + ACT + 2 * STAT, ACT + ACT + 2 * STAT + ACT), fusion
    assert _bytes(reports["xla"], NORM) != _bytes(reports["none"], NORM)  # XLA fuses the plan's own steps


def test_the_statistics_a_norm_kernel_saves_are_residuals_where_the_framework_keeps_them(
        reports: dict[str, CostReport]) -> None:
    """Autograd keeps the kernel's mean and rstd (float32, a row each) for its backward; the lowered program
    XLA runs makes them again from X in the backward, so under XLA they are not kept."""
    stats = {"L1_mean[B_X, S]", "L1_var[B_X, S]"}
    for fusion in ("none", "statement"):
        kept = dict(reports[fusion].memory.residuals)
        assert {k: kept[k] for k in stats} == {k: STAT for k in stats}, fusion
        assert reports[fusion].memory.residual_bytes == reports["xla"].memory.residual_bytes + 2 * STAT
        assert reports[fusion].memory.residual_bytes_expr.endswith("+ 18*B*S/X")  # 2 bf16 (lse) + 2 float32 + 4 ids
    assert not stats & dict(reports["xla"].memory.residuals).keys()


def test_pytorchs_cross_entropy_backward_is_two_kernels(reports: dict[str, CostReport]) -> None:
    """``nll_loss_backward`` zeroes the log-probabilities' gradient and writes each row's target element,
    ``_log_softmax_backward_data`` reads it back with the saved log-probabilities and writes dLogits: the
    logits read once, dLogits' bytes written, read and written again (the ids and the cotangent read beside).
    XLA runs the plan's one step: the logits and the logsumexp read, dLogits written."""
    assert _bytes(reports["none"], "ce_vjp")[1] == LOGITS + IDS + 2 + 3 * LOGITS
    assert _bytes(reports["xla"], "ce_vjp")[1] == LOGITS + ROWS * 2 + IDS + 2 + LOGITS
    assert _bytes(reports["statement"], "ce_vjp") == _bytes(reports["xla"], "ce_vjp")  # Megatron's own loss


def test_a_vocabulary_parallel_loss_is_not_pytorchs_two_kernels() -> None:
    """With the vocabulary sharded, the loss is a vocabulary-parallel one (Megatron-LM's), not
    ``F.cross_entropy``: its gradient step reads and writes as the plan's."""
    text = SPEC.format(line="fusion none\n").replace("mesh X=2", "mesh X=2, Y=2").replace(
        "Lg[B_X, S, V] = L1[B_X, S, D] · W_out[D, V]", "Lg[B_X, S, V_Y] = L1[B_X, S, D] · W_out[D, V_Y]").replace(
        "cross_entropy(Lg[B_X, S, V]", "cross_entropy(Lg[B_X, S, V_Y]")
    (row,) = [r for r in shardc.cost(shardc.plan(shardc.parse(text))).backward.rows if r.text.startswith("ce_vjp")]
    assert "V_Y" in row.text
    assert row.memory_bytes == LOGITS // 2 + ROWS * 2 + IDS + 2 + LOGITS // 2


def test_a_pipeline_stage_keeps_the_saved_statistics_of_each_microbatch_in_flight() -> None:
    """A stage's kept activations count the kernels' statistics too: under GPipe a stage of 2 layers holds 4
    microbatches, each 2 rows a device (B=16 / 4 microbatches / X=2), a layer's mean and rstd a row (float32)."""
    text = ("mesh P=2 pipeline, X=2\ndims B=16, D=8, F=8\nlayers 4\nmicrobatches 4\nschedule gpipe\nhardware h100\n"
            "{line}param W_in, W_out\nH[B_X, D] = layernorm(In[B_X, D] over D)\nU[B_X, F] = H[B_X, D] · W_in[D, F]\n"
            "Out[B_X, D] = In[B_X, D] + U[B_X, F] · W_out[F, D]\n")
    stages = {line: shardc.cost(shardc.plan(shardc.parse(text.format(line=line)))).pipeline.stages  # type: ignore[union-attr]
              for line in ("", "fusion none\n")}
    for xla, eager in zip(stages[""], stages["fusion none\n"], strict=True):
        assert (eager.layers, eager.held) == (2, 4)
        assert eager.activation_bytes == xla.activation_bytes + 2 * 4 * (2 * 2 * 4)
