"""The blocks a step sends around a ring while it computes: a collective matmul's (its gather or scatter in
n blocks, each under one block matmul) and a ring attention kernel's (its family's ``ring``), at given sizes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from shardc.collectives import Op
from shardc.device_pieces import size_of, step_volume
from shardc.ir.plan import Step
from shardc.ir.precision import Precision
from shardc.ir.spec import DType
from shardc.ops.registry import of_op
from shardc.steptime import RingTransfer, Send

__all__ = ["ring_bytes", "ring_of", "matmul_ring", "shared_rings"]


def ring_bytes(step: Step, nbytes: int | Precision) -> int:
    """Bytes an element of what a ring kernel sends: ``nbytes``, or with the tensors' types given, the
    bytes of the type its matmuls run in (:meth:`shardc.ir.precision.Precision.matmul`: ring attention's Q, K and V)."""
    return nbytes if isinstance(nbytes, int) else DType(nbytes.matmul(r.name for r in step.operands)).nbytes


def ring_of(step: Step, sizes: Mapping[str, int], nbytes: int | Precision) -> RingTransfer | None:
    """The sends of a step that sends blocks around a ring while it computes, at ``sizes`` (``nbytes``: an
    element's bytes, :func:`ring_bytes`): a collective matmul's (:func:`matmul_ring`: its collective's whole
    piece, padded, in n blocks), a ring attention kernel's (its family's); None for any other step."""
    if step.op is Op.EINSUM and step.collective is not None:
        c = step.collective
        return matmul_ring(c, step_volume(c, sizes), math.prod(size_of(sizes, a) for a in c.axes))
    family = of_op(step.fn) if step.op is Op.ELEMENTWISE else None
    if family is None or family.ring is None:
        return None
    return family.ring(step, lambda name: size_of(sizes, name), ring_bytes(step, nbytes))


def matmul_ring(collective: Step, volume: Any, n: int) -> RingTransfer:
    """A collective matmul's sends: n - 1 blocks of its collective's ``volume`` (bytes, n blocks: a number,
    or a formula in :mod:`shardc.costmodel.formulas`) over its axis, each under one of its n block matmuls."""
    return RingTransfer(collective.axes, n, 0, (Send(volume / n, 1, n - 1),))


def shared_rings(steps: Sequence[Step]) -> list[bool]:
    """Per step of a phase, whether it is a collective matmul whose collective an earlier step runs as a
    ring too (einsums reading one gathered operand): their sends are the same blocks the same way, and the
    lowered program's chains of permutes are one (XLA keeps one of identical instructions), so only the
    first sends them."""
    seen: set[Step] = set()
    out = []
    for step in steps:
        out.append(step.collective is not None and step.collective in seen)
        if step.collective is not None:
            seen.add(step.collective)
    return out
