"""One device's piece of a tensor and of a step at given sizes: elements, a collective's bytes, an einsum's FLOPs.

Per dim a device holds ``ceil(size / devices)`` (:func:`shardc.collectives.piece`, XLA's padding); a
collective's volume is its formula where every dim divides its devices, else scaled by the padded pieces'
volume over the exact ones'; every size a step names must be given (:func:`size_of`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction

from shardc.collectives import einsum_flops as flops_of  # this module's einsum_flops takes a Step
from shardc.collectives import piece, volume_elements
from shardc.errors import ShardcError
from shardc.ir.plan import Step
from shardc.ir.spec import TensorRef

__all__ = ["size_of", "local_elements", "step_volume", "einsum_flops"]


def _pieces(ref: TensorRef, sizes: Mapping[str, int]) -> list[tuple[int, int]]:
    return [(size_of(sizes, d.name), math.prod(size_of(sizes, a) for a in d.axes)) for d in ref.dims]


def local_elements(ref: TensorRef, sizes: Mapping[str, int]) -> Fraction:
    """Elements of one device's piece of ``ref``: per dim ``ceil(size / devices)`` (XLA's padding)."""
    return Fraction(piece(_pieces(ref, sizes)))


def step_volume(step: Step, sizes: Mapping[str, int]) -> float:
    """V of a collective in bytes: its volume formula, padded where a dim does not divide its devices."""
    if step.volume is None or step.src is None:
        raise ShardcError(f"collective step on {step.tensor} has no volume",
                          fix="this is a planner bug: report it with the spec")
    exact = float(step.volume.evaluate(dict(sizes)))
    src, dst = _pieces(step.src, sizes), _pieces(step.dst, sizes)
    if all(n % k == 0 or not isinstance(n, int) for n, k in src + dst):
        return exact  # even (or a fractional sweep point): the formula is the volume
    group = math.prod(size_of(sizes, a) for a in step.axes)
    unpadded = volume_elements(step.op, _exact(src), _exact(dst), Fraction(group))
    padded = volume_elements(step.op, Fraction(piece(src)), Fraction(piece(dst)), Fraction(group))
    return exact * float(padded / unpadded)


def _exact(pieces: list[tuple[int, int]]) -> Fraction:
    return math.prod((Fraction(n, k) for n, k in pieces), start=Fraction(1))


def einsum_flops(step: Step, sizes: Mapping[str, int]) -> tuple[int, int]:
    """(per-device FLOPs, model FLOPs) of an einsum step (:func:`shardc.collectives.einsum_flops`)."""
    occurrences = ((d.name, d.axes) for ref in (*step.operands, step.dst) for d in ref.dims)
    return flops_of(occurrences, lambda name: size_of(sizes, name))



def size_of(sizes: Mapping[str, int], name: str) -> int:
    try:
        return sizes[name]
    except KeyError:
        raise ShardcError(f"no size for {name!r}: costs need every dim and mesh axis size",
                          fix=f"add {name}=... to the `dims` line, or pass --set {name}=...") from None
