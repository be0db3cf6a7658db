"""Several `layers` blocks under a pipeline: the stages hold runs of the model's layers in order (block 1's
then block 2's), so a stage may hold layers of two blocks; each stage's times and memory are its layers'
of each block, checked here against one-block specs of each block alone; the lowered program holds on a
device its own layers' params (shardc.lowering.pipeline_params)."""

from __future__ import annotations

import math
from functools import cache

import jax
import numpy as np
import pytest

import shardc
from shardc.costmodel.cost_report import CostReport
from shardc.errors import ShardcError
from shardc.ir.spec import Schedule
from shardc.lowering.pipeline_bodies import Union, body_tables, unpacked
from shardc.lowering.pipeline_keep import FlatRing
from shardc.lowering.pipeline_lowering import PipelineLowered, lower_pipeline
from shardc.lowering.pipeline_params import Flat
from shardc.pipeline.block_split import chunk_blocks, counted_device, device_blocks, stage_blocks
from shardc.spec.stages import Pipeline, pipeline_of
from shardc.verification.pipeline_layers import at_run_blocks
from shardc.verification.pipeline_verify import check_pipeline_memory, draw_inputs
from shardc.verification.verify import render_report, verify

# 3 dense-like layers of width F, then M layers twice as wide (K = 2F): the two blocks' layers differ
TWO = """mesh P=4 pipeline, X=2
dims B=4096, D=4096, F=16384, K=32768, M=5
microbatches 8
param W1, W2, V1, V2
E0[B_X, D] = In[B_X, D]
layers 3 {
  H[B_X, F] = gelu(E0[B_X, D] · W1[D, F])
  E1[B_X, D] = E0[B_X, D] + H[B_X, F] · W2[F, D]
}
layers M {
  G[B_X, K] = gelu(E1[B_X, D] · V1[D, K])
  E2[B_X, D] = E1[B_X, D] + G[B_X, K] · V2[K, D]
}
Out[B_X, D] = E2[B_X, D]
"""
# each block alone, 8 layers, with the same statements around it
ONE = {"dense": """mesh P=4 pipeline, X=2
dims B=4096, D=4096, F=16384
microbatches 8
param W1, W2
E0[B_X, D] = In[B_X, D]
layers 8 {
  H[B_X, F] = gelu(E0[B_X, D] · W1[D, F])
  E1[B_X, D] = E0[B_X, D] + H[B_X, F] · W2[F, D]
}
Out[B_X, D] = E1[B_X, D]
""", "wide": """mesh P=4 pipeline, X=2
dims B=4096, D=4096, K=32768
microbatches 8
param V1, V2
E1[B_X, D] = In[B_X, D]
layers 8 {
  G[B_X, K] = gelu(E1[B_X, D] · V1[D, K])
  E2[B_X, D] = E1[B_X, D] + G[B_X, K] · V2[K, D]
}
Out[B_X, D] = E2[B_X, D]
"""}
SPLITS = {2: ((3, 1), (0, 4)), 4: ((2, 0), (1, 1), (0, 2), (0, 2))}


@cache
def _cost(text: str, stages: int) -> CostReport:
    return shardc.cost(shardc.plan(shardc.parse(text.replace("P=4", f"P={stages}"))))


def _layer(kind: str, field: str) -> float:
    """One layer's figure of a block alone: a middle stage of 4 (no statements around the block), of 2 layers."""
    pipe = _cost(ONE[kind], 4).pipeline
    assert pipe is not None
    return float(getattr(pipe.stages[1], field)) / 2


@pytest.mark.parametrize("stages", [2, 4])
def test_each_stage_takes_its_layers_of_each_block(stages: int) -> None:
    pipe = _cost(TWO, stages).pipeline
    assert pipe is not None
    assert [s.blocks for s in pipe.stages] == list(SPLITS[stages])
    assert _layer("wide", "forward_s") > 1.5 * _layer("dense", "forward_s")  # the blocks' layers do differ
    for s in pipe.stages:
        ends = [t for t, here in ((pipe.first, s.stage == 0), (pipe.last, s.stage == stages - 1)) if here]
        for field, end in (("forward_s", "forward"), ("backward_s", "backward"), ("weight_s", "weight")):
            alone = s.blocks[0] * _layer("dense", field) + s.blocks[1] * _layer("wide", field)
            assert getattr(s, field) == pytest.approx(alone + sum(getattr(t, end) for t in ends), rel=1e-9)
        assert s.state_bytes == pytest.approx(s.blocks[0] * _layer("dense", "state_bytes")
                                              + s.blocks[1] * _layer("wide", "state_bytes"), rel=1e-12)


def test_the_simulation_runs_each_stage_at_its_own_times_and_the_slowest_sets_the_tick() -> None:
    pipe = _cost(TWO, 4).pipeline
    assert pipe is not None
    chunks = pipe.simulation.chunk_times
    assert [t.forward for t in chunks] == pytest.approx([s.forward_s for s in pipe.stages], rel=1e-12)
    totals = [s.forward_s + s.backward_s + s.weight_s for s in pipe.stages]
    # the tick: the slowest run of layers, two wide ones (stage 2's, which runs nothing around the blocks)
    assert pipe.timing.forward == pytest.approx(pipe.stages[2].forward_s, rel=1e-12)
    assert pipe.stage_time_s == pytest.approx(totals[2], rel=1e-12)
    # the busiest device's m microbatches, then the bubble: more than the work, less than m + p - 1 of its ticks
    assert pipe.simulation.ideal == pytest.approx(8 * max(totals), rel=1e-12)
    assert pipe.simulation.ideal < pipe.simulation.makespan < (8 + 3) * max(totals) + 6 * 3 * pipe.p2p_s


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1", "interleaved 2", "zbv", "dualpipe", "dualpipev"])
def test_every_schedule_runs_each_layer_once_at_its_blocks_times(schedule: str) -> None:
    """Over 2 stages, each schedule's chunks (4 under interleaved, zbv and dualpipev; DualPipe's two
    directions) and devices together run the 8 layers at their blocks' times, once a direction."""
    report = _cost(TWO.replace("microbatches 8", f"microbatches 8\nschedule {schedule}"), 2)
    pipe = report.pipeline
    assert pipe is not None
    copies = 2 if schedule == "dualpipe" else 1  # DualPipe runs every stage in both directions
    whole = copies * (3 * _layer("dense", "forward_s") + 5 * _layer("wide", "forward_s")
                      + pipe.first.forward + pipe.last.forward)
    assert math.fsum(t.forward for t in pipe.simulation.chunk_times) == pytest.approx(whole, rel=1e-9)
    share = 0.5 if schedule == "dualpipe" else 1.0  # a DualPipe device runs each of its two stages half the time
    assert math.fsum(s.forward_s for s in pipe.stages) / share == pytest.approx(whole, rel=1e-9)
    assert sum(sum(s.blocks) for s in pipe.stages) == 8 * copies


def test_activations_are_each_blocks_layers_for_the_microbatches_held() -> None:
    report = _cost(TWO, 4)
    pipe = report.pipeline
    assert pipe is not None
    a_layer = {name: nbytes / 8 for name, nbytes in report.memory.residuals}  # a microbatch's (the tables': 8)
    dense = a_layer["H[B_X, F]"] + a_layer["H_t1[B_X, F]"] + a_layer["E1[B_X, D]"]  # made by the first block
    wide = a_layer["G[B_X, K]"] + a_layer["G_t1[B_X, K]"]
    assert wide == pytest.approx(2 * (dense - a_layer["E1[B_X, D]"]))
    for s in pipe.stages:
        assert s.held == 4 - s.stage  # 1F1B holds p - s microbatches, whatever the times
        once = a_layer["E0[B_X, D]"] if s.stage == 0 else 0.0  # the first stage's input
        assert s.activation_bytes == pytest.approx(s.held * (s.blocks[0] * dense + s.blocks[1] * wide + once),
                                                   rel=1e-12)
    assert pipe.fullest.stage == 2  # two wide layers a microbatch, 2 held: the most state and activations


def test_the_whole_model_is_counted_once_and_the_tables_are_the_fullest_devices() -> None:
    report, flat = _cost(TWO, 4), shardc.cost(shardc.plan(shardc.parse(TWO.replace("P=4 pipeline, ", "")
                                                                        .replace("microbatches 8\n", ""))))
    assert report.memory.params_total == 2 * 4096 * (16384 * 3 + 32768 * 5)
    assert report.pipeline is not None
    assert report.pipeline.model_flops == pytest.approx(flat.step.model_flops, rel=1e-12)
    assert (report.step.layers, *report.step.more_layers) == (0, 2)  # a stage of two wide layers
    assert str(report.forward.formula.flops) == "8*B*D*K/X"  # its layers, as numbers: no M


def test_chunks_and_devices_hold_runs_of_the_blocks_layers() -> None:
    def pipe(schedule: str, virtual: int = 1, stages: int = 2) -> Pipeline:
        return Pipeline("P", stages, 8, Schedule(schedule, virtual), 8, blocks=(3, 5))

    assert stage_blocks(pipe("1f1b")) == ((3, 1), (0, 4)) and device_blocks(pipe("1f1b")) == ((3, 1), (0, 4))
    assert chunk_blocks(pipe("interleaved", 2)) == ((2, 0), (1, 1), (0, 2), (0, 2))
    assert device_blocks(pipe("interleaved", 2)) == ((2, 2), (1, 3))  # chunks 0 and 2, 1 and 3
    assert device_blocks(pipe("zbv")) == ((2, 2), (1, 3))  # the V: chunks 0 and 3 on device 0
    assert device_blocks(pipe("dualpipe")) == ((3, 5), (3, 5))  # stages d and p-1-d
    assert stage_blocks(pipe("dualpipe")) == ((3, 1), (0, 4))
    assert counted_device(pipe("1f1b", stages=4)) == (0, 2)


def test_a_schedule_with_chunks_needs_whole_layers_a_chunk() -> None:
    text = TWO.replace("P=4", "P=2").replace("microbatches 8", "microbatches 8\nschedule interleaved 2")
    shardc.parse(text)  # 8 layers: 2 a chunk
    with pytest.raises(ShardcError, match="each chunk holds whole layers") as err:
        shardc.parse(text.replace("M=5", "M=4"))  # 7 layers over 2 stages: 4 and 3
    assert err.value.span is not None and err.value.span.line == 11


# the embedding, 2 layers of one block, 4 of a wider one, the loss: lowerable (its ends read token ids)
MODEL = """mesh P=2 pipeline, X=2
dims B=16, S=8, D=16, F=32, K=64, V=64
microbatches 4
const Tok, Next
param W_emb, W1, W2, V1, V2, W_out
X0[B_X, S, D] = embed(Tok[B_X, S], W_emb[V, D])
layers 2 {
  H[B_X, S, F] = gelu(X0[B_X, S, D] · W1[D, F_X])
  X1[B_X, S, D] = X0[B_X, S, D] + H[B_X, S, F] · W2[F, D]
}
layers 4 {
  G[B_X, S, K] = gelu(X1[B_X, S, D] · V1[D, K])
  X2[B_X, S, D] = X1[B_X, S, D] + G[B_X, S, K] · V2[K, D]
}
Fn[B_X, S, D] = rmsnorm(X2[B_X, S, D] over D)
Lg[B_X, S, V] = Fn[B_X, S, D] · W_out[D, V]
Loss[] = cross_entropy(Lg[B_X, S, V], Next[B_X, S])
"""


# 3 + 5 layers over 4 stages of 2: stage 1 holds the first block's last layer and the second's first
STRADDLED = MODEL.replace("P=2", "P=4").replace("microbatches 4", "microbatches 8").replace(
    "layers 2 {", "layers 3 {").replace("layers 4 {", "layers 5 {").replace("V1[D, K]", "V1[D, K_X]")


def test_each_slot_runs_the_block_of_its_layer() -> None:
    """Stage s's slot k runs the block of layer 2s + k (its params where the device holds its own layers:
    shardc.lowering.pipeline_params)."""
    tables = body_tables([0, 2, 4, 6], [2, 2, 2, 2], [3, 5])
    assert tables.which == ((0, 0), (0, 1), (1, 1), (1, 1)) and tables.slots == (2, 2)
    assert tables.possible == ((0, 1), (0, 1)) and tables.branch == ((0, 0), (0, 1), (1, 1), (1, 1))
    one = body_tables([0, 3], [3, 2], [5])  # one block: slot k is slot k everywhere, an uneven split padded
    assert one.possible == ((0,), (0,), (0,)) and one.slots == (3,)


@pytest.mark.slow
def test_a_slot_keeps_one_blocks_values_in_buffers_sized_to_the_larger() -> None:
    """A slot where either block can run keeps one flat buffer a dtype, as long as the larger block's
    values (the ring of the 3 + 5 run held both blocks' at every slot: XLA's temporaries 667 kB, 524 kB
    now), and reads each block's values back as they were written."""
    small = {"H": np.arange(6, dtype=np.float32).reshape(2, 3), "k": np.arange(2, dtype=np.uint32)}
    large = {"G": np.arange(12, dtype=np.float32).reshape(3, 4) + 100, "X": np.ones(4, np.float32)}
    union = Union.of({0: jax.eval_shape(lambda: small), 1: jax.eval_shape(lambda: large)})
    assert dict(union.sizes) == {"float32": 16, "uint32": 2}  # the larger's floats, the smaller's keys
    for b, values in ((0, small), (1, large)):
        packed = jax.eval_shape(union.pack, values)
        assert [x.shape for x in packed.buffers] == [(16,), (2,)]
        got = jax.jit(lambda v, b=b: unpacked(union.pack(v), b))(values)
        assert all(np.array_equal(got[n], v) and got[n].dtype == v.dtype for n, v in values.items())
    assert unpacked({0: small}, 0) is small  # a slot only one block runs keeps its values as they are


def test_each_device_keeps_its_own_layers_residuals_in_its_ring() -> None:
    """The 3 + 5 run's ring under 1F1B on 4 stages: device 0 keeps 4 microbatches of 2 dense layers (a
    elements each), device 1 3 of a dense and an MoE layer (b), devices 2 and 3 2 and 1 of 2 MoE layers.
    Each device's ring slot is as long as its own layers' (the flat buffer as long as device 0's 8a, and
    the tail of a write as wide as the larger block), not 4 slots of 2 of the larger (8b), nor of both."""
    a, b = 5120, 9216  # the run's residuals a layer and microbatch, in float32 elements
    shapes = {0: jax.ShapeDtypeStruct((a,), np.float32), 1: jax.ShapeDtypeStruct((b // 2, 2), np.float32)}
    union = Union.of(shapes)
    which = ((0, 0), (0, 1), (1, 1), (1, 1))
    table = [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 1], [0, 0, 0, 0]]  # each device's ring slot of entries 0..3
    ring = FlatRing.of([union, union], which, np.array([[0, 1, 2, 3]]), table)
    assert ring.dtypes == ("float32",) and ring.start[:, :, 0].tolist() == [  # each slot as long as what it holds
        [0, 2 * a, 4 * a, 6 * a], [0, a + b, 2 * (a + b), 3 * (a + b)], [0, 2 * b, 4 * b, 4 * b],
        [0, 2 * b, 2 * b, 2 * b]]
    assert ring.offset[:, 0, :, 0].tolist() == [[0, a], [0, a], [0, b], [0, b]]
    assert ring.total == (8 * a + (b - a),)


def test_a_ring_slot_is_as_long_as_the_chunks_it_holds() -> None:
    """A device holding a dense chunk and a wide one (DualPipe's, ZBV's) keeps each ring slot as long as the
    chunk whose microbatches it holds, not every slot as the wide one's: DualPipe's 3 + 5 run kept 5 slots of
    2 wide layers (360 kB), where its fullest device keeps 3 of a dense and a wide layer and 2 of 2 wide (312 kB;
    XLA's temporaries 770 -> 721 kB), interleaved's 11 of 2 wide layers (XLA's temporaries 535 -> 453 kB)."""
    a, b = 5120, 9216
    shapes = {0: jax.ShapeDtypeStruct((a,), np.float32), 1: jax.ShapeDtypeStruct((b,), np.float32)}
    union = Union.of(shapes)
    # 2 devices of 2 chunks (2 microbatches each): device 0's chunk 0 the dense virtual stage 0, chunk 1 the wide
    # 1; device 1 the other way round.  Entries chunk x 2 + microbatch; device 1 never holds its entry 1.
    table = [[0, 1, 2, 2], [0, 0, 1, 2]]
    ring = FlatRing.of([union, union], ((0, 0), (1, 1)), np.array([[0, 1], [1, 0]]), table, [[0, 1, 2, 3], [0, 2, 3]])
    assert ring.start[:, :, 0].tolist() == [[0, 2 * a, 4 * a], [0, 2 * b, 2 * b + 2 * a]]
    assert ring.total == (max(4 * a + b + b, 2 * b + 2 * a + a + b),)  # a write is as wide as the union at its offset
    assert ring.total[0] < 3 * 2 * b  # a slot of the wider chunk each


def test_a_layer_keeps_only_what_its_backward_reads() -> None:
    """What a ring slot keeps of a layer's forward is what its backward reads (H, its GELU's input H_t1, the
    layer's input X0), not every forward value: the layer's output X1 (the next layer's input, kept there)
    and the residual branch X1_t1 (read by no backward) took 7168 floats a dense layer of the 3 + 5 run's
    microbatch where shardc counts 5120 (its ring 246 kB against 182 kB of activations; now 180 kB)."""
    bodies = lower_pipeline(shardc.plan(shardc.parse(STRADDLED))).namespace.PIPELINE.bodies
    assert [sorted(set(b.part.forward_out) & b.part.backward_reads) for b in bodies] == [["H", "H_t1"], ["G", "G_t1"]]
    assert [b.input in b.part.backward_reads for b in bodies] == [True, True]


@pytest.mark.slow
def test_the_straddled_programs_memory_is_its_stages() -> None:
    """XLA's buffers for the 3 + 5 run's program beside shardc's fullest stage: 0.82 (0.66 before the loop's
    control scalars, 0.41 with every block's residuals in every slot of every device's ring, 0.51 with the
    larger block's, 0.60 reading a slot's union whole, 0.67 keeping every forward value of a layer, not
    what its backward reads: temporaries 667, 524, 432, 387 and 318 kB; 0.79 with both blocks' params and
    gradient sums on every device: arguments 30.7 kB, outputs 26.7 kB, now 24.6 and 20.5 kB, temporaries
    316 kB), what is left each device's slots as long as the wider layer and both ends' params (README)."""
    check = check_pipeline_memory(shardc.plan(shardc.parse(STRADDLED)), 8)
    assert check.ratio is not None and 0.82 <= check.ratio <= 1.0


@pytest.mark.slow
def test_dualpipe_updates_its_rings_in_place() -> None:
    """A DualPipe tick's B reads the rings as the tick found them and its F's writes land at the next tick's
    start, so XLA updates each ring in place: F writing in the tick had XLA copy the whole residual ring
    (440 kB in the 3 + 5 run) every tick, for B's reads of the old (ratio 0.32, XLA's temporaries 1.36 MB;
    then 0.44, 963 kB; 0.48, 869 kB now that a slot keeps what the backward reads; 0.50, 860 kB with each
    device's own layers' params; 0.56, 770 kB with the ends' W values in the block's rings' slots, not one a
    microbatch; 0.59, 721 kB with each ring slot as long as the chunk it holds, not the device's wider; 0.66,
    640 kB with the ends' W values in rings of their own, one slot where the block's rings took 5 and 2)."""
    check = check_pipeline_memory(shardc.plan(shardc.parse(STRADDLED.replace("microbatches 8",
                                                                             "microbatches 8\nschedule dualpipe"))), 8)
    assert check.ratio is not None and 0.65 <= check.ratio <= 1.0
    assert dict(check.xla_parts)["temporaries"] <= 640e3


@pytest.mark.slow
def test_the_ends_keep_their_w_values_for_the_microbatches_in_flight() -> None:
    """Under ZB-H1 the ends' W values (the logits' cotangent, the final norm's output, the block input's
    gradient) lie in rings of the microbatches in flight between the ends' B and W on their devices, 4 and 1
    of the 8: one a microbatch took XLA's temporaries to 792 kB (ratio 0.61; 0.69 at 693 kB in the block's
    rings, 4 and 4 slots; now 0.70, 681 kB)."""
    check = check_pipeline_memory(shardc.plan(shardc.parse(STRADDLED.replace("microbatches 8",
                                                                             "microbatches 8\nschedule zb-h1"))), 8)
    assert check.ratio is not None and 0.70 <= check.ratio <= 1.0
    assert dict(check.xla_parts)["temporaries"] <= 682e3


def test_a_stage_holding_two_blocks_lowers_with_each_blocks_functions() -> None:
    source = lower_pipeline(shardc.plan(shardc.parse(STRADDLED)), load=False).source
    compile(source, "straddled.py", "exec")
    for line in ("\nLAYERS = 8 ", "\nBLOCK_LAYERS = (3, 5)", "def forward_local(X0, W1, W2",
                 "def b2_forward_local(X1, V1, V2", "def b2_backward_local(", "PIPELINE = model_pipeline(globals())",
                 "MORE_BLOCKS = ({'prefix': 'B2', 'input': 'X1', 'output': 'X2', 'params': ('V1', 'V2')},)"):
        assert line in source, line
    assert "_b1l0" not in source  # no block written out


def test_a_statement_between_two_blocks_is_refused_with_its_place() -> None:
    between = STRADDLED.replace("layers 5 {", "Y1[B_X, S, D] = X1[B_X, S, D]\nlayers 5 {").replace(
        "gelu(X1[B_X, S, D] · V1", "gelu(Y1[B_X, S, D] · V1").replace("X2[B_X, S, D] = X1[B_X, S, D] +",
                                                                      "X2[B_X, S, D] = Y1[B_X, S, D] +")
    with pytest.raises(ShardcError, match="Y1 is computed between two `layers` blocks") as err:
        shardc.parse(between)  # validation refuses it: plan, cost and lower never see it
    assert err.value.span is not None and err.value.span.line == 11


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved 2", "dualpipe"])
def test_a_stage_holding_two_blocks_verifies(schedule: str) -> None:
    """Values, gradients and the HLO's collectives against the plan (block 2's all-gather of V1 inside its
    branch of the switch), stage 1 (and under interleaved devices 1 and 2's chunks) holding both blocks;
    under DualPipe the two copies' gradient sums swapped once, one buffer of each device's own layers."""
    report = verify(shardc.parse(STRADDLED.replace("microbatches 8", f"microbatches 8\nschedule {schedule}")))
    assert report.ok, render_report(report)
    assert report.sizes["layers"] == 8
    planned = {r.step for r in report.collectives if r.ok}
    assert any("V1[D, K_X] -> V1[D, K]" in p for p in planned) and any("W1[D, F_X]" in p for p in planned)


def test_a_step_sharing_a_recomputed_one_stays_in_its_block() -> None:
    """A backward step that repeats a recomputed one becomes its alias, in the same block: each block's
    lowered functions hold that block's steps (the norm's statistic of block 2 is not block 1's)."""
    text = """mesh X=2
dims B=64, D=32, F=64
param W1, V1, V2
recompute rmsnorm
E0[B_X, D] = In[B_X, D]
layers 2 {
  E1[B_X, D] = E0[B_X, D] + gelu(E0[B_X, D] · W1[D, F]) · W1[D, F]
}
layers 3 {
  N[B_X, D] = rmsnorm(E1[B_X, D] over D)
  E2[B_X, D] = E1[B_X, D] + gelu(N[B_X, D] · V1[D, F]) · V2[F, D]
}
Out[B_X, D] = E2[B_X, D]
"""
    aliases = [s for s in shardc.plan(shardc.parse(text)).backward if "recomputed one" in s.note]
    assert {s.dst.name for s in aliases} == {"N_ms_2", "N_again"} and {s.block for s in aliases} == {1}


def test_the_run_costs_each_block_at_its_layers_in_the_run() -> None:
    """verify's memory check costs the spec at the run's layers of each block (DeepSeek-V3's 3 + 58 run as
    1 + 3), a count written as a dim given that size."""
    spec = shardc.parse(STRADDLED.replace("layers 5 {", "layers M {").replace("V=64", "V=64, M=5"))
    sizes: dict[str, int] = {}
    run = at_run_blocks(spec, sizes, (1, 3))
    pipe = pipeline_of(run, sizes)
    assert pipe is not None and pipe.blocks == (1, 3) and sizes == {"M": 3} and run.layers == 1


@cache
def _straddled(schedule: str) -> PipelineLowered:
    return lower_pipeline(shardc.plan(shardc.parse(STRADDLED.replace("microbatches 8",
                                                                     f"microbatches 8\nschedule {schedule}"))))


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipe"])
def test_a_device_holds_its_own_layers_params(schedule: str) -> None:
    """The 3 + 5 run over 4 stages of 2 layers: a dense layer's params on a device are 768 floats (W1[D, F_X]
    256, W2[F, D] 512), a wide one's 1536; each device's buffer is its 2 slots (DualPipe: its 2 stages' 4),
    each as long as the wider layer that runs there: 3072 floats (6144), where a stack of each block over
    its slots put 2 dense and 2 wide layers on every device (4608; DualPipe 9216).  The buffers hand every
    layer's params back as the blocks stack them."""
    lowered = _straddled(schedule)
    pipeline = lowered.namespace.PIPELINE
    assert isinstance(pipeline.holding, Flat)
    inputs = draw_inputs(lowered, 0, 0)
    (held,) = pipeline.holding.host(inputs)
    copies = 2 if schedule == "dualpipe" else 1
    assert [b.shape for b in held.buffers] == [(4, 2, 3072 * copies)]
    back = pipeline.holding.gradients((held,))  # read back as the program's gradients are
    for body in pipeline.bodies:
        for p in body.params:
            assert np.array_equal(back[body.part.grads[p]], inputs[p]), p
    if schedule == "dualpipe":  # device s's stage s lies where device 3 - s keeps it: the two copies' sums add
        (buffer,) = held.buffers
        assert all(np.array_equal(buffer[s, :, :3072], buffer[3 - s, :, 3072:]) for s in range(4))


def test_a_flat_buffer_is_the_wider_layer_at_each_slot() -> None:
    program = _straddled("1f1b").namespace.PIPELINE
    assert isinstance(program.holding, Flat) and program.holding.elements([768, 1536]) == 3072
    assert _straddled("dualpipe").namespace.PIPELINE.holding.elements([768, 1536]) == 6144


@pytest.mark.slow
def test_gpipe_keeps_the_loss_cotangent_not_its_graph() -> None:
    """GPipe's last stage holds all 8 microbatches: a framework (torch.distributed.pipelining's ScheduleGPipe)
    keeps the loss's graph (the final norm's input, the logits and the loss's row logsumexp, 17.7 kB a
    microbatch here) until each one's backward, as shardc cost counts; the program runs the loss's backward at
    the forward tick and keeps the block output's cotangent (512 B).  Counted as the cost counts it, the check
    read 1.09 (shardc above XLA)."""
    check = check_pipeline_memory(shardc.plan(shardc.parse(STRADDLED.replace(
        "microbatches 8", "microbatches 8\nschedule gpipe"))), 8)
    assert check.stage == 3 and check.loss_graph == 8 * (512 - 17664)
    assert check.ratio is not None and 0.93 <= check.ratio <= 1.0
