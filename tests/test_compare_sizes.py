"""``shardc compare``'s sizes keep the spec's proportions (``proportional_sizes``); verify's stay dim by dim.

A plan chosen at the spec's sizes is judged by compare at small ones: sized dim by dim (``small_sizes``),
StarCoder's layer gets D=12 beside N·H=100, and its query gradient dQ[B, S, N, H], the same size as
dX[B, S, D] in the spec, reads 8 times dX.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import shardc
from shardc.ir.plan import Plan
from shardc.lowering.sizes import MAX_SCALED_ELEMENTS, proportional_sizes, small_sizes

# StarCoder's layer at its sizes (benchmarks/runs/starcoder_15b.shard): N·H = D, F = 4D, multi-query K and V
STARCODER = """mesh X=2, Y=4
dims B=16, S=8192, T=8192, D=6144, N=48, H=128, F=24576
param W_q, W_k, W_v, W_o, W_in, W_out
Kx[B_X, T, D] = L1[B_X, S, D]
Q[B_X, S, N_Y, H] = L1[B_X, S, D] · W_q[D, N_Y, H]
K[B_X, T, H] = Kx[B_X, T, D] · W_k[D, H]
Vl[B_X, T, H] = Kx[B_X, T, D] · W_v[D, H]
C[B_X, S, N_Y, H] = attention(Q[B_X, S, N_Y, H], K[B_X, T, H], Vl[B_X, T, H] over T, causal)
R1[B_X, S, D] = L1[B_X, S, D] + C[B_X, S, N_Y, H] · W_o[N_Y, H, D]
Hd[B_X, S, F_Y] = gelu(R1[B_X, S, D] · W_in[D, F_Y])
X1[B_X, S, D] = R1[B_X, S, D] + Hd[B_X, S, F_Y] · W_out[F_Y, D]
"""


@pytest.fixture(scope="module")
def plan() -> Plan:
    return shardc.plan(shardc.parse(STARCODER))


def test_compare_keeps_the_layers_proportions_where_dim_by_dim_sizes_do_not(plan: Plan) -> None:
    sizes = proportional_sizes(plan, 8)
    assert sizes["N"] * sizes["H"] == sizes["D"] and sizes["F"] == 4 * sizes["D"]  # exact: powers of two
    assert sizes["S"] == sizes["T"] and sizes["X"] == 2 and sizes["Y"] == 4
    old = small_sizes(plan, 8)  # verify's: each dim on its own
    assert old["N"] * old["H"] / old["D"] > 4


def test_compare_sizes_divide_every_sharding_and_stay_small(plan: Plan) -> None:
    sizes = proportional_sizes(plan, 8)
    for info in plan.tensors:
        ref = info.ref
        assert math.prod(sizes[d.name] for d in ref.dims) <= MAX_SCALED_ELEMENTS, ref
        for d in ref.dims:
            assert sizes[d.name] % math.prod(sizes[a] for a in d.axes) == 0, (ref, d)


def test_a_spec_already_small_keeps_its_own_sizes() -> None:
    spec = shardc.parse("mesh X=2\ndims B=8, D=4, F=6\nparam W\nY[B_X, F] = A[B_X, D] · W[D, F]\n")
    plan = shardc.plan(spec)
    assert proportional_sizes(plan, 8) == small_sizes(plan, 8) == {"B": 8, "D": 4, "F": 6, "X": 2}


def test_a_product_against_a_dim_holds_where_two_dims_must_move_at_once() -> None:
    """pipeline_llama (N·H = D, F = 2.6875 D): one dim's power at a time stopped at N·H = D/2, F = 1.34 D."""
    spec = shardc.parse((Path(__file__).resolve().parent.parent / "examples" / "pipeline_llama.shard").read_text())
    sizes = proportional_sizes(shardc.plan(spec), 16)
    assert sizes["N"] * sizes["H"] == sizes["D"] and sizes["F"] * spec.sizes["D"] == sizes["D"] * spec.sizes["F"]


# StarCoder's attention block with its tokens against D (B·S = 131072 beside D = 6144) at S = 1024, whose
# causal scores XLA compiles fast: the plan moves dQ[B, S, N, H] (AllToAll) where XLA all-reduces dX[B, S, D]
ATTENTION = STARCODER.split("\nHd[")[0].replace("B=16, S=8192, T=8192", "B=128, S=1024, T=1024").replace(
    ", F=24576", "").replace(", W_in, W_out", "") + "\n"


@pytest.mark.slow
def test_compare_counts_the_bytes_at_the_spec_sizes_where_the_plan_was_chosen() -> None:
    """At compare's small sizes (B·S/D about 1 where the spec has 21) the plan read 1.141 of XLA's bytes; at
    the spec's own dims, where the planner chose it, 0.853.  The run stays at the small sizes."""
    from shardc.verification.compare import compare

    spec = shardc.parse(ATTENTION)
    result = compare(spec, devices=8)
    assert {k: result.counted_at[k] for k in spec.sizes} == spec.sizes
    assert result.counted_at["X"] == 2 and result.counted_at["Y"] == 4
    assert result.sizes["D"] < spec.sizes["D"]  # the run is small
    dq = next(r for r in result.plan.rows if r.tensor == "dQ" and r.kind == "AllToAll_Y")
    assert dq.bytes == 128 // 2 * 1024 * 48 * 128 * spec.dtype.nbytes  # dQ[B_X, S, N, H], whole over Y
    assert result.volume_ratio is not None and result.volume_ratio <= 1.0


@pytest.mark.parametrize("example", ["starcoder", "gpt_layer_tp"])
def test_xlas_side_traced_at_the_spec_sizes_holds_no_constant_of_a_masks_size(example: str) -> None:
    """The jax.numpy reference builds its causal and dropout masks in jax.numpy (iotas, a hash of them), so that
    compare can count at the spec's dims: before, GPT-3's dropout on its [B, N, S, T] scores (96 x 2048^2) was a
    numpy constant of that size (over 70 s and 6.5 GB to compile), StarCoder's causal attention 8192^2."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from shardc.lowering import reference
    from shardc.spec.functions import ID_DTYPE
    from shardc.spec.walk import id_names, leaves

    spec = shardc.parse(STARCODER if example == "starcoder" else
                        (Path(__file__).resolve().parent.parent / "examples" / f"{example}.shard").read_text())
    made, ids = {s.result.name for s in spec.statements}, id_names(spec)
    args = {t.name: jax.ShapeDtypeStruct(tuple(spec.sizes[d.name] for d in t.dims),
                                         ID_DTYPE if t.name in ids else np.float32)
            for s in spec.statements for t in leaves(s.expr) if t.name not in made}
    jaxpr = jax.make_jaxpr(lambda xs: reference.forward(spec, xs, jnp, sizes=spec.sizes))(args)
    assert max((np.size(c) for c in jaxpr.consts), default=0) <= max(spec.sizes.values())
