"""A pipelined program's compiled HLO against its plan: the loop and its permutes between stages,
and every collective of the stages' plans by kind, axes and bytes.

The program is a while loop over its schedule's tick table (2(m + p - 1) ticks for
GPipe and 1F1B; a DualPipe F&B pair one tick: :mod:`shardc.pipeline.ticks`), its trip count
the table's length, with one collective-permute down and one up in its body (a ring's each may
be cut in two; in a V, two each way: activations and cotangents both go down the stages
and back up), each moving one microbatch's shard of the block output (the cost model's
``p2p_bytes``) between neighbouring stages.

The stages' own collectives run inside that loop (and a stage's layers inside its
tick), so the HLO text holds each once per loop body that runs it, not once per run:
their counts are not compared.  Each planned collective must be in the program with
the same kind, axes and bytes (a microbatch's), and every collective in the HLO must
be a planned one.  The weight gradients' reductions run once a step on the sums of the
microbatches' partial gradients (:mod:`shardc.lowering.pipeline_grads`), as the cost
charges them: each must be in the program outside the loop's body.

A param read on both ends of the block (a tied embedding) adds one collective-permute
each way between the first and the last stage, once a step: each end's sum of its
contribution to the gradient, swapped (:mod:`shardc.lowering.pipeline_ends`); none in a V,
whose first and last virtual stage are both on stage 0.

DualPipe holds each stage on two devices, s and P-1-s: once a step, after the loop, the two
swap their sums of each weight gradient (one collective-permute a param, each device's two
chunks' partial sums; with several ``layers`` blocks one of the buffer of the device's own
layers' sums, :mod:`shardc.lowering.pipeline_params`; the ends' between stages 0 and P-1,
which both run them), as the cost's ``copies_exchange_s`` charges.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from typing import Any

from shardc.device_pieces import local_elements
from shardc.ir.plan import Op, Plan, Step, backward_program
from shardc.lowering.pipeline_grads import split_reductions
from shardc.lowering.pipeline_lowering import PipelineLowered
from shardc.pipeline.boundary import carried_refs, send_bytes
from shardc.verification.hlo import Collective, collectives
from shardc.verification.report import (
    CollectiveRow,
    axes_text,
    hlo_axes,
    planned_collective,
    ring_rows,
    unplanned_row,
)
from shardc.verification.ring_hlo import ring_sends

__all__ = ["loop_rows", "stage_rows", "outside_loop"]

_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")  # a computation's first line
_LOOP = re.compile(r"(?:body|condition)=%?([\w.\-]+)")
_CALLED = re.compile(r"(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'known_trip_count\\?"?:\{\\?"?n\\?"?:\\?"?(\d+)')

Signature = tuple[Op | None, tuple[str, ...], int | None]


def loop_rows(lowered: PipelineLowered, text: str, parts: tuple[Plan, ...] | None = None,
              cut: tuple[str, ...] = ()) -> list[CollectiveRow]:
    """The program's loop and permutes, then every planned collective (``parts``: the plans the
    program was lowered from, when not ``lowered.plan`` alone)."""
    return _loop_permutes(lowered, text, parts) + stage_rows(lowered, text, parts, cut)


def _mesh(lowered: PipelineLowered) -> tuple[tuple[str, int], ...]:
    return tuple(lowered.namespace.PIPE_MESH_AXES.items())


def _by_signature(found: list[Collective], nbytes: int) -> dict[Signature, Collective]:
    """``found`` by kind, axes and bytes, a floating element at ``nbytes``."""
    return {(c.kind, hlo_axes(c), c.bytes(nbytes)): c for c in found}


def stage_rows(lowered: PipelineLowered, text: str, parts: tuple[Plan, ...] | None,
               cut: tuple[str, ...]) -> list[CollectiveRow]:
    """Each planned collective against the program's HLO ``text`` (its floating elements at the bytes of the
    step's tensor, a `dtype T` line's), and each of its collectives against the plan."""
    mesh = _mesh(lowered)
    sizes, nbytes = dict(lowered.sizes), lowered.plan.spec.dtype.nbytes
    # the HLO's collectives (permutes aside, checked on their own), in the program and after its loop
    regions = {once: [c for c in collectives(part, mesh) if c.kind is not None and c.axes]
               for once, part in ((False, text), (True, "\n".join(outside_loop(text))))}
    priced: dict[tuple[bool, int], dict[Signature, Collective]] = {}

    def found(once: bool, size: int) -> dict[Signature, Collective]:
        if (once, size) not in priced:
            priced[once, size] = _by_signature(regions[once], size)
        return priced[once, size]

    allowed: set[tuple[int, Signature]] = set()  # each planned collective's signature, at its tensor's bytes
    rows = []
    for plan in parts or (lowered.plan,):
        split = split_reductions(plan)
        steps = [(s, False, "") for s in split.each.forward + backward_program(split.each) if s.is_collective]
        for step, once, when in steps + [(s, True, " (once a step)") for s in split.once if s.is_collective]:
            p = planned_collective("step", step, dict(mesh), sizes, cut)
            if isinstance(p, CollectiveRow):
                rows.append(p)
                continue
            size = plan.nbytes(step.tensor)
            allowed.add((size, (p.op, p.axes, p.want)))
            hit = found(once, size).get((p.op, p.axes, p.want))  # the loop runs each distinct one once in its body
            rows.append(CollectiveRow("step", p.label + when, step.op.title, axes_text(p.axes), p.want,
                                      hit.hlo_op if hit else "-", axes_text(hit.axes) if hit else "-",
                                      p.want if hit else None, hit is not None,
                                      "" if hit else f"no collective of its kind, axes and bytes in the HLO"
                                                     f"{' after the loop' if when else ''}"))
    sizes_planned = {size for size, _ in allowed}
    return rows + [unplanned_row("step", c, nbytes) for c in found(False, nbytes).values()
                   if not any((size, (c.kind, hlo_axes(c), c.bytes(size))) in allowed for size in sizes_planned)]


def outside_loop(text: str) -> list[str]:
    """The lines of a compiled module's HLO ``text`` outside its while loops' bodies (and conditions, and
    what they call): what runs once a run."""
    computations: dict[str, list[str]] = {}
    name = ""
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            name = head.group(1)
        computations.setdefault(name, []).append(line)
    inside: set[str] = set()
    pending = [n for lines in computations.values() for line in lines if " while(" in line
               for n in _LOOP.findall(line)]
    while pending:
        current = pending.pop()
        if current in inside:
            continue
        inside.add(current)
        for line in computations.get(current, []):
            pending += _CALLED.findall(line)
            pending += [n.strip().lstrip("%") for group in _BRANCHES.findall(line) for n in group.split(",")]
    return [line for n, lines in computations.items() if n not in inside for line in lines]


def _boundary_bytes(lowered: PipelineLowered) -> tuple[tuple[int, int], tuple[int, int]]:
    """One microbatch's shard of the block output: what a permute moves each way, its elements and the bytes
    of one (the activation's type on, its gradient's back: :func:`shardc.pipeline.boundary.send_bytes`, the cost
    model's ``p2p_bytes`` and its gradient's)."""
    plan, ns = lowered.plan, lowered.namespace
    boundary = next(i.ref for i in plan.tensors if i.name == ns.BLOCK_OUTPUT)
    elements = int(sum(local_elements(r, lowered.sizes) for r in (boundary, *carried_refs(plan)[1:])))  # riders
    on, back = send_bytes(plan, boundary.name)
    return (elements, on), (elements, back)


def _stride(lowered: PipelineLowered) -> int:
    """Device ids between neighbouring stages: the product of the axes after the stage axis."""
    mesh = _mesh(lowered)
    names = [n for n, _ in mesh]
    return math.prod(s for _, s in mesh[names.index(lowered.pipeline.axis) + 1:])


def _loop_permutes(lowered: PipelineLowered, text: str, parts: tuple[Plan, ...] | None = None) -> list[CollectiveRow]:
    """The HLO: one permute down and one up (a ring's each may be cut in two), in a while loop of the tick
    table's ticks; a stage's ring kernels' own permutes (ring attention over another axis) are theirs."""
    pipe, nbytes = lowered.pipeline, lowered.plan.spec.dtype.nbytes
    ways = _boundary_bytes(lowered)
    ticks = len(lowered.namespace.F_TABLE)
    trips = [int(n) for n in _TRIPS.findall(text)]
    found = [c for c in collectives(text, _mesh(lowered)) if c.hlo_op == "collective-permute"]
    tied, found = _tied_permutes(lowered, found)
    copies, found = _copies_permutes(lowered, text, found)
    tied += copies
    steps = tuple(s for plan in parts or (lowered.plan,) for s in plan.forward + plan.backward)
    sizes = {**dict(_mesh(lowered)), **lowered.sizes}
    tied += ring_rows("step", steps, found, sizes, nbytes)  # takes them, one copy
    tied += _ring_copies(steps, found, sizes, nbytes)
    rows = tied + [CollectiveRow("step", f"while loop of {ticks} ticks (the schedule's tick table)", "Loop",
                          pipe.axis, None,
                          f"while x {trips}", pipe.axis, None, ticks in trips,
                          "" if ticks in trips else "no loop of that trip count")]
    # interleaved: chunks wrap from the last stage to the first, a ring XLA may cut in two permutes
    # (its collective-permute cycle decomposer), each moving a microbatch between its own pairs; in a V
    # (zbv) activations and cotangents each go down the stages and up (shardc.lowering.pipeline_routes)
    place = lowered.namespace.PIPELINE.placement
    ring = place.chunks > 1 and not place.v_shape
    most, left, links = 2 if ring else 1, list(found), 0
    for step, what, (elements, per) in ((1, "activations", ways[0]), (-1, "cotangents", ways[1])):
        want_bytes = elements * per  # the HLO's floats priced in this direction's type, as the cost prices them
        for pairs in place.links(step):
            mine = _take(left, _device_pairs(lowered, pairs), most)
            left, links = [c for c in left if c not in mine], links + 1
            ok = bool(mine) and all(c.bytes(per) == want_bytes for c in mine)
            way = "s -> s+1" if pairs[0][1] > pairs[0][0] else "s+1 -> s"
            rows.append(CollectiveRow("step", f"ppermute_{pipe.axis} a tick: {what} {way}, a microbatch",
                                      "CollectivePermute", pipe.axis, want_bytes, f"collective-permute x {len(mine)}",
                                      pipe.axis, max((c.bytes(per) for c in mine), default=0), ok,
                                      "" if ok else "not one of the bytes"))
    if left or not links <= len(found) <= links * most:
        want = f"{links}" if most == 1 else f"{links} to {links * most}"
        rows.append(CollectiveRow("step", "", "CollectivePermute", "-", None, "collective-permute", "-", None,
                                  False, f"{len(found)} permutes in the HLO, not {want}"
                                  + (f" ({len(left)} not the stages' sends)" if left else "")))
    return rows


def _ring_copies(steps: tuple[Step, ...], found: list[Collective], sizes: dict[str, int],
                 nbytes: int) -> list[CollectiveRow]:
    """The ring kernels' permutes again in each further layer a tick runs (the loop's body holds a stage's
    layers one after another): every other permute of a ring's elements over its axes leaves ``found``,
    and must make whole copies of those kernels' sends."""
    per_copy: Counter[tuple[int, tuple[str, ...]]] = Counter()
    for sends in ring_sends(steps, sizes):
        per_copy[(sends.elements, sends.axes)] += sends.count
    rows = []
    for (elements, axes), count in per_copy.items():
        more = [c for c in found if c.hlo_op == "collective-permute" and c.elements == elements and c.axes == axes]
        if not more:
            continue
        for c in more:
            found.remove(c)
        ok = len(more) % count == 0
        rows.append(CollectiveRow("step", f"the ring kernels' sends again, each further layer of a tick: "
                                  f"{count} a layer", "CollectivePermute", axes_text(axes), elements * nbytes,
                                  f"collective-permute x {len(more)}", axes_text(axes), elements * nbytes, ok,
                                  "" if ok else f"{len(more)} is not a multiple of {count}"))
    return rows


def _device_pairs(lowered: PipelineLowered, stage_pairs: list[tuple[int, int]]) -> set[tuple[int, int]]:
    """Every device's sends of the (source, target) stage pairs, as (source, target) device ids."""
    stride, stages = _stride(lowered), lowered.pipeline.stages
    devices = math.prod(s for _, s in _mesh(lowered))
    return {(d, d + (target - source) * stride) for d in range(devices) for source, target in stage_pairs
            if d // stride % stages == source}


def _take(found: list[Collective], pairs: set[tuple[int, int]], most: int) -> list[Collective]:
    """The permutes (at most ``most``, their pairs apart) that together make exactly ``pairs``; else
    every permute within them (which fails the row)."""
    within = [c for c in found if set(_pairs(c.text)) <= pairs]
    for size in range(1, most + 1):
        for group in itertools.combinations(within, size):
            sent = [pair for c in group for pair in _pairs(c.text)]
            if len(sent) == len(set(sent)) and set(sent) == pairs:
                return list(group)
    return within


def _tied_permutes(lowered: PipelineLowered,
                   found: list[Collective]) -> tuple[list[CollectiveRow], list[Collective]]:
    """A tied param's two permutes between the end stages (each end's sum of its contribution), and the
    permutes left."""
    ends, ns = lowered.ends, lowered.namespace
    if ends is None or not ends.tied or ns.PIPELINE.placement.last_stage == 0:  # in a V both ends are on stage 0
        return [], found
    nbytes, reach = lowered.plan.spec.dtype.nbytes, _stride(lowered) * (lowered.pipeline.stages - 1)
    own = {final: partial for partial, final in getattr(ns, "PRE_FINAL_GRADS", {}).items()}
    made = {s.dst.name: s.dst for s in ends.pre.backward + ends.post.backward}
    rows, left = [], list(found)
    for param, contribution, grad in ends.tied:
        sends = ((own.get(grad, grad), reach, "first -> last"), (contribution, -reach, "last -> first"))
        for name, step, what in sends:
            want = int(local_elements(made[name], lowered.sizes)) * nbytes
            mine = [c for c in left if (pr := _pairs(c.text)) and all(t - s == step for s, t in pr)
                    and c.bytes(nbytes) == want]
            ok = len(mine) >= 1
            left = [c for c in left if c is not (mine[0] if mine else None)]
            rows.append(CollectiveRow("step", f"ppermute_{lowered.pipeline.axis} once a step: {name} (tied {param}), "
                                      f"{what}", "CollectivePermute", lowered.pipeline.axis, want,
                                      f"collective-permute x {len(mine)}", lowered.pipeline.axis,
                                      mine[0].bytes(nbytes) if mine else 0, ok, "" if ok else "not found"))
    return rows, left


def _copies_permutes(lowered: PipelineLowered, text: str,
                     found: list[Collective]) -> tuple[list[CollectiveRow], list[Collective]]:
    """DualPipe's swaps of the two copies' gradient sums, one a param, outside the loop between mirrored
    stages (s and P-1-s), each the bytes of the device's partial sums; and the permutes left."""
    ns = lowered.namespace
    if not ns.PIPELINE.placement.two_way:
        return [], found
    stride, stages, nbytes = _stride(lowered), lowered.pipeline.stages, lowered.plan.spec.dtype.nbytes
    once = {c.text for c in collectives("\n".join(outside_loop(text)), _mesh(lowered))}
    wants = _copies_wants(lowered)
    rows, left = [], list(found)
    for name, want in wants:
        mine = [c for c in left if c.text in once and (pr := _pairs(c.text)) and c.bytes(nbytes) == want
                and all((t - s) // stride == stages - 1 - 2 * (s // stride % stages) for s, t in pr)]
        left = [c for c in left if c is not (mine[0] if mine else None)]
        rows.append(CollectiveRow("step", f"ppermute_{lowered.pipeline.axis} once a step: {name}, the two copies' "
                                  "sums swapped (s <-> P-1-s)", "CollectivePermute", lowered.pipeline.axis, want,
                                  f"collective-permute x {min(len(mine), 1)}", lowered.pipeline.axis,
                                  mine[0].bytes(nbytes) if mine else 0, bool(mine),
                                  "" if mine else "not found after the loop"))
    return rows, left


def _copies_wants(lowered: PipelineLowered) -> list[tuple[str, int]]:
    """What DualPipe's two copies swap once a step, each swap's bytes: with one block its each param's sums
    of the device's two chunks; with several the device's own layers' sums, one buffer
    (:class:`~shardc.lowering.pipeline_params.Flat`); each end's params' sums."""
    ns, nbytes = lowered.namespace, lowered.plan.spec.dtype.nbytes
    ends = lowered.ends
    block = ends.block if ends is not None else lowered.plan
    blocks = [(block, ns.PARAMS, ns.GRADS)] + ([(plan, more["params"], getattr(ns, more["prefix"] + "_GRADS"))
                                                for plan, more in zip(ends.more, getattr(ns, "MORE_BLOCKS", ()),
                                                                      strict=True)] if ends is not None else [])
    sums = [{k: int(local_elements(_made(plan)[grads[k]], lowered.sizes)) for k in params}
            for plan, params, grads in blocks]
    holding = ns.PIPELINE.holding  # Flat with several blocks (Pipeline.holding), its module loads jax: not imported
    if len(ns.PIPELINE.bodies) > 1:  # several blocks: each device's own layers' sums in one buffer, swapped once
        wants = [("every block's gradient sums (one buffer: the device's own layers', as long as the fullest "
                  "device's)", holding.elements([sum(mine.values()) for mine in sums]) * nbytes)]
    else:
        wants = [(f"{grads[k]} (the block's two chunks)", n * nbytes * 2 * holding.slots.tables.slots[0])
                 for (_, _, grads), mine in zip(blocks, sums, strict=True) for k, n in mine.items()]
    if ends is not None:
        wants += [(f"{grads[k]} ({what})", int(local_elements(_made(plan)[grads[k]], lowered.sizes)) * nbytes)
                  for plan, params, grads, what in ((ends.pre, ns.PIPELINE.ends.summed(False), ns.PRE_GRADS,
                                                     "before the block"),
                                                    (ends.post, ns.PIPELINE.ends.summed(True), ns.POST_GRADS,
                                                     "after the block"))
                  for k in params]
    return wants


def _made(plan: Plan) -> dict[str, Any]:
    """The gradients a plan's backward makes, by name, as each microbatch's backward hands them on."""
    return {s.dst.name: s.dst for s in split_reductions(plan).each.backward}


def _pairs(text: str) -> list[tuple[int, int]]:
    match = _PAIRS.search(text)
    if not match:
        return []
    return [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", match.group(1))]
