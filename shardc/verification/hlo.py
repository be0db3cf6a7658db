"""The collectives in compiled HLO text: kind, mesh axes, elements moved.

Axes come from the replica groups: each group lists the devices (flattened
mesh positions, since the mesh's device order is the executable's device
assignment) that talk to each other; the mesh coordinates that vary across a
group are the collective's axes, ordered major to minor by how slowly they
change along the group (the order all-gather concatenates in).  Volume is V (bytes a
device would hold unsharded over the group), counted in elements so a caller can price floating ones in
the spec's dtype (XLA on CPU widens bf16 collectives to f32); integer ones (token ids, ``s32``) are
priced at the width HLO gives them, which the plan's element bytes must match.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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

    def bytes(self, nbytes: int) -> int:
        """V in bytes: a floating element at ``nbytes`` (the spec's dtype), an integer one at its own width."""
        integer = _INTEGER.fullmatch(self.dtype)
        return self.elements * (int(integer.group(1)) // 8 if integer else 1 if self.dtype == "pred" else nbytes)


def parse_replica_groups(line: str, devices: int) -> list[list[int]]:
    """Both spellings: ``{{0,1},{2,3}}`` and the iota form ``[2,2]<=[4]`` (with ``T(...)``)."""
    iota = _IOTA.search(line)
    if iota:
        shape = [int(x) for x in iota.group(1).split(",")]
        dims = [int(x) for x in iota.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
        return ids.reshape(shape).tolist()  # type: ignore[no-any-return]
    listed = _LIST.search(line)
    if listed and listed.group(1).strip():
        return [[int(x) for x in g.split(",") if x.strip()]
                for g in re.findall(r"\{([\d,\s]*)\}", listed.group(1))]
    return [list(range(devices))]  # no groups: every device


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
