"""The op families' registry: a spec function and a local operation find their family by lookup."""

from __future__ import annotations

import pytest

import shardc
from shardc.ops.masks import MASKS
from shardc.ops.reductions import REDUCTIONS
from shardc.ops.registry import Family, Reference, families, of_call, of_op, register
from shardc.ops.route import ROUTING
from shardc.ops.vocabulary import VOCABULARY
from shardc.planner.graph import build_graph
from shardc.planner.localops import Causal, Combine, Dropout, DropoutMask, DropoutVjp, Map, Route, Row, Vocab


def test_a_family_is_found_by_its_calls_and_by_the_class_of_its_operations() -> None:
    assert of_call("causal") is MASKS and of_call("dropout") is MASKS and of_call("gelu") is None
    assert of_op(DropoutMask(0.1, 7)) is MASKS and of_op(Causal("S", "T")) is MASKS and of_op(Map("gelu")) is None
    assert of_call("route") is ROUTING and of_op(Route("S", "E", "C", 2)) is ROUTING
    assert families() == (MASKS, REDUCTIONS, ROUTING, VOCABULARY)


def test_a_call_belongs_to_one_family() -> None:
    clash = Family("clash", frozenset({"causal"}), (), MASKS.argument, MASKS.aux, MASKS.aux_bytes, MASKS.plan,
                   MASKS.backward, MASKS.emit, Reference(MASKS.reference.forward, None, MASKS.reference.magnitude))
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
    assert [VOCABULARY.reference.grad_operand(n.call) for n in graph.nodes if n.call is not None] == [1, 0]
    plan = shardc.plan(spec)
    assert Vocab.EMBED_VJP in {s.fn for s in plan.backward}
    assert plan.grad_name("Tok") not in {g.name for g in plan.grads}
    assert {of_op(s.fn) for s in plan.forward if isinstance(s.fn, Vocab)} == {VOCABULARY}
