"""Exact memory and bytes: token ids are int32 (4 bytes) wherever bytes are counted, a value the
backward reads for its shape only (a sum's input, the embedding table) is no residual, and each
residual's why names the steps that make and read it."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import shardc
from shardc.costmodel.formulas import text
from shardc.costmodel.memory import kept_once, memory, residual_formula, residual_table
from shardc.device_pieces import step_volume
from shardc.ir.localops import ALIAS, Row, Vocab
from shardc.ir.plan import Op, Plan
from shardc.ir.spec import Spec, TensorRef
from shardc.planner.check import check_plan
from shardc.planner.plan_text import render_text, to_json
from shardc.spec.functions import ID_BYTES, ID_DTYPE
from shardc.spec.walk import element_bytes, id_names, id_vocabulary
from shardc.testing import specs
from shardc.timing import plan_sizes
from shardc.verification.hlo import Collective
from shardc.verification.verify import render_report, verify
from tests.example_reports import example_plan

# The lookup needs the ids off the table's axis X: Tok[B_X, S] is gathered (4*B*S bytes), not W_emb (2*V*D).
EMBED = "mesh X=4\ndims B=16, S=8, V=4096, D=256\nE[B, S, D] = embed(Tok[B_X, S], W_emb[V_X, D])\n"
# The loss reads the ids laid out as the logits' rows, B whole: Tok[B_X, S] is gathered.
LOSS = "mesh X=4\ndims B=16, S=8, V=64\nL[] = cross_entropy(Lg[B, S, V_X], Tok[B_X, S])\n"
# X is an activation; sum's gradient spreads dM along D and reads X for D's length only.
SUM = "mesh X=4\ndims B=64, F=512, D=1024\nX[B_X, D] = In[B_X, F] · W[F, D]\nM[B_X] = sum(X[B_X, D] over D)\n"


def _plan(spec_text: str, **options: str) -> Plan:
    p = shardc.plan(shardc.parse(spec_text), **options)
    assert check_plan(p) == []
    return p


def _id_moves(p: Plan) -> list[tuple[Op, str]]:
    return [(s.op, str(s.volume)) for s in p.forward + p.backward if s.is_collective and s.tensor == "Tok"]


def test_token_ids_are_int32_where_the_spec_decides_it() -> None:
    spec = shardc.parse("mesh X=2\nTok2[B, S] = Tok[B_X, S]\nE[B, S, D] = embed(Tok2[B, S], W_emb[V_X, D])\n")
    assert element_bytes(spec) == {"Tok": 4, "Tok2": 4}  # a copy of ids holds ids
    assert id_vocabulary(spec) == {"Tok": "V", "Tok2": "V"}
    assert np.dtype(ID_DTYPE).itemsize == ID_BYTES == 4
    p = shardc.plan(spec)
    assert [g.name for g in p.grads] == ["dW_emb"]  # neither holder of ids gets a gradient
    assert p.nbytes("Tok") == p.nbytes("Tok2") == 4 and p.nbytes("W_emb") == 2


@pytest.mark.parametrize("spec_text", [EMBED, LOSS])
def test_a_collective_moving_token_ids_counts_4_bytes_an_element(spec_text: str) -> None:
    p = _plan(spec_text)
    assert _id_moves(p) == [(Op.ALL_GATHER, "4*B*S")]
    (gather,) = [s for s in p.forward if s.tensor == "Tok"]
    assert step_volume(gather, plan_sizes(p)) == 4 * 16 * 8
    f32 = _plan(spec_text.replace("mesh X=4", "mesh X=4\ndtype f32"))
    assert _id_moves(f32) == [(Op.ALL_GATHER, "4*B*S")]  # whatever the dtype: ids are int32


def test_memory_counts_token_id_residuals_at_4_bytes() -> None:
    p = _plan(LOSS)
    kept = {str(ref): why for ref, why in residual_table(p)}
    assert "Tok[B, S]" in kept  # the gathered ids, kept for the loss's gradient
    mem = memory(p, plan_sizes(p), 1, 96e9)
    assert dict(mem.residuals)["Tok[B, S]"] == 4 * 16 * 8
    assert dict(mem.residuals)["L_lse[B, S]"] == 2 * 16 * 8  # a float statistic stays bf16
    assert text(residual_formula(p)) == "2*B*S*V/X + 6*B*S"  # logits 2BSV/X, lse 2BS, ids 4BS


def test_the_hlo_check_prices_integers_at_their_own_width() -> None:
    ids = Collective(Op.ALL_GATHER, "all-gather", ("X",), 128, "s32", "")
    floats = Collective(Op.ALL_GATHER, "all-gather", ("X",), 128, "f32", "")
    assert (ids.bytes(2), floats.bytes(2), floats.bytes(4)) == (512, 256, 512)
    assert Collective(Op.ALL_REDUCE, "all-reduce", ("X",), 8, "pred", "").bytes(2) == 8


@pytest.mark.slow
@pytest.mark.parametrize("spec_text", [EMBED, LOSS])
def test_verify_agrees_the_ids_move_4_bytes_an_element(spec_text: str) -> None:
    report = verify(_plan(spec_text))
    assert report.ok, render_report(report)
    (row,) = [r for r in report.collectives if r.step.split(" ")[1].startswith("Tok")]
    sizes = report.sizes
    assert row.plan_bytes == row.hlo_bytes == 4 * sizes["B"] * sizes["S"], render_report(report)


@pytest.mark.slow
def test_a_sum_over_an_activation_keeps_no_residual_for_it() -> None:
    p = _plan(SUM)
    (spread,) = [s for s in p.backward if s.fn is Row.SUM_VJP]
    assert [str(r) for r in spread.operands] == ["dM[B_X]"] and [str(r) for r in spread.shapes] == ["X[B_X, D]"]
    assert "X" not in {r.name for r in p.residuals}
    assert "X" not in {ref.name for ref, _ in residual_table(p)}
    mem = memory(p, plan_sizes(p), 1, 96e9)
    assert [v for v, _ in mem.residuals] == ["In[B_X, F]"]  # the einsum's input, for dW
    mean = _plan(SUM.replace("sum(", "mean("))
    assert "X" not in {ref.name for ref, _ in residual_table(mean)}
    full = _plan(SUM, recompute="full")
    assert not any(s.tensor == "X" for s in full.recomputed)  # nothing to make again for a shape
    assert verify(p).ok


def test_the_embedding_gradient_reads_the_table_for_its_shape_only() -> None:
    p = _plan("mesh X=4\ndims B=8, S=16, V=64, D=32\nE[B_X, S, D] = embed(Tok[B_X, S], W_emb[V, D])\n")
    (scatter,) = [s for s in p.backward if s.fn is Vocab.EMBED_VJP]
    assert [r.name for r in scatter.operands] == ["Tok", "dE"] and [r.name for r in scatter.shapes] == ["W_emb"]
    assert "embed_vjp     dW_emb[V, D]{U_X} = Tok[B_X, S], dE[B_X, S, D]; the shape of W_emb[V, D]" in render_text(p)
    assert [s["shapes"] for s in to_json(p)["backward"] if s.get("fn") == "embed_vjp"] == [["W_emb[V, D]"]]


ROOT = Path(__file__).resolve().parent.parent
ATTENTION = """mesh X=2, Y=2
dims B=8, S=64, T=64, N=4, H=16, D=64
Q[B_X, S, N_Y, H] = Xq[B_X, S, D] · W_q[D, N_Y, H]
Sc[B_X, N_Y, S, T] = Q[B_X, S, N_Y, H] · K[B_X, T, N_Y, H]
P[B_X, N_Y, S, T] = softmax(Sc[B_X, N_Y, S, T] over T)
O[B_X, S, N_Y, H] = P[B_X, N_Y, S, T] · V[B_X, T, N_Y, H]
Out[B_X, S, D] = O[B_X, S, N_Y, H] · W_o[N_Y, H, D]
"""


def _aliases(p: Plan, ref: TensorRef) -> set[TensorRef]:
    """``ref`` and every forward value an alias step (a rename) makes the same array."""
    same = {ref}
    for _ in range(3):
        for step in p.forward:
            if step.fn == ALIAS and (step.dst in same or step.operands[0] in same):
                same |= {step.dst, step.operands[0]}
    return same


def _check_whys(p: Plan) -> None:
    """Each why names a step that reads the value for its data, and the forward step that moved it."""
    for ref, why in residual_table(p):
        read = re.search(r"read by (backward step (\d+)|the recomputed forward): (.*)$", why)
        assert read is not None, why
        steps = p.backward[int(read.group(2)) - 1:int(read.group(2))] if read.group(2) else p.recomputed
        same = _aliases(p, ref)  # a rename's reads are its source's (memory counts the array once)
        assert any(r in same for s in steps for r in (*s.operands, *((s.src,) if s.src else ()))), why
        made = re.search(r"made by forward step (\d+) \((\w+)_", why)
        if made is not None:
            step = p.forward[int(made.group(1)) - 1]
            assert step.dst == ref and step.is_collective and step.op.title == made.group(2), why
        assert ("token ids" in why) == (ref.name in id_names(p.spec)), why
        assert ("kept once" in why) == (p.spec.block is not None and ref in kept_once(p, [ref])), why


def test_each_why_says_what_the_value_is_and_who_reads_it() -> None:
    fsdp_tp = shardc.plan(shardc.parse((ROOT / "examples/fsdp_tp.shard").read_text()))
    whys = {str(ref): why for ref, why in residual_table(fsdp_tp)}
    assert whys["In[B_X, D]"].startswith("made by forward step 1 (AllGather_Y In[B_X, D_Y] -> In[B_X, D]), "
                                         "kept rather than moved again (--save default), read by backward step")
    vocab = shardc.plan(shardc.parse((ROOT / "examples/vocab_parallel.shard").read_text()))
    whys = {ref.name: why for ref, why in residual_table(vocab)}
    assert whys["Tok"].startswith("token ids, 4 bytes an element (int32), layer input, read by backward step")
    assert "embed_vjp(Tok[B_Y, S], dE[B_Y, S, D]) -> dW_emb" in whys["Tok"]  # the table is read for its shape
    blocks = shardc.plan(shardc.parse((ROOT / "examples/residual_blocks.shard").read_text()))
    whys = {ref.name: why for ref, why in residual_table(blocks)}
    assert whys["In"].startswith("input, outside the layers block, kept once (not once a layer), read by")
    assert whys["E2_t1_mask"].startswith("1 byte an element, read by backward step")  # a dropout's keep-mask
    assert "kept once" not in whys["H"]
    for mode in ("none", "selective", "full"):
        p = shardc.plan(shardc.parse(ATTENTION), recompute=mode)
        _check_whys(p)
        whys = {ref.name: why for ref, why in residual_table(p)}
        assert "Sc" not in whys  # softmax's gradient reads its output, not its input
        if mode == "none":
            assert whys["P"].startswith("read by backward step")
        if mode == "selective":
            assert whys["Q"].startswith("kept (outside the attention-score region), read by the recomputed forward")


@pytest.mark.slow  # every example planned
def test_each_why_of_every_example_names_its_reader_and_its_maker() -> None:
    for path in (ROOT / "examples").glob("*.shard"):
        _check_whys(example_plan(path.stem))  # shardc.plan of the example, made once a test process


def _volume_bytes(p: Plan) -> list[tuple[str, int, int]]:
    return [(s.tensor, int(s.volume.coeff), p.nbytes(s.tensor)) for s in p.forward + p.backward + p.recomputed
            if s.is_collective and s.volume is not None]


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(specs(max_devices=8, max_statements=3, layer_ops=True))
def test_every_collective_and_residual_counts_its_own_element_bytes(spec: Spec) -> None:
    p = shardc.plan(spec)
    ids = element_bytes(spec)
    for tensor, coeff, nbytes in _volume_bytes(p):
        assert coeff == nbytes == ids.get(tensor, spec.dtype.nbytes), (tensor, coeff)
    _check_whys(p)  # each residual is read for its data by the step its why names, never for a shape alone
    if p.sizes is not None:
        sizes = plan_sizes(p)
        mem = memory(p, sizes, 1, 96e9)
        for (ref, _), (_, nbytes) in zip(residual_table(p), mem.residuals, strict=True):
            assert nbytes == pytest.approx(p.nbytes(ref.name) * _elements(ref, sizes))


def _elements(ref: shardc.ir.spec.TensorRef, sizes: dict[str, int]) -> float:  # type: ignore[name-defined]
    count = 1.0
    for d in ref.dims:
        count *= -(-sizes[d.name] // int(np.prod([sizes[a] for a in d.axes])))
    return count
