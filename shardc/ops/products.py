"""Einsums: a product of tensors (``A[B, D] · W[D, F]``) and a copy or transpose of one (``O[E, S] = A[S, E]``).

Planned by the sharded-matmul search (:mod:`shardc.sharding.einsum`: the book's four cases,
searched exactly when the sizes are known); the backward of ``C = A · B`` is the two
products ``dA = dC · B`` and ``dB = A · dC``, the right operand first (usually the
weight, as in the book's listings) so its gradient's reduction can be issued while the
rest of the backward runs.  A step is one ``jnp.einsum`` of the local blocks; its FLOPs
are :func:`shardc.collectives.einsum_flops`.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING, Any

import numpy as np

from shardc.errors import ShardcError
from shardc.ir.plan import Op, Step
from shardc.ir.spec import TensorRef
from shardc.ops.arrays import contract
from shardc.ops.registry import CONTRACT, Array, Arrays, Family, Namer, Reference, Site, register
from shardc.ops.row_plans import reader_of
from shardc.sharding.layout import Value

if TYPE_CHECKING:
    from shardc.ops.registry import BackwardPass, Node
    from shardc.sharding.phase import Phase

__all__ = ["PRODUCTS", "emit", "einsum_letters"]

_LETTERS = string.ascii_lowercase + string.ascii_uppercase


def _plan(phase: Phase, node: Node, declared: dict[str, TensorRef], target: Value | None, label: str) -> None:
    final = phase.einsum(node.result, node.operands, target, label, span=node.statement.span,
                         partial=node.partial and node.reader is None, reader=reader_of(node.reader, declared))
    if node.result not in declared or node.reader:  # a chain intermediate or one handed on: as the planner made it
        declared[node.result] = phase.ref(node.result, final)


def _backward(bw: BackwardPass, node: Node, grad: str) -> None:
    if len(node.operands) == 1:
        (a,) = node.operands
        if a in bw.needs:
            bw.contribute(a, (grad,), (grad,))
        return
    a, b = node.operands
    if b in bw.needs:  # the right operand first (see the module's docstring)
        bw.contribute(b, (a, grad), (a, grad))
    if a in bw.needs:
        bw.contribute(a, (grad, b), (grad, b))


def einsum_letters(refs: tuple[TensorRef, ...]) -> dict[str, str]:
    """One einsum letter per index of one einsum, its own initial when free.

    Per einsum, not per plan: a plan may use more than the 52 letters in all.
    """
    indices = list(dict.fromkeys(i for ref in refs for i in ref.indices))
    if len(indices) > len(_LETTERS):
        raise ShardcError(f"one einsum has {len(indices)} distinct indices; jnp.einsum takes at most "
                          f"{len(_LETTERS)}", fix="split the product into statements with fewer indices")
    pool = list(_LETTERS)
    letters: dict[str, str] = {}
    for index in indices:
        first = index[0].lower()
        letter = first if first in pool else (index[0].upper() if index[0].upper() in pool else pool[0])
        pool.remove(letter)
        letters[index] = letter
    return letters


def emit(step: Step, var: Namer, sizes: dict[str, int] | None = None) -> str:
    """One local ``jnp.einsum`` of the step's blocks (any sizes); a collective matmul's ring
    (:mod:`shardc.lowering.runtime_collective`)."""
    letters = einsum_letters((*step.operands, step.dst))
    ins = ",".join("".join(letters[i] for i in ref.indices) for ref in step.operands)
    out = "".join(letters[i] for i in step.dst.indices)
    args = ", ".join(var(ref) for ref in step.operands)
    c = step.collective
    if c is None:
        return f"{step.op.info.jax_call}('{ins}->{out}', {args})"
    if c.op is Op.ALL_GATHER:  # a collective matmul (shardc.planner.collective_matmul): a ring over one axis
        assert c.src is not None
        return f"allgather_einsum('{ins}->{out}', ({args},), {step.operands.index(c.src)}, {c.dim}, {c.axes[0]!r})"
    return f"einsum_reducescatter('{ins}->{out}', ({args},), {c.dim}, {c.axes[0]!r})"


def _forward(site: Site, xs: Arrays, xp: Any) -> Array:
    return contract(xp, list(xs), list(site.labels), site.out, site.shape)


def _vjp(site: Site, xs: Arrays, d: Array, xp: Any) -> tuple[Array | None, ...]:
    """Each operand's gradient: the cotangent contracted with the other operands."""
    grads = []
    for k in range(len(xs)):
        others = [x for j, x in enumerate(xs) if j != k]
        labels = [site.out, *(lab for j, lab in enumerate(site.labels) if j != k)]
        grads.append(contract(xp, [d, *others], labels, site.labels[k], site.shape))
    return tuple(grads)


def _magnitude(site: Site, xs: Arrays, mags: Arrays, y: Array) -> Array:
    """The sum of the products of the operands' magnitudes."""
    return _forward(site, mags, np)


def _grad_magnitude(site: Site, xs: Arrays, mags: Arrays, d: Array) -> tuple[Array | None, ...]:
    return _vjp(site, mags, d, np)


PRODUCTS = register(Family(name="einsum", calls=frozenset({CONTRACT}), ops=(), steps=(Op.EINSUM, Op.COPY),
                         plan=_plan, backward=_backward, emit=emit,
                         reference=Reference(_forward, _vjp, _magnitude, _grad_magnitude)))
