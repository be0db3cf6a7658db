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
:mod:`shardc.verification.compare` passes jax.numpy to build the same computation
for XLA's partitioner.

A GEMM a ``gemm T`` line names (an einsum that sums an index) reads its operands rounded to T and back, in
the forward and in both backward GEMMs, as the lowered module's ``gemm_input`` does: the reference computes
what the module computes, from the spec (:meth:`shardc.ir.spec.Spec.gemm_of`), not from the plan.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from shardc.ir.precision import ARRAY_DTYPE
from shardc.ir.spec import Add, Call, Contract, Expr, Spec, Statement, TensorRef
from shardc.ops.registry import CONTRACT, RENAME, SUM, Family, Site, family_of, of_call
from shardc.spec.walk import chain_indices, fold, leaves, operand_outers

__all__ = ["forward", "backward", "magnitudes", "outputs", "leaf_names", "sum_lengths", "gemm_rounded",
           "reference_rounded"]

Array = Any
SCALE_FLOOR = -11  # the least power-of-two scale gemm_rounded gives an element (2**-11 x E4M3's 2**-9 grid)


@dataclass(frozen=True)
class _Node:
    """One operation of the expression tree, of an op family (its meaning on whole arrays)."""

    result: str
    operands: tuple[str, ...]
    labels: tuple[tuple[str, ...], ...]  # each operand's indices
    out: tuple[str, ...]  # the result's indices
    family: Family = field(compare=False)
    fn: str | None = None  # the spec function or form ("add", "rename"); None: an einsum
    signs: tuple[int, ...] = ()  # a sum's (fn "add"): +1 or -1 per operand
    call: Call | None = None  # an op family's call (its indices, its rate, its k)
    salt: int = 0  # a random mask's, as its family draws it (Reference.salt: a dropout's)
    gemm: str | None = None  # a GEMM's `gemm T` type (its array type): its operands and cotangent rounded to it


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

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
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
        if isinstance(expr, Add):
            terms = [self.value(t, chain_indices(t, keep)) for t in expr.terms]
            key = self.temp()
            out = chain_indices(expr, keep)
            self.nodes.append(_Node(key, tuple(terms), tuple(self.labels[t] for t in terms), out, family_of(SUM),
                                    "add", signs=expr.signs))
            self.labels[key] = out
            return key
        if isinstance(expr, Call):
            arg = self.value(expr.arg, keep)
            key = self.temp()
            family = family_of(expr.func)
            assert self.current is not None
            salt = family.reference.salt(self.current, expr) if family.reference.salt is not None else 0
            self.nodes.append(_Node(key, (arg,), (self.labels[arg],), self.labels[arg], family, expr.func, call=expr,
                                    salt=salt))
            self.labels[key] = self.labels[arg]
            return key
        assert isinstance(expr, Contract)
        towards = operand_outers(expr, keep)
        parts = [chain_indices(o, t) for o, t in zip(expr.operands, towards, strict=True)]
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
        self.nodes.append(_Node(key, tuple(keys), labels, out, family, expr.func, call=expr))
        self.labels[key] = out
        return key

    def einsum(self, keys: list[str], out: tuple[str, ...]) -> str:
        key = self.temp()
        labels = tuple(self.labels[k] for k in keys)
        kind = self.spec.gemm_of(self.current.result.name) if self.current is not None else None
        sums = len(keys) > 1 and bool(set().union(*labels) - set(out))  # a GEMM, not a product or a copy
        gemm = ARRAY_DTYPE[kind] if kind is not None and sums else None
        self.nodes.append(_Node(key, tuple(keys), labels, out, family_of(CONTRACT), gemm=gemm))
        self.labels[key] = out
        return key

    def statement(self, result: TensorRef, expr: Expr) -> None:
        if isinstance(expr, TensorRef) and set(expr.indices) != set(result.indices):
            # a rename (`Kx[B, T, D] = X[B, S, D]`): the same array, its indices renamed by position
            self.labels.setdefault(expr.name, expr.indices)
            self.nodes.append(_Node(result.name, (expr.name,), (expr.indices,), result.indices,
                                    family_of(RENAME), "rename"))
            self.labels[result.name] = result.indices
            return
        key = self.value(expr, result.indices)
        if not key.startswith("#") or self.labels[key] != result.indices:
            key = self.einsum([key], result.indices)  # a permuted (or copied) tensor
        last = self.nodes[-1]
        self.nodes[-1] = dataclasses.replace(last, result=result.name)
        self.labels[result.name] = result.indices


def _nodes(spec: Spec, key: int = 0) -> list[_Node]:
    builder = _Builder(spec)
    for s in spec.statements:
        builder.current = s
        builder.statement(s.result, s.expr)
    if key:  # a dropout key draws other masks: the salts move as the lowered module's do
        return [replace(n, salt=keyed_salt(n.salt, key)) if n.salt else n for n in builder.nodes]
    return builder.nodes


def keyed_salt(salt: int, key: int) -> int:
    """A dropout's salt under a key, as the lowered ``keep_mask`` mixes them (32-bit wrap)."""
    return (salt + int(key) * 0x9E3779B9) % 2**32


def gemm_rounded(x: Array, kind: str | None, xp: Any = np) -> Array:
    """A GEMM's operand as it reads it under ``gemm T`` (``kind`` T's array type, ``float8_e4m3fn``; None: as
    it is): each element cast to T and back at a power-of-two scale of its own (``frexp``: its mantissa
    in [1, 2) cast, its exponent kept), so it keeps T's mantissa bits (E4M3's 3) and never overflows: the
    fine-grained scaling of FP8 recipes (DeepSeek-V3 section 3.3.2 scales a 1x128 tile) taken to the
    element, as no scale shared by a tile could be computed alike on a device's block and on the whole
    array.  No scale is below ``2**SCALE_FLOOR``: smaller elements are E4M3's subnormals there (a grid of
    2**-20), as a tile scaled to its largest element flushes what lies 17 binades under it; at its own
    scale an element left small by cancellation would turn its last-place error into a whole E4M3 step,
    which the module and the reference, summing in other orders, would not round alike.  A float64 value
    is rounded to float32 first: FP8 products sum exactly in float64, so many operands sit exactly on an
    E4M3 tie, and a last-place difference (XLA's exp beside numpy's) would round one a whole step apart;
    float32 holds such a value exactly, and the two sides' values alike.  The lowered module's
    ``gemm_input`` calls it (numpy's and jax's float8 types are ml_dtypes'); the reference computes the same
    values by :func:`reference_rounded`."""
    if kind is None:
        return x
    import ml_dtypes  # a jax dependency: numpy's float8 types

    narrow = x.astype("float32")  # the last places of a wider value round off first (see above)
    _, exponent = xp.frexp(narrow)
    shift = xp.maximum(exponent, SCALE_FLOOR + 1) - 1
    return xp.ldexp(xp.ldexp(narrow, -shift).astype(getattr(ml_dtypes, kind)).astype(x.dtype), shift)


def reference_rounded(x: Array, kind: str | None, xp: Any = np) -> Array:
    """:func:`gemm_rounded`'s values, bit for bit, as the reference computes them: the same rounding written
    on the float's bits (:func:`_e4m3_scaled`), with no cast at a computed scale, which made each operand a
    dozen operations that the unsharded program of a verify (thousands of GEMMs' operands) compiled slowly.
    The lowered module casts (:func:`shardc.lowering.runtime.gemm_input`: the FP8 type in its program); a
    GEMM of another type (`gemm bf16`, a few) is cast here too."""
    if kind != "float8_e4m3fn":  # another type (`gemm bf16`): rare, cast as the module does
        return gemm_rounded(x, kind, xp)
    return _e4m3_scaled(x.astype("float32"), xp).astype(x.dtype)


def _e4m3_scaled(narrow: Array, xp: Any) -> Array:
    """float32 ``narrow`` cast to E4M3 and back at each element's own power-of-two scale, floored at
    ``2**SCALE_FLOOR``, written as the rounding it is: at or above ``2**(SCALE_FLOOR - 6)`` (E4M3's least
    normal, 2**-6, at the least scale) the float32 mantissa rounded to E4M3's 3 bits, to nearest, ties to
    even, as the cast rounds; below, the multiples of ``2**(SCALE_FLOOR - 9)`` (E4M3's subnormal step at
    that scale).  Integer operations on the float's bits, where a cast at a computed scale (frexp, ldexp)
    made each operand a dozen operations."""
    drop = 23 - 3  # float32's mantissa bits E4M3 does not keep
    bits = _as_bits(narrow, xp)
    def word(n: int) -> Array:  # a uint32 constant (jax's weak Python ints are int32)
        return xp.asarray(n, dtype=xp.uint32)

    half, lsb = word((1 << (drop - 1)) - 1), (bits >> word(drop)) & word(1)
    kept = (bits + half + lsb) & word(0xFFFFFFFF ^ ((1 << drop) - 1))
    step, small = 2.0 ** (SCALE_FLOOR - 9), xp.abs(narrow) < 2.0 ** (SCALE_FLOOR - 6)
    tiny = xp.round(xp.where(small, narrow, 0.0) / step) * step  # exact: a power of two's multiples; half to even
    return xp.where(small, tiny.astype("float32"), _from_bits(kept, xp))


def _as_bits(narrow: Array, xp: Any) -> Array:
    if xp is np:
        return np.asarray(narrow, np.float32).view(np.uint32)
    import jax

    return jax.lax.bitcast_convert_type(narrow, xp.uint32)


def _from_bits(bits: Array, xp: Any) -> Array:
    if xp is np:
        return np.asarray(bits, np.uint32).view(np.float32)
    import jax

    return jax.lax.bitcast_convert_type(bits.astype(xp.uint32), xp.float32)


def _site(node: _Node, shape: dict[str, int], result: Array = None) -> Site:
    """Where a family's node applies, for its reference (:class:`shardc.ops.registry.Site`); ``result``:
    its value, once known (in the backward)."""
    return Site(node.labels, node.out, shape, node.call, node.salt, node.signs, result)


def _run(nodes: list[_Node], inputs: dict[str, Array], xp: Any, given: dict[str, Array] | None,
         sizes: dict[str, int] | None = None) -> tuple[dict[str, Array], dict[str, int]]:
    values = dict(inputs)
    shape: dict[str, int] = dict(sizes or {})  # the inputs' shapes win; sizes give the rest (a capacity)
    for node in nodes:
        args = [reference_rounded(values[o], node.gemm, xp) for o in node.operands]
        for group, arg in zip(node.labels, args, strict=True):
            shape.update(zip(group, arg.shape, strict=True))
        values[node.result] = node.family.reference.forward(_site(node, shape), tuple(args), xp)
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
    (:meth:`shardc.ir.plan.Plan.grad_name`), and this reference does not read the plan.
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
        vjp = node.family.reference.vjp
        if vjp is None:  # a 0/1 mask: no gradient
            continue
        xs = tuple(reference_rounded(values[o], node.gemm, xp) for o in node.operands)
        site = _site(node, shape, values[node.result])
        for name, g in zip(node.operands, vjp(site, xs, reference_rounded(d, node.gemm, xp), xp), strict=True):
            if g is not None:  # None: no gradient there (token ids)
                add(name, g)
    return {name: grads[name] for name in leaf_names(spec) if name in grads}


def magnitudes(spec: Spec, inputs: dict[str, np.ndarray],
               cotangents: dict[str, np.ndarray], sizes: dict[str, int] | None = None,
               key: int = 0) -> dict[str, np.ndarray]:
    """A running bound on the terms behind each value: results by name, gradients by primal's name.

    Each einsum sums the products of its operands' magnitudes, a function scales its
    argument's by ``|f'|`` (and adds ``|f|``), the backward likewise: rounding a sum of
    terms errs by at most a few units of the last place of this magnitude, however much
    the terms cancel (Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 3-4).
    Numpy only; ``key`` draws the dropout masks, as in :func:`forward`.
    """
    nodes = _nodes(spec, key)
    values, shape = _run(nodes, inputs, np, None, sizes)
    mag: dict[str, np.ndarray] = {k: np.abs(v) for k, v in inputs.items()}
    for node in nodes:
        mag[node.result] = node.family.reference.magnitude(
            _site(node, shape), tuple(values[o] for o in node.operands), tuple(mag[o] for o in node.operands),
            values[node.result])
    grads: dict[str, np.ndarray] = {out: np.abs(cotangents[out]) for out in outputs(spec) if out in cotangents}
    for node in reversed(nodes):
        if node.result not in grads:
            continue
        d = grads.pop(node.result)
        grads.update(_family_grad_magnitude(node, shape, values, mag, d, grads))
    return {**{s.result.name: mag[s.result.name] for s in spec.statements},
            **{name: grads[name] for name in leaf_names(spec) if name in grads}}


def sum_lengths(spec: Spec, sizes: dict[str, int]) -> list[int]:
    """Per operation of ``spec``, forward and backward, the most terms one of its values sums: an
    einsum's forward sums over the indices its result lacks, each operand's gradient over the
    indices that operand lacks; a function adds its reduction's (``over``) length; 1 for a map."""
    lengths = []
    for node in _nodes(spec):
        every = set(node.out).union(*node.labels)
        over = node.call.over if node.call is not None and node.call.over else None
        extra = sizes.get(over, 1) if over is not None else 1
        for kept in (node.out, *node.labels):
            lengths.append(math.prod(sizes.get(i, 1) for i in every - set(kept)) * extra)
    return lengths


def _family_grad_magnitude(node: _Node, shape: dict[str, int], values: dict[str, np.ndarray],
                           mag: dict[str, np.ndarray], d: np.ndarray,
                           grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A family's argument's gradient magnitude, added to what it has: its own bound where it has
    one, else its vjp of the cotangent's magnitude (a map linear given the call: a mask's)."""
    ref = node.family.reference
    if ref.vjp is None:  # no gradient (a 0/1 mask)
        return {}
    site = _site(node, shape, values[node.result])
    xs, mags = tuple(values[o] for o in node.operands), tuple(mag[o] for o in node.operands)
    gs = ref.grad_magnitude(site, xs, mags, d) if ref.grad_magnitude is not None else ref.vjp(site, xs, d, np)
    made: dict[str, np.ndarray] = {}
    for name, g in zip(node.operands, gs, strict=True):
        if g is not None:  # None: no gradient there (token ids)
            made[name] = made.get(name, grads.get(name, 0)) + g
    return made
