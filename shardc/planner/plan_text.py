"""Plans as text (the book's notation, one numbered line a step) and as JSON data."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardc.collectives import FACTOR
from shardc.device_pieces import step_volume
from shardc.ir.localops import ALIAS
from shardc.ir.plan import Monomial, Op, Plan, Step, sum_formula, unfused
from shardc.names import book_name
from shardc.spec.stages import pipeline_note
from shardc.timing import plan_time
from shardc.units import fmt_bytes, fmt_seconds

__all__ = ["render_text", "render_explain", "to_json", "sum_formula", "phase_total", "step_label"]


def phase_total(steps: Sequence[Step]) -> tuple[str, float | None, list[Monomial]]:
    """Weighted volume of a phase: the formula and, with sizes, nothing numeric here."""
    terms = [w for s in steps for part in unfused(s) if (w := part.weighted_volume()) is not None]
    return sum_formula(terms), None, terms


def step_label(step: Step) -> str:
    if step.collective is not None:  # a collective matmul: the einsum and the collective it runs as a ring
        return "+".join(step_label(s) for s in unfused(step))
    if step.op in (Op.EINSUM, Op.COPY):
        return step.op.title
    if step.op is Op.ELEMENTWISE:
        return f"Map {step.fn}"
    suffix = "".join(step.axes) if all(len(a) == 1 for a in step.axes) else "{" + ",".join(step.axes) + "}"
    return f"{step.op.title}_{suffix}"


def _bytes_number(step: Step, sizes: dict[str, int] | None) -> str:
    if step.volume is None or sizes is None:
        return ""
    return " = " + fmt_bytes(step_volume(step, sizes))


def _step_line(k: int, step: Step, sizes: dict[str, int] | None) -> str:
    label = step_label(step)
    if step.op in (Op.EINSUM, Op.COPY, Op.ELEMENTWISE):
        joiner = ", " if step.op is Op.ELEMENTWISE else " · "
        body = f"{step.dst} = " + joiner.join(str(o) for o in step.operands)
        if step.shapes:  # read for the shape only: no data, no residual
            body += f"; the shape of {', '.join(str(o) for o in step.shapes)}"
        if step.collective is not None:
            c = step.collective
            body = f"{body:<44} {c.volume} bytes{_bytes_number(c, sizes)}    (collective matmul over " \
                   f"{''.join(c.axes)}: a ring of sends under its block matmuls)"
        return f"{k:3d}  {label:<17} {body}"
    body = f"{step.src} -> {step.dst}"
    if step.volume is None:
        return f"{k:3d}  {label:<17} {body}   (free)"
    when = "(ahead of time)" if step.ahead else "(critical path)"
    volume = f"{step.volume} bytes{_bytes_number(step, sizes)}"
    return f"{k:3d}  {label:<17} {body:<44} {volume:<28} {when}"


def _region_mark(step: Step) -> str:
    """A step outside every ``layers`` block, or in a block after the first, says so."""
    if step.once:
        return "   [once: outside the layers block]"
    return f"   [layers block {step.block + 1}]" if step.block else ""


def _phase_lines(title: str, steps: Sequence[Step], sizes: dict[str, int] | None) -> list[str]:
    lines = [title]
    k = 0
    for step in steps:
        if step.fn == ALIAS:  # a new name for the same array (a rename, a sum's cotangent): not a step
            lines.append(f"     {'= alias':<17} {step.dst} is {step.operands[0]}   (no data moved)")
            continue
        k += 1
        lines.append(_step_line(k, step, sizes) + _region_mark(step))
    formula, _, terms = phase_total(steps)
    total = f"       total {formula} bytes"
    if sizes is not None:
        total += " = " + fmt_bytes(_phase_bytes(steps, sizes))
    lines.append(total + "   (AllReduce counted twice, AllToAll a quarter)")
    return lines


def _phase_bytes(steps: Sequence[Step], sizes: dict[str, int]) -> float:
    """Weighted bytes of a phase at the padded sizes (what ``shardc cost`` counts)."""
    return sum(step_volume(p, sizes) * float(FACTOR[p.op]) for s in steps for p in unfused(s) if p.volume is not None)


def _time_line(plan: Plan) -> str:
    t = plan_time(plan)
    opt = f", optimizer {fmt_seconds(t.optimizer_s)}" if plan.optimizer else ""
    opt += f", update {fmt_seconds(t.update_s)}" if t.update_s else ""
    where = plan.hardware + ("" if plan.topology is None else " " + "x".join(map(str, plan.topology)))
    return (f"# step time on {where}: {fmt_seconds(t.step_s)} (forward {fmt_seconds(t.forward_s)}, backward "
            f"{fmt_seconds(t.backward_s)}{opt}), as `shardc cost` reports it")


def render_text(plan: Plan) -> str:
    sizes = plan.size_map
    if plan.strategy == "search":
        how = f"by least step time on {plan.hardware}"
    elif sizes is not None:
        how = "by the book's rules (no cheaper in total than the search)"
    else:
        how = "by the book's rules (no dims)"
    lines = [f"# {plan.spec.filename or 'spec'}: {plan.spec.mesh}; collectives chosen {how}"]
    note = pipeline_note(plan.spec)
    lines += note
    if sizes is not None and not note:  # a pipeline's step is the schedule's: `shardc cost` gives it
        lines.append(_time_line(plan))
    lines += [f"# note: {n}" for n in plan.notes]
    if plan.spec.tensor_dtypes:  # mixed precision: say which tensors are not of the spec's type
        lines.append(f"# dtype {plan.spec.dtype}; " + "; ".join(plan.spec.dtype_lines()) + " (each with its "
                     "gradient; an einsum runs at the fp8 rate only where both operands are f8)")
    lines += _phase_lines("forward", plan.forward, sizes)
    lines.append("")
    lines += _phase_lines(f"backward (save={plan.save})", plan.backward, sizes)
    if plan.residuals:
        lines.append("       residuals kept from the forward: " + ", ".join(str(r) for r in plan.residuals))
    if plan.recomputed:
        line = f", the spec's `recompute {', '.join(plan.spec.recompute)}`" if plan.spec.recompute else ""
        lines.append(f"       recomputed in the backward (--recompute {plan.recompute}{line}): "
                     + ", ".join(dict.fromkeys(s.tensor for s in plan.recomputed)))
    if plan.optimizer:
        lines.append("")
        how = ("gradients reduce-scattered onto the optimizer state's shard" if plan.spec.zero is not None
               and plan.spec.zero.stage == 1 else "gradients made on the shard by the backward")
        lines += _phase_lines(f"optimizer ({plan.spec.zero}: {how}, each shard updated, the updated params "
                              "all-gathered)", plan.optimizer, sizes)
    renamed = [(plan.primal(g.name), g.name) for g in plan.cotangents + plan.grads
               if g.name != book_name(plan.primal(g.name))]
    if renamed:  # the book's dX names a tensor of the spec: say what the gradient is called instead
        lines.append("       gradient names: " + ", ".join(
            f"{grad} is the gradient of {primal} ({book_name(primal)} is a tensor of the spec)"
            for primal, grad in renamed))
    return "\n".join(lines) + "\n"


def render_explain(plan: Plan) -> str:
    lines = ["", "choices"]
    if plan.memory_choices:  # memory changed the choice, or nothing fits: the fastest beside the other
        lines += ["  [memory] the step time as the planner times it, the memory a device as `shardc cost` "
                  "counts it"]
        lines += [f"    {'*' if c.chosen else ' '} {fmt_seconds(c.step_s):>10}  {fmt_bytes(c.memory_bytes):>9}  "
                  f"{c.label}" for c in plan.memory_choices]
    for choice in plan.choices:
        lines.append(f"  [{choice.phase}] {choice.statement}")
        for alt in choice.alternatives:
            mark = "*" if alt.chosen else " "
            time = f"{alt.time * 1e6:10.2f} us" if alt.time is not None else "            "
            lines.append(f"    {mark} {time}  {alt.collectives} coll.  {alt.description}   [{alt.volume}]")
        lines.append(f"      why: {choice.reason}")
    return "\n".join(lines) + "\n"


def step_json(step: Step, sizes: dict[str, int] | None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "op": step.op.value,
        "tensor": step.tensor,
        "axes": list(step.axes),
        "src": str(step.src) if step.src is not None else None,
        "dst": str(step.dst),
        "bytes": None,
        "bytes_expr": str(step.volume) if step.volume is not None else None,
        "ahead": step.ahead,
    }
    if step.volume is not None and sizes is not None:
        data["bytes"] = int(step_volume(step, sizes))
    if step.operands:
        data["operands"] = [str(o) for o in step.operands]
    if step.shapes:
        data["shapes"] = [str(o) for o in step.shapes]
    if step.dim is not None:
        data["dim"] = step.dim
    if step.dim2 is not None:
        data["dim2"] = step.dim2
    if step.fn is not None:
        data["fn"] = str(step.fn)  # as listed: the operation's parameters rendered
    if step.collective is not None:  # a collective matmul: the collective it runs as a ring of sends
        data["collective"] = step_json(step.collective, sizes)
    if step.once:
        data["once"] = True  # outside a `layers L { ... }` block: runs once, not once a layer
    elif step.block:
        data["block"] = step.block  # in the `layers` block after the first this many: its layers a step
    return data


def to_json(plan: Plan) -> dict[str, Any]:
    sizes = plan.size_map
    totals = {}
    for name, steps in (("forward", plan.forward), ("backward", plan.backward), ("optimizer", plan.optimizer)):
        formula, _, terms = phase_total(steps)
        value = int(_phase_bytes(steps, sizes)) if sizes is not None else None
        totals[name] = {"bytes_expr": formula, "bytes": value}
    topology = None if plan.topology is None else "x".join(map(str, plan.topology))  # None: the chip's usual
    timing: dict[str, Any] = {"hardware": plan.hardware, "topology": topology, "notes": list(plan.notes)}
    if sizes is not None:
        t = plan_time(plan)
        timing.update(step_s=t.step_s, forward_s=t.forward_s, backward_s=t.backward_s, optimizer_s=t.optimizer_s,
                      comm_s=t.comm_s)
        if t.reduce.comm_s:  # a pipeline's, once a step: what of them the last microbatch's backward leaves
            timing.update(grad_reduce_s=t.reduce.seconds, grad_reduce_exposed_s=t.reduce_exposed_s)
    return timing | {
        "forward": [step_json(s, sizes) for s in plan.forward],
        "backward": [step_json(s, sizes) for s in plan.backward],
        "optimizer": [step_json(s, sizes) for s in plan.optimizer],
        "zero": None if plan.spec.zero is None else {"stage": plan.spec.zero.stage, "axes": list(plan.spec.zero.axes)},
        "recompute": plan.recompute,
        "recomputed": [step_json(s, sizes) for s in plan.recomputed],
        "save": plan.save,
        "strategy": plan.strategy,
        "totals": totals,
        "residuals": [str(r) for r in plan.residuals],
        "grads": [str(g) for g in plan.grads],
        "cotangents": [str(c) for c in plan.cotangents],
        "gradient_names": {plan.primal(g.name): g.name for g in plan.cotangents + plan.grads},
    } | ({"dtypes": {t: str(kind) for t, kind in plan.dtypes}} if plan.dtypes else {})
