"""The book's closed-form optimum beside the searched one, for FSDP over one axis and tensor parallelism over another.

"How To Scale Your Model" (the training chapter, "Combining FSDP and tensor parallelism") sets
the FSDP communication ``4DF / (Y W M_X)`` equal to the tensor-parallel one ``4BD / (X W M_Y)``
and gets ``X_opt = sqrt(B/F * M_X/M_Y * N)``: on a 4x4x4 v5p slice (N = 64) with B = 48,000 tokens
and F = 32,768, about 14, so X = 16 and Y = 4.  Here B is the tokens of a step (the product of the dims
no parameter has), F the one dim parameters shard over the second axis, and M_X, M_Y the physical axes' worth of
links of the chosen layout's two axes on its topology.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardc.costmodel.cost_report import CostReport, token_dims
from shardc.timing import plan_links

__all__ = ["BookOptimum", "book_optimum"]


@dataclass(frozen=True)
class BookOptimum:
    """X_opt and the figures it is made from."""

    fsdp_axis: str
    tp_axis: str
    batch: str  # the token dim's name (B)
    hidden: str  # the dim the second axis shards in the weights (F)
    b: int
    f: int
    m_x: float
    m_y: float
    chips: int
    x: int = 0  # the layout whose links M_X and M_Y are
    y: int = 0

    @property
    def x_opt(self) -> float:
        return math.sqrt(self.b / self.f * self.m_x / self.m_y * self.chips)

    def text(self, searched: int) -> str:
        return (f"the book's X_opt = sqrt({self.batch}/{self.hidden} * M_{self.fsdp_axis}/M_{self.tp_axis} * N) = "
                f"sqrt({self.b}/{self.f} * {self.m_x:g}/{self.m_y:g} * {self.chips}) = {self.x_opt:.1f} "
                f"(at {self.fsdp_axis}={self.x}, {self.tp_axis}={self.y}'s links) beside the searched "
                f"{self.fsdp_axis}={searched}")

    def to_json(self) -> dict[str, object]:
        return {"x_opt": self.x_opt, "fsdp_axis": self.fsdp_axis, "tp_axis": self.tp_axis, "B": self.b,
                "F": self.f, "M_X": self.m_x, "M_Y": self.m_y, "N": self.chips, "at": {self.fsdp_axis: self.x,
                                                                                 self.tp_axis: self.y}}


def book_optimum(report: CostReport, axes: tuple[str, ...]) -> BookOptimum | None:
    """The book's X_opt for the chosen layout's report, when its spec is FSDP over ``axes[0]`` and tensor
    parallelism over ``axes[1]``: a token dim, and a parameter dim sharded over the second axis."""
    if len(axes) != 2:
        return None
    plan, (x, y) = report.plan, axes
    tokens = list(token_dims(plan))
    hidden = {d.name for info in plan.tensors if info.role == "param" for d in info.ref.dims if y in d.axes}
    fsdp = any(x in d.axes for info in plan.tensors if info.role == "param" for d in info.ref.dims)
    if not tokens or len(hidden) != 1 or not fsdp:  # the book's block: one hidden dim F over Y
        return None
    (f,) = hidden
    links, _ = plan_links(plan, report.hardware, report.sizes)
    m_x, m_y = (float(links[a].links) if a in links else 1.0 for a in (x, y))
    chips = report.sizes[x] * report.sizes[y]
    b = math.prod(report.sizes[t] for t in tokens)  # every token of a step (sequences x their length)
    return BookOptimum(x, y, "*".join(tokens), f, b, report.sizes[f], m_x, m_y, chips, report.sizes[x],
                       report.sizes[y])
