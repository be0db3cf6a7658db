"""The op families' registry: a spec function and a local operation find their family by lookup."""

from __future__ import annotations

import numpy as np
import pytest

import shardc
from shardc.ir.localops import (
    ALIAS,
    NEG,
    Add,
    AffineVjp,
    Attention,
    Causal,
    Combine,
    Dispatch,
    Dropout,
    DropoutMask,
    DropoutVjp,
    Map,
    MapVjp,
    Rotary,
    Route,
    Row,
    Update,
    Vocab,
)
from shardc.ir.plan import Op
from shardc.ir.spec import Call, TensorRef
from shardc.ops.affine import AFFINE
from shardc.ops.attention import ATTENTION
from shardc.ops.dispatch import DISPATCH
from shardc.ops.elementwise import MAPS
from shardc.ops.masks import MASKS
from shardc.ops.products import PRODUCTS
from shardc.ops.reductions import REDUCTIONS
from shardc.ops.registry import (
    CONTRACT,
    RENAME,
    SUM,
    Family,
    Reference,
    Site,
    families,
    of_call,
    of_op,
    of_step,
    register,
)
from shardc.ops.rotary import ROTARY
from shardc.ops.route import ROUTING
from shardc.ops.sums import SUMS
from shardc.ops.vocabulary import VOCABULARY
from shardc.planner.graph import build_graph
from shardc.spec.functions import FUNCTIONS


def test_a_family_is_found_by_its_calls_and_by_the_class_of_its_operations() -> None:
    assert of_call("causal") is MASKS and of_call("dropout") is MASKS
    assert of_op(DropoutMask(0.1, 7)) is MASKS and of_op(Causal("S", "T")) is MASKS
    assert of_call("route") is ROUTING and of_op(Route("S", "E", "C", 2)) is ROUTING
    assert of_call("gelu") is MAPS and of_op(Map("gelu")) is MAPS and of_op(MapVjp("tanh")) is MAPS
    assert of_call(SUM) is SUMS and of_call(RENAME) is SUMS and of_op(Add((1, -1))) is SUMS
    assert of_op(NEG) is SUMS and of_op(ALIAS) is SUMS
    assert of_call("softmax") is REDUCTIONS and of_op(Row.SOFTMAX) is REDUCTIONS and of_op(Combine.MAX) is REDUCTIONS
    assert of_call("embed") is VOCABULARY and of_op(Vocab.EMBED) is VOCABULARY
    assert of_call(CONTRACT) is PRODUCTS and PRODUCTS.steps == (Op.EINSUM, Op.COPY)
    assert of_call("attention") is ATTENTION and of_op(Attention("out", "T")) is ATTENTION
    assert of_call("dispatch") is DISPATCH and of_call("combine") is DISPATCH
    assert of_op(Dispatch("combine_gate_vjp", "S", "E", "C", 2)) is DISPATCH
    assert of_call("scale") is AFFINE and of_call("shift") is AFFINE and of_op(AffineVjp(0.5)) is AFFINE
    assert of_call("rotary") is ROTARY and of_op(Rotary("T", "H", inverse=True)) is ROTARY
    assert set(families()) == {AFFINE, ATTENTION, DISPATCH, MAPS, MASKS, PRODUCTS, REDUCTIONS, ROTARY, ROUTING, SUMS,
                               VOCABULARY}
    assert len(families()) == 11


def test_every_step_of_a_plan_is_found_by_its_kind_or_its_operation() -> None:
    """Einsums and copies by their step kind, every other local step by its operation: codegen asks
    the registry for each; collectives, local slices and the optimizer's update belong to no family."""
    plan = shardc.plan(shardc.parse(
        "mesh X=2\nH[B_X, F] = gelu(In[B_X, D] · W_in[D, F])\nO[F, B] = H[B_X, F]\n"
        "Out[B_X, D] = H[B_X, F] · W_out[F, D]\n"))
    steps = plan.forward + plan.backward + plan.optimizer
    assert {of_step(s) for s in steps if s.op in (Op.EINSUM, Op.COPY)} == {PRODUCTS}
    assert {of_step(s) for s in steps if isinstance(s.fn, (Map, MapVjp))} == {MAPS}
    alone = [s for s in steps if of_step(s) is None]
    assert alone and all(s.is_collective or s.op is Op.SLICE or isinstance(s.fn, Update) for s in alone)
    with pytest.raises(ValueError, match="einsum"):
        register(Family(name="again", calls=frozenset(), ops=(), steps=(Op.COPY,), plan=PRODUCTS.plan,
                        backward=None, emit=PRODUCTS.emit, reference=PRODUCTS.reference))


def test_every_spec_function_belongs_to_exactly_one_family() -> None:
    for name in FUNCTIONS:
        assert [f for f in families() if name in f.calls] == [of_call(name)] != [None]
    assert set().union(*(f.calls for f in families())) == set(FUNCTIONS) | {SUM, RENAME, CONTRACT}  # no other


def test_a_call_belongs_to_one_family() -> None:
    clash = Family(name="clash", calls=frozenset({"causal"}), ops=(), plan=MASKS.plan, backward=MASKS.backward,
                   emit=MASKS.emit, reference=Reference(MASKS.reference.forward, None, MASKS.reference.magnitude))
    with pytest.raises(ValueError, match="masks"):
        register(clash)
    assert of_call("causal") is MASKS


def test_the_graph_puts_the_family_on_its_nodes_and_the_plan_carries_its_operations() -> None:
    spec = shardc.parse("mesh X=2\nY[B_X, D] = dropout(X[B_X, D], 0.5)\n")
    (node,) = build_graph(spec).nodes
    assert node.family is MASKS and node.aux == ("Y_mask",)
    plan = shardc.plan(spec)
    assert [type(s.fn) for s in plan.forward] == [DropoutMask, Dropout]
    assert {of_op(s.fn) for s in plan.forward + plan.backward} == {MASKS}
    assert [s.fn for s in plan.backward] == [DropoutVjp(0.5)] and plan.nbytes("Y_mask") == 1


def test_a_family_without_a_backward_gives_its_argument_no_gradient() -> None:
    spec = shardc.parse("mesh X=2\ndims G=4, S=8, E=4, C=3\nD[G_X, S, E, C] = route(Gt[G_X, S, E], S, C, 2 over E)\n")
    (node,) = build_graph(spec).nodes
    assert node.family is ROUTING and ROUTING.backward is None and ROUTING.reference.vjp is None
    plan = shardc.plan(spec)
    assert [type(s.fn) for s in plan.forward] == [Route] and plan.backward == () and plan.grads == ()


def test_an_elementwise_map_is_a_node_of_its_family_and_its_gradient_reads_its_argument() -> None:
    spec = shardc.parse("mesh X=2\nY[B_X, D] = gelu(X[B_X, D])\n")
    (node,) = build_graph(spec).nodes
    assert node.family is MAPS and node.fn == "gelu" and node.aux == ()
    plan = shardc.plan(spec)
    assert [s.fn for s in plan.forward] == [Map("gelu")] and [s.fn for s in plan.backward] == [MapVjp("gelu")]
    assert [r.name for r in plan.backward[0].operands] == ["X", plan.grad_name("Y")]


def test_an_elementwise_map_bounds_its_gradient_by_its_own_slope_not_its_vjp() -> None:
    site = Site(((),), (), {}, Call("tanh", TensorRef("X", ())))
    x, mag, d = np.array([0.5]), np.array([0.5]), np.array([1.0])
    assert MAPS.reference.vjp is not None and MAPS.reference.grad_magnitude is not None
    assert MAPS.reference.grad_magnitude(site, x, mag, d) > np.abs(MAPS.reference.vjp(site, x, d, np))


def test_sums_and_renames_are_nodes_of_one_family_and_a_renamed_gradient_passes_on_as_made() -> None:
    spec = shardc.parse("mesh X=2\nK[B_X, T] = X[B_X, S]\nY[B_X, T] = K[B_X, T] - Bias[T]\n")
    rename, add = build_graph(spec).nodes
    assert rename.family is SUMS and add.family is SUMS
    assert SUMS.aliases(rename) and not SUMS.aliases(add)
    plan = shardc.plan(spec)
    assert [s.fn for s in plan.forward] == [ALIAS, Add((1, -1))]
    assert {of_step(s) for s in plan.backward if not s.is_collective} == {SUMS, PRODUCTS}  # einsum: dBias over B
    assert NEG in [s.fn for s in plan.backward]


def test_a_sums_reference_is_signed_and_its_magnitudes_are_not() -> None:
    site = Site((("B", "T"), ("T",)), ("B", "T"), {"B": 2, "T": 3}, signs=(1, -1))
    k, bias = np.ones((2, 3)), np.full(3, 2.0)
    assert (SUMS.reference.forward(site, (k, bias), np) == -1.0).all()
    assert (SUMS.reference.magnitude(site, (k, bias), (k, bias), k) == 3.0).all()
    assert SUMS.reference.vjp is not None and SUMS.reference.grad_magnitude is not None
    dk, dbias = SUMS.reference.vjp(site, (k, bias), k, np)
    assert (dk == 1.0).all() and (dbias == -2.0).all()
    assert (SUMS.reference.grad_magnitude(site, (k, bias), (k, bias), k)[1] == 2.0).all()


def test_a_reduction_is_one_node_of_its_family_with_its_row_statistics_indexed_by_row() -> None:
    spec = shardc.parse("mesh X=2\nY[B, D_X] = rmsnorm(X[B, D_X] over D)\nZ[B] = max(Y[B, D_X] over D)\n")
    norm, top = build_graph(spec).nodes
    assert norm.family is REDUCTIONS and top.family is REDUCTIONS and of_call("softmax") is REDUCTIONS
    assert norm.aux == ("Y_ms",) and top.aux == () and build_graph(spec).indices["Y_ms"] == ("B",)
    plan = shardc.plan(spec)
    ops = {s.fn for s in plan.forward + plan.backward if s.fn is not None}
    assert Row.ROW_MEANSQ in ops and Combine.MAX in ops and {of_op(op) for op in ops} == {REDUCTIONS}


def test_a_vocabulary_op_reads_two_tensors_and_its_gradient_reaches_the_table_or_the_logits() -> None:
    spec = shardc.parse("mesh X=2\ndims B=4, S=8, V=16, D=8\nH[B, S, D] = embed(Tok[B, S], W_emb[V_X, D])\n"
                        "L[] = cross_entropy(H[B, S, D], Tok[B, S])\n")
    graph = build_graph(spec)
    embed, loss = graph.nodes
    assert embed.family is VOCABULARY and loss.family is VOCABULARY and embed.operands == ("Tok", "W_emb")
    assert loss.aux == ("L_max", "L_sum", "L_lse", "L_target") and graph.indices["L_lse"] == ("B", "S")
    vjp = VOCABULARY.reference.vjp
    assert vjp is not None
    tok, table, logits = np.array([[0, 2]]), np.ones((3, 2)), np.ones((1, 2, 3))
    g_tok, g_table = vjp(Site((("B", "S"), ("V", "D")), ("B", "S", "D"), {}, embed.call), (tok, table),
                         np.ones((1, 2, 2)), np)
    g_logits, g_ids = vjp(Site((("B", "S", "V"), ("B", "S")), (), {}, loss.call), (logits, tok), np.ones(()), np)
    assert g_tok is None and g_ids is None and g_table.shape == table.shape and g_logits.shape == logits.shape
    plan = shardc.plan(spec)
    assert Vocab.EMBED_VJP in {s.fn for s in plan.backward}
    assert plan.grad_name("Tok") not in {g.name for g in plan.grads}
    assert {of_op(s.fn) for s in plan.forward if isinstance(s.fn, Vocab)} == {VOCABULARY}


def test_attention_reads_three_tensors_keeps_its_row_logsumexp_and_runs_matmuls() -> None:
    spec = shardc.parse("mesh X=2\ndims B=2, S=4, T=4, N=2, H=8\n"
                        "O[B_X, S, N, H] = attention(Q[B_X, S, N, H], K[B_X, T, N, H], V[B_X, T, N, H] over T)\n")
    graph = build_graph(spec)
    (node,) = graph.nodes
    assert node.family is ATTENTION and node.operands == ("Q", "K", "V") and node.aux == ("O_lse",)
    assert graph.indices["O_lse"] == ("B", "S", "N") and graph.element_bytes["O_lse"] == 4  # float32
    plan = shardc.plan(spec)
    assert [s.fn for s in plan.forward] == [Attention("out", "T"), Attention("lse", "T", kernel=False)]
    assert [s.fn.part for s in plan.backward if isinstance(s.fn, Attention)] == ["dq", "dk", "dv"]
    assert ATTENTION.flops is not None and not ATTENTION.fusible
