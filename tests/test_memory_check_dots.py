"""Dots against XLA's CPU backend: its dot decomposer copies the operands of a dot with several free or
contracted indices into (batch, free, contracted) and (batch, contracted, free), and its YNNPACK fusion
makes a large dot read only by a dot with no free index inside that reader, with no buffer."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import shardc
from shardc.costmodel.fusion_buffers import derivatives, summed_into
from shardc.costmodel.layout_copies import layout_copies
from shardc.costmodel.phase_memory import Buffers, phase_memory
from shardc.ir.plan import Step, backward_program
from shardc.verification.memory_check import XLA_CPU

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# Comb's two free indices (E, C) after its contracted S: copied as [G, E, C, S] for the dot, where a dot
# with one free index reads a transposed operand in place (W [F, D] as its second operand, contracted last)
MASKED = ("mesh X=2\ndims G=4, S=8, E=4, C=2, D=6, F=6\ndtype f32\nparam W\n"
          "Y[G_X, E, C, D] = Comb[G_X, S, E, C] · X[G_X, S, D]\nZ[G_X, E, C, F] = Y[G_X, E, C, D] · W[F, D]\n")


def _step(text: str, name: str, backward: bool = False) -> Step:
    plan = shardc.plan(shardc.parse(text))
    return next(s for s in (backward_program(plan) if backward else plan.forward) if s.dst.name == name)


def test_the_dot_decomposer_copies_an_operand_with_two_free_indices_into_canonical_order() -> None:
    y = _step(MASKED, "Y")
    assert [r.name for r in layout_copies(y, canonical=True)] == ["Comb"]
    assert layout_copies(y) == []  # a TPU or GPU (and Eigen) reads it as (batch, contracted, free) in place
    assert layout_copies(_step(MASKED, "Z"), canonical=True) == []  # W's transpose is folded into the dot


def test_the_contracted_indices_are_in_their_letters_order() -> None:
    # dL = dQ · W over G, R and H: jnp.einsum lists them as g, h, r, so dQ [B, S, G, R, H], its contracted
    # indices last, is copied all the same (gemma2_27b.shard's dL1g_1 and dL1l_1 at verify's sizes)
    # and W [D, G, R, H] too
    text = ("mesh X=2\ndims B=4, S=2, D=4, G=2, R=2, H=3\ndtype f32\nparam W\n"
            "Q[B_X, S, G, R, H] = L[B_X, S, D] · W[D, G, R, H]\n")
    dl = _step(text, "dL", backward=True)
    assert sorted(r.name for r in layout_copies(dl, canonical=True)) == ["W", "dQ"]
    ordered = text.replace("G, R, H]", "G, H, R]").replace("W[D, G, H, R]", "W[G, H, R, D]")
    assert layout_copies(_step(ordered, "dL", backward=True), canonical=True) == []


# the backward's dGate sums dComb · Disp over C: a dot with no free index, XLA's multiply and reduce
SUMMED = ("mesh X=2\ndims G=4, S=8, E=4, C=2, D=6\ndtype f32\nparam Ex\nconst Disp\n"
          "Comb[G_X, S, E, C] = Gate[G_X, S, E] * Disp[G_X, S, E, C]\n"
          "Out[G_X, S, D] = Comb[G_X, S, E, C] · Ex[E, C, D]\n")


def test_a_dot_read_only_by_a_dot_with_no_free_index_is_made_inside_it_from_ynnpacks_least_size() -> None:
    plan = shardc.plan(shardc.parse(SUMMED))
    assert plan.sizes is not None
    sizes = dict(plan.sizes)
    steps = backward_program(plan)
    comb, gate = (next(k for k, s in enumerate(steps) if s.dst.name == n) for n in ("dComb", "dGate"))
    elements = 4 // 2 * 8 * 4 * 2
    assert summed_into(steps, sizes, elements) == {comb: gate}
    assert summed_into(steps, sizes, elements + 1) == {} and summed_into(steps, sizes, 0) == {}
    fused, alone = (phase_memory(plan, sizes, 4, Buffers(dot_sums=n))[1].temporaries for n in (elements, 0))
    assert alone - fused == elements * 4  # dComb's buffer


@pytest.mark.slow
@pytest.mark.parametrize("name", ["moe_layer", "moe_dispatch"])
def test_moe_layers_within_ten_percent_at_sixteen_times_the_sizes(name: str) -> None:
    """The MoE layers' backward at 16x verify's dims: moe_layer.shard at 0.84 of XLA's total while the combine
    weights were read in place by dEx's dot (XLA copies them as [G, E·C, S], 604 MB) and dComb (604 MB, which
    XLA makes inside dGate's fusion) had a buffer, 1.11 with the copy alone, 0.95 with both, 1.00 with gelu's
    derivative made once; moe_dispatch.shard at 0.86, 0.97 with the derivative."""
    from shardc.lowering.api import lower
    from shardc.lowering.sizes import small_sizes
    from shardc.verification.memory_check import check_memory, render_memory

    plan = shardc.plan(shardc.parse((EXAMPLES / f"{name}.shard").read_text()))
    mesh = {a.name for a in plan.spec.mesh.axes}
    sizes = {k: v if k in mesh else 16 * v for k, v in small_sizes(plan, 8).items()}
    check = check_memory(lower(plan, sizes=sizes))
    assert check.phase == "backward" and check.within_target, render_memory(check)
    assert XLA_CPU.dots_canonical and XLA_CPU.dot_sums == 4096


# an expert MLP: dH_t1 = gelu_vjp(H_t1, dH) is read by dW_1's and dIn's dots, each copying it (E, the batch,
# is not its first index)
EXPERTS = ("mesh X=2\ndims G=4, E=2, C=2, D=4, F=6\ndtype f32\nparam W_1, W_2\n"
           "H[G, E_X, C, F] = gelu(In[G, E_X, C, D] · W_1[E_X, D, F])\n"
           "Ex[G, E_X, C, D] = H[G, E_X, C, F] · W_2[E_X, F, D]\n")


def test_a_transcendental_derivative_two_copies_read_is_made_once_from_the_start() -> None:
    for function, expected in (("gelu", 1), ("relu", 0)):
        plan = shardc.plan(shardc.parse(EXPERTS.replace("gelu", function)))
        assert plan.sizes is not None
        steps = backward_program(plan)
        (k,) = (k for k, s in enumerate(steps) if s.dst.name == "dH_t1")
        h = steps[k].operands[0]
        assert h.name == "H_t1" and sum(steps[k].dst in layout_copies(s, True) for s in steps) == 2
        spans = derivatives(steps, lambda s: layout_copies(s, True), {h}, lambda ref: 96.0)
        assert spans == [(0, k, 96.0)] * expected  # relu's derivative is a compare, made inside each fusion
        assert derivatives(steps, lambda s: [], {h}, lambda ref: 96.0) == []  # read in place: fused once


def test_a_value_made_for_the_dot_in_its_layout_is_not_copied_again() -> None:
    """The attention output divided again for the dot reading it, and a weight gathered along a dim other than
    its first, copied into place, are written in the order the dot decomposer wants: no second copy."""
    attention = ("mesh X=2\ndims B=4, S=8, T=8, G=2, R=2, H=4, D=6\ndtype f32\nparam W\n"
                 "C[B_X, S, G, R, H] = attention(Q[B_X, S, G, R, H], K[B_X, T, G, H], V[B_X, T, G, H] over T, causal)\n"
                 "Y[B_X, S, D] = C[B_X, S, G, R, H] · W[G, H, R, D]\n")
    gathered = ("mesh X=2\ndims B=4, S=8, G=2, R=2, H=4, D=6\ndtype f32\nparam W\n"
                "Y[B_X, S, D] = C[B_X, S, G, H, R] · W[G, R, H, D_X]\n")
    for text, copied in ((attention, "C"), (gathered, "W")):
        plan = shardc.plan(shardc.parse(text))
        assert plan.sizes is not None
        (y,) = (s for s in plan.forward if s.dst.name == "Y")
        assert [r.name for r in layout_copies(y, canonical=True)] == [copied]
        heaps = {phase_memory(plan, dict(plan.sizes), 4, replace(XLA_CPU, dots_canonical=c))[0].temporaries
                 for c in (True, False)}
        assert len(heaps) == 1
