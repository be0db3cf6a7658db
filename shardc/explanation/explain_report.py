"""``shardc explain``: a user's jitted jax program, its collectives and their source lines, and shardc's plan.

The program is compiled (on whatever devices jax has: emulated CPU devices are enough; nothing runs)
and read back twice: its jaxpr as a ``.shard`` spec (:mod:`shardc.explanation.jaxpr_spec`), and its
compiled HLO's collectives (:mod:`shardc.verification.hlo`), each with the tensor of its per-device
shape, its mesh axes, V in bytes, its time on the chip (shardc's collective model) and the user's
source line (the HLO's stack frame tables).  shardc then plans the spec's forward pass and the two
are put side by side, paired as ``shardc compare`` pairs them: the collectives shardc would not
need, those it does otherwise, and the forward's communication time on the chip, compiled
program's (every collective on the critical path) against the plan's.  The compiled program's
memory is XLA's own ``memory_analysis()``.  A training step (``jax.value_and_grad`` of a loss, then
an update) is read as its forward; each compiled collective's phase is its ``op_name``'s (jax names
a backward op ``transpose(jvp(...))``), and both phases are paired with shardc's forward and backward.
"""

from __future__ import annotations

import inspect
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import jax

from shardc.collectives import Layout, collective_time, share
from shardc.costmodel.cost_report import cost
from shardc.device_pieces import step_volume
from shardc.errors import ShardcError, clip
from shardc.explanation.jaxpr_spec import ProgramSpec, read_program
from shardc.explanation.sources import installed
from shardc.explanation.training import phase_of
from shardc.ir.plan import Op, Plan, Step
from shardc.ir.spec import Call, TensorRef
from shardc.ops.row_plans import FORWARD
from shardc.planner.plan_text import step_label
from shardc.planner.planner import plan as make_plan
from shardc.spec.parser import parse
from shardc.timing import plan_chip, plan_links, plan_time
from shardc.verification.compare import Row, pair_rows
from shardc.verification.hlo import collectives

__all__ = ["Collective", "Explanation", "explain", "render_explanation"]

_FRAME = re.compile(r"stack_frame_id=(\d+)")
_RESULT = re.compile(r"=\s*(\(.*?\)|\S+)\s+[a-z-]+\(")
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COMBINED = re.compile(r"(.*?/)\((.*)\)")
_WHILE = re.compile(r"while\(.*?body=%?([\w.\-]+).*?\"known_trip_count\":\{\"n\":\"(\d+)\"")


@dataclass(frozen=True)
class Collective:
    """One collective: what it moves and where the program asked for it."""

    kind: str
    tensor: str
    axes: str
    bytes: int
    seconds: float | None
    line: str = ""
    phase: str = "forward"  # forward, backward or update (a training step's optimizer)
    whole: bool = False  # an AllGather of a whole sharded tensor onto every device (a full rematerialization)
    runs: int = 1  # times a step: a loop's trip count (a scan of layers), the spec's layers for the plan's


@dataclass
class Explanation:
    origin: str
    spec: str  # the program as a .shard spec
    hardware: str
    xla: list[Collective]
    plan: list[Collective]
    xla_comm_s: float
    plan_comm_s: float
    compute_s: float  # the forward's einsum FLOPs on the chip, the same for both
    xla_memory: dict[str, int] = field(default_factory=dict)
    shardc_memory: float = 0.0  # shardc's bytes a device for a training step of the spec (its cost report)
    not_needed: list[Collective] = field(default_factory=list)  # XLA's, with no counterpart in the plan
    differently: list[Collective] = field(default_factory=list)  # the plan's, with none in XLA's
    training: bool = False  # a training step: its forward read as the spec, both phases compared

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _names(fn: Any, args: tuple[Any, ...]) -> list[str]:
    """A spec name for each array leaf of the arguments: the parameter's name and its key path."""
    try:
        params = list(inspect.signature(getattr(fn, "__wrapped__", fn)).parameters)
    except (TypeError, ValueError):
        params = []
    names: list[str] = []
    for position, arg in enumerate(args):
        base = params[position] if position < len(params) else f"arg{position}"
        for path, _ in jax.tree_util.tree_flatten_with_path(arg)[0]:
            text = re.sub(r"\W+", "_", base + jax.tree_util.keystr(path)).strip("_") or f"arg{position}"
            name = text if text[0].isalpha() else "a" + text
            while name in names:
                name += "_"
            names.append(name[:200])
    return names


def _source_lines(hlo: str) -> dict[str, str]:
    """stack_frame_id -> "file:line", from the compiled module's FileNames/FileLocations/StackFrames tables."""
    tables: dict[str, dict[str, str]] = {}
    current = None
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and (m := re.match(r"(\d+) (.*)", line)):
            current[m.group(1)] = m.group(2)
        elif not line.strip():
            current = None
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    where = {k: f"{files.get(_field(v, 'file_name_id'), '?')}:{_field(v, 'line')}"
             for k, v in tables.get("FileLocations", {}).items()}
    frames = tables.get("StackFrames", {})
    lines = {k: where.get(_field(v, "file_location_id"), "") for k, v in frames.items()}
    return {k: _own(k, frames, lines) for k in frames}


def _own(frame: str, frames: dict[str, str], lines: dict[str, str]) -> str:
    """The innermost line of a stack frame's chain outside installed packages (else its own line): a
    frame's parent is ``parent_frame_id`` - 1, 0 for none."""
    seen, k = set(), frame
    while k in frames and k not in seen and installed(lines[k]):
        seen.add(k)
        k = str(int(_field(frames[k], "parent_frame_id") or 1) - 1)
    return lines[k] if k in frames else lines[frame]


def _field(text: str, key: str) -> str:
    m = re.search(rf"\b{key}=(\d+)", text)
    return m.group(1) if m else ""


def _local(ref: TensorRef, sizes: dict[str, int]) -> tuple[int, ...]:
    return tuple(share(sizes[d.name], math.prod(sizes[a] for a in d.axes)) for d in ref.dims)


def _mesh_of(shardings: list[Any]) -> dict[str, int]:
    for s in shardings:
        mesh = getattr(s, "mesh", None)
        if mesh is not None and tuple(getattr(mesh, "axis_names", ())):
            return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    return {}


def explain(fn: Any, *args: Any, hardware: str | None = None, origin: str | None = None,
            approximate: bool = False) -> Explanation:
    """Explain a jitted function on its arguments (arrays or ``jax.ShapeDtypeStruct``s with shardings);
    ``approximate``: what the spec language cannot say (a constant inside a run of maps, a map it names no
    function for) is a note of the spec, not an error."""
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    try:
        compiled = jitted.lower(*args).compile()
    except Exception as err:  # the user's program: jax's own error, said in one line
        raise ShardcError(f"jax cannot compile the program: {type(err).__name__}: {clip(str(err), 300)}",
                          fix="run the program with jax to see the traceback") from None
    ins = list(jax.tree_util.tree_leaves(compiled.input_shardings[0]))
    leaves = jax.tree_util.tree_leaves(args)
    if len(ins) != len(leaves):  # jit leaves out the arguments the program never reads: take each one's own
        ins = [getattr(leaf, "sharding", None) for leaf in leaves]
    outs = list(jax.tree_util.tree_leaves(compiled.output_shardings))
    mesh = _mesh_of(ins + outs)
    if not mesh:
        raise ShardcError("the program's arguments and results carry no NamedSharding on a mesh",
                          fix="give the arguments shardings (jax.device_put or ShapeDtypeStruct(sharding=...))")
    origin = origin or str(getattr(fn, "__name__", "program"))
    # a result of literals alone (jnp.zeros) is put on one device (SingleDeviceSharding, no spec): replicated
    empty = next((leaf for leaf in leaves if 0 in tuple(getattr(leaf, "shape", ()))), None)
    if empty is not None:
        raise ShardcError(f"an argument of shape {tuple(empty.shape)} holds no elements: a spec's dims are at least 1",
                          fix="explain the program on arguments of the sizes it runs at")
    in_specs, out_specs = ([getattr(s, "spec", ()) for s in shardings] for shardings in (ins, outs))
    program = read_program(_jaxpr(jitted, args), in_specs, out_specs, _names(fn, args), mesh, origin,
                           approximate)
    plan = make_plan(parse(program.text, filename=f"{origin}.shard"), hardware=hardware)
    return _compare(plan, program, compiled, mesh, origin)


def _jaxpr(jitted: Any, args: tuple[Any, ...]) -> Any:
    """The program's jaxpr, traced with every argument an array (as the spec reads them)."""
    try:
        return jax.make_jaxpr(jitted)(*args)
    except Exception as err:  # static_argnums: make_jaxpr traces a static argument as an array
        raise ShardcError(f"jax cannot trace the program with its arguments as arrays: {type(err).__name__}: "
                          f"{clip(str(err), 300)}",
                          fix="bind static arguments before jit (functools.partial(fn, n=3)) and pass arrays alone"
                          ) from None


def _compare(plan: Plan, program: ProgramSpec, compiled: Any, mesh: dict[str, int], origin: str) -> Explanation:
    sizes = dict(plan.sizes or ())
    hw = plan_chip(plan)
    phases = ("forward", "backward") if program.training else ("forward",)
    links = plan_links(plan, hw, sizes)[0]  # the torus spans plan_time prices the plan's steps over
    ours = [_planned(step, phase, plan, sizes, hw, links, program.lines) for phase in phases
            for step in getattr(plan, phase) if step.is_collective and step.volume is not None]
    xla = _compiled(compiled, plan, sizes, hw, links, mesh, program)
    not_needed, differently = _unpaired(ours, xla, _partial_links(plan), set(program.tensors))
    not_needed, differently = _fused(not_needed, differently, program.parts)
    times = plan_time(plan, hw, sizes)
    comm_s = times.forward_comm_s + (times.backward_comm_s if program.training else 0.0)
    compute_s = times.forward_compute_s + (times.backward_compute_s if program.training else 0.0)
    memory = compiled.memory_analysis()
    xla_memory = {k: int(getattr(memory, f"{k}_size_in_bytes", 0)) for k in ("argument", "output", "temp")}
    return Explanation(origin, program.text, hw.name, xla, ours, math.fsum((c.seconds or 0.0) * c.runs for c in xla),
                       comm_s,
                       compute_s, xla_memory, float(cost(plan).memory.total_bytes), not_needed, differently,
                       program.training)


def _unpaired(ours: list[Collective], xla: list[Collective], linked: dict[str, set[str]], spec_tensors: set[str]
              ) -> tuple[list[Collective], list[Collective]]:
    """XLA's collectives with no counterpart in the plan, and the plan's with none in XLA's, phase by
    phase: paired as ``shardc compare`` pairs them (:func:`pair_rows`), then what is left by size (a plan
    step on a value no statement of the spec makes, cross_entropy's partial max, sum and target, or a
    gradient, has no spec tensor XLA's could be named by: whatever XLA's is named, by its per-device
    shape, is another tensor's; its kind, devices and bytes are what pair it)."""
    not_needed: list[Collective] = []
    differently: list[Collective] = []
    for phase in ("forward", "backward", "update"):
        mine, theirs = [c for c in ours if c.phase == phase], [c for c in xla if c.phase == phase]
        pairs = pair_rows([_as_row(c) for c in mine], [_as_row(c) for c in theirs])
        left = [c for c in theirs if any(m is None and t is not None and _same(c, t) for m, t in pairs)]
        unpaired = [c for c in mine if any(t is None and m is not None and _same(c, m) for m, t in pairs)]
        for c in list(unpaired):  # XLA's of no spec tensor's shape (a weight the program reshapes): by size,
            # else one finishing the same partial a reduction later or earlier than the plan's
            # (over one group of devices: XLA may name a dim's axes `m,d` where the plan says `d,m`)
            unnamed = c.tensor not in spec_tensors
            match = next((x for x in left if c.kind.startswith(x.kind) and _group(x) == _group(c) and (
                (x.tensor == "?" or unnamed) and x.bytes == c.bytes or _chained(c.tensor, x.tensor, linked))), None)
            if match is not None:
                left.remove(match)
                unpaired.remove(c)
        not_needed += left
        differently += unpaired
    return not_needed, differently


def _fused(not_needed: list[Collective], differently: list[Collective], parts: dict[str, str]
           ) -> tuple[list[Collective], list[Collective]]:
    """XLA's one collective of a fused weight or its gradient (a QKV's, gathered or reduced whole) paired
    with the plan's of its parts, one a part (the spec's contractions, one a part): same phase, kind and
    axes, their bytes its."""
    for weight in dict.fromkeys(parts.values()):
        for x in list(not_needed):
            mine = [c for c in differently if weight in (parts.get(c.tensor), parts.get(_forward_name(c.tensor)))
                    and c.phase == x.phase
                    and c.kind.startswith(x.kind) and _group(c) == _group(x)]
            if len(mine) == list(parts.values()).count(weight) and sum(c.bytes for c in mine) == x.bytes:
                not_needed.remove(x)
                differently = [c for c in differently if c not in mine]
    return not_needed, differently


def _group(c: Collective) -> frozenset[str]:
    return frozenset(c.axes.split(","))


def _partial_links(plan: Plan) -> dict[str, set[str]]:
    """Each tensor -> the tensors reductions of its partial's kind make of it, one after another: a partial
    sum stays partial through linear reductions (sum, mean), a partial maximum through maxima (a function
    that is its own statistic), so the one AllReduce may come after any of them (XLA reduces ``x.sum()``
    to a scalar on each device, then all-reduces it; the plan may all-reduce a step earlier)."""
    made: dict[str, tuple[str, str]] = {}  # result -> (argument, the kind of partial it keeps)
    for s in plan.spec.statements:
        call = s.expr
        if isinstance(call, Call) and call.over is not None and isinstance(call.arg, TensorRef) \
                and call.func in FORWARD and (FORWARD[call.func].linear or not FORWARD[call.func].named):
            made[s.result.name] = (call.arg.name, "sum" if FORWARD[call.func].linear else call.func)
    links: dict[str, set[str]] = {}
    for result, (arg, kind) in made.items():
        # up the chain while each tensor is of this kind (one not made by a reduction: an einsum's partial sum)
        while (made[arg][1] if arg in made else "sum") == kind:
            links.setdefault(arg, set()).add(result)
            if arg not in made:
                break
            arg = made[arg][0]
    return links


def _chained(mine: str, theirs: str, links: dict[str, set[str]]) -> bool:
    """Whether the plan's and XLA's collectives finish one partial, before and after reductions."""
    names = set(theirs.split("|"))
    return bool(links.get(mine, set()) & names) or any(mine in links.get(n, set()) for n in names)


def _planned(step: Step, phase: str, plan: Plan, sizes: dict[str, int], hw: Any, links: Layout,
             lines: dict[str, str]) -> Collective:
    v = int(step_volume(step, sizes))
    count = plan.spec.layer_counts()[step.block]
    layers = count if isinstance(count, int) and not step.once else 1
    return Collective(step_label(step), step.tensor, ",".join(step.axes), v,
                      collective_time(step.op, v, step.axes, plan.spec.mesh, sizes, hw, links, step.routed).seconds,
                      lines.get(step.tensor) or lines.get(_forward_name(step.tensor), ""), phase, runs=layers)


def _forward_name(gradient: str) -> str:
    """The tensor a gradient is of (``dW`` or ``d_W`` is W's), for its source line."""
    return gradient[2:] if gradient.startswith("d_") else gradient[1:]


def _compiled(compiled: Any, plan: Plan, sizes: dict[str, int], hw: Any, links: Layout, mesh: dict[str, int],
              program: ProgramSpec) -> list[Collective]:
    """The compiled module's collectives, each named by the spec's tensors of its per-device shape (a
    backward one by the plan's gradients first), its phase from its ``op_name`` (one op of a tuple
    collective XLA combined from several has the name of its own part)."""
    names: dict[str, dict[tuple[Any, ...], list[str]]] = {"forward": {}, "backward": {}}
    for phase in names:
        steps = plan.backward if phase == "backward" else ()
        refs = [r for step in steps for r in (step.dst, step.src) if r is not None]
        for ref in [*refs, *program.tensors.values()]:
            local = _local(ref, sizes)
            for key in (local, ("any order", *sorted(local))):  # XLA may hold a gradient transposed
                named = names[phase].setdefault(key, [])
                if ref.name not in named:
                    named.append(ref.name)
    # an AllGather whose result is the whole of a sharded tensor of the spec, on every device: XLA's
    # "involuntary full rematerialization" (a reshard its partitioner makes by gathering all, then slicing)
    wholes: dict[tuple[int, ...], list[str]] = {}
    for ref in program.tensors.values():
        if any(d.axes for d in ref.dims):
            wholes.setdefault(tuple(sizes[d.name] for d in ref.dims), []).append(ref.name)
    hlo = compiled.as_text()
    frames = _source_lines(hlo)
    trips = _trips(hlo)
    seen: Counter[str] = Counter()
    found = []
    for c in collectives(hlo, tuple(mesh.items())):
        k = seen[c.text]
        seen[c.text] += 1
        shapes, ops = _parts(c.text)
        shape = shapes[k] if len(shapes) > 1 and k < len(shapes) else c.shape  # a tuple's k-th part
        phase = phase_of(ops[min(k, len(ops) - 1)] if ops else "", program.training)
        v = c.bytes()  # at the program's own types
        seconds = collective_time(c.kind, v, c.axes, plan.spec.mesh, sizes, hw, links).seconds if c.kind else None
        frame = _FRAME.search(c.text)
        known = names["backward" if phase != "forward" else "forward"]
        tensor = "|".join(known.get(shape) or known.get(("any order", *sorted(shape)), []))
        whole = not tensor and c.kind is Op.ALL_GATHER and shape in wholes
        found.append(Collective(c.kind.title if c.kind else c.hlo_op, "|".join(wholes[shape]) if whole else tensor
                                or "?", ",".join(c.axes), v, seconds, frames.get(frame.group(1), "") if frame else "",
                                phase, whole, trips.get(c.text, 1)))
    return found


def _trips(hlo: str) -> dict[str, int]:
    """Each instruction of a loop body with the loop's known trip count (XLA's ``while`` of a scan):
    instruction text -> the times it runs."""
    bodies = {m.group(1): int(m.group(2)) for m in _WHILE.finditer(hlo)}
    trips: dict[str, int] = {}
    current = 1
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            current = bodies.get(line.split()[0].lstrip("%"), 1)
        elif line.strip() and current > 1:
            trips[line.strip()] = current
    return trips


def _parts(text: str) -> tuple[list[tuple[int, ...]], list[str]]:
    """A collective's result shapes (several for a tuple) and the op names of its parts, in order: XLA
    names a collective it combined from several ``prefix/(name1:name2:...)``."""
    result = _RESULT.search(text)
    shapes = [tuple(int(n) for n in dims.split(",") if n) for dims in _SHAPE.findall(result.group(1))] \
        if result else []
    found = _OP_NAME.search(text)
    name = found.group(1) if found else ""
    combined = _COMBINED.fullmatch(name)
    return shapes, [combined.group(1) + part for part in combined.group(2).split(":")] if combined else [name]


def _as_row(c: Collective) -> Row:
    return Row(c.phase, c.tensor, c.kind, c.axes, c.bytes)


def _same(c: Collective, row: Row) -> bool:
    return (c.tensor, c.kind, c.axes, c.bytes) == (row.tensor, row.kind, row.axes, row.bytes)


def _row(c: Collective) -> str:
    time = "" if c.seconds is None else f"{c.seconds * 1e6:9.2f} us"
    what = f"{c.tensor} (whole)" if c.whole else c.tensor
    time += f" x{c.runs}" if c.runs > 1 else ""
    return f"    {c.phase:<8} {c.kind:<18} {what:<14} over {c.axes or '-':<10} {c.bytes:>12,} B {time}  {c.line}"


def render_explanation(e: Explanation) -> str:
    """The spec, XLA's collectives, shardc's plan beside them, and the totals."""
    what = "the program's forward as a spec (a training step: shardc derives its backward)" if e.training \
        else "the program as a spec"
    lines = [f"# shardc explain {e.origin} (times on {e.hardware})", "", f"{what}:", ""]
    lines += ["    " + line for line in e.spec.splitlines()]
    lines += ["", f"XLA's collectives ({len(e.xla)}):"] + ([_row(c) for c in e.xla] or ["    none"])
    what = "forward and backward" if e.training else "forward"
    lines += ["", f"shardc's plan of the {what} ({len(e.plan)}):"] + ([_row(c) for c in e.plan] or ["    none"])
    lines += ["", "collectives shardc would not need:"] + ([_row(c) for c in e.not_needed] or ["    none"])
    lines += ["collectives shardc does otherwise:"] + ([_row(c) for c in e.differently] or ["    none"])
    lines += ["", f"{what} on {e.hardware}: compute {e.compute_s * 1e6:.2f} us; communication: XLA "
              f"{e.xla_comm_s * 1e6:.2f} us, shardc {e.plan_comm_s * 1e6:.2f} us",
              "XLA's memory a device (this program): " + ", ".join(f"{k} {v:,} B" for k, v in e.xla_memory.items()),
              f"shardc's memory a device (a training step of the spec: params, gradients, optimizer state, "
              f"activations kept): {e.shardc_memory:,.0f} B"]
    return "\n".join(lines) + "\n"
