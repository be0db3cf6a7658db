"""The unsharded reference: the spec's statements on whole arrays, forward and backward.

Built from the spec's own semantics, not from the planner: each statement's
expression is read as the language defines it (:func:`shardc.spec.walk.fold`:
products fold left to right, a shared index kept only when the result has it and
no later operand reads it; a function applies elementwise; a parenthesised group
is its own product),
and the gradients are derived here by reverse mode over that expression tree,
with closed-form derivatives.  Neither the planner's graph nor the plan's steps
are read, so a wrong plan (a wrong collective, a wrong local einsum, a wrong
planned backward) shows up as a wrong value.  ``xp`` is numpy by default;
:mod:`shardc.lowering.compare` passes jax.numpy to build the same computation
for XLA's partitioner.
"""

from __future__ import annotations

import dataclasses
import string
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from shardc.errors import ShardcError
from shardc.lowering.functions import function
from shardc.ops.registry import Family, Site, of_call
from shardc.spec.functions import dropout_salt, signature
from shardc.spec.ir import Add, Call, Contract, Expr, Spec, Statement, TensorRef
from shardc.spec.walk import chain_indices, dropout_number, fold, leaves

__all__ = ["forward", "backward", "magnitudes", "outputs", "leaf_names"]

Array = Any
_LETTERS = string.ascii_letters  # einsum subscripts, assigned per call


@dataclass(frozen=True)
class _Node:
    """One operation of the expression tree: ``fn`` None is an einsum of ``operands``."""

    result: str
    operands: tuple[str, ...]
    labels: tuple[tuple[str, ...], ...]  # each operand's indices
    out: tuple[str, ...]  # the result's indices
    fn: str | None = None
    signs: tuple[int, ...] = ()  # a sum's (fn "add"): +1 or -1 per operand
    call: Call | None = None  # an op family's call (its indices, its rate, its k)
    salt: int = 0  # a dropout's (shardc.spec.functions.dropout_salt)
    family: Family | None = None  # its op family (shardc.ops): its meaning on whole arrays


def leaf_names(spec: Spec) -> list[str]:
    """Inputs and params: tensors read but never made, in first-read order."""
    made = {s.result.name for s in spec.statements}
    names = [ref.name for s in spec.statements for ref in leaves(s.expr) if ref.name not in made]
    return list(dict.fromkeys(names))


def outputs(spec: Spec) -> list[str]:
    """Statement results no other statement reads."""
    read = {ref.name for s in spec.statements for ref in leaves(s.expr)}
    return [s.result.name for s in spec.statements if s.result.name not in read]


class _Builder:
    """Turns statements into a list of nodes (temporaries are ``#k``, never a tensor name)."""

    def __init__(self) -> None:
        self.current: Statement | None = None
        self.nodes: list[_Node] = []
        self.labels: dict[str, tuple[str, ...]] = {}

    def temp(self) -> str:
        return f"#{len(self.nodes)}"

    def value(self, expr: Expr, keep: tuple[str, ...]) -> str:
        """The key of ``expr``'s value; a product or call comes out indexed by ``keep``."""
        if isinstance(expr, TensorRef):
            self.labels.setdefault(expr.name, expr.indices)
            return expr.name
        if isinstance(expr, Call) and (family := of_call(expr.func)) is not None and family.reference.arguments:
            return self.family_node(expr, family, keep)
        if isinstance(expr, Call) and signature(expr.func).kind == "route":
            return self.route(expr, keep)
        if isinstance(expr, Add):
            terms = [self.value(t, chain_indices(t, keep)) for t in expr.terms]
            key = self.temp()
            out = chain_indices(expr, keep)
            self.nodes.append(_Node(key, tuple(terms), tuple(self.labels[t] for t in terms), out, "add",
                                    signs=expr.signs))
            self.labels[key] = out
            return key
        if isinstance(expr, Call):
            arg = self.value(expr.arg, keep)
            key = self.temp()
            salt = 0
            if expr.func == "dropout":
                assert self.current is not None
                salt = dropout_salt(self.current.result.name, dropout_number(self.current, expr))
            family = of_call(expr.func)
            self.nodes.append(_Node(key, (arg,), (self.labels[arg],), self.labels[arg], expr.func,
                                    call=expr if family is not None else None, salt=salt, family=family))
            self.labels[key] = self.labels[arg]
            return key
        assert isinstance(expr, Contract)
        parts = [chain_indices(o, keep) for o in expr.operands]
        keys = [self.value(o, part) for o, part in zip(expr.operands, parts, strict=True)]
        left = keys[0]
        for k in range(1, len(keys)):  # left to right, as the language folds a chain
            later = {i for p in parts[k + 1:] for i in p}
            out = keep if k == len(keys) - 1 else fold(self.labels[left], parts[k], set(keep), later)
            left = self.einsum([left, keys[k]], out)
        return left

    def family_node(self, expr: Call, family: Family, keep: tuple[str, ...]) -> str:
        """A call of a family that says its arguments and result (``softmax(X over I)``: X towards the
        result's indices and I): each argument as the family computes it, then one node."""
        ref = family.reference
        assert ref.arguments is not None and ref.indices is not None
        keys = [self.value(arg, towards) for arg, towards in ref.arguments(expr, keep)]
        labels = tuple(self.labels[k] for k in keys)
        out = ref.indices(expr, labels)
        key = self.temp()
        self.nodes.append(_Node(key, tuple(keys), labels, out, expr.func, call=expr, family=family))
        self.labels[key] = out
        return key

    def route(self, expr: Call, keep: tuple[str, ...]) -> str:
        """``route(Gate, S, C, k over E)``: the gates' indices, then the capacity index C (a mask)."""
        assert expr.over is not None
        _, slots = expr.names
        arg = self.value(expr.arg, tuple(i for i in keep if i != slots))
        labels = self.labels[arg]
        key = self.temp()
        self.nodes.append(_Node(key, (arg,), (labels,), (*labels, slots), "route", call=expr,
                                family=of_call(expr.func)))
        self.labels[key] = (*labels, slots)
        return key

    def einsum(self, keys: list[str], out: tuple[str, ...]) -> str:
        key = self.temp()
        self.nodes.append(_Node(key, tuple(keys), tuple(self.labels[k] for k in keys), out))
        self.labels[key] = out
        return key

    def statement(self, result: TensorRef, expr: Expr) -> None:
        if isinstance(expr, TensorRef) and set(expr.indices) != set(result.indices):
            # a rename (`Kx[B, T, D] = X[B, S, D]`): the same array, its indices renamed by position
            self.labels.setdefault(expr.name, expr.indices)
            self.nodes.append(_Node(result.name, (expr.name,), (expr.indices,), result.indices, "rename"))
            self.labels[result.name] = result.indices
            return
        key = self.value(expr, result.indices)
        if not key.startswith("#") or self.labels[key] != result.indices:
            key = self.einsum([key], result.indices)  # a permuted (or copied) tensor
        last = self.nodes[-1]
        self.nodes[-1] = dataclasses.replace(last, result=result.name)
        self.labels[result.name] = result.indices


def _nodes(spec: Spec, key: int = 0) -> list[_Node]:
    builder = _Builder()
    for s in spec.statements:
        builder.current = s
        builder.statement(s.result, s.expr)
    if key:  # a dropout key draws other masks: the salts move as the lowered module's do
        return [replace(n, salt=keyed_salt(n.salt, key)) if n.salt else n for n in builder.nodes]
    return builder.nodes


def keyed_salt(salt: int, key: int) -> int:
    """A dropout's salt under a key, as the lowered ``keep_mask`` mixes them (32-bit wrap)."""
    return (salt + int(key) * 0x9E3779B9) % 2**32


def _subscripts(labels: list[tuple[str, ...]], out: tuple[str, ...]) -> str:
    names = list(dict.fromkeys([i for group in labels for i in group] + list(out)))
    if len(names) > len(_LETTERS):
        raise ShardcError(f"one product has {len(names)} distinct indices; einsum takes at most "
                          f"{len(_LETTERS)}", fix="split the product into statements of fewer indices")
    letters = {name: _LETTERS[k] for k, name in enumerate(names)}
    ins = ",".join("".join(letters[i] for i in group) for group in labels)
    return ins + "->" + "".join(letters[i] for i in out)


def _contract(xp: Any, arrays: list[Array], labels: list[tuple[str, ...]], out: tuple[str, ...],
              shape: dict[str, int]) -> Array:
    """einsum to ``out``, broadcasting output indices no operand has (gradients of sums)."""
    present = {i for group in labels for i in group}
    kept = tuple(i for i in out if i in present)
    value = xp.einsum(_subscripts(labels, kept), *arrays)
    if len(kept) == len(out):
        return value
    value = xp.reshape(value, [shape[i] if i in present else 1 for i in out])
    return xp.broadcast_to(value, [shape[i] for i in out])


_LAYER = frozenset({"add", "rename"})  # the transformer-layer maps: linear


def _layer_forward(xp: Any, node: _Node, args: list[Array], shape: dict[str, int],
                   absolute: bool = False) -> Array:
    """A sum (each term broadcast to the result's indices, signed) or a rename (the same array)."""
    if node.fn == "rename":
        shape.update(zip(node.out, args[0].shape, strict=True))
        return args[0]
    total = None
    for arg, labels, sign in zip(args, node.labels, node.signs, strict=True):
        term = _contract(xp, [arg], [labels], node.out, shape)
        term = term if sign > 0 or absolute else -term
        total = term if total is None else total + term
    return total


def _layer_backward(xp: Any, node: _Node, d: Array, shape: dict[str, int],
                    absolute: bool = False) -> list[tuple[str, Array]]:
    """Each operand's gradient: ±d summed over the indices a term lacks; a rename's is d itself."""
    if node.fn == "rename":
        return [(node.operands[0], d)]
    out = []
    for name, labels, sign in zip(node.operands, node.labels, node.signs, strict=True):
        g = _contract(xp, [d], [node.out], labels, shape)
        out.append((name, g if sign > 0 or absolute else -g))
    return out


def _site(node: _Node, shape: dict[str, int], values: dict[str, Array],
          mags: dict[str, np.ndarray] | None = None) -> Site:
    """Where a family's call applies, for its reference (:class:`shardc.ops.registry.Site`)."""
    assert node.call is not None
    return Site(node.call, node.labels[0], node.salt, shape, node.labels, tuple(values[o] for o in node.operands),
                tuple(mags[o] for o in node.operands) if mags is not None else (), values.get(node.result))


def _run(nodes: list[_Node], inputs: dict[str, Array], xp: Any, given: dict[str, Array] | None,
         sizes: dict[str, int] | None = None) -> tuple[dict[str, Array], dict[str, int]]:
    values = dict(inputs)
    shape: dict[str, int] = dict(sizes or {})  # the inputs' shapes win; sizes give the rest (a capacity)
    for node in nodes:
        args = [values[o] for o in node.operands]
        for group, arg in zip(node.labels, args, strict=True):
            shape.update(zip(group, arg.shape, strict=True))
        if node.family is not None:
            values[node.result] = node.family.reference.forward(_site(node, shape, values), args[0], xp)
        elif node.fn in _LAYER:
            values[node.result] = _layer_forward(xp, node, args, shape)
        elif node.fn is not None:
            values[node.result] = function(node.fn).forward(args[0], xp)
        else:
            values[node.result] = _contract(xp, args, list(node.labels), node.out, shape)
        if given and node.result in given:  # a forward value the caller already has
            values[node.result] = given[node.result]
    return values, shape


def forward(spec: Spec, inputs: dict[str, Array], xp: Any = np,
            sizes: dict[str, int] | None = None, key: int = 0) -> dict[str, Array]:
    """Every statement's result, by name, from the inputs and params (``sizes``: the dims no input
    has, such as a route's capacity)."""
    values, _ = _run(_nodes(spec, key), inputs, xp, None, sizes)
    return {s.result.name: values[s.result.name] for s in spec.statements}


def backward(spec: Spec, inputs: dict[str, Array], cotangents: dict[str, Array],
             xp: Any = np, given: dict[str, Array] | None = None,
             sizes: dict[str, int] | None = None, key: int = 0) -> dict[str, Array]:
    """The gradient of every input and param, keyed by the input's name, given the
    cotangent of each output keyed by the output's name.

    Keys are the tensors' own names, not gradient names: those are the plan's
    (:meth:`shardc.planner.ir.Plan.grad_name`), and this reference does not read the plan.
    ``given`` holds forward values already computed (by name), used in place of recomputing them.
    """
    nodes = _nodes(spec, key)
    values, shape = _run(nodes, inputs, xp, given, sizes)
    grads: dict[str, Array] = {}

    def add(name: str, g: Array) -> None:
        grads[name] = grads[name] + g if name in grads else g

    for out in outputs(spec):  # an output without a cotangent leads to no gradient
        if out in cotangents:
            add(out, cotangents[out])
    for node in reversed(nodes):
        if node.result not in grads:
            continue
        d = grads.pop(node.result)
        if node.family is not None:
            ref = node.family.reference
            if ref.vjp is not None:  # None: a 0/1 mask, no gradient
                site = _site(node, shape, values)
                add(node.operands[ref.grad_operand(site.call)], ref.vjp(site, d, xp))
            continue
        if node.fn in _LAYER:
            for name, g in _layer_backward(xp, node, d, shape):
                add(name, g)
            continue
        if node.fn is not None:
            add(node.operands[0], d * function(node.fn).derivative(values[node.operands[0]], xp))
            continue
        for k, name in enumerate(node.operands):
            others = [values[o] for j, o in enumerate(node.operands) if j != k]
            labels = [node.out, *(lab for j, lab in enumerate(node.labels) if j != k)]
            add(name, _contract(xp, [d, *others], labels, node.labels[k], shape))
    return {name: grads[name] for name in leaf_names(spec) if name in grads}


def magnitudes(spec: Spec, inputs: dict[str, np.ndarray],
               cotangents: dict[str, np.ndarray], sizes: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """A running bound on the terms behind each value: results by name, gradients by primal's name.

    Each einsum sums the products of its operands' magnitudes, a function scales its
    argument's by ``|f'|`` (and adds ``|f|``), the backward likewise: rounding a sum of
    terms errs by at most a few units of the last place of this magnitude, however much
    the terms cancel (Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 3-4).
    Numpy only.
    """
    nodes = _nodes(spec)
    values, shape = _run(nodes, inputs, np, None, sizes)
    mag: dict[str, np.ndarray] = {k: np.abs(v) for k, v in inputs.items()}
    for node in nodes:
        if node.family is not None:
            x = node.operands[0]
            mag[node.result] = node.family.reference.magnitude(_site(node, shape, values, mag), values[x], mag[x],
                                                               values[node.result])
        elif node.fn in _LAYER:  # linear maps: the magnitudes map alike, signs dropped
            mag[node.result] = _layer_forward(np, node, [mag[o] for o in node.operands], shape, absolute=True)
        elif node.fn is not None:
            z, f = values[node.operands[0]], function(node.fn)
            mag[node.result] = np.abs(f.forward(z, np)) + np.abs(f.derivative(z, np)) * mag[node.operands[0]]
        else:
            mag[node.result] = _contract(np, [mag[o] for o in node.operands], list(node.labels), node.out, shape)
    grads: dict[str, np.ndarray] = {out: np.abs(cotangents[out]) for out in outputs(spec) if out in cotangents}
    for node in reversed(nodes):
        if node.result not in grads:
            continue
        d = grads.pop(node.result)
        if node.family is not None:
            ref = node.family.reference
            if ref.vjp is not None:  # without grad_magnitude, linear given the call: magnitudes map as values do
                site = _site(node, shape, values, mag)
                g = ref.grad_magnitude(site, d) if ref.grad_magnitude is not None else ref.vjp(site, d, np)
                to = node.operands[ref.grad_operand(site.call)]
                grads[to] = grads.get(to, 0) + g
            continue
        if node.fn in _LAYER:
            for name, g in _layer_backward(np, node, d, shape, absolute=True):
                grads[name] = grads.get(name, 0) + g
            continue
        if node.fn is not None:
            z, m = values[node.operands[0]], mag[node.operands[0]]
            grads[node.operands[0]] = grads.get(node.operands[0], 0) + d * _slope(function(node.fn), z, m)
            continue
        for k, name in enumerate(node.operands):
            others = [mag[o] for j, o in enumerate(node.operands) if j != k]
            labels = [node.out, *(lab for j, lab in enumerate(node.labels) if j != k)]
            grads[name] = grads.get(name, 0) + _contract(np, [d, *others], labels, node.labels[k], shape)
    return {**{s.result.name: mag[s.result.name] for s in spec.statements},
            **{name: grads[name] for name in leaf_names(spec) if name in grads}}


def _slope(f: Any, z: np.ndarray, m: np.ndarray) -> np.ndarray:
    """What the backward's ``f'(z)`` may err by, in the units of ``magnitudes``.

    The terms its evaluation adds (``slope_terms``), plus how far ``f'`` moves when ``z``
    moves by its own magnitude ``m`` (``|f''| m``, by a float64 difference quotient).
    """
    h = 1e-4
    moved = np.abs(f.derivative(z + h * m, np) - f.derivative(z, np)) / h
    return np.abs(f.derivative(z, np)) + f.slope_terms(z) + moved
