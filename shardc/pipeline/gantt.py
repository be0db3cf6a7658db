"""``shardc cost --schedule-plot out.png``: the simulated schedule as a Gantt chart.

One row a device (stage 0 on top), one bar an op, coloured by kind (forward,
backward, and weight gradient for the zero-bubble schedules) and labelled with its
microbatch, as the schedule figures of the zero-bubble paper and torchtitan's
visualiser draw them.  DualPipe's overlapped F&B pairs are outlined in black, as the
deepseek-ai/DualPipe README's figure encloses them, each op drawn as its share of the pair.
matplotlib is imported only here, on use.
"""

from __future__ import annotations

from shardc.errors import ShardcError
from shardc.images import check_image_path, pyplot, save_figure
from shardc.pipeline.dualpipe import TWO_WAY
from shardc.pipeline.schedules import PAIRED, Simulation

__all__ = ["draw", "COLOURS", "MAX_BARS"]

MAX_BARS = 5000  # a bar an op: past this the chart is unreadable and takes tens of seconds to draw

COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
_NAMES = {"F": "forward", "B": "backward (input grad)", "W": "weight grad"}


def draw(sim: Simulation, path: str, title: str = "", force: bool = False) -> None:
    """Write the Gantt chart of ``sim`` to ``path`` (any format matplotlib knows from the suffix).

    ``force`` replaces a file at ``path`` that is not an image (see :mod:`shardc.images`).
    """
    check_image_path(path, "--schedule-plot", force)
    if len(sim.ops) > MAX_BARS:
        raise ShardcError(f"--schedule-plot: the schedule has {len(sim.ops):,} ops, more bars than a chart can "
                          f"show (at most {MAX_BARS:,}, each drawn in milliseconds)",
                          fix="draw it with fewer microbatches (the order repeats: 4 a stage show it all)")
    import matplotlib

    plt = pyplot("--schedule-plot")
    scale, unit = _unit(sim.makespan)
    paired = sim.schedule in PAIRED  # a fourth legend entry and longer row names: a wider chart
    wide = 4 + 0.12 * len(sim.ops) / sim.stages + (3 if paired else 0)
    fig, ax = plt.subplots(figsize=(min(18.0, wide), 0.6 * sim.stages + 1.6))
    for op in sim.ops:
        width = (op.end - op.start) * scale
        light = sim.chunks > 1 and op.chunk >= sim.stages  # a later chunk: paler
        ax.barh(op.device, width, left=op.start * scale, height=0.8, color=COLOURS[op.kind],
                alpha=0.6 if light else 1.0, edgecolor="black" if op.paired else "white",
                linewidth=0.8 if op.paired else 0.5)
        if width > sim.makespan * scale / 120:
            ax.text((op.start + op.end) / 2 * scale, op.device, str(op.microbatch), ha="center", va="center",
                    fontsize=6, color="white")
    kinds = [k for k in ("F", "B", "W") if any(op.kind == k for op in sim.ops)]
    handles = [matplotlib.patches.Patch(color=COLOURS[k], label=_NAMES[k] if k != "B" or "W" in kinds
                                        else "backward") for k in kinds]
    if paired:
        handles.append(matplotlib.patches.Patch(facecolor="white", edgecolor="black", label="overlapped F&B pair"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(handles), fontsize="small")
    rows = [f"device {s}: stages {s}, {sim.stages - 1 - s}" if sim.schedule in TWO_WAY else f"stage {s}"
            for s in range(sim.stages)]
    ax.set_yticks(range(sim.stages), rows)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title or f"{sim.schedule}: p={sim.stages}, m={sim.microbatches}, "
                 f"bubble {sim.bubble_of_ideal:.1%} of ideal")
    fig.tight_layout()
    save_figure(plt, fig, path, "--schedule-plot", dpi=120)


def _unit(span: float) -> tuple[float, str]:
    for scale, unit in ((1.0, "seconds"), (1e3, "milliseconds"), (1e6, "microseconds")):
        if span * scale >= 1:
            return scale, unit
    return 1.0, "seconds"
