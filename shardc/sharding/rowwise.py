"""Planning a local step that works row by row: the input layouts worth costing, the cheapest, what
``--explain`` says of them, and the steps (local maps, per-row statistics all-reduced).

A step that reduces or looks up along one index I, each row (every other index) on its own, can run
where I is whole (gathered first) or where I is sharded over axes A, with per-row statistics
all-reduced over A.  An op family's rule (:mod:`shardc.ops.row_plans`, :mod:`shardc.ops.vocab_plans`,
:mod:`shardc.ops.route`, ...) lists its candidates (:class:`Layouts`) with these helpers, costs each with the
same objective as everything else (:meth:`CostContext.seconds`, the table of collectives), and emits the
cheapest.  The steps are local maps (``Op.ELEMENTWISE``; ``dim`` is the position of I in the frame, see
:func:`frame_of`) and AllReduces (``fn=Combine.MAX`` for a maximum).  Local maps are free in the cost
model, as every elementwise step is.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from shardc.collectives import FACTOR
from shardc.ir.localops import Combine, Row, Vocab
from shardc.ir.plan import Alternative, Choice, Op, Step, sum_formula
from shardc.sharding.layout import ZERO, Cost, Layout, Move, Value
from shardc.sharding.phase import Phase

__all__ = ["by_index", "in_order", "frame_of", "Layouts", "stats_cost", "choose", "candidates", "moved_onto", "record",
           "local_map", "all_reduce", "statistic"]


def by_index(indices: tuple[str, ...], layout: Layout) -> dict[str, tuple[str, ...]]:
    return dict(zip(indices, layout, strict=True))


def in_order(indices: tuple[str, ...], axes: dict[str, tuple[str, ...]], unreduced: tuple[str, ...] = ()) -> Value:
    """A value laid out index by index (indices absent from ``axes`` replicated)."""
    return Value(tuple(axes.get(i, ()) for i in indices), tuple(sorted(unreduced)))


def frame_of(step: Step) -> tuple[str, ...]:
    """The index order a row step computes in: its result's if that has every index, else its first operand's."""
    widest = max(len(r.indices) for r in (*step.operands, step.dst))
    return step.dst.indices if len(step.dst.indices) == widest else step.operands[0].indices


@dataclass(frozen=True)
class Layouts:
    """One candidate: the input's local value and what the plan does with it."""

    local: Value  # the input as the row function reads it (I's axes: ``axes``)
    axes: tuple[str, ...]  # the mesh axes sharding I there (statistics all-reduced over them)
    cost: Cost
    moves_in: tuple[Move, ...]
    moves_out: tuple[Move, ...]
    result: Value  # the local result
    final: Value  # the result after moves_out
    handed: bool = False  # the result handed on as made: moves_out ranks the option, its reader places them

    def describe(self, stats: int) -> str:
        reduces = (Op.ALL_REDUCE, Op.REDUCE_SCATTER)
        parts = [f"{m.op.title}_{''.join(m.axes)}" + (" of the input" if m.op in reduces else "")
                 for m in self.moves_in if m.op is not Op.SLICE]
        if self.axes and stats:
            parts.append(f"{stats} row statistic{'s' if stats > 1 else ''} AllReduce_{''.join(self.axes)}")
        parts += [f"{m.op.title}_{''.join(m.axes)}" + (" (its reader's)" if self.handed else "")
                  for m in self.moves_out if m.op is not Op.SLICE]
        return ", ".join(parts) if parts else "no communication"


def stats_cost(phase: Phase, rows: tuple[str, ...], value: Value, axes: tuple[str, ...], count: int) -> Cost:
    """``count`` AllReduces over ``axes`` of one statistic per row (rows laid out as ``value``)."""
    if not axes or not count:
        return ZERO
    volume = phase.ctx.local_bytes(rows, value)
    seconds = phase.ctx.seconds(Op.ALL_REDUCE, volume, axes) * phase.ctx.repeats  # an activation's: once a microbatch
    return (seconds * count, count, count)


def choose(options: list[Layouts], stats: int) -> tuple[Layouts, list[Layouts]]:
    """The cheapest option (ties: the first) and the distinct others, for ``--explain``."""
    best = min(options, key=lambda o: o.cost)
    seen: dict[str, Layouts] = {}
    for o in sorted(options, key=lambda o: o.cost):
        seen.setdefault(o.describe(stats), o)
    return best, list(seen.values())


def record(phase: Phase, label: str, best: Layouts, options: list[Layouts], stats: int,
           idx: tuple[str, ...], over: str) -> None:
    """A ``--explain`` entry: each way the reduction could run (``idx``: the indices of an option's
    ``local`` value, ``over`` the reduced one), and why the chosen one won; only when asked
    (:attr:`CostContext.explain`)."""
    if not phase.ctx.explain:
        return
    rows = []
    for o in options:
        vol = _volume(phase, o, stats, idx, over)
        time = o.cost[0] if phase.sized else None
        rows.append(Alternative(o.describe(stats), time, vol, o.cost[1], o is best or
                                o.describe(stats) == best.describe(stats)))
    others = [o for o in options if o.describe(stats) != best.describe(stats)]
    if not others:
        reason = "the only valid local layout"
    elif not phase.sized:
        reason = "no sizes: every dim costed at 2**20, the least time of these"
    else:
        runner = min(others, key=lambda o: o.cost)
        what = ("all-reduce row statistics rather than gather the reduced index" if best.axes and stats else
                "gather the reduced index rather than all-reduce row statistics" if stats and runner.axes else
                "fewer or smaller collectives")
        if runner.cost[0] > best.cost[0] * (1 + 1e-9):
            reason = f"least time ({best.cost[0]:.3g} s vs {runner.cost[0]:.3g} s next): {what}"
        else:
            reason = f"tie in time ({best.cost[0]:.3g} s): fewer collectives, then the first listed"
    phase.choices.append(Choice(phase.name, label, tuple(rows), reason))


def _volume(phase: Phase, o: Layouts, stats: int, idx: tuple[str, ...], over: str) -> str:
    """An option's weighted bytes: its moves', and its statistics' AllReduces (rows x 1 each, counted twice)."""
    terms = [m.volume.scale(FACTOR[m.op]) for m in (*o.moves_in, *o.moves_out) if m.volume is not None]
    if o.axes and stats:
        rows = tuple(i for i in idx if i != over)
        value = in_order(rows, by_index(idx, o.local.layout))
        terms += [phase.ctx.local_bytes(rows, value).scale(FACTOR[Op.ALL_REDUCE])] * stats
    return sum_formula(terms)


def candidates(phase: Phase, arg: str, whole: tuple[str, ...], result_idx: tuple[str, ...], target: Value | None,
               linear: bool, moved: bool = False) -> list[Value]:
    """Input layouts worth costing: held values (reduced first unless linear), the target's, and each of
    them with the indices ``whole`` gathered (a reduction's I; ``route``'s expert and token indices), and,
    where ``moved``, with their axes moved onto another index instead (an AllToAll: a sort's)."""
    idx = phase.indices[arg]
    found: dict[Value, None] = {}
    for source in phase.held[arg]:
        found[Value(source.layout, source.unreduced if linear else ())] = None
        found[Value(source.layout, ())] = None  # a linear function's partial sums also reduced first, where cheaper
    if target is not None:
        axes = by_index(result_idx, target.layout)
        found[in_order(idx, axes, target.unreduced if linear else ())] = None
    out: dict[Value, None] = {}
    for value in found:
        out[value] = None
        axes = by_index(idx, value.layout)
        if any(axes.get(i) for i in whole):
            out[in_order(idx, {**axes, **dict.fromkeys(whole, ())}, value.unreduced)] = None
            for other in (moved_onto(idx, axes, whole, value.unreduced) if moved else []):
                out[other] = None
    return list(out)


def moved_onto(idx: tuple[str, ...], axes: dict[str, tuple[str, ...]], whole: tuple[str, ...],
               unreduced: tuple[str, ...] = ()) -> list[Value]:
    """``axes`` with the axes of the indices ``whole`` moved onto each other index in turn (minor to its
    own): the layouts an AllToAll reaches with those indices whole on a device."""
    spare = tuple(a for i in whole for a in axes.get(i, ()))
    rest = {**axes, **dict.fromkeys(whole, ())}
    return [in_order(idx, {**rest, j: (*rest.get(j, ()), *spare)}, unreduced) for j in idx if j not in whole]


def local_map(phase: Phase, fn: Row | Vocab, dst: str, value: Value, operands: tuple[tuple[str, Value], ...],
              over: str, shapes: tuple[tuple[str, Value], ...] = ()) -> None:
    """One local row map; its ``dim`` is I's position in its frame (:func:`frame_of`); ``shapes``
    are read for their shape only (:class:`Step`)."""
    step = Step(Op.ELEMENTWISE, dst, phase.ref(dst, value), operands=tuple(phase.ref(n, v) for n, v in operands),
                fn=fn, shapes=tuple(phase.ref(n, v) for n, v in shapes))
    frame = frame_of(step)
    phase.emit(replace(step, dim=frame.index(over) if over in frame else None), value)


def all_reduce(phase: Phase, name: str, value: Value, axes: tuple[str, ...], combine: Combine | None) -> Value:
    """One AllReduce of a statistic (partial over ``axes``); ``combine`` None sums."""
    done = Value(value.layout, tuple(a for a in value.unreduced if a not in axes))
    volume = phase.ctx.local_bytes(phase.indices[name], value, phase.ctx.nbytes(name))
    phase.emit(Step(Op.ALL_REDUCE, name, phase.ref(name, done), phase.ref(name, value), axes,
                    fn=combine, volume=volume,
                    note="row statistic"), done)
    return done


def statistic(phase: Phase, fn: Row, name: str, rows_value: Value, axes: tuple[str, ...],
              operands: tuple[tuple[str, Value], ...], over: str, combine: Combine | None) -> Value:
    """A per-row statistic: local over this shard (partial over ``axes``), then all-reduced."""
    partial = Value(rows_value.layout, tuple(sorted(axes)))
    local_map(phase, fn, name, partial, operands, over)
    return all_reduce(phase, name, partial, axes, combine) if axes else partial
