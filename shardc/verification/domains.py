"""Where a map defined on part of the reals (``log``, ``sqrt``, ``rsqrt``: x > 0; ``reciprocal``: x != 0) reads
values outside it, for ``shardc verify``.

Verify draws each input such a map reads in the map's domain (:func:`shardc.lowering.api.drawn_in`).  A map of a
computed value (``log(H)``, H a product of normal inputs) has no draw that keeps it there: its values are NaN or
infinite in the reference and in the lowered program alike, and those rows fail as values not compared.  This
says which map and statement made them, so the failure is read as the spec's, not the plan's.
"""

from __future__ import annotations

import numpy as np

from shardc.ir.spec import Spec
from shardc.lowering import reference
from shardc.spec.functions import DOMAINS, is_known, signature
from shardc.spec.walk import calls

__all__ = ["outside_notes"]


def outside_notes(spec: Spec, inputs: dict[str, np.ndarray], sizes: dict[str, int] | None = None) -> list[str]:
    """One note per call of a map whose argument, in the float64 reference from ``inputs``, leaves the map's
    domain (a NaN counts as outside)."""
    made_in = {id(call): s.result.name for s in spec.statements for call in calls(s.expr)}
    nodes = reference._nodes(spec)
    with np.errstate(all="ignore"):
        values, _ = reference._run(nodes, inputs, np, None, sizes)
    notes = []
    for node in nodes:
        domain = signature(node.fn).domain if node.fn is not None and is_known(node.fn) else ""
        if not domain or node.call is None:
            continue
        says, inside = DOMAINS[domain]
        x = np.asarray(values[node.operands[0]])
        outside = int(np.count_nonzero(~inside(x)))
        if outside:
            notes.append(f"the argument of {node.fn} in {made_in.get(id(node.call), '?')} is outside its domain "
                         f"({says}) at {outside} of {x.size} elements, a value computed from the inputs (verify draws "
                         f"an input {node.fn} reads in its domain): the values there are NaN or infinite, and not "
                         f"compared; write the spec so that it stays there ({node.fn} of a softmax, of a shift of a "
                         "square, of an input)")
    return notes
