"""A value's ``PartitionSpec`` as generated source: the one text every part of a lowered module uses."""

from __future__ import annotations

from shardc.ir.spec import TensorRef

__all__ = ["pspec", "axes_entry"]


def pspec(ref: TensorRef) -> str:
    """The PartitionSpec source of a value (stacked partial sums lead when unreduced)."""
    entries = [axes_entry(ref.unreduced)] if ref.unreduced else []
    entries += [axes_entry(d.axes) if d.axes else "None" for d in ref.dims]
    return "P(" + ", ".join(entries) + ")"


def axes_entry(axes: tuple[str, ...]) -> str:
    return repr(axes[0]) if len(axes) == 1 else "(" + ", ".join(repr(a) for a in axes) + ")"
