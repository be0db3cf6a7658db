"""Dots a compiler fuses with the steps that read them, so that their results get no buffer of their own
(:func:`shardc.costmodel.phase_memory.phase_memory` counts none for them)."""

from __future__ import annotations

from shardc.collectives import Op
from shardc.device_pieces import local_elements
from shardc.fusion import is_product
from shardc.ir.plan import Step

__all__ = ["summed_into"]


def summed_into(steps: tuple[Step, ...], sizes: dict[str, int], least: int) -> dict[int, int]:
    """Per dot whose only reader is a dot with no free index (an elementwise product summed over the
    indices the result lacks), the reader's step, where the product has at least ``least`` elements
    (0: none).

    XLA's algebraic simplifier runs a dot with no free index as a multiply and a reduce, and XLA's CPU
    backend grows the YNNPACK fusion of the dot making its operand over them, as it does over every
    elementwise op and reduction with at least 4096 elements in its result or an operand
    (``IsInstructionPreferredByYnn`` in ``xla/backends/cpu/ynn_support.cc``): the dot's result is never
    written (``moe_layer.shard``'s backward at 16x its sizes: dComb = dOut · Ex, 604 MB, summed with
    the dispatch mask over C into dGate inside one fusion; at verify's sizes, 2304 elements, it is)."""
    if not least:
        return {}
    made = {s.dst: j for j, s in enumerate(steps)}
    readers: dict[int, list[int]] = {}
    for k, step in enumerate(steps):
        for ref in dict.fromkeys(step.reads):
            if made.get(ref, k) < k:
                readers.setdefault(made[ref], []).append(k)
    out = {}
    for j, k in ((j, ks[0]) for j, ks in readers.items() if len(ks) == 1):
        dot, reader = steps[j], steps[k]
        if dot.op is Op.EINSUM and not is_product(dot) and _no_free(reader) \
                and local_elements(dot.dst, sizes) >= least:
            out[j] = k
    return out


def _no_free(step: Step) -> bool:
    """Whether a dot of two operands has no free index: each operand's indices are all the other's."""
    if step.op is not Op.EINSUM or is_product(step) or len(step.operands) != 2:
        return False
    a, b = ({d.name for d in ref.dims} for ref in step.operands)
    return a == b
