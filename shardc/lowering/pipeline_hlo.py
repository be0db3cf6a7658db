"""A pipelined program's compiled HLO against its plan: the permutes between stages, and every
collective of the stages' plans by kind, axes and bytes.

GPipe compiles two programs.  The forward one holds m + p - 2 collective-permutes, each
moving one microbatch's shard of the block output (the cost model's ``p2p_bytes``) from
stage s to s + 1; the backward one recomputes that and sends as many cotangents from
s + 1 back to s.  1F1B's one program is a while loop of 2(m + p - 1) ticks with one
permute down and one up in its body.

The stages' own collectives run inside those loops (and a stage's layers inside its
tick), so the HLO text holds each once per loop body that runs it, not once per run:
their counts are not compared.  Each planned collective must be in the program that runs
its phase with the same kind, axes and bytes (a microbatch's), and every collective in
the HLO must be a planned one; the backward program may also hold the forward's, which
it recomputes.
"""

from __future__ import annotations

import math
import re

from shardc.lowering.hlo import Collective, collectives
from shardc.lowering.pipeline import PipelineLowered, permutes_expected
from shardc.lowering.report import CollectiveRow, axes_text, hlo_axes, plan_row_key
from shardc.planner.ir import Op, Plan
from shardc.planner.render import step_label
from shardc.timing import local_elements

__all__ = ["gpipe_rows", "one_f_one_b_rows"]

_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_TRIPS = re.compile(r'known_trip_count\\?"?:\{\\?"?n\\?"?:\\?"?(\d+)')

Signature = tuple[Op | None, tuple[str, ...], int | None]


def gpipe_rows(lowered: PipelineLowered, fwd_text: str, bwd_text: str, parts: tuple[Plan, ...] | None = None,
               cut: tuple[str, ...] = ()) -> list[CollectiveRow]:
    """The GPipe programs' permutes, then every planned collective (``parts``: the plans the
    program was lowered from, when not ``lowered.plan`` alone)."""
    rows = _permutes(lowered, fwd_text, bwd_text)
    return rows + stage_rows(lowered, {"forward": fwd_text, "backward": bwd_text}, parts, cut)


def one_f_one_b_rows(lowered: PipelineLowered, text: str, parts: tuple[Plan, ...] | None = None,
                     cut: tuple[str, ...] = ()) -> list[CollectiveRow]:
    """The 1F1B program's loop and permutes, then every planned collective."""
    return _loop_permutes(lowered, text) + stage_rows(lowered, {"step": text}, parts, cut)


def _mesh(lowered: PipelineLowered) -> tuple[tuple[str, int], ...]:
    return tuple(lowered.namespace.PIPE_MESH_AXES.items())


def _signatures(text: str, mesh: tuple[tuple[str, int], ...], nbytes: int) -> dict[Signature, Collective]:
    """The HLO's collectives (permutes aside, checked on their own) by kind, axes and bytes."""
    return {(c.kind, hlo_axes(c), c.bytes(nbytes)): c for c in collectives(text, mesh)
            if c.kind is not None and c.axes}


def stage_rows(lowered: PipelineLowered, programs: dict[str, str], parts: tuple[Plan, ...] | None,
               cut: tuple[str, ...]) -> list[CollectiveRow]:
    """Each planned collective against the program that runs its phase ("step" runs both)."""
    mesh = _mesh(lowered)
    sizes, nbytes = dict(lowered.sizes), lowered.plan.spec.dtype.nbytes
    found = {name: _signatures(text, mesh, nbytes) for name, text in programs.items()}
    allowed: dict[str, set[Signature]] = {name: set() for name in programs}
    rows = []
    for plan in parts or (lowered.plan,):
        for phase, steps in (("forward", plan.forward), ("backward", plan.backward)):
            program = phase if phase in programs else "step"
            for step in (s for s in steps if s.is_collective):
                op, axes = plan_row_key(step, dict(mesh))
                want = int(step.volume.evaluate(sizes)) if step.volume is not None else None
                label = f"{step_label(step)} {step.src} -> {step.dst}"
                skipped = [a for a in step.axes if a in cut]
                if skipped or not axes:
                    note = (f"not run: {','.join(skipped)} cut to 1 to fit the devices (raise --devices)"
                            if skipped else "size-1 axes: nothing to move")
                    rows.append(CollectiveRow(program, label, step.op.title, axes_text(step.axes), want,
                                              "-", "-", None, not skipped, note))
                    continue
                signature: Signature = (op, axes, want)
                allowed[program].add(signature)
                if phase == "forward" and "backward" in programs:
                    allowed["backward"].add(signature)  # the backward program recomputes the forward
                hit = found[program].get(signature)
                rows.append(CollectiveRow(program, label, step.op.title, axes_text(axes), want,
                                          hit.hlo_op if hit else "-", axes_text(hit.axes) if hit else "-",
                                          want if hit else None, hit is not None,
                                          "" if hit else "no collective of its kind, axes and bytes in the HLO"))
    for name, got in found.items():
        for signature, c in got.items():
            if signature not in allowed[name]:
                rows.append(CollectiveRow(name, "", c.kind.title if c.kind else c.hlo_op, "-", None, c.hlo_op,
                                          axes_text(c.axes), signature[2], False, "not in the plan"))
    return rows


def _boundary_bytes(lowered: PipelineLowered) -> int:
    """One microbatch's shard of the block output: what a permute moves (the cost model's ``p2p_bytes``)."""
    plan, ns = lowered.plan, lowered.namespace
    boundary = next(i.ref for i in plan.tensors if i.name == ns.BLOCK_OUTPUT)
    return int(local_elements(boundary, lowered.sizes)) * plan.nbytes(boundary.name)


def _stride(lowered: PipelineLowered) -> int:
    """Device ids between neighbouring stages: the product of the axes after the stage axis."""
    mesh = _mesh(lowered)
    names = [n for n, _ in mesh]
    return math.prod(s for _, s in mesh[names.index(lowered.pipeline.axis) + 1:])


def _loop_permutes(lowered: PipelineLowered, text: str) -> list[CollectiveRow]:
    """1F1B's HLO: one permute down and one up, in a while loop of 2(m+p-1) ticks."""
    pipe, nbytes = lowered.pipeline, lowered.plan.spec.dtype.nbytes
    want_bytes, stride = _boundary_bytes(lowered), _stride(lowered)
    ticks = 2 * (pipe.microbatches + pipe.stages - 1)
    trips = [int(n) for n in _TRIPS.findall(text)]
    found = [c for c in collectives(text, _mesh(lowered)) if c.hlo_op == "collective-permute"]
    rows = [CollectiveRow("step", f"while loop of {ticks} ticks (2(m+p-1))", "Loop", pipe.axis, None,
                          f"while x {trips}", pipe.axis, None, ticks in trips,
                          "" if ticks in trips else "no loop of that trip count")]
    for step, what in ((stride, "activations s -> s+1"), (-stride, "cotangents s+1 -> s")):
        mine = [c for c in found if (pr := _pairs(c.text)) and all(t - s == step for s, t in pr)]
        ok = len(mine) == 1 and mine[0].bytes(nbytes) == want_bytes
        rows.append(CollectiveRow("step", f"ppermute_{pipe.axis} a tick: {what}, a microbatch", "CollectivePermute",
                                  pipe.axis, want_bytes, f"collective-permute x {len(mine)}", pipe.axis,
                                  sum(c.bytes(nbytes) for c in mine), ok, "" if ok else "not one of the bytes"))
    if len(found) != 2:
        rows.append(CollectiveRow("step", "", "CollectivePermute", "-", None, "collective-permute", "-", None,
                                  False, f"{len(found)} permutes in the HLO, not 2"))
    return rows


def _permutes(lowered: PipelineLowered, fwd_text: str, bwd_text: str) -> list[CollectiveRow]:
    """GPipe's HLO: m + p - 2 permutes down in the forward program, as many down and up in the backward."""
    pipe, nbytes = lowered.pipeline, lowered.plan.spec.dtype.nbytes
    want_bytes, stride = _boundary_bytes(lowered), _stride(lowered)
    want = permutes_expected(pipe.stages, pipe.microbatches)
    rows = []
    # The forward program sends activations down; the backward one recomputes that, then sends cotangents up.
    for phase, text, directions in (("forward", fwd_text, (stride,)), ("backward", bwd_text, (stride, -stride))):
        found = [c for c in collectives(text, _mesh(lowered)) if c.hlo_op == "collective-permute"]
        for step in directions:
            mine = [c for c in found if (pr := _pairs(c.text)) and all(t - s == step for s, t in pr)]
            right = sum(1 for c in mine if c.bytes(nbytes) == want_bytes)
            what = "activations s -> s+1" if step > 0 else "cotangents s+1 -> s"
            label = f"ppermute_{pipe.axis} x {want}: {what}, a microbatch each"
            ok = len(mine) == want and right == want
            note = "" if ok else f"{len(mine)} in the HLO, {right} of {want_bytes} bytes"
            rows.append(CollectiveRow(phase, label, "CollectivePermute", pipe.axis, want_bytes * want,
                                      f"collective-permute x {len(mine)}", pipe.axis,
                                      sum(c.bytes(nbytes) for c in mine), ok, note))
        stray = len(found) - sum(1 for c in found if _pairs(c.text) and
                                 all(abs(t - s) == stride for s, t in _pairs(c.text)))
        if stray:
            rows.append(CollectiveRow(phase, "", "CollectivePermute", "-", None, "collective-permute",
                                      "-", None, False, f"{stray} permutes not between neighbouring stages"))
    return rows


def _pairs(text: str) -> list[tuple[int, int]]:
    match = _PAIRS.search(text)
    if not match:
        return []
    return [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", match.group(1))]
