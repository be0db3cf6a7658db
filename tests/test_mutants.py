"""Mutation testing of verify: modules `shardc lower` writes, edited by hand, must fail ``verify --module``.

Each row of :data:`MUTANTS` is one edit (a regular expression anchored on an emitted call, and
its replacement) of the module ``shardc lower`` writes for one of :data:`SPECS`; the edited text
is run through the same path as ``shardc verify FILE --module MOD.py`` (``verify(plan, module=...)``).
A mutant is killed when verify fails it: a value or collective row fails, or the module is
rejected (it no longer loads, or raises while it runs).  Each test also checks that the unedited
module passes, so it can fail.  A held-out mutant is added as one more row.

The specs are small (2 to 4 devices, dims of 8 or so, f32 but two) so the whole table runs in a
few minutes; each spec's module is lowered once and its unedited verdict computed once.
"""

from __future__ import annotations

import functools
import io
import re
import tokenize
from dataclasses import dataclass

import pytest

import shardc
from shardc.ir.plan import Plan
from shardc.lowering.api import module_source
from shardc.verification.module_check import ModuleRejected
from shardc.verification.report import Report
from shardc.verification.verify import render_report, verify

pytestmark = pytest.mark.slow  # every test lowers, compiles and runs a module

SPECS = {
    # einsum, an elementwise map and its derivative; AllReduce forward and backward
    "mlp": """mesh X=2, Y=2
dims B=8, D=8, F=12
dtype f32
H[B_X, F_Y] = gelu(In[B_X, D] · W[D, F_Y])
Out[B_X, D] = H[B_X, F_Y] · W2[F_Y, D]
""",
    # the same in bf16: a 10% scale must fail where the bound is looser
    "mlp16": """mesh X=2
dims B=8, D=4, F=6
dtype bf16
H[B_X, F] = gelu(In[B_X, D] · W[D, F])
Out[B_X, D] = H[B_X, F] · W2[F, D]
""",
    # norms and a softmax: statistics all-reduced, AllGathers, free slices (rmsnorm feeds the
    # softmax, not a layernorm, whose input gradient is orthogonal to its input: a sign flip of
    # rmsnorm's projection term would change nothing there)
    "norm": """mesh X=2, Y=2
dims B=8, D=16
dtype f32
N[B_Y, D_X] = rmsnorm(X[B_Y, D_X] over D)
Out[B_Y, D_X] = softmax(N[B_Y, D_X] over D)
L[B_Y, D_X] = layernorm(Z[B_Y, D_X] over D) * G[D_X]
""",
    # the norms in bf16, whose backward bounds are loose (checked again in float32)
    "norm16": """mesh X=2, Y=2
dims B=8, D=16
dtype bf16
N[B_Y, D_X] = rmsnorm(X[B_Y, D_X] over D)
Out[B_Y, D_X] = softmax(N[B_Y, D_X] over D)
L[B_Y, D_X] = layernorm(Z[B_Y, D_X] over D) * G[D_X]
""",
    # an AllToAll over two axes, tanh, an AllReduce over two axes
    "a2a": """mesh X=2, Y=2
dims S=8, D=8, F=8
dtype f32
Act2[S, D_XY] = tanh(Act[S_XY, D])
Out[S, F] = Act2[S, D_XY] · W[D_XY, F]
""",
    # an AllGather over two axes, exp, a ReduceScatter
    "gather": """mesh X=2, Y=2
dims B=8, D=8, F=12
dtype f32
In2[B, D] = In[B_XY, D]
H[B, F_Y] = In2[B, D] · W[D, F_Y]
Out[B, D_Y] = exp(H[B, F_Y]) · W2[F_Y, D]
""",
    # attention with a rename, a causal mask and dropout over a sharded query dim, a sum
    "attn": """mesh X=2, Y=2
dims B=2, S=8, T=8, D=8, N=2, H=4
dtype f32
param W_q, W_k, W_v
Kx[B, T, D] = X[B, S_X, D]
Q[B, S_X, N_Y, H] = X[B, S_X, D] · W_q[D, N_Y, H]
K[B, T, N_Y, H] = Kx[B, T, D] · W_k[D, N_Y, H]
V[B, T, N_Y, H] = Kx[B, T, D] · W_v[D, N_Y, H]
Sc[B, N_Y, S_X, T] = Q[B, S_X, N_Y, H] · K[B, T, N_Y, H]
P[B, N_Y, S_X, T] = dropout(softmax(causal(Sc[B, N_Y, S_X, T], S, T) over T), 0.25)
C[B, S_X, N_Y, H] = P[B, N_Y, S_X, T] · V[B, T, N_Y, H]
R[B, S_X, N_Y, H] = Q[B, S_X, N_Y, H] + C[B, S_X, N_Y, H]
""",
    # vocabulary parallelism: embed and cross_entropy over a sharded vocabulary (pmax, psum)
    "vocab": """mesh Y=2, X=2
dims B=4, S=4, V=16, D=8
dtype f32
E[B_Y, S, D] = embed(Tok[B_Y, S], W_emb[V_X, D])
Loss[] = cross_entropy(E[B_Y, S, D] · W_lm[D, V_X], Next[B_Y, S])
""",
    # ZeRO-2: an optimizer phase (a slice, the update, an AllGather)
    "zero": """mesh X=2
dims B=8, D=4, F=6
dtype f32
zero 2 over X
H[B_X, F] = tanh(In[B_X, D] · W[D, F])
""",
    # top-2 routing with capacity, AllToAlls between group and expert sharding, relu
    "moe": """mesh X=2
dims G=4, S=8, E=4, C=6, D=8, F=8
dtype f32
param W_r, W_1
Gate[G_X, S, E] = softmax(X[G_X, S, D] · W_r[D, E] over E)
Disp[G_X, S, E, C] = route(Gate[G_X, S, E], S, C, 2 over E)
Comb[G_X, S, E, C] = Gate[G_X, S, E] * Disp[G_X, S, E, C]
In[G, E_X, C, D] = Disp[G_X, S, E, C] · X[G_X, S, D]
H[G, E_X, C, F] = relu(In[G, E_X, C, D] · W_1[E_X, D, F])
Out[G_X, S, F] = Comb[G_X, S, E, C] · H[G, E_X, C, F]
""",
    # the same layer, routed by index (dispatch and combine)
    "dispatch": """mesh X=2
dims G=4, S=8, E=4, C=6, D=8, F=8
dtype f32
param W_r, W_1
Gate[G_X, S, E] = softmax(X[G_X, S, D] · W_r[D, E] over E)
In[G, E_X, C, D] = dispatch(Gate[G_X, S, E], X[G_X, S, D], S, C, 2 over E)
H[G, E_X, C, F] = relu(In[G, E_X, C, D] · W_1[E_X, D, F])
Out[G_X, S, F] = combine(Gate[G_X, S, E], H[G, E_X, C, F], S, C, 2 over E)
""",
}


@dataclass(frozen=True)
class Mutant:
    """One edit of a lowered module: ``pattern`` (a regex on its text) replaced by ``replacement``."""

    kind: str  # the op family or collective edited, and how
    spec: str  # a key of SPECS
    pattern: str
    replacement: str

    @property
    def id(self) -> str:
        return f"{self.spec}: {self.kind}"


M = Mutant
MUTANTS = [
    # ---- einsum
    M("einsum: reads the pre-activation cotangent", "mlp",
      r"(dW_1 = jnp\.einsum\('bd,bf->df', In, )dH_t1\)", r"\1dH)"),
    M("einsum: reads the pre-activation value", "a2a", r"(Out_1 = jnp\.einsum\('sd,df->sf', )Act2,", r"\1Act_1,"),
    M("einsum: a sign wrong", "mlp", r"dIn_1 = jnp\.einsum\(", r"dIn_1 = -jnp.einsum("),
    M("einsum: a contracted index misaligned (an operand reversed along it)", "attn",
      r"(dW_q_1 = jnp\.einsum\('bsd,bsnh->dnh', )X,", r"\1jnp.flip(X, 1),"),
    # ---- elementwise maps
    M("map: 10% scale on an activation", "mlp", r"(H = jax\.nn\.gelu\(H_t1\))", r"\1 * 1.1"),
    M("map: 10% scale on an activation (bf16)", "mlp16", r"(H = jax\.nn\.gelu\(H_t1\))", r"\1 * 1.1"),
    M("map: 10% scale on a gradient (bf16)", "mlp16", r"(dH_t1 = jax\.vjp\(jax\.nn\.gelu, H_t1\)\[1\]\(dH\)\[0\])",
      r"\1 * 1.1"),
    M("map: a residual scaled by 1.1 (the backward reads it)", "mlp", r"return \(H, Out, H_t1\)",
      r"return (H, Out, H_t1 * 1.1)"),
    M("map: gelu exact for its tanh approximation (bf16)", "mlp16", r"H = jax\.nn\.gelu\(H_t1\)",
      r"H = jax.nn.gelu(H_t1, approximate=False)"),
    M("map: derivative wrong (gelu's of silu)", "mlp", r"jax\.vjp\(jax\.nn\.gelu,", r"jax.vjp(jax.nn.silu,"),
    M("map: derivative wrong (tanh's of sinh)", "a2a", r"jax\.vjp\(jnp\.tanh,", r"jax.vjp(jnp.sinh,"),
    M("map: derivative wrong (exp's of sinh)", "gather", r"jax\.vjp\(jnp\.exp,", r"jax.vjp(jnp.sinh,"),
    M("map: derivative wrong (relu's of gelu)", "moe", r"jax\.vjp\(jax\.nn\.relu,", r"jax.vjp(jax.nn.gelu,"),
    # ---- reductions and norms
    M("norm: rmsnorm statistic divided by 4", "norm", r"(N_ms_1 = jax\.lax\.psum\(N_ms, 'X'\))", r"\1 / 4"),
    M("norm: layernorm variance over n-1", "norm", r"(L_t1_var = .*?) / (\w+)\.shape\[1\]", r"\1 / (\2.shape[1] - 1)"),
    M("norm: layernorm mean dropped", "norm", r"(L_t1 = \(\w+) - jnp\.expand_dims\(L_t1_mean, 1\)\)", r"\1)"),
    M("norm: rmsnorm backward sign wrong", "norm", r"(dX = .*?\(dN) - (N_again)", r"\1 + \2"),
    M("norm: 10% scale on rmsnorm's gradient (bf16)", "norm16", r"^(    dX = [^#]*?)(\s+#)", r"\1 * 1.1\2"),
    M("norm: 10% scale on layernorm's gradient (bf16)", "norm16", r"^(    dZ_1 = [^#]*?)(\s+#)", r"\1 * 1.1\2"),
    M("reduction: 10% scale on softmax's gradient (bf16)", "norm16", r"^(    dN = Out [^#]*?)(\s+#)",
      r"\1 * 1.1\2"),
    M("reduction: softmax scaled by 1.1", "norm", r"jax\.nn\.softmax\((\w+), axis=1\)",
      r"jax.nn.softmax(\1 * 1.1, axis=1)"),
    M("reduction: softmax backward sign wrong", "norm", r"(dN = Out \* \(dOut) - ", r"\1 + "),
    M("reduction: router softmax backward sign wrong", "moe", r"(dGate_t1 = Gate \* \(dGate) - ", r"\1 + "),
    # ---- masks
    M("mask: dropout key ignored", "attn", r", dropout_key, \(", r", 0, ("),
    M("mask: dropout offset (query block positions unsharded)", "attn",
      r"(P_mask = keep_mask\(P_t1, \d+, 0\.25, \(\(\), \('Y',\), )\('X',\)", r"\1()"),
    M("mask: dropout kept at the wrong rate", "attn", r"(keep_mask\(P_t1, \d+, )0\.25", r"\g<1>0.3"),
    M("mask: dropout rescaled wrongly", "attn", r"(P_1 = jnp\.where\(P_mask, P_t1) / 0\.75", r"\1 / 0.8"),
    M("mask: dropout's gradient rescaled wrongly", "attn", r"(dP_t1 = jnp\.where\(P_mask, dP) / 0\.75", r"\1 / 0.8"),
    M("mask: causal offset by one (the next key visible)", "attn",
      r"P_t1_t1 = causal_mask\(Sc, \(2, \('X',\)\), \(3, \(\)\)\)",
      r"P_t1_t1 = jnp.where(positions(Sc, 3, ()) > positions(Sc, 2, ('X',)) + 1, -jnp.inf, Sc)"),
    M("mask: causal offset (query positions unsharded)", "attn",
      r"P_t1_t1 = causal_mask\(Sc, \(2, \('X',\)\)", r"P_t1_t1 = causal_mask(Sc, (2, ())"),
    M("mask: causal backward transposed", "attn",
      r"dSc = causal_mask\(dP_t1_t1, \(2, \('X',\)\), \(3, \(\)\)",
      r"dSc = causal_mask(dP_t1_t1, (3, ()), (2, ('X',))"),
    # ---- sums and renames
    M("sum: a term's sign wrong", "attn", r"R = Q \+ C", r"R = Q - C"),
    M("sum: a gradient term dropped", "attn", r"dQ = dQ_1 \+ dQ_2", r"dQ = dQ_2"),
    M("rename: a renamed tensor's gradient dropped", "attn", r"dX_sum = dX_2 \+ dX_3", r"dX_sum = dX_2"),
    # ---- vocabulary ops
    M("embed: lookup without its vocabulary offset", "vocab", r"vocab_lookup\(W_emb, Tok, \('X',\)\)",
      r"vocab_lookup(W_emb, Tok, ())"),
    M("embed: gradient scattered without its offset", "vocab",
      r"(vocab_scatter\(Tok, dE_1, W_emb\.shape\[0\], )\('X',\)", r"\1()"),
    M("loss: the sum of exponentials reduced by max", "vocab", r"Loss_sum_1 = jax\.lax\.psum\(Loss_sum, 'X'\)",
      r"Loss_sum_1 = jax.lax.pmax(Loss_sum, 'X')"),
    M("loss: 10% scale on its gradient", "vocab", r"(vocab_ce_grad\(Loss_t1, Loss_lse, Next, )dLoss,",
      r"\1dLoss * 1.1,"),
    M("loss: mean over the local batch only", "vocab", r" \* jax\.lax\.axis_size\(\('Y',\)\)\)\)", r"))"),
    M("loss: target logit summed over the wrong axis", "vocab",
      r"Loss_target_1 = jax\.lax\.psum\(Loss_target, 'X'\)", r"Loss_target_1 = jax.lax.psum(Loss_target, ('Y', 'X'))"),
    # ---- routing
    M("route: top-1 for top-2", "moe", r"route_topk\(Gate, k=2,", r"route_topk(Gate, k=1,"),
    M("route: tokens in reverse order", "moe", r"route_topk\(Gate, (k=2, capacity=[^,]+, order=1, experts=2)\)",
      r"jnp.flip(route_topk(jnp.flip(Gate, 1), \1), 1)"),
    M("route: capacity one slot short", "moe",
      r"(Disp = route_topk\(Gate, k=2, capacity=([^,]+), order=1, experts=2\))",
      r"\1 * (jnp.arange(\2) < \2 - 1)"),
    M("route: tokens past capacity wrap to the first slots, not dropped", "moe",
      r"Disp = route_topk\(Gate, k=2, capacity=([^,]+), order=1, experts=2\)",
      r"Disp = (lambda r: r[..., :\1] + r[..., \1:])(route_topk(Gate, k=2, capacity=2 * \1, order=1, experts=2))"),
    M("route: slots shifted by one", "moe", r"(Disp = )(route_topk\(Gate, .*?experts=2\))",
      r"\1jnp.roll(\2, 1, axis=-1)"),
    # ---- index-based dispatch and combine
    M("dispatch: top-1 for top-2", "dispatch", r"(In_1 = expert_dispatch\(Gate, X, k=)2", r"\g<1>1"),
    M("dispatch: tokens' gradient from their first expert only", "dispatch",
      r"(dX_1 = expert_dispatch_vjp\(Gate, dIn_1, k=)2", r"\g<1>1"),
    M("dispatch: combine weighs by the squared gates (the same experts chosen)", "dispatch",
      r"Out = expert_combine\(Gate,", r"Out = expert_combine(Gate ** 2,"),
    M("dispatch: the gates' gradient negated", "dispatch", r"dGate = expert_gate_vjp\(",
      r"dGate = -expert_gate_vjp("),
    M("dispatch: the expert rows' gradient scaled 10%", "dispatch", r"dH = expert_combine_vjp\(",
      r"dH = 1.1 * expert_combine_vjp("),
    # ---- AllReduce (psum, pmax)
    # a psum simply dropped, or moved to another axis, leaves a value that varies where the
    # out_specs say it does not: jax's shard_map rejects it while tracing (a killed mutant, but not
    # by verify's checks); the mutants below keep jax's replication types and change the values
    M("AllReduce: dropped (forward, jax rejects it)", "mlp", r"Out = jax\.lax\.psum\(Out_1, 'Y'\)", r"Out = Out_1 * 2"),
    M("AllReduce: a mean for a sum (forward)", "mlp", r"psum\(Out_1, 'Y'\)", r"pmean(Out_1, 'Y')"),
    M("AllReduce: over an extra axis (forward)", "mlp", r"psum\(Out_1, 'Y'\)", r"psum(Out_1, ('X', 'Y'))"),
    M("AllReduce: a max for a sum (backward)", "mlp", r"dW = jax\.lax\.psum\(dW_1, 'X'\)",
      r"dW = jax.lax.pmax(dW_1, 'X')"),
    M("AllReduce: as an AllGather and a local sum (values right)", "mlp", r"dW = jax\.lax\.psum\(dW_1, 'X'\)",
      r"dW = jax.lax.all_gather(dW_1, 'X', axis=0, tiled=False, to='invarying').sum(0)"),
    M("AllReduce: an unplanned extra one (values right)", "mlp", r"dW = jax\.lax\.psum\(dW_1, 'X'\)",
      r"dW = jax.lax.psum(dW_1, 'X') + 0 * jax.lax.psum(dW_1, ('X', 'Y'))"),
    M("AllReduce: a max over one of its two axes", "a2a", r"psum\(Out_1, \('X', 'Y'\)\)",
      r"pmax(jax.lax.psum(Out_1, 'X'), 'Y')"),
    M("AllReduce: over an extra axis (backward)", "norm", r"dG = jax\.lax\.psum\(dG_1, 'Y'\)",
      r"dG = jax.lax.psum(dG_1, ('X', 'Y'))"),
    M("AllReduce: a norm gradient's statistic dropped", "norm", r"dN_dot_1 = jax\.lax\.psum\(dN_dot, 'X'\)",
      r"dN_dot_1 = dN_dot * 2"),
    M("AllReduce: the embedding's a max for a sum", "vocab", r"E = jax\.lax\.psum\(E_1, 'X'\)",
      r"E = jax.lax.pmax(E_1, 'X')"),
    # ---- AllGather
    M("AllGather: order of its two axes transposed", "gather", r"all_gather\(In2_1, \('X', 'Y'\)",
      r"all_gather(In2_1, ('Y', 'X')"),
    M("AllGather: dropped (forward, local block repeated)", "norm",
      r"N_1 = jax\.lax\.all_gather\(N, 'X', axis=1, tiled=True, to='invarying'\)",
      r"N_1 = jnp.concatenate([N, N], axis=1)"),
    M("AllGather: dropped (backward, local block repeated)", "gather",
      r"dOut_1 = jax\.lax\.all_gather\(dOut, 'Y', axis=1, tiled=True, to='invarying'\)",
      r"dOut_1 = jnp.concatenate([dOut, dOut], axis=1)"),
    M("AllGather: over the wrong axis", "norm", r"(N_1 = jax\.lax\.all_gather\(N, )'X'", r"\1'Y'"),
    M("AllGather: a 10% scale on the gathered value", "attn", r"(Kx = jax\.lax\.all_gather\(Kx_1, .*?\))", r"\1 * 1.1"),
    # ---- ReduceScatter
    M("ReduceScatter: dropped (a slice, no sum)", "gather",
      r"Out = jax\.lax\.psum_scatter\(Out_1, 'Y', scatter_dimension=1, tiled=True\)",
      r"Out = shard_slice(Out_1, 'Y', dim=1)"),
    M("ReduceScatter: over an extra axis", "gather", r"Out = jax\.lax\.psum_scatter\(Out_1, 'Y',",
      r"Out = jax.lax.psum_scatter(jax.lax.psum(Out_1, 'X'), 'Y',"),
    M("ReduceScatter: as an AllReduce and a slice (values right)", "gather",
      r"Out = jax\.lax\.psum_scatter\(Out_1, 'Y', scatter_dimension=1, tiled=True\)",
      r"Out = shard_slice(jax.lax.psum(Out_1, 'Y'), 'Y', dim=1)"),
    # ---- AllToAll
    M("AllToAll: order of its two axes transposed", "a2a", r"all_to_all\(Act, \('X', 'Y'\)",
      r"all_to_all(Act, ('Y', 'X')"),
    M("AllToAll: backward order transposed", "a2a", r"all_to_all\(dAct_1, \('X', 'Y'\)",
      r"all_to_all(dAct_1, ('Y', 'X')"),
    M("AllToAll: dropped (local block repeated)", "moe",
      r"In = jax\.lax\.all_to_all\(In_1, 'X', split_axis=1, concat_axis=0, tiled=True\)",
      r"In = shard_slice(jnp.concatenate([In_1, In_1], axis=0), 'X', dim=1)"),
    M("AllToAll: backward dropped (local block repeated)", "moe",
      r"dH_1 = jax\.lax\.all_to_all\(dH, 'X', split_axis=1, concat_axis=0, tiled=True\)",
      r"dH_1 = shard_slice(jnp.concatenate([dH, dH], axis=0), 'X', dim=1)"),
    # ---- ZeRO-2's optimizer phase
    M("optimizer: update sign wrong", "zero", r"(W_1 = W_1) - LEARNING_RATE", r"\1 + LEARNING_RATE"),
    M("optimizer: param slice from the wrong block", "zero", r"W_1 = shard_slice\(W, 'X', dim=0\)",
      r"W_1 = shard_slice(jnp.flip(W, 0), 'X', dim=0)"),
    M("AllGather: the optimizer's blocks in reverse order", "zero",
      r"W = jax\.lax\.all_gather\(W_1, 'X', axis=0, tiled=True, to='invarying'\)",
      r"W = jax.lax.all_gather(W_1, 'X', axis=0, tiled=False, to='invarying')[::-1].reshape(-1, W_1.shape[1])"),
    # ---- a free slice
    M("slice: over the wrong axis", "gather", r"dIn = shard_slice\(dIn_2, 'Y', dim=0\)",
      r"dIn = shard_slice(dIn_2, 'X', dim=0)"),
]

# what the table must cover: every op family and every collective kind of a plain module
# (collective-permute is only emitted by the pipelined lowering, which --module does not run)
FAMILIES = ("einsum", "map", "norm", "reduction", "mask", "sum", "rename", "embed", "loss", "route", "dispatch",
            "optimizer",
            "AllReduce", "AllGather", "ReduceScatter", "AllToAll")


@functools.cache
def _plan(spec: str) -> Plan:
    return shardc.plan(shardc.parse(SPECS[spec]))


@functools.cache
def _source(spec: str) -> str:
    """The module `shardc lower` writes for the spec (shared by its mutants)."""
    source, note = module_source(_plan(spec))
    assert note is None, note
    return source


def _code(source: str) -> list[str]:
    """The module's tokens less its comments: an edit that lands in a line's comment changes nothing."""
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    return [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in skip]


def _verdict(spec: str, source: str) -> tuple[bool, str]:
    """Whether verify --module passes ``source``, and the report or the rejection."""
    try:
        report: Report = verify(_plan(spec), module=source)
    except ModuleRejected as err:
        return False, err.render()
    return report.ok, render_report(report)


@functools.cache
def _unedited(spec: str) -> tuple[bool, str]:
    return _verdict(spec, _source(spec))


def test_the_table_covers_every_op_family_and_collective_kind() -> None:
    kinds = {m.kind.split(":")[0] for m in MUTANTS}
    assert set(FAMILIES) <= kinds, set(FAMILIES) - kinds
    assert len(MUTANTS) >= 30
    assert len({m.id for m in MUTANTS}) == len(MUTANTS)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.id)
def test_verify_kills_the_mutant(mutant: Mutant) -> None:
    ok, text = _unedited(mutant.spec)
    assert ok, f"the unedited module of {mutant.spec} must pass:\n{text}"
    source = _source(mutant.spec)
    edited, count = re.subn(mutant.pattern, mutant.replacement, source, flags=re.MULTILINE)
    assert count >= 1 and edited != source, f"the edit matched nothing in the module of {mutant.spec}"
    assert _code(edited) != _code(source), f"the edit of {mutant.id} changed only comments"
    ok, text = _verdict(mutant.spec, edited)
    assert not ok, f"verify passed the mutant {mutant.id}:\n{text}"
