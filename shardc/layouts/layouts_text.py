"""The text table and the JSON of a layout search, and the chosen layout's reason in numbers."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

from shardc.ir.spec import Mesh, MeshAxis
from shardc.layouts.rank import DIGITS, Layout, Skipped, rank_key
from shardc.units import fmt_bytes, fmt_seconds

if TYPE_CHECKING:
    from shardc.layouts.layout_search import LayoutSearch

__all__ = ["render", "to_json", "reason"]

SKIPPED_SHOWN = 8


def _name(row: Layout | Skipped) -> str:
    return os.path.basename(row.spec)


def _header(search: LayoutSearch) -> list[str]:
    o = search.options
    specs = list(dict.fromkeys([r.spec for r in search.layouts] + [s.spec for s in search.skipped]))
    return [f"layouts of {', '.join(specs)} on {search.chips} {o.hardware.name} chips "
            f"({fmt_bytes(o.hardware.hbm_bytes)} HBM each; {o.optimizer}, --save {o.save}, --recompute {o.recompute})",
            f"rank: {search.rule}"]


def _table(search: LayoutSearch, rows: tuple[Layout, ...]) -> list[str]:
    mfu = search.options.mfu
    width = max([len(_name(r)) for r in rows] + [4])
    axes = max([len(r.axes_text) for r in rows] + [4])
    at = f"  {f'at {mfu:.0%} MFU':>11}" if mfu is not None else ""
    lines = [f"  {'#':>3}  {'spec':<{width}}  {'axes':<{axes}}  {'step':>9}  {'compute':>9}  {'comm':>9}  "
             f"{'critical':>9}  {'bound':<13}{at}  {'memory':>9}  fits"]
    for i, r in enumerate(rows, 1):
        at = f"  {fmt_seconds(r.at_mfu_s):>11}" if r.at_mfu_s is not None else ""
        lines.append(f"  {i:>3}  {_name(r):<{width}}  {r.axes_text:<{axes}}  {fmt_seconds(r.step_s):>9}  "
                     f"{fmt_seconds(r.compute_s):>9}  {fmt_seconds(r.comm_s):>9}  {fmt_seconds(r.critical_s):>9}  "
                     f"{r.bound:<13}{at}  {fmt_bytes(r.memory_bytes):>9}  {'yes' if r.fits else 'no'}")
    return lines


def render(search: LayoutSearch, top: int = 0) -> str:
    """The table (the first ``top`` rows; 0: all), the skipped candidates, the choice and its reason."""
    shown = search.layouts[:top] if top else search.layouts
    lines = _header(search) + _table(search, shown)
    if len(shown) < len(search.layouts):
        lines.append(f"  ... {len(search.layouts) - len(shown)} more (--top 0 lists all)")
    if search.skipped:
        lines.append(f"skipped {len(search.skipped)} candidate(s) the spec refuses at those sizes:")
        lines += [f"  {_name(s)} {' '.join(f'{k}={v}' for k, v in s.sizes)}: {s.reason}"
                  for s in search.skipped[:SKIPPED_SHOWN]]
        if len(search.skipped) > SKIPPED_SHOWN:
            lines.append(f"  ... {len(search.skipped) - SKIPPED_SHOWN} more (--json lists all)")
    notes = sorted({n for r in shown for n in r.notes})
    if notes:
        lines.append("notes (of the rows shown):")
        lines += [f"  {n}" for n in notes]
    lines.append(reason(search))
    lines += _order(search)
    if search.optimum is not None and search.chosen is not None:
        lines.append(search.optimum.text(dict(search.chosen.sizes)[search.optimum.fsdp_axis]))
    s = search.stats
    if "templates" in s:
        lines.append(f"searched {s['candidates']:.0f} candidate(s){_orders(s)}: {s['templates']:.0f} template(s) "
                     f"planned once and re-costed at each candidate's sizes, {s['planned']:.0f} plans in all (the "
                     f"best rows planned at their own sizes), {s['recosted']:.0f} row(s) left re-costed, "
                     f"{len(search.skipped)} skipped, in {s['seconds']:.1f} s over {s['jobs']:.0f} process(es)")
    else:
        lines.append(f"searched {s['candidates']:.0f} candidate(s){_orders(s)}: {s['planned']:.0f} planned and "
                     f"costed, {s['reused']:.0f} reused (the same spec once size-1 axes are stripped), "
                     f"{len(search.skipped)} skipped, in {s['seconds']:.1f} s over {s['jobs']:.0f} process(es)")
    return "\n".join(lines) + "\n"


def _order(search: LayoutSearch) -> list[str]:
    """The chosen layout's mesh line, in the order searched, against the spec's written order, and where each
    axis lies."""
    best = search.chosen
    if best is None:
        return []
    order = tuple(name for name, _ in best.sizes)
    spec_mesh = dict(search.written).get(best.spec)
    written = order if spec_mesh is None else spec_mesh.names
    # the spec's own axes at the chosen sizes, so the line keeps their `pipeline` and `over dcn` and can be pasted
    mesh = Mesh(tuple(replace(spec_mesh.axis(name), size=size) if spec_mesh is not None else MeshAxis(name, size)
                      for name, size in best.sizes))
    same = "the spec's order" if order == written else f"reordered from the spec's {', '.join(written)}"
    return [f"chosen mesh order: {mesh} ({same})"] + [f"  {n}" for n in best.placement]


def _orders(stats: dict[str, float]) -> str:
    """What the counts hold of the mesh orders and knob settings searched, and of those a bound skipped."""
    parts = []
    if stats.get("orders"):
        parts.append(f"{stats['orders']:.0f} other mesh order(s)")
    if stats.get("orders_pruned"):
        parts.append(f"{stats['orders_pruned']:.0f} of them skipped, slower or fuller than a row that fits")
    if stats.get("pruned"):
        parts.append(f"{stats['pruned']:.0f} knob setting(s) skipped, unable to fit or slower than a row that fits")
    return f" (with {'; '.join(parts)})" if parts else ""


def _fine(x: float) -> str:
    """Seconds to 4 digits: the reason compares figures the table's 3 digits round alike."""
    return fmt_seconds(x, digits=4)


def reason(search: LayoutSearch) -> str:
    """Why the first layout is chosen, by the ranking rule's figures."""
    best = search.chosen
    if best is None:
        return "chosen: none: the spec refuses every candidate (see skipped)"
    head = f"chosen: {_name(best)} {best.axes_text}: "
    if not best.fits:
        return head + (f"no layout fits {fmt_bytes(best.hbm_bytes)} of HBM (this one needs "
                       f"{fmt_bytes(best.memory_bytes)}); it is the fastest of those that do not; "
                       + _none_fits(search.layouts))
    parts = [f"fits ({fmt_bytes(best.memory_bytes)} of {fmt_bytes(best.hbm_bytes)}) and takes "
             f"{_fine(best.step_s)} a step, {best.bound}-bound"]
    if best.at_mfu_s is not None:
        parts.append(f"{fmt_seconds(best.at_mfu_s)} at {search.options.mfu:.0%} MFU")
    faster = [r for r in search.layouts if not r.fits and r.step_s < best.step_s]
    if faster:
        parts.append(f"{len(faster)} faster layout(s) do not fit (e.g. {_name(faster[0])} {faster[0].axes_text}: "
                     f"{fmt_bytes(faster[0].memory_bytes)})")
    tied = [r for r in search.layouts[1:] if rank_key(r)[:2] == rank_key(best)[:2]]
    if tied and tied[0].split and not best.split:
        parts.append(f"{len(tied)} other layout(s) take the same step time (to {DIGITS} digits); its mesh axes lie "
                     f"on whole physical axes, as JAX lays them by default, where {_name(tied[0])} "
                     f"{tied[0].axes_text} splits one (less usable bandwidth)")
    elif tied:
        nxt = tied[0]
        parts.append(f"{len(tied)} other layout(s) take the same step time (to {DIGITS} digits); least "
                     f"critical-path communication: {_fine(best.critical_s)} vs "
                     f"{_fine(nxt.critical_s)} for {_name(nxt)} {nxt.axes_text}"
                     + (f", then memory {fmt_bytes(best.memory_bytes)} vs {fmt_bytes(nxt.memory_bytes)}"
                        if nxt.critical_s == best.critical_s else ""))
    elif len(search.layouts) > 1 and search.layouts[1].fits:
        parts.append("next: " + _versus(search.layouts[1], best, bool(search.options.knobs)))
    other = next((r for r in search.layouts[1:] if r.fits and (r.spec, r.sizes) != (best.spec, best.sizes)), None)
    if other is not None and other is not search.layouts[1] and search.options.knobs:  # the next turned a knob only
        parts.append("the best other layout: " + _versus(other, best, True))
    own = _own(search)
    if own is not None and own[1] is not best and own[1] is not search.layouts[1]:
        k, row = own
        parts.append(f"the spec's own layout is #{k}: " + _versus(row, best, True)
                     + f", compute {_fine(row.compute_s)} vs {_fine(best.compute_s)}"
                     + ("" if row.planned else " (its row re-costed, not planned at its sizes)"))
    return head + "; ".join(parts)


def _own(search: LayoutSearch) -> tuple[int, Layout] | None:
    """The best-ranked row of a spec's own layout (its written mesh sizes, no knob turned), and its rank."""
    written = dict(search.written)
    for k, row in enumerate(search.layouts, 1):
        mesh = written.get(row.spec)
        if mesh is not None and not row.knobs and dict(row.sizes) == {a.name: a.size for a in mesh.axes}:
            return k, row
    return None


# what to change where a part of a device's memory keeps the leanest layout over the HBM
_FIXES = {"activations": "recompute (--recompute, --knobs recompute)",
          "training state": "a `zero` line (--knobs zero) or host offload (--knobs offload)",
          "gathered weights": "fewer weights kept gathered (--save none) or a variant sharding them (--with)",
          "working buffers": "smaller microbatches (--knobs microbatches) or a variant sharding more (--with)"}


def _none_fits(rows: tuple[Layout, ...]) -> str:
    """Why no layout fits: the leanest layout's memory and its largest part (the kept activations, the
    training state, the weights gathered), and what would shrink that part."""
    lean = min(rows, key=lambda r: (r.memory_bytes, rank_key(r)))
    parts: dict[str, float] = {}
    for part, size in lean.memory:
        name = {"activations": "activations", "gathered": "gathered weights"}.get(part, "training state")
        if part != "host":
            parts[name] = parts.get(name, 0.0) + size
    rest = lean.memory_bytes - sum(parts.values())  # a pipeline's tick working set and gradient sums
    if rest > 0.005 * lean.memory_bytes:
        parts["working buffers"] = rest
    largest = max(parts, key=lambda k: parts[k])
    shown = ", ".join(f"{fmt_bytes(size)} {name}" for name, size in sorted(parts.items(), key=lambda kv: -kv[1]))
    fix = _FIXES[largest]
    if largest == "activations" and any(part == "state" for part, _ in lean.memory):  # a pipeline's stage
        fix += ", or smaller microbatches (--knobs microbatches)"
    over = lean.memory_bytes / lean.hbm_bytes
    times = f"{over:.2g}" if over < 10 else f"{over:.0f}"
    return (f"the leanest, {_name(lean)} {lean.axes_text}, needs {fmt_bytes(lean.memory_bytes)} ({shown}), "
            f"{times}x the HBM, most of it {largest} (fix: more chips, or {fix})")


def _versus(row: Layout, best: Layout, memory: bool) -> str:
    """``row`` against the chosen ``best``: step, bound, communication (and ``memory``), in numbers."""
    return (f"{_name(row)} {row.axes_text} at {_fine(row.step_s)} vs {_fine(best.step_s)} ({row.bound}-bound, "
            f"communication {_fine(row.comm_s)} vs {_fine(best.comm_s)}"
            + (f", memory {fmt_bytes(row.memory_bytes)} vs {fmt_bytes(best.memory_bytes)})" if memory else ")"))


def to_json(search: LayoutSearch, top: int = 0) -> dict[str, object]:
    """Strict-JSON data: the chip, the rule, the rows (ranked), skipped, chosen and why, the counts."""
    o = search.options
    shown = search.layouts[:top] if top else search.layouts
    best = search.chosen
    return {"chips": search.chips, "hardware": o.hardware.name, "hbm_bytes": o.hardware.hbm_bytes,
            "optimizer": o.optimizer, "save": o.save, "recompute": o.recompute, "mfu": o.mfu,
            "rule": search.rule, "layouts": [r.to_json() for r in shown], "more": len(search.layouts) - len(shown),
            "skipped": [s.to_json() for s in search.skipped],
            "chosen": best.to_json() if best is not None else None, "reason": reason(search),
            "x_opt": search.optimum.x_opt if search.optimum is not None else None,
            "book_optimum": search.optimum.to_json() if search.optimum is not None else None,
            "topology": _topology(o.topology), "stats": search.stats}


def _topology(topology: str | tuple[int, ...] | None) -> str | None:
    return topology if topology is None or isinstance(topology, str) else "x".join(map(str, topology))
