"""Plan -> the text of a readable JAX module (no jax import here).

Each phase of the plan becomes one per-device function run under
``jax.shard_map``: every step is one line (a collective, a ``jnp.einsum``, an
elementwise call), commented with the sharded tensor it makes and its local
shape.  Values cross the phase boundary as global arrays whose
``PartitionSpec`` is the value's layout; a value unreduced over axes ``U``
travels stacked (a leading dim sharded over ``U`` holding each device's partial
sum), so the boundary never hides a reduction the plan did not make.

Gathers use ``to="invarying"``: a gathered value is the same on every device of
the gathered axes, and saying so lets ``shard_map``'s replication check (on)
accept it in replicated ``out_specs``.
"""

from __future__ import annotations

import builtins
import dataclasses
import keyword
import math
import string
from dataclasses import dataclass

from shardc.collectives import share
from shardc.errors import InternalError
from shardc.ir.localops import Combine, Update
from shardc.ir.plan import Op, Plan, Step, backward_program, unfused
from shardc.ir.precision import ARRAY_DTYPE, Precision
from shardc.ir.spec import Mesh, TensorRef
from shardc.lowering import template
from shardc.lowering.partition_specs import axes_entry
from shardc.lowering.sizes import small_sizes
from shardc.ops.registry import Namer, of_step
from shardc.ops.text import aligned_text
from shardc.pipeline.backward_split import step_reads, value_key
from shardc.quantize import step_gemm

__all__ = ["Boundary", "Phase", "Module", "generate", "local_shape_text"]

_LETTERS = string.ascii_lowercase + string.ascii_uppercase
# Names a tensor's variable must not take whatever the module: keywords, builtins (``__debug__``
# cannot even be assigned) and the skeleton's own locals.  The module's globals are reserved
# from the module itself (:func:`generate`).
_RESERVED = frozenset(keyword.kwlist) | frozenset(keyword.softkwlist) | frozenset(dir(builtins)) | frozenset(
    template.LOCALS)
_COMMENT_COLUMN = 80  # code wider than this pushes only its own comment right


@dataclass(frozen=True)
class Boundary:
    """A value entering or leaving a phase: its dict key, variable and sharded ref."""

    key: str
    var: str
    ref: TensorRef

    @property
    def stacked(self) -> bool:
        return bool(self.ref.unreduced)


@dataclass(frozen=True)
class Phase:
    name: str
    inputs: tuple[Boundary, ...]
    outputs: tuple[Boundary, ...]
    body: tuple[str, ...]


@dataclass(frozen=True)
class Module:
    source: str
    mesh: tuple[tuple[str, int], ...]
    sizes: dict[str, int] | None  # dims and mesh sizes, when known
    forward: Phase
    backward: Phase
    results: tuple[str, ...]  # forward() keys: every statement's result
    cotangents: dict[str, str]  # the gradient of an output (d<Out>) -> the output
    grads: dict[str, str]  # input or param name -> its gradient's name
    optimizer: Phase | None = None  # ZeRO-1/2's optimizer phase (shardc.lowering.optimizer)
    variables: frozenset[str] = frozenset()  # the names the phase functions give the tensors


def local_shape_text(ref: TensorRef, sizes: dict[str, int] | None) -> str:
    """``[B/X, D]``, and ``= [2, 8]`` once sizes are known."""
    parts = [d.name + ("/" + "".join(d.axes) if d.axes and all(len(a) == 1 for a in d.axes)
                       else "/(" + "*".join(d.axes) + ")" if d.axes else "") for d in ref.dims]
    text = "[" + ", ".join(parts) + "]"
    if sizes is not None and all(d.name in sizes for d in ref.dims):
        nums = [str(share(sizes[d.name], math.prod(sizes.get(a, 1) for a in d.axes))) for d in ref.dims]
        text += " = [" + ", ".join(nums) + "]"
    return text


class _Namer:
    """One Python name per value, shared by both phases so residuals keep theirs."""

    def __init__(self, declared: dict[str, TensorRef], reserved: frozenset[str]) -> None:
        self.declared = declared
        self.names: dict[TensorRef, str] = {}
        self.used: set[str] = set(_RESERVED | reserved)
        self.counts: dict[str, int] = {}

    def __call__(self, ref: TensorRef) -> str:
        key = value_key(ref)
        if key in self.names:
            return self.names[key]
        # a tensor's own name goes to its declared value, or to its first value if none is declared
        own = value_key(self.declared.get(ref.name, key)) == key
        base = _identifier(ref.name)
        name = base if own and base not in self.used and not base.startswith("__") else ""
        while not name or name in self.used:
            self.counts[base] = self.counts.get(base, 0) + 1
            name = f"{base}_{self.counts[base]}"
        self.used.add(name)
        self.names[key] = name
        return name


def _identifier(name: str) -> str:
    """``name`` as a Python identifier: a tensor name made in Python may be anything."""
    text = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in name)
    return text if text.isidentifier() else "t_" + text


def _check_einsum(step: Step, number: int, phase: str) -> None:
    """The planner's promise for a local einsum: every index sharded alike wherever it appears."""
    layouts: dict[str, tuple[str, ...]] = {}
    for ref in step.operands:
        for d in ref.dims:
            if layouts.setdefault(d.name, d.axes) != d.axes:
                raise InternalError(f"{phase} step {number} ({step.dst}): index {d.name} is sharded "
                                  f"differently in the operands of a local einsum",
                                  fix="this is a planner bug: report the spec")
    for d in step.dst.dims:
        if d.name in layouts and layouts[d.name] != d.axes:
            raise InternalError(f"{phase} step {number} ({step.dst}): result index {d.name} is not "
                              f"sharded like its operands", fix="this is a planner bug: report the spec")


class _Quantized:
    """The names of a GEMM's operands cast to its ``gemm`` type as it reads them (``gemm_input``)."""

    def __init__(self, var: _Namer, kind: str) -> None:
        self.var, self.kind = var, kind

    def __call__(self, ref: TensorRef) -> str:
        return f"gemm_input({self.var(ref)}, {self.kind!r})"


def _operand_names(step: Step, var: _Namer, precision: Precision) -> Namer:
    """How a step names its operands: a GEMM a ``gemm`` line names reads them cast to its type
    (:func:`shardc.quantize.step_gemm`, the type cost prices it in), forward, Dgrad and Wgrad alike."""
    kind = step_gemm(step, precision)
    return var if kind is None else _Quantized(var, ARRAY_DTYPE[kind])


def _step_code(step: Step, var: Namer, sizes: dict[str, int] | None = None) -> str:
    """One step as one line of Python (without the comment)."""
    src = var(step.src) if step.src is not None else ""
    axes = axes_entry(step.axes) if step.axes else ""
    call = step.op.info.jax_call
    if step.op is Op.ALL_GATHER and step.dim is None:
        return f"gather_dims({src}, {_gathered_groups(step)})"
    if step.op is Op.ALL_GATHER:
        return f"{call}({src}, {axes}, axis={step.dim}, tiled=True, to='invarying')"
    if step.op is Op.REDUCE_SCATTER:
        return f"{call}({src}, {axes}, scatter_dimension={step.dim}, tiled=True)"
    if step.op is Op.ALL_REDUCE:
        return f"{'jax.lax.pmax' if step.fn is Combine.MAX else call}({src}, {axes})"
    if step.op is Op.ALL_TO_ALL:
        return (f"{call}({src}, {axes}, split_axis={step.dim}, "
                f"concat_axis={step.dim2}, tiled=True)")
    if step.op is Op.SLICE:
        return f"shard_slice({src}, {axes}, dim={step.dim})"
    family = of_step(step)
    if family is not None:
        return family.emit(step, var, sizes)
    return _elementwise_code(step, var)


def _gathered_groups(step: Step) -> str:
    """``((dim, axes), ...)`` of an AllGather of several dims: the suffix each dim loses."""
    assert step.src is not None
    groups = [(d, have[len(want):]) for d, (have, want) in enumerate(zip(step.src.layout, step.dst.layout,
                                                                        strict=True)) if have != want]
    return "(" + ", ".join(f"({d}, {axes!r})" for d, axes in groups) + ",)"


def _elementwise_code(step: Step, var: Namer) -> str:
    fn = step.fn
    args = [aligned_text(var(ref), ref.indices, step.dst.indices) for ref in step.operands]
    if isinstance(fn, Update):  # the optimizer's step, lowered as plain SGD (shardc.lowering.optimizer)
        return f"{args[0]} - LEARNING_RATE * {args[1]}"
    raise InternalError(f"lowering does not know the local operation {fn} of {step.dst}",
                        fix="this is a shardc bug: please report the spec")


def _body(phase: str, steps: tuple[Step, ...], ready: set[TensorRef], var: _Namer,
          sizes: dict[str, int] | None, precision: Precision) -> tuple[list[str], set[TensorRef]]:
    """The lines of one phase; ``ready`` holds the values available at its start; ``precision`` the
    plan's types (a ``gemm`` line's GEMMs cast their operands)."""
    lines: list[tuple[str, str]] = []
    made = set(ready)
    for number, step in enumerate(steps, 1):
        for ref in step_reads(step):
            if ref not in made:
                raise InternalError(f"{phase} step {number} ({step.op.title} -> {step.dst}) reads "
                                  f"{ref}, which no earlier step makes",
                                  fix="this is a planner bug: report the spec")
        for part in unfused(step):  # a collective matmul: its einsum as the planner made it
            if part.op in (Op.EINSUM, Op.COPY):
                _check_einsum(part, number, phase)
        code = f"{var(step.dst)} = {_step_code(step, _operand_names(step, var, precision), sizes)}"
        lines.append((code, template.comment(f"{step.dst}  {local_shape_text(step.dst, sizes)}")))
        made.add(value_key(step.dst))
    width = min(max((len(code) for code, _ in lines), default=0), _COMMENT_COLUMN)
    return [f"{code.ljust(width)}  {comment}" for code, comment in lines], made


def _external_reads(steps: tuple[Step, ...]) -> list[TensorRef]:
    """Values a phase reads before (or without) making them, in first-read order."""
    made: set[TensorRef] = set()
    external: list[TensorRef] = []
    for step in steps:
        for ref in step_reads(step):
            if ref not in made and ref not in external:
                external.append(ref)
        made.add(value_key(step.dst))
    return external


def _declared(plan: Plan) -> dict[str, TensorRef]:
    refs = {info.name: value_key(info.ref) for info in plan.tensors}
    refs.update({r.name: value_key(r) for r in plan.cotangents + plan.grads})
    return refs


def _forward_phase(plan: Plan, var: _Namer, sizes: dict[str, int] | None,
                   needed: list[TensorRef]) -> tuple[Phase, tuple[str, ...]]:
    entry = [info for info in plan.tensors if info.role in ("input", "param")]
    ready = {value_key(info.ref) for info in entry}
    lines, made = _body("forward", plan.forward, ready, var, sizes, plan.precision)
    results = [info for info in plan.tensors if info.role not in ("input", "param")]
    outputs = [Boundary(info.name, var(info.ref), value_key(info.ref)) for info in results]
    for info in results:
        if value_key(info.ref) not in made:
            raise InternalError(f"the forward never makes {info.ref}, the result the spec declares",
                              fix="this is a planner bug: report the spec")
    kept = {b.ref for b in outputs} | ready
    outputs += [Boundary(var(r), var(r), r) for r in needed if r not in kept and r in made]
    inputs = tuple(Boundary(info.name, var(info.ref), value_key(info.ref)) for info in entry)
    return Phase("forward", inputs, tuple(outputs), tuple(lines)), tuple(info.name for info in results)


def _backward_phase(plan: Plan, var: _Namer, sizes: dict[str, int] | None,
                    forward: Phase, external: list[TensorRef]) -> Phase:
    """The backward phase: the recomputed forward steps, then the backward's (:func:`backward_program`)."""
    inputs = {b.ref: b for b in forward.inputs}
    inputs.update({b.ref: b for b in forward.outputs})
    inputs.update({value_key(c): Boundary(c.name, var(c), value_key(c)) for c in plan.cotangents})
    missing = [r for r in external if r not in inputs]
    if missing:
        raise InternalError(f"the backward reads {missing[0]}, which neither the forward nor the "
                          "inputs, residuals or cotangents provide",
                          fix="this is a planner bug: report the spec")
    used = [inputs[r] for r in external]
    used += [inputs[value_key(c)] for c in plan.cotangents if inputs[value_key(c)] not in used]
    lines, made = _body("backward", backward_program(plan), {b.ref for b in used}, var, sizes, plan.precision)
    for g in plan.grads:
        if value_key(g) not in made:
            raise InternalError(f"the backward never makes {g}", fix="this is a planner bug: report the spec")
    outputs = tuple(Boundary(g.name, var(g), value_key(g)) for g in plan.grads)
    return Phase("backward", tuple(used), outputs, tuple(lines))


def generate(plan: Plan, mesh: tuple[tuple[str, int], ...], sizes: dict[str, int] | None,
             title: str = "", zero: Plan | None = None, reserved: frozenset[str] = frozenset(),
             offload: str = "none") -> Module:
    """The module for ``plan`` on ``mesh`` (axis sizes may differ from the spec's); with ``zero``, a
    ZeRO-1/2 plan of the same spec, also its optimizer phase (``optimizer_step``); ``offload``: what the
    host's memory holds (the residuals, the optimizer phase's arguments and results, or both).

    No tensor's variable takes a name the module defines at its top level: those are read
    from the module written (:func:`shardc.lowering.template.defined_names`), and should a
    variable have taken one, the module is written again with them ``reserved`` (its
    globals do not depend on the variables' names, so once is enough)."""
    var = _Namer(_declared(plan), reserved)
    external = _external_reads(backward_program(plan))
    forward, results = _forward_phase(plan, var, sizes, external)
    backward = _backward_phase(plan, var, sizes, forward, external)
    cotangents = {c.name: plan.primal(c.name) for c in plan.cotangents}
    grads = {plan.primal(g.name): g.name for g in plan.grads}
    demo = small_sizes(_with_mesh(plan, mesh), devices=None)
    optimizer = _optimizer_phase(zero, var, sizes) if zero is not None and zero.optimizer else None
    section = (str(zero.spec.zero), optimizer) if zero is not None and optimizer is not None else None
    source = template.render(plan, title, mesh, demo, forward, backward, results, cotangents, grads, section,
                             offload)
    variables = frozenset(var.names.values())
    defined = template.defined_names(source)
    if variables & defined:
        return generate(plan, mesh, sizes, title, zero, reserved | defined, offload)
    return Module(source, mesh, sizes, forward, backward, results, cotangents, grads, optimizer, variables)


def _optimizer_phase(zero: Plan, var: _Namer, sizes: dict[str, int] | None) -> Phase:
    """The ZeRO plan's optimizer phase: params and gradients in, the updated params out."""
    external = _external_reads(zero.optimizer)
    inputs = tuple(Boundary(ref.name, var(ref), ref) for ref in external)
    lines, made = _body("optimizer", zero.optimizer, set(external), var, sizes, zero.precision)
    updated = dict.fromkeys(s.tensor for s in zero.optimizer if s.op is Op.ELEMENTWISE)
    outputs = []
    for name in updated:
        ref = value_key(zero.tensor(name).ref)
        if ref not in made:
            raise InternalError(f"the optimizer phase never gathers {ref} back",
                                fix="this is a planner bug: report the spec")
        outputs.append(Boundary(name, var(ref), ref))  # its last line rebinds the param's variable
    return Phase("optimizer", inputs, tuple(outputs), tuple(lines))


def _with_mesh(plan: Plan, mesh: tuple[tuple[str, int], ...]) -> Plan:
    axes = tuple(dataclasses.replace(a, size=dict(mesh)[a.name]) for a in plan.spec.mesh.axes)
    spec = dataclasses.replace(plan.spec, mesh=Mesh(axes))
    return dataclasses.replace(plan, spec=spec)
