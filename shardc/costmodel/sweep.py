"""``--sweep B=1e3:1e7``: compute vs communication time as one dim varies, and ``--plot``.

The plan is kept fixed (its collectives were chosen at the spec's sizes); only
the sizes change, and each point is costed with the same model as the report.
Points are log-spaced.  Several plans (strategies) can be swept together, which
is how the book's figures compare them; ``--plot`` draws them with matplotlib,
imported only then (``pip install shardc[plot]``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardc.costmodel.cost_report import resolve_sizes
from shardc.errors import ShardcError
from shardc.hardware import Hardware
from shardc.images import check_image_path, pyplot, save_figure
from shardc.ir.plan import Plan
from shardc.layer_counts import block_counts, runs
from shardc.phase_time import bound_of
from shardc.ring_sends import shared_rings
from shardc.spec.lexicon import MAX_SIZE
from shardc.step_cost import cost_step
from shardc.timing import plan_dtype, plan_links

__all__ = ["SweepPoint", "Sweep", "parse_sweep", "sweep", "plot", "check_plot_path"]


@dataclass(frozen=True)
class SweepPoint:
    value: float
    compute_s: float
    comm_s: float
    critical_s: float

    @property
    def bound(self) -> str:
        return bound_of(self.compute_s, self.comm_s)


@dataclass(frozen=True)
class Sweep:
    label: str
    dim: str
    points: tuple[SweepPoint, ...]

    def render(self) -> str:
        lines = [f"{self.label}: sweep of {self.dim} (the plan fixed; whole step, all layers)",
                 f"  {self.dim:>12}  {'compute':>11}  {'comm':>11}  {'critical':>11}  bound"]
        for p in self.points:
            lines.append(f"  {p.value:>12.4g}  {p.compute_s:>11.4g}  {p.comm_s:>11.4g}  "
                         f"{p.critical_s:>11.4g}  {p.bound}")
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, object]:
        return {"label": self.label, "dim": self.dim,
                "points": [{"value": p.value, "compute_s": p.compute_s, "comm_s": p.comm_s,
                            "critical_s": p.critical_s, "bound": p.bound} for p in self.points]}


def parse_sweep(text: str) -> tuple[str, float, float]:
    """``B=1e3:1e7`` as (dim, low, high); errors say how to write it."""
    name, sep, span = text.partition("=")
    low_text, colon, high_text = span.partition(":")
    try:
        low, high = float(low_text.replace("_", "")), float(high_text.replace("_", ""))
    except ValueError:
        low = high = math.nan
    if not sep or not colon or not name.isidentifier() or not 1 <= low < high <= MAX_SIZE:  # inf, nan refused
        raise ShardcError(f"--sweep expects NAME=LOW:HIGH with 1 <= LOW < HIGH <= 1e18 (sizes count elements "
                          f"or devices), got {text!r}",
                          fix="write e.g. --sweep B=1e3:1e7")
    return name, low, high


def sweep(plan: Plan, hw: Hardware, dim: str, low: float, high: float, points: int = 13,
          sizes: dict[str, int] | None = None, label: str | None = None,
          spans: dict[str, int] | None = None) -> Sweep:
    """Whole-step compute and communication time at ``points`` log-spaced values of ``dim``."""
    base = resolve_sizes(plan, sizes)
    if dim not in base:
        raise ShardcError(f"--sweep {dim}: no dim or mesh axis of that name",
                          fix="sweep one of " + ", ".join(sorted(base)))
    if points < 2:
        raise ShardcError("--points must be at least 2", fix="write e.g. --points 13")
    out: list[SweepPoint] = []
    mesh = plan.spec.mesh
    links = plan_links(plan, hw, base, spans)[0]
    for k in range(points):
        value = math.exp(math.log(low) + math.log(high / low) * k / (points - 1))
        if dim in mesh.names:  # devices come whole: a mesh axis takes the nearest count, padding as XLA pads
            value = round(value)
        values = dict(base)
        values[dim] = value  # type: ignore[assignment]  # fractional sizes are fine for costing
        counts = block_counts(plan, values)
        phases = (plan.forward, plan.recomputed + plan.backward, plan.optimizer)
        shared = [flag for steps in phases for flag in shared_rings(steps)]
        rows = [cost_step(i, s, mesh, values, hw, links, plan_dtype(plan), shared=one) for i, (s, one) in enumerate(
            zip(plan.forward + plan.recomputed + plan.backward + plan.optimizer, shared, strict=True))]
        times = [runs(r.once, r.block, counts) for r in rows]
        compute = math.fsum(r.compute_s * n for r, n in zip(rows, times, strict=True))
        comm = math.fsum(r.comm_s * n for r, n in zip(rows, times, strict=True))
        critical = math.fsum(r.comm_s * n for r, n in zip(rows, times, strict=True)
                             if r.is_collective and not r.ahead)
        out.append(SweepPoint(value, compute, comm, critical))
    return Sweep(label or plan.spec.filename or "<spec>", dim, tuple(out))


def check_plot_path(path: str, force: bool = False) -> None:
    """A path matplotlib can write an image to without replacing a file that is not one."""
    check_image_path(path, "--plot", force)


def plot(sweeps: Sequence[Sweep], path: str, hw: Hardware, force: bool = False) -> None:
    """Communication time of each plan against the dim, with compute time dashed, log-log.

    ``force`` replaces a file at ``path`` that is not an image (see :mod:`shardc.images`).
    """
    check_plot_path(path, force)
    plt = pyplot("--plot")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in sweeps:
        xs = [p.value for p in s.points]
        line = ax.plot(xs, [p.comm_s for p in s.points], label=f"{s.label}: communication")[0]
        ax.plot(xs, [p.compute_s for p in s.points], linestyle="--", color=line.get_color(),
                label=f"{s.label}: compute")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(sweeps[0].dim)
    ax.set_ylabel("seconds per step")
    ax.set_title(f"{hw.name}: communication (solid) vs compute (dashed) per step")
    ax.legend(fontsize="small")
    fig.tight_layout()
    save_figure(plt, fig, path, "--plot")
