"""Names shardc makes up: gradients (cotangents) and their partial contributions.

A gradient is named in one place, :func:`gradient_names`, and every pass reads
the mapping (the plan carries it as :meth:`shardc.ir.plan.Plan.grad_name`).
The book writes the gradient of ``W`` as ``dW``; shardc does too whenever no
tensor of the spec already has that name.  A spec may well have one (a tensor
``dW`` beside a param ``W``, an input ``dOut`` beside an output ``Out``), and a
gradient that took the user's name would silently read the user's tensor.

>>> gradient_names(["In", "W", "dW"], taken=["In", "W", "dW"])
{'In': 'dIn', 'W': 'd_W', 'dW': 'ddW'}
>>> fresh("dIn_1", {"dIn_1"})
'dIn_1_2'
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["gradient_names", "fresh", "book_name"]


def fresh(base: str, taken: set[str]) -> str:
    """``base``, or ``base_2``, ``base_3``... : the first not in ``taken`` (which it joins)."""
    name, k = base, 1
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


def book_name(tensor: str) -> str:
    """The book's name for ``tensor``'s gradient, ``d<Name>``: the gradient's own name unless the spec took it."""
    return f"d{tensor}"


def gradient_names(tensors: Iterable[str], taken: Iterable[str]) -> dict[str, str]:
    """Each tensor's gradient name: ``d<Name>``, else ``d_<Name>``, ``d_<Name>_2``...

    ``taken`` holds every name the spec (and the planner's intermediates) use; no
    gradient name is one of them, and no two gradients share a name.  Names are
    given in ``tensors`` order, so the same spec always gets the same names.
    """
    used = set(taken)
    names: dict[str, str] = {}
    for tensor in tensors:
        if tensor in names:
            continue
        preferred = book_name(tensor)
        names[tensor] = fresh(f"d_{tensor}", used) if preferred in used else fresh(preferred, used)
    return names
