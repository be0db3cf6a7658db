"""A plan's shardings as a readable JAX module (``shardc export FILE --to jax``).

The module holds ``make_mesh()`` (the spec's axes, ``AxisType.Explicit`` unless asked otherwise),
``SHARDINGS`` (a ``PartitionSpec`` for every declared input, parameter and statement result, partial
sums as ``unreduced=``), ``GRAD_SHARDINGS`` (each gradient's), and, for explicit sharding mode,
``OUT_SHARDINGS`` / ``BACKWARD_OUT_SHARDINGS``: the ``out_sharding=`` of each einsum the plan computes
in a sharding jax would not infer from its operands.  ``named(specs, mesh)`` makes them
``NamedSharding``s.  Every name of the spec reaches the text through ``repr`` (the spec's names are
identifiers already; ``repr`` keeps the text Python whatever a future spec allows).

Explicit mode's rule for ``jnp.einsum`` (jax's dot_general sharding rule; docs.jax.dev's "Explicit
sharding" and "Autodiff and sharding" pages describe the mode): each result index keeps the axes it
has in the operands (a batch index must have the same in both); a contracted index that is sharded
leaves the result ambiguous, so jax asks for ``out_sharding``; an operand's partial sums are never
inferred.  ``tests/test_export_jax.py`` checks this rule against jax's own, einsum by einsum.  The plan's einsum
result differs from that inference exactly where it is a partial sum (a sharded contraction) or
where the plan lays the result out otherwise; those get an ``out_sharding``.
"""

from __future__ import annotations

from collections.abc import Iterable

from shardc.collectives import Op
from shardc.ir.plan import Plan, Step, unfused
from shardc.ir.spec import Dim, TensorRef

__all__ = ["jax_module", "pspec_text", "inferred_result", "declared", "out_shardings"]


def pspec_text(ref: TensorRef) -> str:
    """``P(...)`` for a tensor: one entry a dim (``None`` replicated), partial sums as ``unreduced=``."""
    entries = [_entry(d.axes) for d in ref.dims]
    if ref.unreduced:
        entries.append("unreduced={" + ", ".join(repr(a) for a in ref.unreduced) + "}")
    return "P(" + ", ".join(entries) + ")"


def _entry(axes: tuple[str, ...]) -> str:
    if not axes:
        return "None"
    return repr(axes[0]) if len(axes) == 1 else "(" + ", ".join(repr(a) for a in axes) + ")"


def declared(plan: Plan) -> list[tuple[str, TensorRef]]:
    """Every declared input and parameter and every statement result: (role, the declared sharding)."""
    made = [s.result.name for s in plan.spec.statements]
    infos = {info.name: info for info in plan.tensors}
    found = [(info.role, info.ref) for role in ("input", "param") for info in plan.tensors if info.role == role]
    for name in dict.fromkeys(made):
        if name in infos and infos[name].role not in ("input", "param"):
            found.append(("output" if infos[name].is_output else "result", infos[name].ref))
    return found


def inferred_result(step: Step) -> TensorRef | None:
    """The result sharding explicit mode infers for an einsum step's operands; None where jax cannot."""
    axes_of: dict[str, tuple[str, ...]] = {}
    for operand in step.operands:
        if operand.unreduced:
            return None
        for dim in operand.dims:
            if axes_of.setdefault(dim.name, dim.axes) != dim.axes:
                return None  # a batch or contracted index sharded two ways
    out = step.dst.indices
    if any(axes_of.get(name) for name in axes_of if name not in out):
        return None  # a sharded contraction: jax asks for out_sharding
    dims = tuple(Dim(name, axes_of.get(name, ())) for name in out)
    used = [a for d in dims for a in d.axes]
    if len(used) != len(set(used)):
        return None  # one axis on two result dims
    return TensorRef(step.dst.name, dims)


def out_shardings(steps: Iterable[Step]) -> list[tuple[str, Step]]:
    """The einsum steps whose result the plan shards otherwise than explicit mode infers, keyed by result."""
    found: list[tuple[str, Step]] = []
    seen: dict[str, int] = {}
    # a collective matmul as its einsum and its collective: jax's explicit mode runs them so (the ring is
    # shardc's lowering's), and the einsum's result is the one a user's program makes
    for step in dict.fromkeys(part for s in steps for part in unfused(s)):
        if step.op is not Op.EINSUM:
            continue
        guess = inferred_result(step)
        if guess is not None and guess.layout == step.dst.layout and not step.dst.unreduced:
            continue
        seen[step.dst.name] = seen.get(step.dst.name, 0) + 1
        key = step.dst.name if seen[step.dst.name] == 1 else f"{step.dst.name}#{seen[step.dst.name]}"
        found.append((key, step))
    return found


_HEAD = '''"""Shardings of a shardc plan for jax (written by `shardc export --to jax`).

SHARDINGS, GRAD_SHARDINGS and the OUT_SHARDINGS of explicit mode are PartitionSpecs over the mesh
make_mesh() builds; named(SHARDINGS, mesh) turns them into NamedShardings for jax.jit's
in_shardings/out_shardings, jax.device_put or jax.ShapeDtypeStruct.
"""

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
'''

_MESH = '''

def make_mesh(sizes=None, explicit=True):
    """The spec's mesh; ``sizes`` overrides axis sizes (e.g. fewer devices to try it on a CPU)."""
    shape = {**AXIS_SIZES, **(sizes or {})}
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(tuple(shape.values()), tuple(shape), axis_types=(kind,) * len(shape))


def named(specs, mesh):
    """NamedShardings of a dict of PartitionSpecs on ``mesh``."""
    return {name: NamedSharding(mesh, spec) for name, spec in specs.items()}
'''


def _dict(name: str, rows: list[tuple[str, str, str]], why: tuple[str, ...]) -> list[str]:
    """``NAME = {key: P(...), ...}``, one row a line, each with its comment (written above it)."""
    lines = ["", *(f"# {line}" for line in why), f"{name} = {{"]
    for key, value, comment in rows:
        lines += [f"    # {comment}", f"    {key!r}: {value},"]
    return lines + ["}"]


def _einsum_rows(plan: Plan, steps: Iterable[Step]) -> list[tuple[str, str, str]]:
    return [(key, pspec_text(step.dst), f"{step.dst} = " + " · ".join(str(o) for o in step.operands))
            for key, step in out_shardings(steps)]


def jax_module(plan: Plan) -> str:
    """The module's source text."""
    spec = plan.spec
    lines = [_HEAD.rstrip("\n"), "", f"# exported from {spec.filename or '<spec>'!r}: {spec.mesh}"]
    stage = spec.mesh.pipeline_axis
    if stage is not None:
        lines.append(f"# {stage.name!r} is the pipeline stage axis: the stages' layers are on its devices in "
                     "turn, which no PartitionSpec expresses (see `shardc lower`)")
    sizes = ", ".join(f"{a.name!r}: {a.size}" for a in spec.mesh.axes)
    lines += ["# mesh axes in device-mesh order (major to minor) and their sizes", f"AXIS_SIZES = {{{sizes}}}"]
    lines += _MESH.rstrip("\n").split("\n") + [""]
    lines += _dict("SHARDINGS", [(ref.name, pspec_text(ref), f"{role}: {ref}") for role, ref in declared(plan)],
                   ("every declared input, parameter and result",))
    grads = [(g.name, pspec_text(g), f"gradient of {plan.primal(g.name)}: {g}") for g in plan.grads]
    lines += _dict("GRAD_SHARDINGS", grads, ("the gradient of each input and parameter, as the backward leaves it",))
    lines += _dict("OUT_SHARDINGS", _einsum_rows(plan, plan.forward),
                   ("explicit mode: jnp.einsum(..., out_sharding=OUT_SHARDINGS[result]) for the forward",
                    "einsums whose result sharding jax would not infer from the operands'"))
    lines += _dict("BACKWARD_OUT_SHARDINGS", _einsum_rows(plan, plan.backward),
                   ("the same for the backward's einsums",))
    return "\n".join(lines) + "\n"
