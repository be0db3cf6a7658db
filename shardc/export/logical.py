"""A plan's shardings as logical axis rules: MaxText's YAML and flax's rule list.

MaxText and flax name a tensor's dims by role (``embed``, ``mlp``, ...) and map each name to mesh
axes with ``logical_axis_rules``.  Weights and activations have names of their own (MaxText's
``embed`` and ``activation_embed``), since FSDP shards a weight's model dim over the data axis while
the activations shard it otherwise.  The names are MaxText's (its ``src/MaxText/configs/base.yml``):
a spec's dim letter maps to one by :data:`DEFAULT_NAMES`, or by ``--names D=embed,...``.  Every dim
sharded one way in every weight (or every activation) gives one rule; where tensors of one name
disagree, the rule takes the sharding most of them have, and the text names the others.

``--to maxtext`` writes the file format of MaxText's ``custom_mesh_and_rule`` files
(``src/maxtext/configs/custom_mesh_and_rule/pure-fsdp.yml`` in github.com/AI-Hypercomputer/maxtext):
``mesh_axes``, ``data_sharding`` and ``logical_axis_rules`` as flow lists, then the
``ici_*_parallelism`` / ``dcn_*_parallelism`` sizes.  MaxText's mesh axes are named by role, so each
spec axis gets one (:func:`axis_roles`): the pipeline axis is ``stage``; an axis sharding experts
``expert``; a `zero 3` axis ``fsdp`` (the weights' shards over it are FSDP's, whichever dims the
line gave them), or ``context`` where it shards the sequence and not the batch; a weight's model
dim (mlp, heads, vocab) ``tensor``; a weight's embed dim, or a ZeRO-1/2 axis, ``fsdp``; the batch
alone ``data``; the length alone ``context``.  ``--to flax`` writes the rules over the spec's own
axis names, as ``flax.linen.logical_axis_rules`` takes them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from shardc.errors import ShardcError, clip
from shardc.export.jax_export import declared
from shardc.ir.plan import Plan
from shardc.ir.spec import Network, format_axes

__all__ = ["DEFAULT_NAMES", "PHYSICAL", "Rule", "parse_names", "logical_rules", "axis_roles",
           "maxtext_yaml", "flax_rules"]

# a spec's usual dim letters -> MaxText's weight name (an activation's is "activation_" + it)
DEFAULT_NAMES = {"B": "batch", "S": "length", "T": "length", "D": "embed", "F": "mlp", "N": "heads",
                 "K": "kv_heads", "V": "vocab", "E": "exp", "H": "kv"}

# MaxText's mesh axes (base.yml's mesh_axes); a stage axis's sizes are its ici/dcn_pipeline_parallelism
PHYSICAL = ("data", "stage", "fsdp", "fsdp_transpose", "sequence", "context", "context_autoregressive", "tensor",
            "tensor_transpose", "tensor_sequence", "expert", "autoregressive")
_MODEL = frozenset({"mlp", "heads", "kv_heads", "vocab", "kv", "q_heads"})  # a weight's tensor-parallel dims
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}")


@dataclass(frozen=True)
class Rule:
    """One logical name, the spec axes it shards over, and the tensors sharded otherwise."""

    logical: str
    base: str  # the weight name it derives from (``embed`` for ``activation_embed``)
    axes: tuple[str, ...]
    others: tuple[str, ...] = ()  # "In: D_Y" for each tensor of this name sharded otherwise


def parse_names(items: Sequence[str] | None, plan: Plan) -> dict[str, str]:
    """``--names D=embed,F=mlp`` (repeatable): a dim's logical name, or a mesh axis's MaxText axis."""
    dims = {d.name for _, ref in declared(plan) for d in ref.dims}
    axes = set(plan.spec.mesh.names)
    names: dict[str, str] = {}
    for item in (part.strip() for group in items or () for part in group.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not _NAME_RE.fullmatch(value):
            raise ShardcError(f"--names expects NAME=LOGICAL, got {clip(repr(item))}",
                              fix="write e.g. --names D=embed,F=mlp (a logical name is letters, digits and _)")
        if key not in dims and key not in axes:
            raise ShardcError(f"--names {clip(key)}: not a dim or mesh axis of the spec",
                              fix="name one of the dims " + ", ".join(sorted(dims)) + " or the axes "
                                  + ", ".join(plan.spec.mesh.names))
        if key in axes and value not in PHYSICAL:
            raise ShardcError(f"--names {key}={clip(value)}: MaxText has no mesh axis {clip(value)!r}",
                              fix="use one of " + ", ".join(PHYSICAL))
        names[key] = value
    return names


def _base(dim: str, names: dict[str, str]) -> str:
    return names[dim].removeprefix("activation_") if dim in names else DEFAULT_NAMES[dim]


def logical_rules(plan: Plan, names: dict[str, str]) -> list[Rule]:
    """The rules of the declared tensors: activations' first, then weights', each in first-seen order."""
    refs = declared(plan)
    missing = sorted({d.name for _, ref in refs for d in ref.dims} - set(names) - set(DEFAULT_NAMES))
    if missing:
        plural = len(missing) > 1
        raise ShardcError(f"no logical name for the dim{'s' if plural else ''} " + ", ".join(missing),
                          fix=f"name {'them' if plural else 'it'}, e.g. --names "
                              + ",".join(f"{d}=NAME" for d in missing)
                              + " (the letters named by default: " + ", ".join(DEFAULT_NAMES) + ")")
    seen: dict[tuple[bool, str], list[tuple[tuple[str, ...], str]]] = {}
    for role, ref in refs:
        for dim in ref.dims:
            seen.setdefault((role == "param", _base(dim.name, names)), []).append((dim.axes, f"{ref.name}: {dim}"))
    rules = []
    for weight in (False, True):
        for (is_weight, base), uses in seen.items():
            if is_weight != weight:
                continue
            axes = Counter(a for a, _ in uses).most_common(1)[0][0]
            logical = base if weight else "activation_" + base
            rules.append(Rule(logical, base, axes, tuple(text for a, text in uses if a != axes)))
    return rules


def _role(plan: Plan, axis: str, rules: list[Rule]) -> str:
    if plan.spec.mesh.axis(axis).pipeline:
        return "stage"
    weights = {r.base for r in rules if axis in r.axes and r.logical == r.base}
    acts = {r.base for r in rules if axis in r.axes and r.logical != r.base}
    zero = plan.spec.zero is not None and axis in plan.spec.zero.axes
    if "exp" in weights:
        return "expert"
    if zero and plan.spec.zero is not None and plan.spec.zero.stage == 3:  # FSDP's shards, whichever dims they took
        # an axis that also shards the sequence, not the batch, is MaxText's context axis (base.yml's rules shard
        # the weights' embed over it too)
        return "context" if "length" in acts and "batch" not in acts else "fsdp"
    if weights & _MODEL:
        return "tensor"
    if weights or zero:
        return "fsdp"
    if "batch" in acts:
        return "data"
    if "length" in acts:
        return "context"
    return "tensor" if acts else "data"


def axis_roles(plan: Plan, names: dict[str, str], rules: list[Rule]) -> dict[str, str]:
    """Each spec axis's MaxText axis; two axes of one network may not share one."""
    roles = {a: names.get(a) or _role(plan, a, rules) for a in plan.spec.mesh.names}
    for network in Network:
        taken: dict[str, str] = {}
        for axis in plan.spec.mesh.axes:
            if axis.network is not network:
                continue
            other = taken.setdefault(roles[axis.name], axis.name)
            if other != axis.name:
                raise ShardcError(f"mesh axes {other} and {axis.name} both map to MaxText's {roles[other]!r} axis",
                                  fix=f"say which is which, e.g. --names {other}={roles[other]},{axis.name}=data")
    return roles


def _physical(axes: tuple[str, ...], roles: dict[str, str]) -> list[str]:
    return list(dict.fromkeys(roles[a] for a in axes))


def _header(plan: Plan, tool: str) -> list[str]:
    spec = plan.spec
    lines = [f"# {tool} for {spec.filename or '<spec>'!r} ({spec.mesh}), written by `shardc export`."]
    if any(ref.unreduced for _, ref in declared(plan)):
        lines.append("# Partial sums ({U_..}) have no logical-axis form: their tensors' rules say their dims only.")
    return lines


def _conflicts(rules: list[Rule]) -> list[str]:
    return [f"#   {r.logical}: the rule follows most tensors; sharded otherwise: {', '.join(r.others)}"
            for r in rules if r.others]


def maxtext_yaml(plan: Plan, names: dict[str, str]) -> str:
    """MaxText's custom_mesh_and_rule YAML, then the run's ici/dcn parallelism."""
    rules = logical_rules(plan, names)
    roles = axis_roles(plan, names, rules)
    mesh = plan.spec.mesh
    physical = _physical(mesh.names, roles)
    batch = next((r.axes for r in rules if r.logical == "activation_batch"), ())
    lines = _header(plan, "MaxText mesh and logical axis rules (a custom_mesh_and_rule file)")
    lines.append("# spec axis -> MaxText axis: " + ", ".join(
        f"{a.name} -> {roles[a.name]} ({a.network}, {a.size})" for a in mesh.axes))
    lines += [f"mesh_axes: {physical!r}", f"data_sharding: [{_physical(batch, roles)!r}]"]
    conflicts = _conflicts(rules)
    lines += ["# where the declared tensors disagree:"] + conflicts if conflicts else []
    lines.append("logical_axis_rules: [")
    lines += [f"  [{r.logical!r}, {_physical(r.axes, roles)!r}]," for r in rules]
    lines += ["]", "# the run's parallelism over those axes (ICI within a slice, DCN across slices)"]
    for network in (Network.ICI, Network.DCN):
        for name in physical:
            size = 1
            for axis in mesh.axes:
                size *= axis.size if roles[axis.name] == name and axis.network is network else 1
            key = "pipeline" if name == "stage" else name
            lines.append(f"{network}_{key}_parallelism: {size}")
    return "\n".join(lines) + "\n"


def _flax_axes(axes: tuple[str, ...]) -> str:
    if not axes:
        return "None"
    return repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))


def flax_rules(plan: Plan, names: dict[str, str]) -> str:
    """``LOGICAL_AXIS_RULES``: (logical name, the spec's mesh axes) pairs, as flax.linen takes them."""
    rules = logical_rules(plan, names)
    lines = _header(plan, "flax logical axis rules")
    lines.append("# Use with flax.linen.logical_axis_rules(LOGICAL_AXIS_RULES) over a mesh of the spec's axes "
                 f"({format_axes(plan.spec.mesh.names)}).")
    conflicts = _conflicts(rules)
    lines += ["# Where the declared tensors disagree:"] + conflicts if conflicts else []
    lines.append("LOGICAL_AXIS_RULES = [")
    lines += [f"    ({r.logical!r}, {_flax_axes(r.axes)})," for r in rules]
    return "\n".join(lines + ["]"]) + "\n"
