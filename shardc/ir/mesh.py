"""The device mesh a spec runs on: its axes, in device-mesh order, and the network each one's collectives cross.

:mod:`shardc.ir.spec` holds the rest of the spec IR and names these too.

>>> str(Mesh((MeshAxis("P", 4, pipeline=True), MeshAxis("X", 8, Network.DCN))))
'mesh P=4 pipeline, X=8 over dcn'
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shardc.errors import ShardcError, Span

__all__ = ["Network", "MeshAxis", "Mesh", "format_axes", "parse_topology"]


class Network(enum.Enum):
    """Which network a mesh axis's collectives cross."""

    ICI = "ici"  # the fast chip-to-chip links (ICI on TPU, NVLink on GPU)
    DCN = "dcn"  # the slower data-centre network (DCN on TPU, InfiniBand on GPU)

    def __str__(self) -> str:
        return self.value


def parse_topology(text: str, span: Span | None = None, what: str = "topology") -> tuple[int, ...]:
    """``4x4x4``, ``16x16`` or ``48x8``: two or three whole sizes of 1 or more, joined by ``x``; ``what`` names
    where it was given (``--topology``: no line to point at)."""
    parts = text.strip().lower().split("x")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() and len(p) <= 9 and int(p) >= 1 for p in parts):
        raise ShardcError(f"{what} {text[:40]!r}: expects a shape like 4x4x4, 16x16 or 48x8", span,
                          fix="write the slice's sides (TPU) or NODESxGPUS (GPU), joined by x")
    return tuple(int(p) for p in parts)


def format_axes(axes: tuple[str, ...]) -> str:
    """Axes as the spec writes them: a run of one-letter names, else a braced list."""
    if axes and all(len(a) == 1 for a in axes):
        return "".join(axes)
    return "{" + ",".join(axes) + "}"


@dataclass(frozen=True)
class MeshAxis:
    name: str
    size: int
    network: Network = Network.ICI
    span: Span | None = field(default=None, compare=False, hash=False, repr=False)
    pipeline: bool = False  # the pipeline-stage axis (`P=4 pipeline`): its devices hold different layers

    def __str__(self) -> str:
        text = f"{self.name}={self.size}"
        if self.pipeline:
            text += " pipeline"
        if self.network is Network.DCN:
            text += " over dcn"
        return text


@dataclass(frozen=True)
class Mesh:
    """Mesh axes in device-mesh order (major to minor)."""

    axes: tuple[MeshAxis, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    def size(self, name: str) -> int:
        for axis in self.axes:
            if axis.name == name:
                return axis.size
        raise KeyError(name)

    def axis(self, name: str) -> MeshAxis:
        for axis in self.axes:
            if axis.name == name:
                return axis
        raise KeyError(name)

    @property
    def pipeline_axis(self) -> MeshAxis | None:
        """The axis marked ``pipeline``, if any (validation allows at most one); one of size 1 is
        pipelining switched off, none: its one stage is the whole model, run on the whole batch."""
        return next((a for a in self.axes if a.pipeline and a.size > 1), None)

    @property
    def devices(self) -> int:
        total = 1
        for axis in self.axes:
            total *= axis.size
        return total

    def __str__(self) -> str:
        return "mesh " + ", ".join(str(a) for a in self.axes)
