"""Override sizes from the command line (``--set X=8 --set B=4096``).

A name that is a mesh axis sets that axis's size; any other name must be a dim
the spec uses (an index of some tensor, a ``dims`` entry, or the ``L`` of
``layers L``) and sets or adds its size.  The result is validated again, so a
size that no longer divides is reported.

>>> from shardc.spec.parser import parse
>>> spec = parse("mesh X=4\\ndims B=8, D=16\\nOut[B_X, D] = In[B_X, D]\\n")
>>> new = apply_overrides(spec, {"X": 8, "B": 64})
>>> str(new.mesh), new.sizes
('mesh X=8', {'B': 64, 'D': 16})
"""

from __future__ import annotations

import dataclasses

from shardc.errors import ShardcError
from shardc.ir.spec import Mesh, Spec
from shardc.spec.validate import validate
from shardc.spec.walk import leaves

__all__ = ["apply_overrides", "dim_names"]


def dim_names(spec: Spec) -> list[str]:
    """Every dim the spec mentions, in first-use order (dims line, statements, layers)."""
    names = dict.fromkeys(name for name, _ in spec.dims)
    for statement in spec.statements:
        for ref in [statement.result, *leaves(statement.expr)]:
            names.update(dict.fromkeys(ref.indices))
    if isinstance(spec.layers, str):
        names[spec.layers] = None
    return list(names)


def apply_overrides(spec: Spec, sets: dict[str, int]) -> Spec:
    """A copy of ``spec`` with mesh axis sizes and dim sizes replaced or added, re-validated."""
    axes = {axis.name: axis for axis in spec.mesh.axes}
    dims = dim_names(spec)
    sizes = dict(spec.dims)
    layers = spec.layers
    for name, value in sets.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ShardcError(f"--set {name}={value}: a size must be a positive whole number",
                              fix=f"write e.g. --set {name}=8")
        if name in axes:
            axes[name] = dataclasses.replace(axes[name], size=value)
        elif name in dims:
            sizes[name] = value
        elif name == "L" and layers is None:
            layers = value  # `--set L=40` on a spec without a `layers` line repeats its block
        else:
            valid = ", ".join([*axes, *dims])
            raise ShardcError(f"--set {name}: {name} is neither a mesh axis nor a dim of the spec",
                              fix=f"set one of {valid}")
    mesh = Mesh(tuple(axes[a.name] for a in spec.mesh.axes))
    updated = dataclasses.replace(spec, mesh=mesh, dims=tuple(sizes.items()), layers=layers)
    validate(updated)
    return updated
