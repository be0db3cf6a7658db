"""The unsharded reference: the spec's einsums on whole arrays, forward and backward.

Independent of the plan on purpose: it reads the spec's operations (the
planner's graph: one node per einsum or elementwise map, chains folded left to
right as the language defines) but none of the plan's steps, and derives the
gradients itself by reverse mode, so a wrong planned backward (not only a
wrong collective) shows up.  ``xp`` is numpy by
default; :mod:`shardc.lowering.compare` passes jax.numpy to build the same
computation for XLA's partitioner.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardc.lowering.functions import function
from shardc.planner.graph import Graph, build_graph
from shardc.spec.ir import Spec

__all__ = ["forward", "backward", "outputs", "leaf_names"]

Array = Any
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _values_shape(graph: Graph, values: dict[str, Array]) -> dict[str, int]:
    shape: dict[str, int] = {}
    for name, value in values.items():
        shape.update(zip(graph.indices[name], value.shape, strict=True))
    return shape


def leaf_names(spec: Spec) -> list[str]:
    """Inputs and params: tensors read but never made, in first-read order."""
    return list(build_graph(spec).inputs)


def outputs(spec: Spec) -> list[str]:
    """Statement results no other statement reads."""
    return list(build_graph(spec).outputs)


def _subscripts(labels: list[list[str]], out: list[str]) -> str:
    names = list(dict.fromkeys([i for group in labels for i in group] + out))
    letters = {name: _LETTERS[k] for k, name in enumerate(names)}
    ins = ",".join("".join(letters[i] for i in group) for group in labels)
    return ins + "->" + "".join(letters[i] for i in out)


def _contract(xp: Any, arrays: list[Array], labels: list[list[str]], out: list[str],
              shape: dict[str, int]) -> Array:
    """einsum to ``out``, broadcasting output indices no operand has (gradients of sums)."""
    present = {i for group in labels for i in group}
    kept = [i for i in out if i in present]
    value = xp.einsum(_subscripts(labels, kept), *arrays)
    if len(kept) == len(out):
        return value
    value = xp.reshape(value, [shape[i] if i in present else 1 for i in out])
    return xp.broadcast_to(value, [shape[i] for i in out])


def _run(graph: Graph, inputs: dict[str, Array], xp: Any,
         given: dict[str, Array] | None = None) -> tuple[dict[str, Array], dict[str, int]]:
    values = dict(inputs)
    shape = _values_shape(graph, values)
    for node in graph.nodes:
        if given and node.result in given:  # a forward value the caller already has
            values[node.result] = given[node.result]
            shape.update(zip(node.indices, values[node.result].shape, strict=True))
            continue
        labels = [list(graph.indices[o]) for o in node.operands]
        args = [values[o] for o in node.operands]
        if node.kind == "elementwise":
            z = _contract(xp, args, labels, list(node.indices), shape)
            values[node.result] = function(node.fn or "").forward(z, xp)
        else:
            values[node.result] = _contract(xp, args, labels, list(node.indices), shape)
        shape.update(zip(node.indices, values[node.result].shape, strict=True))
    return values, shape


def forward(spec: Spec, inputs: dict[str, Array], xp: Any = np) -> dict[str, Array]:
    """Every statement's result (and chain intermediate) from the inputs and params."""
    graph = build_graph(spec)
    values, _ = _run(graph, inputs, xp)
    return {name: value for name, value in values.items() if name not in inputs}


def backward(spec: Spec, inputs: dict[str, Array], cotangents: dict[str, Array],
             xp: Any = np, given: dict[str, Array] | None = None) -> dict[str, Array]:
    """The gradient of every input and param, keyed by the input's name, given the
    cotangent of each output keyed by the output's name.

    Keys are the tensors' own names, not gradient names: those are the plan's
    (:meth:`shardc.planner.ir.Plan.grad_name`), and this reference does not read the plan.
    ``given`` holds forward values already computed (by name); the rest are recomputed.
    """
    graph = build_graph(spec)
    values, shape = _run(graph, inputs, xp, given)
    grads: dict[str, Array] = {}

    def add(name: str, g: Array) -> None:
        grads[name] = grads[name] + g if name in grads else g

    for out in graph.outputs:  # an output without a cotangent leads to no wanted gradient
        if out in cotangents:
            add(out, cotangents[out])
    for node in reversed(graph.nodes):
        if node.result not in grads:
            continue
        d = grads.pop(node.result)
        labels = [list(graph.indices[o]) for o in node.operands]
        if node.kind == "elementwise":
            z = _contract(xp, [values[node.operands[0]]], labels, list(node.indices), shape)
            dz = d * function(node.fn or "").derivative(z, xp)
            add(node.operands[0], _contract(xp, [dz], [list(node.indices)], labels[0], shape))
            continue
        for k, name in enumerate(node.operands):
            others = [values[o] for j, o in enumerate(node.operands) if j != k]
            other_labels = [lab for j, lab in enumerate(labels) if j != k]
            add(name, _contract(xp, [d, *others], [list(node.indices), *other_labels], labels[k], shape))
    return {name: grads[name] for name in graph.inputs if name in grads}
