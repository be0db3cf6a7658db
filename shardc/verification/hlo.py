"""The collectives in compiled HLO text: kind, mesh axes, elements moved.

Axes come from the replica groups: each group lists the devices (flattened
mesh positions, since the mesh's device order is the executable's device
assignment) that talk to each other, however XLA spells them (a list of lists,
an iota tile, or axes of a mesh of XLA's own, which need not be the spec's); the
mesh coordinates that vary across a group are the collective's axes, ordered
major to minor by how slowly they change along the group (the order all-gather
concatenates in).  Volume is V (bytes a
device would hold unsharded over the group), counted in elements so a caller can price floating ones in
the spec's dtype (XLA on CPU widens bf16 collectives to f32); integer ones (token ids, ``s32``) are
priced at the width HLO gives them, which the plan's element bytes must match.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from shardc.collectives import BY_HLO_OP, TABLE
from shardc.ir.plan import Op

__all__ = ["Collective", "collectives", "parse_replica_groups", "pair_axes"]

_KINDS = BY_HLO_OP
_HLO_OPS = [i.hlo_op for i in TABLE.values() if i.is_collective and i.hlo_op]  # the pipeline's permute too
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>\(.*?\)|[\w\[\],{}:]+?)\s+"
                   r"(?P<op>" + "|".join(map(re.escape, _HLO_OPS)) + ")"
                   r"(?P<start>-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST = re.compile(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}")
# XLA's mesh-axes spelling: the mesh (named axes, and the device ids at its positions where they are not
# 0..n-1 in row-major order), then the axes a group spans, e.g. ``mesh['axis_0'=4,'axis_1'=2] {'axis_1'}``
_QUOTED = r"'(?:[^'\\]|\\.)*'"
_MESH = re.compile(rf"replica_groups=(?:mesh\[(?P<axes>(?:{_QUOTED}|[^\]'])*)\]"
                   r"(?:,\s*device_ids=\((?P<ids>[^)]*\)?)\))?"
                   rf"|@mesh<(?P<old_axes>(?:{_QUOTED}|[^>'])*)>(?:\(devices=(?P<old_ids>[^)]*\)?)\))?)"
                   rf"\s*\{{(?P<group>(?:{_QUOTED}|[^}}'])*)\}}")
_AXIS_SIZE = re.compile(rf"({_QUOTED}|[\w.\-]+)=(\d+)")
_AXIS_REF = re.compile(rf"({_QUOTED}|[\w.\-]+)(?::\((\d+)\)(\d+))?")
_IDS = re.compile(r"(?:\[([\d,]+)\](?:<=\[([\d,]+)\])?)?(?:T\(([\d,]+)\))?([\d,]*)")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_INTEGER = re.compile(r"[su](\d+)")  # HLO's signed and unsigned integer types: s32, u8, ...


@dataclass(frozen=True)
class Collective:
    kind: Op | None  # None: a collective the plan never makes (collective-permute)
    hlo_op: str
    axes: tuple[str, ...]
    elements: int  # V in elements
    dtype: str
    text: str
    shape: tuple[int, ...] = ()  # the result array's dims (per device)

    def bytes(self, nbytes: int | None = None) -> int:
        """V in bytes: a floating element at ``nbytes`` (the spec's dtype: a lowered module computes every
        float in one type) or, without it, at the HLO type's own width (a user's program holds each
        tensor in its own type); an integer one at its own width."""
        integer = _INTEGER.fullmatch(self.dtype)
        if integer or self.dtype == "pred":
            return self.elements * (int(integer.group(1)) // 8 if integer else 1)
        return self.elements * (nbytes if nbytes is not None else _float_bytes(self.dtype))


def _float_bytes(hlo_type: str) -> int:
    """An HLO float type's width: ``f32`` 4, ``bf16`` and ``f16`` 2, every ``f8e...`` format 1."""
    return 1 if hlo_type.startswith("f8") else int(hlo_type.removeprefix("b")[1:]) // 8


def parse_replica_groups(line: str, devices: int) -> list[list[int]]:
    """The replica groups of an HLO instruction as device ids, in any of XLA's spellings: listed
    ``{{0,1},{2,3}}``, iota ``[2,2]<=[4]`` (with ``T(...)``), and mesh axes
    ``mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'b'}``; none at all: every device."""
    mesh = _MESH.search(line)
    if mesh:
        return _mesh_groups(mesh)
    iota = _IOTA.search(line)
    if iota:
        return _iota(iota.group(1), iota.group(2), iota.group(3)).tolist()  # type: ignore[no-any-return]
    listed = _LIST.search(line)
    if listed and listed.group(1).strip():
        return [[int(x) for x in g.split(",") if x.strip()]
                for g in re.findall(r"\{([\d,\s]*)\}", listed.group(1))]
    return [list(range(devices))]  # no groups: every device


def _ints(text: str | None) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()] if text else []


def _iota(shape: str, dims: str, perm: str | None) -> np.ndarray:
    """XLA's iota tile: 0..n-1 laid out as ``dims``, transposed by ``perm``, read as ``shape``."""
    ids = np.arange(int(np.prod(_ints(dims)))).reshape(_ints(dims))
    if perm:
        ids = ids.transpose(_ints(perm))
    return ids.reshape(_ints(shape))


def _unquote(name: str) -> str:
    return re.sub(r"\\(.)", r"\1", name[1:-1]) if name.startswith("'") else name


def _mesh_groups(match: re.Match[str]) -> list[list[int]]:
    """XLA's ``MeshAxesReplicaGroupList`` (openxla/xla, xla/hlo/ir/replica_group.cc): a group is the
    devices of the mesh's device array that differ only in the listed axes, ordered as listed (the first
    most major); the other positions, in mesh order, index the groups."""
    axes = [(_unquote(n), int(k)) for n, k in _AXIS_SIZE.findall(match.group("axes") or match.group("old_axes"))]
    refs = [(_unquote(n), int(pre) if pre else None, int(size) if size else None)
            for n, pre, size in _AXIS_REF.findall(match.group("group"))]
    ids = _mesh_ids(match.group("ids") or match.group("old_ids"), [k for _, k in axes])
    parts, grouped = _split_axes(axes, refs, match.group(0))
    rest = [k for k in range(len(parts)) if k not in grouped]
    members = int(np.prod([parts[k] for k in grouped]))
    return ids.reshape(parts).transpose(rest + grouped).reshape(-1, members).tolist()  # type: ignore[no-any-return]


def _split_axes(axes: list[tuple[str, int]], refs: list[tuple[str, int | None, int | None]],
                text: str) -> tuple[list[int], list[int]]:
    """The mesh's dims with each axis cut where its sub-axes begin and end, and the dim of each listed
    axis.  A sub-axis ``'a':(pre)size`` is the ``size`` positions of ``a`` under its ``pre`` most major
    ones: ``a`` read as ``[pre, size, rest]`` in row-major order."""
    index = {name: k for k, (name, _) in enumerate(axes)}
    if any(name not in index for name, _, _ in refs):
        raise ValueError(f"replica groups over an axis not in their mesh: {text}")
    cuts = [{1, size} for _, size in axes]  # per axis: the sizes of its major parts where it is cut
    for name, pre, size in refs:
        if pre is not None and size is not None:
            cuts[index[name]] |= {pre, pre * size}
    bounds = [sorted(c) for c in cuts]
    parts: list[int] = []
    first = []  # where each axis's parts begin
    for (_, size), cut in zip(axes, bounds, strict=True):
        if cut[-1] != size or any(b % a for a, b in pairwise(cut)):
            raise ValueError(f"sub-axes that do not tile their mesh axis: {text}")
        first.append(len(parts))
        parts += [b // a for a, b in pairwise(cut)] or [1]  # an axis of size 1 stays a dim
    grouped = [first[index[name]] + (bounds[index[name]].index(pre) if pre is not None else 0)
               for name, pre, _ in refs]
    whole_of_cut = any(pre is None and len(bounds[index[name]]) > 2 for name, pre, _ in refs)
    if len(set(grouped)) != len(grouped) or whole_of_cut:
        raise ValueError(f"replica groups that list a mesh axis twice: {text}")
    return parts, grouped


def _mesh_ids(text: str | None, shape: list[int]) -> np.ndarray:
    """The device id at each mesh position: ``[4,2]T(1,0)`` (an iota tile), ``[8]<=[2,4]T(1,0)`` (the
    older spelling), listed ids, or, absent, 0..n-1 in row-major order."""
    n = int(np.prod(shape))
    if not text:
        return np.arange(n)
    spelled = _IDS.fullmatch(text.strip())
    if spelled is None:
        raise ValueError(f"mesh device ids XLA spelled in an unknown way: {text}")
    dims, reshape, perm, listed = spelled.groups()
    if listed:
        ids = np.array(_ints(listed))
    elif dims or reshape:
        ids = _iota(str(n), reshape or dims, perm)
    else:
        raise ValueError(f"mesh device ids XLA spelled in an unknown way: {text}")
    if sorted(ids.tolist()) != list(range(n)):
        raise ValueError(f"mesh device ids are not a permutation of 0..{n - 1}: {text}")
    return ids


def group_axes(group: list[int], mesh: tuple[tuple[str, int], ...]) -> tuple[str, ...]:
    """The mesh axes a replica group spans, major to minor along the group."""
    shape = [size for _, size in mesh]
    coords = np.array(np.unravel_index(np.array(group), shape)).T  # (members, axes)
    varying = [k for k in range(len(shape)) if len(set(coords[:, k])) > 1]

    def stride(k: int) -> int:
        # members between changes of this axis's coordinate: larger = more major
        changes = np.nonzero(np.diff(coords[:, k]))[0]
        return int(changes[0]) + 1 if len(changes) else len(group)

    return tuple(mesh[k][0] for k in sorted(varying, key=lambda k: (-stride(k), k)))


def pair_axes(line: str, mesh: tuple[tuple[str, int], ...]) -> tuple[str, ...]:
    """The mesh axes a collective-permute's sources and targets differ in, in mesh order (() where it has
    no pairs, or sends each device's block to itself)."""
    match = _PAIRS.search(line)
    if not match:
        return ()
    shape = [size for _, size in mesh]
    moved: set[int] = set()
    for a, b in re.findall(r"\{(\d+),(\d+)\}", match.group(1)):
        src, dst = np.unravel_index(int(a), shape), np.unravel_index(int(b), shape)
        moved.update(k for k in range(len(shape)) if src[k] != dst[k])
    return tuple(mesh[k][0] for k in sorted(moved))


def _arrays(shape_text: str) -> list[tuple[str, int]]:
    return [(dt, int(np.prod([int(x) for x in dims.split(",") if x] or [1])))
            for dt, dims in _ARRAY.findall(shape_text)]


def _last_shape(shape_text: str) -> tuple[int, ...]:
    found = _ARRAY.findall(shape_text)
    return tuple(int(x) for x in found[-1][1].split(",") if x) if found else ()


def collectives(hlo_text: str, mesh: tuple[tuple[str, int], ...]) -> list[Collective]:
    """Every collective instruction of a compiled module, in text order."""
    devices = int(np.prod([size for _, size in mesh]))
    found: list[Collective] = []
    for line in hlo_text.splitlines():
        match = _LINE.match(line)
        if not match:
            continue
        op, arrays = match.group("op"), _arrays(match.group("shape"))
        if not arrays:
            continue
        groups = parse_replica_groups(line, devices)
        axes = group_axes(groups[0], mesh) if groups and groups[0] else ()
        if op == "collective-permute":  # no replica groups: the axes its sources and targets differ in
            axes = pair_axes(line, mesh) or axes
        group = len(groups[0]) if groups else 1
        kind = _KINDS.get(op)
        if match.group("start") and kind is Op.ALL_GATHER:
            arrays = arrays[-1:]  # async start: (operand, result); the result is what counts
        if kind is Op.ALL_TO_ALL:
            # the tuple form lists one chunk per peer: together they are the per-device array
            arrays = [(arrays[0][0], sum(n for _, n in arrays))]
        for dtype, elements in arrays:  # a combined (tuple) collective counts each array
            if kind is Op.REDUCE_SCATTER or kind is Op.ALL_TO_ALL:
                elements *= group  # V: before scattering / per-device bytes times the group
            found.append(Collective(kind, op, axes, elements, dtype, line.strip(),
                                    _last_shape(match.group("shape"))))
    return found
