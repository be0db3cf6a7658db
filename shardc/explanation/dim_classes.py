"""The dims of a jaxpr joined into the named dims of a spec, and a dim that a reshape splits into several.

Every array dim of the jaxpr has an id.  Ids that an op shows to be one dim (a contraction's pair, an
elementwise op's operand and result) are joined (union-find); each class is one named dim of the
spec.  A reshape that splits a dim (``D -> (N, H)``, heads out of a projection) or merges several
(``(N, H) -> D``) gives the class of the whole dim *parts*: the classes it is made of, major first.
The spec writes a dim that has parts as its parts (``Wq[D, N, H]`` where the program has ``Wq[D, F]``
reshaped), as a spec of multi-head attention does; a sharding of the whole dim is written on the
parts when it shards them in blocks the language writes (``F_{model}`` with ``model`` dividing N is
``N_{model}, H``), else it is an error.
"""

from __future__ import annotations

import math

from shardc.errors import ShardcError

__all__ = ["DimClasses", "UNWRITABLE"]

UNWRITABLE = "EXPLAIN_UNWRITABLE"  # the kind of an error the reader reports with its equation and line


def unwritable(message: str, fix: str = "") -> ShardcError:
    """An error of the reader, which the walk prefixes with the equation and its line; ``fix`` says what
    to do where more can be said than to leave the op out."""
    return ShardcError(message, fix=fix or "explain a program without it, or write its .shard spec", kind=UNWRITABLE)


class DimClasses:
    def __init__(self, mesh: dict[str, int]) -> None:
        self.mesh = mesh
        self.parent: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.parts: dict[int, list[int]] = {}  # a class's root -> the ids of its parts, major first
        self.origin: dict[int, str] = {}  # a class's root -> the reshape that gave it parts, and its line

    def new(self, size: int) -> int:
        d = len(self.parent)
        self.parent[d], self.size[d] = d, size
        return d

    def find(self, d: int) -> int:
        while self.parent[d] != d:
            self.parent[d] = self.parent[self.parent[d]]
            d = self.parent[d]
        return d

    def join(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        root, child = min(ra, rb), max(ra, rb)
        self.parent[child] = root
        mine, theirs = self.parts.pop(root, None), self.parts.pop(child, None)
        if child in self.origin:
            self.origin.setdefault(root, self.origin.pop(child))
        if mine is None or theirs is None:
            if mine or theirs:
                self.parts[root] = mine or theirs or []
            return
        self.parts[root] = mine
        if [self.size[p] for p in mine] != [self.size[p] for p in theirs]:
            raise unwritable(f"a dim of {self.size[root]} is split two ways ({self.shape(mine)} and "
                             f"{self.shape(theirs)}), which one set of named dims cannot write")
        for p, q in zip(mine, theirs, strict=True):
            self.join(p, q)

    def shape(self, ids: list[int]) -> str:
        return "x".join(str(self.size[d]) for d in ids)

    def split(self, whole: int, pieces: list[int], origin: str) -> None:
        """``whole`` is ``pieces`` (a reshape's split or merge, ``origin``): their sizes multiply to its size."""
        root = self.find(whole)
        self.origin.setdefault(root, origin)
        if root in self.parts:
            old = self.parts[root]
            if [self.size[p] for p in old] != [self.size[p] for p in pieces]:
                raise unwritable(f"a dim of {self.size[root]} is split two ways ({self.shape(old)} and "
                                 f"{self.shape(pieces)}), which one set of named dims cannot write")
            for p, q in zip(old, pieces, strict=True):
                self.join(p, q)
        else:
            self.parts[root] = list(pieces)

    def atoms(self, d: int) -> list[int]:
        """The roots of the classes ``d`` is made of, major first (its own when it has no parts)."""
        root = self.find(d)
        if root not in self.parts:
            return [root]
        return [a for p in self.parts[root] for a in self.atoms(p)]

    def fresh(self, d: int) -> int:
        """A new id of ``d``'s size whose parts (if any) are new ones of the same shape."""
        e = self.new(self.size[d])
        root = self.find(d)
        if root in self.parts:
            self.parts[e] = [self.fresh(p) for p in self.parts[root]]
        return e

    def spread(self, d: int, held: dict[int, tuple[str, ...]]) -> list[tuple[int, tuple[str, ...]]]:
        """``d``'s atoms, each with the axes sharding it, from ``held`` (id -> axes: ids of the tensor's
        dims as a view of it, a reshape or the tensor itself, shows them, or of their atoms)."""
        atoms: dict[int, tuple[str, ...]] = {}
        for k, axes in held.items():
            for atom, mine in self._spread(k, axes):
                atoms.setdefault(atom, mine)
        return [(a, atoms.get(a, ())) for a in self.atoms(d)]

    def _spread(self, d: int, axes: tuple[str, ...]) -> list[tuple[int, tuple[str, ...]]]:
        root = self.find(d)
        if root not in self.parts:
            return [(root, axes)]
        out: list[tuple[int, tuple[str, ...]]] = []
        rest = list(axes)
        for p in self.parts[root]:
            try:
                out += self._spread(p, tuple(self._take(p, rest, axes, self.shape(self.parts[root]))))
            except ShardcError as err:
                where = self.origin.get(root, "")
                raise unwritable(err.message + (f" ({where})" if where else "")) from None
        return out

    def _take(self, part: int, rest: list[str], axes: tuple[str, ...], shape: str) -> list[str]:
        """The axes, of those left (major first), that shard ``part`` of a dim sharded over ``axes``:
        a block of the whole is a block of each part only when the major parts are split whole."""
        mine: list[str] = []
        while rest and self.size[part] % (math.prod(self.mesh[a] for a in mine) * self.mesh[rest[0]]) == 0:
            mine.append(rest.pop(0))
        devices = math.prod(self.mesh[a] for a in mine)
        if rest and devices != self.size[part]:
            raise unwritable(f"a dim sharded over {', '.join(axes)} is reshaped to {shape}: a device's block "
                             "of it is not a block of each of those dims")
        return mine


def reshape_groups(shape: tuple[int, ...], new: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """The dims of ``shape`` and of ``new`` in groups of equal size, in order (dims of size 1 left out):
    ``(4, 8, 16) -> (4, 8, 2, 8)`` is ``[([0], [0]), ([1], [1]), ([2], [2, 3])]``; None when the sizes
    never meet (not a reshape)."""
    ins = [k for k, n in enumerate(shape) if n != 1]
    outs = [k for k, n in enumerate(new) if n != 1]
    groups: list[tuple[list[int], list[int]]] = []
    x = y = 0
    while x < len(ins) and y < len(outs):
        gi, go = [ins[x]], [outs[y]]
        a, b = shape[ins[x]], new[outs[y]]
        x, y = x + 1, y + 1
        while a != b:
            if a < b and x < len(ins):
                gi.append(ins[x])
                a, x = a * shape[ins[x]], x + 1
            elif b < a and y < len(outs):
                go.append(outs[y])
                b, y = b * new[outs[y]], y + 1
            else:
                return None
        groups.append((gi, go))
    return groups if x == len(ins) and y == len(outs) else None
