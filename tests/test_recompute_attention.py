"""``+attention``: a dots policy that keeps each fused attention's output and row logsumexp, as torchtitan's
op-level selective checkpointing saves the SDPA kernel's results; checked by hand counts on one attention layer."""

from __future__ import annotations

import pytest

import shardc
from shardc.ir.plan import Plan
from shardc.planner.recompute import Policy, policy

# one attention layer on 2 devices: a device holds B=2 of the batch; K and V read a rename of X, as a layer's spec does
LAYER = """mesh X=2
dims B=4, S=64, T=64, N=4, H=16, D=64
Kx[B_X, T, D] = X[B_X, S, D]
Q[B_X, S, N, H] = X[B_X, S, D] · W_q[D, N, H]
K[B_X, T, N, H] = Kx[B_X, T, D] · W_k[D, N, H]
V[B_X, T, N, H] = Kx[B_X, T, D] · W_v[D, N, H]
C[B_X, S, N, H] = attention(Q[B_X, S, N, H], K[B_X, T, N, H], V[B_X, T, N, H] over T)
Out[B_X, S, D] = C[B_X, S, N, H] · W_o[N, H, D]
"""
B, S, T, N, H, D = 2, 64, 64, 4, 16, 64  # a device's share
K_MATMUL = 2 * B * T * D * N * H  # K = Kx · W_k
ATTENTION_FORWARD = 4 * B * S * T * N * H  # Q·K^T and P·V, no mask
C_BYTES, LSE_BYTES = B * S * N * H * 2, B * S * N * 4  # the output in bf16, the logsumexp in f32


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    spec = shardc.parse(LAYER, "<layer>")
    return {m: shardc.plan(spec, recompute=m) for m in ("none", "dots-except:W_k", "dots-except:W_k+attention")}


def test_plus_attention_keeps_the_kernels_output_and_logsumexp_so_its_forward_is_not_rerun(
        plans: dict[str, Plan]) -> None:
    assert [s.dst.name for s in plans["dots-except:W_k"].recomputed] == ["Kx", "K", "C", "C_lse"]
    assert [s.dst.name for s in plans["dots-except:W_k+attention"].recomputed] == ["Kx", "K"]  # Kx: a rename


def test_plus_attention_reruns_the_named_matmul_only_and_keeps_the_output_and_logsumexp_bytes(
        plans: dict[str, Plan]) -> None:
    none, dots, keep = (shardc.cost(plans[m]) for m in ("none", "dots-except:W_k", "dots-except:W_k+attention"))
    assert keep.backward.compute_flops - none.backward.compute_flops == K_MATMUL
    assert dots.backward.compute_flops - keep.backward.compute_flops == ATTENTION_FORWARD
    assert keep.memory.residual_bytes - dots.memory.residual_bytes == C_BYTES + LSE_BYTES
    assert none.memory.residual_bytes - keep.memory.residual_bytes == B * T * N * H * 2  # K, rerun


def test_dots_alternate_reruns_every_second_weight_matmul_of_the_layer_as_torchtitan_counts_mm() -> None:
    """Q, K, V, Out read W_q, W_k, W_v, W_o in that order: the 2nd and 4th are rerun, as dots-except names them."""
    spec = shardc.parse(LAYER, "<layer>")
    alternate, named = (shardc.plan(spec, recompute=m)
                        for m in ("dots-alternate+attention", "dots-except:W_k,W_o+attention"))
    assert [s.dst.name for s in alternate.recomputed] == [s.dst.name for s in named.recomputed] == ["Kx", "K"]
    assert shardc.cost(alternate).backward.compute_flops == shardc.cost(named).backward.compute_flops


BLOCK = """mesh X=2
dims B=4, D=16, E=8, F=32
param W_0, W_a, W_b, W_c, W_d, W_out
X0[B_X, E] = In[B_X, D] · W_0[D, E]
layers 2 {
  L1[B_X, D] = X0[B_X, E] · W_a[E, D]
  L2[B_X, F] = tanh(L1[B_X, D] · W_b[D, F])
  L3[B_X, D] = L2[B_X, F] · W_c[F, D]
  X1[B_X, E] = L3[B_X, D] · W_d[D, E]
}
Out[B_X, D] = X1[B_X, E] · W_out[E, D]
"""


def test_dots_alternate_counts_inside_the_layers_block_only() -> None:
    """The block's 2nd and 4th matmuls (W_b, W_d) are not kept; W_0 and W_out run once, outside the checkpointed
    layers.  W_b's product (tanh's input, L2_t1) is rerun with tanh; W_d's (the layer's output) no backward reads."""
    spec = shardc.parse(BLOCK, "<block>")
    alternate, named = (shardc.plan(spec, recompute=m) for m in ("dots-alternate", "dots-except:W_b,W_d"))
    assert [s.dst.name for s in alternate.recomputed] == [s.dst.name for s in named.recomputed] == ["L2_t1", "L2"]


def test_the_grammar_and_its_spans() -> None:
    assert policy("dots-alternate") == Policy("dots", frozenset(), False, alternate=True)
    assert policy("dots+attention") == Policy("dots", frozenset(), True)
    assert policy("dots-except:W_k,W_o+attention", ["W_k", "W_o"]) == Policy("dots", frozenset({"W_k", "W_o"}), True)
    with pytest.raises(shardc.ShardcError, match=r"'W_x' is not a param") as bad:
        policy("dots-except:W_k,W_x+attention", ["W_k"])
    assert bad.value.span is not None and (bad.value.span.column, bad.value.span.length) == (17, 3)
    with pytest.raises(shardc.ShardcError, match=r"\+attention follows a dots policy only"):
        policy("full+attention")
    with pytest.raises(shardc.ShardcError, match="unknown recompute mode 'dots-alternat"):
        policy("dots-alternat+attention")
