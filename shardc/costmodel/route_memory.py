"""The arrays a routing holds while it makes its mask, or its slots: per token and expert whether it
chose the expert and how many before it did, int32, as the lowered module's routing computes them
(:func:`shardc.lowering.runtime.route_topk`, :func:`shardc.lowering.runtime.expert_dispatch`)."""

from __future__ import annotations

from shardc.costmodel.heap import Span
from shardc.device_pieces import local_elements
from shardc.ir.localops import Dispatch, Route
from shardc.ir.plan import Step
from shardc.ir.spec import TensorRef

__all__ = ["route_arrays", "routed_once"]

ID_BYTES = 4  # int32 counts, slots and top-k indices, as the lowered routing makes them


def route_arrays(step: Step, sizes: dict[str, int], block: int = 0, hosting: bool = False
                 ) -> tuple[list[float], list[float]]:
    """A top-k route's own arrays, and those of the routing an index-based dispatch step runs again from
    its gates (its first operand): whether each token chose each expert and the running sums of those
    choices along the tokens (the slots), the gates' shape each, both alive while the mask, or the slots,
    are made from them.  ``route_by_choice`` counts along its k choices and the tokens together (every
    token's first choice before any second): its running sums are k times the gates' shape, and the slot
    each choice's sums add up to is made beside them, the choices and the top-k's indices (k a token),
    which the slot's sum reads again to make each choice's one-hot.  ``block``: the sums are a scan of
    blocks of this many counts, padded (:attr:`shardc.costmodel.phase_memory.Buffers.scan_block`): the
    blocks, then the sums.  Bytes in the heap, and with ``hosting`` those that die before the mask is
    written (the blocks; by choice the sums too), which fit an output's buffer, apart."""
    if not isinstance(step.fn, Route | Dispatch):
        return [], []
    gates = step.operands[0]
    counts = float(local_elements(gates, sizes)) * ID_BYTES
    k = step.fn.k if isinstance(step.fn, Route) and step.fn.by_choice else 1
    tokens = _local(gates, step.fn.order, sizes) * k  # the scan's length: by choice, each choice a token
    scanned = counts * k / tokens * (-(-tokens // block) * block if block else tokens)
    blocks = [scanned] if block else []
    if k == 1:  # the mask is made from the choices and the sums: only the blocks die before
        return ([counts, scanned], blocks) if hosting else ([counts, scanned, *blocks], [])
    slot = [counts, counts, counts * k / _local(gates, step.fn.experts, sizes)]  # choices, slot, indices
    if hosting:  # the mask is made from the choices and the slot: the blocks and the sums die before
        return slot, [*blocks, scanned]
    return max([counts, scanned, *blocks], [*slot, scanned], key=sum), []  # the scan, or the slot by the sums


def _local(ref: TensorRef, name: str, sizes: dict[str, int]) -> int:
    """The length on one device of ``ref``'s index ``name``."""
    (dim,) = (d for d in ref.dims if d.name == name)
    return int(local_elements(TensorRef("", (dim,)), sizes))


def routed_once(steps: tuple[Step, ...], sizes: dict[str, int]) -> tuple[set[int], list[Span]]:
    """The index-based dispatch steps whose routing an earlier one of ``steps`` already ran (the same gates,
    routed the same way), and per routing run for several, its indices kept from the first to the last:
    each choice's batch row, expert and slot, int32, 3 k a token (the gather's and the scatter's indices).

    The lowered steps each run :func:`shardc.lowering.runtime_experts._routing` from their gates; XLA's
    common-subexpression elimination (``HloCSE``) merges the identical computations into one, run before
    the first (``moe_dispatch.shard``'s backward at verify's sizes: one top-k and one scan for dEx, dGate
    and dX_2, the s32[2, 24, 2, 3] indices alive from dEx's scatter to dX_2's gather)."""
    runs: dict[tuple[object, ...], list[int]] = {}
    for j, step in enumerate(steps):
        if isinstance(step.fn, Dispatch):
            f = step.fn
            runs.setdefault((step.operands[0], f.order, f.experts, f.slots, f.k, f.limit, f.groups), []).append(j)
    again = {j for js in runs.values() for j in js[1:]}
    kept = []
    for js in (js for js in runs.values() if len(js) > 1):
        gates, fn = steps[js[0]].operands[0], steps[js[0]].fn
        assert isinstance(fn, Dispatch)
        tokens = float(local_elements(gates, sizes)) / _local(gates, fn.experts, sizes)
        kept.append((js[0] - 0.5, float(js[-1]), tokens * fn.k * 3 * ID_BYTES))  # made before the first moves a row
    return again, kept
