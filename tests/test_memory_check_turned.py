"""A dot's result transposed after the dot, against XLA's CPU backend (shardc.costmodel.dot_results): which
operand ``jnp.einsum`` puts on the dot's left, the transpose made after the dot, each later dot's copy of the
product, and a softmax's exponentials alive to the copy a dot takes of it."""

from __future__ import annotations

from collections.abc import Callable

import shardc
from shardc.costmodel.dot_results import DotResult
from shardc.costmodel.fusion_buffers import exponentials
from shardc.costmodel.heap import Span
from shardc.costmodel.layout_copies import layout_copies, read_order
from shardc.costmodel.phase_memory import _turned
from shardc.costmodel.step_order import lifetimes
from shardc.ir.plan import Plan, Step
from shardc.ir.spec import TensorRef

# moe_transformer.shard's attention: At's product is [B, G, H, R, S] (Vl on the left), transposed into At's
# order; W_o's dot reads At
ATTENTION = ("mesh X=2\ndims B=4, S=4, T=4, G=2, R=2, H=3, D=4\ndtype f32\nparam W_o\n"
             "At[B_X, S, G, R, H] = P[B_X, G, R, S, T] · Vl[B_X, T, G, H]\n"
             "Y[B_X, S, D] = At[B_X, S, G, R, H] · W_o[G, R, H, D]\n")
# gpt_layer_tp_sp.shard's backward: dV read by dW_v's dot as [B*T, N*H] and by dKx's as [B*T, H*N]
TWO_ORDERS = ("mesh X=2\ndims B=2, S=4, T=4, N=2, H=3, D=4\ndtype f32\nparam W_v\n"
              "V[B, T, N_X, H] = Pd[B, N_X, S, T] · dC[B, S, N_X, H]\n"
              "Gw[D, N_X, H] = Kx[B, T, D] · V[B, T, N_X, H]\n"
              "Gk[B, T, D] = V[B, T, N_X, H] · W_v[D, N_X, H]\n")


def _plan(text: str) -> Plan:
    return shardc.plan(shardc.parse(text))


def _step(steps: tuple[Step, ...], name: str) -> int:
    return next(k for k, s in enumerate(steps) if s.dst.name == name)


def test_jnp_einsum_puts_its_second_operand_on_the_left_unless_the_product_is_in_order() -> None:
    import jax
    import jax.numpy as jnp

    p, v = jax.ShapeDtypeStruct((2, 2, 2, 4, 4), jnp.float32), jax.ShapeDtypeStruct((2, 4, 2, 3), jnp.float32)
    text = jax.jit(lambda p, v: jnp.einsum("bgrst,btgh->bsgrh", p, v)).lower(p, v).as_text()
    assert "dot_general %arg1, %arg0" in text  # Vl on the left, so P is the operand copied after the batch
    steps = _plan(ATTENTION).forward
    at = steps[_step(steps, "At")]
    assert [r.name for r in layout_copies(at, canonical=True)] == ["P", "Vl", "At"]
    assert read_order(at, at.operands[0]) == ("B", "G", "T", "R", "S")
    in_order = jax.jit(lambda p, v: jnp.einsum("bgrst,btgh->bgrsh", p, v)).lower(p, v).as_text()
    assert "dot_general %arg0, %arg1" in in_order


def test_each_later_dot_copies_the_product_once_an_order() -> None:
    steps = _plan(TWO_ORDERS).forward
    dots = DotResult(steps, set(), set())
    v = steps[_step(steps, "V")].dst
    gw, gk = _step(steps, "Gw"), _step(steps, "Gk")
    assert dots.turned == {v: _step(steps, "V")}
    assert read_order(steps[gw], v) == ("B", "T", "N", "H") and read_order(steps[gk], v) == ("B", "T", "H", "N")
    assert dots.copies(v) == [[gw], [gk]]
    # read in one order (G before H in its letters too): one copy for both, as CSE merges them
    same = _plan(TWO_ORDERS.replace("N", "G")).forward
    w = same[_step(same, "V")].dst
    assert DotResult(same, set(), set()).copies(w) == [[_step(same, "Gw"), _step(same, "Gk")]]
    # only dots read V: XLA never makes it in its own layout, unless the phase returns it
    assert dots.only_dots(v) and not DotResult(steps, set(), {v}).only_dots(v)


def test_the_transpose_is_made_after_the_dot_and_a_ready_dot_runs_right_after_its_copy() -> None:
    plan = _plan(ATTENTION)
    steps = plan.forward
    k, y = _step(steps, "At"), _step(steps, "Y")
    at = steps[k].dst
    w_o = next(r for r in steps[y].operands if r.name == "W_o")
    ahead: dict[int, float] = {}
    # At returned: its transpose and Y's copy a moment after the dot (its operands' copies freed), Y run
    # right after
    dots = DotResult(steps, {w_o}, {at})
    assert _turned(k, at, 96.0, dots, ahead) == [(k + 0.5, k + 0.5, 96.0), (k + 0.5, k + 0.75, 96.0)]
    assert ahead == {y: k + 0.75}
    ahead = {}  # W_o not there before At's dot (not one of the arguments): Y runs where the program puts it
    assert _turned(k, at, 96.0, DotResult(steps, set(), {at}), ahead) == [(k + 0.5, k + 0.5, 96.0),
                                                                          (k + 0.5, y, 96.0)]
    assert _turned(k, at, 96.0, DotResult(steps, set(), set()), {}) == [(k + 0.5, y, 96.0)]  # only Y reads At


def test_a_returned_softmax_a_dot_copies_keeps_its_exponentials_to_that_dot() -> None:
    """moe_transformer.shard's forward: P, returned, is copied for At's dot with its last division made again."""
    text = ("mesh X=2\ndims B=4, S=4, T=4, G=2, R=2, H=3\ndtype f32\n"
            "P[B_X, G, R, S, T] = softmax(Sc[B_X, G, R, S, T] over T)\n"
            "At[B_X, S, G, R, H] = P[B_X, G, R, S, T] · Vl[B_X, T, G, H]\n")
    plan = _plan(text)
    assert plan.sizes is not None
    sizes, steps = dict(plan.sizes), plan.forward
    k, at = _step(steps, "P"), _step(steps, "At")
    readers, last = lifetimes(steps)
    p = steps[k].dst
    copied = lambda s: layout_copies(s, True)  # noqa: E731
    rows = 4 // 2 * 2 * 2 * 4  # B on one device, G, R, S: one reciprocal of a row's sum each

    def spans(copies: Callable[[Step], list[TensorRef]], outs: set[TensorRef], least: int) -> list[Span]:
        return exponentials(steps, readers, last, lambda ref: 64.0, copies, outs, sizes, least)

    assert spans(copied, {p}, rows + 1) == [(k, at, 64.0)]
    assert spans(copied, {p}, rows) == []  # YNNPACK fuses the reciprocal too: the softmax written whole, copied
    assert spans(copied, set(), rows + 1) == []  # written only for the dot: divided inside the copy alone
    assert spans(lambda s: [], {p}, rows + 1) == []  # read in place
