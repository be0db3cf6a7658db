"""A program read from its jaxpr, written as a ``.shard`` spec: its dims named, its statements (a scan's
inside a ``layers`` block), its head (mesh, dims, dtype, params).

:class:`Reading` is what the reader (:mod:`shardc.explanation.jaxpr_spec`) finds and this module writes:
the tensors' dims and shardings, the statements in order.  A dim's name is the user's ``jnp.einsum``
letter where it has one, else the next letter of ``_LETTERS`` not taken by a mesh axis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardc.errors import ShardcError
from shardc.explanation.dim_classes import DimClasses
from shardc.explanation.fresh import Made
from shardc.explanation.sources import comment
from shardc.explanation.training import TrainingStep
from shardc.ir.spec import Call, Dim, TensorRef
from shardc.ops.rotary import THETA

__all__ = ["Made", "ProgramSpec", "Reading", "Statement", "render"]

_LETTERS = "BSTDFNHEVKGCRMPQUIJLOAZ"
# JAX's float types as a spec writes them; both FP8 formats are one byte, the spec's `f8`
_DTYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "float8_e4m3fn": "f8", "float8_e5m2": "f8"}


@dataclass
class Statement:
    kind: str  # "dot", "mul", "fn", "sum", "reduce", "norm" (softmax), "copy", "embed", "loss" (cross_entropy),
    # "route" (an MoE router's one-hot mask), "dispatch" and "combine" (its index-based moves), "causal"
    result: Any
    operands: tuple[Any, ...]
    fn: str = ""  # the function (fn) or reduction (reduce)
    signs: tuple[int, ...] = ()
    over: int = -1  # the reduced dim id
    line: str = ""
    names: tuple[int, ...] = ()  # a routing's token and capacity dim ids, a causal mask's query and key
    number: int = 0  # a routing's k, a causal mask's sliding window
    value: float | None = None  # a function's number: a scale's or a shift's (explanation.affine_runs)


@dataclass
class ProgramSpec:
    """The spec text, and where each tensor came from."""

    text: str
    tensors: dict[str, TensorRef]  # name -> declared sharding
    lines: dict[str, str] = field(default_factory=dict)  # tensor -> "file:line" of the op that made it
    notes: list[str] = field(default_factory=list)
    training: bool = False  # the program is a training step: the spec is its forward
    parts: dict[str, str] = field(default_factory=dict)  # a fused weight's part -> the weight (a QKV's)


class Reading(DimClasses):
    """The tensors, their dims and shardings, and the statements found so far."""

    def __init__(self, mesh: dict[str, int], approximate: bool = False) -> None:
        super().__init__(mesh)
        self.approximate = approximate  # a constant the language cannot say: a note, not an error (constants.py)
        self.dims: dict[Any, list[int]] = {}
        self.names: dict[Any, str] = {}
        self.axes: dict[Any, dict[int, tuple[str, ...]]] = {}  # tensor -> dim id or atom -> axes
        self.statements: list[Statement] = []
        self.hints: dict[int, str] = {}  # dim id -> the letter the user's einsum equation gave it
        self.ids: set[Any] = set()  # token ids of lookups and losses (no gradient, implied by the language)
        self.step = TrainingStep([])  # a training step's backward and update, which the spec leaves out
        self.stacked: set[int] = set()  # a scan's layers dim of its stacked weights (left out of the spec)
        self.blocks: list[tuple[int, int, int]] = []  # each scan's statements [start, end) and its length
        self.layer_inputs: tuple[list[Any], list[Any]] = ([], [])  # a scan's stacked weights, and its consts
        self.carries: set[Any] = set()  # a scan's carry outs (in its carry in's layout, the next layer's input)
        self.notes: list[str] = []  # where the spec is the program's nearest equivalent, what differs
        self.fused_parts: dict[str, str] = {}  # a fused weight's parts, each a tensor of the spec -> the weight
        self.unreadable: dict[Any, tuple[str, str]] = {}  # arrays no tensor of the spec holds -> (why, fix)
        self.scalars: dict[Any, tuple[Any, ...]] = {}  # a run of maps -> its scalar constants (explanation.constants)
        self.runs: dict[Any, tuple[Any, ...]] = {}  # a run of maps -> its equations in order (explanation.affine_runs)
        self.customs: dict[Any, Any] = {}  # a custom function's result (relu's, logaddexp's) -> its call equation

    def dims_of(self, var: Any) -> list[int]:
        if var not in self.dims:
            self.dims[var] = [self.new(int(n)) for n in var.aval.shape]
        return self.dims[var]

    def layout(self, var: Any) -> list[tuple[int, tuple[str, ...]]]:
        """The tensor's atoms (named dims of the spec), each with the axes sharding it; a dim of size 1
        (``keepdims``, ``b[None, :]``) holds one element and is left out."""
        held = self.axes.get(var, {})
        return [item for d in self.dims_of(var) if d not in self.stacked for item in self.spread(d, held)
                if self.size[item[0]] != 1]


def _dim_names(reader: Reading) -> dict[int, str]:
    """A name for each class of dims: the user's einsum letter where it has one, else the next free letter."""
    names: dict[int, str] = {}
    for d, letter in reader.hints.items():
        if letter not in reader.mesh and letter not in names.values() and reader.find(d) not in reader.parts:
            names.setdefault(reader.find(d), letter)
    letters = iter([c for c in _LETTERS if c not in reader.mesh] + [f"I{k}" for k in range(1000)])
    for statement in reader.statements:
        for var in (*statement.operands, statement.result):
            for atom, _ in reader.layout(var):
                while atom not in names:
                    letter = next(letters)
                    if letter not in names.values():
                        names[atom] = letter
    return names


def _expression(s: Statement, operands: list[TensorRef], over: str, names: tuple[str, ...] = ()) -> str:
    if s.kind in ("route", "dispatch", "combine"):
        return f"{s.fn or s.kind}({', '.join(map(str, operands))}, {names[0]}, {names[1]}, {s.number} over {over})"
    if s.kind == "dropout":
        return f"dropout({operands[0]}, {s.fn})"
    if s.kind == "rotary":  # its frequency base written where it is not the language's default
        return str(Call("rotary", operands[0], names=names[:1], numbers=() if s.value in (None, THETA) else (s.value,)))
    if s.kind == "causal":
        return f"causal({operands[0]}, {names[0]}, {names[1]}" + (f", window {s.number})" if s.number else ")")
    if s.kind in ("dot", "mul"):
        return (" · " if s.kind == "dot" else " * ").join(map(str, operands))
    if s.kind == "copy":
        return str(operands[0])
    if s.kind in ("embed", "loss"):
        return f"{'embed' if s.kind == 'embed' else 'cross_entropy'}({operands[0]}, {operands[1]})"
    if s.kind == "fn":
        return f"{s.fn}({operands[0]}" + (")" if s.value is None else f", {s.value!r})")
    if s.kind == "sum":
        return f"{operands[0]} {'-' if s.signs[1] < 0 else '+'} {operands[1]}"
    return f"{s.fn}({operands[0]} over {over})"


def render(reader: Reading, jaxpr: Any, origin: str) -> ProgramSpec:
    names = _dim_names(reader)

    def ref(var: Any) -> TensorRef:
        dims = tuple(Dim(names[atom], axes) for atom, axes in reader.layout(var))
        if len({d.name for d in dims}) != len(dims):
            raise ShardcError(f"{reader.names[var]} reads one dim twice ({', '.join(d.name for d in dims)}), which "
                              "the spec language cannot write", fix="explain a program without it")
        if hasattr(var, "aval"):  # a tensor explain makes (a renamed copy) has no type of its own
            types[reader.names[var]] = str(var.aval.dtype)
        return TensorRef(reader.names[var], dims)

    types: dict[str, str] = {}
    body: list[str] = []
    tensors: dict[str, TensorRef] = {}
    lines: dict[str, str] = {}
    for s in reader.statements:
        result, operands = ref(s.result), [ref(o) for o in s.operands]
        tensors.update({r.name: r for r in (result, *operands)})
        lines[result.name] = s.line
        for operand in operands:
            lines.setdefault(operand.name, s.line)  # an input: where it is first read
        over = _over(reader, names, s, s.over) if s.kind in ("reduce", "norm", "route", "dispatch", "combine") else ""
        named = tuple(_over(reader, names, s, d) for d in s.names)
        text = f"{result} = {_expression(s, operands, over, named)}" + (f"  # {comment(s.line)}" if s.line else "")
        inside = any(start <= len(body) < end for start, end, _ in reader.blocks)
        body.append(("  " + text) if inside else text)
    if not body:
        raise ShardcError("the program computes nothing the spec language writes (no contraction, map or sum)",
                          fix="explain a program with at least one")
    for start, end, length in reversed(reader.blocks):  # the last first: the earlier ones' places hold
        body = [*body[:start], f"layers {length} {{", *body[start:end], "}", *body[end:]]
    sizes = {names[reader.find(d)]: reader.size[d] for d in reader.size if reader.find(d) in names}
    floats = [str(v.aval.dtype) for v in jaxpr.invars if str(v.aval.dtype) in _DTYPES]
    dtype = _DTYPES[(floats or ["float32"])[0]]
    head = [f"# {comment(origin)}: read by `shardc explain` from its jaxpr and shardings",
            *(f"# {note}" for note in reader.notes),
            "mesh " + ", ".join(f"{a}={n}" for a, n in reader.mesh.items()),
            "dims " + ", ".join(f"{k}={v}" for k, v in sizes.items()), f"dtype {dtype}",
            *_dtype_lines(types, dtype)]
    head += reader.step.lines(reader.names, set(tensors), reader.ids, reader.layer_inputs)
    return ProgramSpec("\n".join([*head, "", *body]) + "\n", tensors, lines, list(reader.notes),
                       training=reader.step.backward, parts=dict(reader.fused_parts))


def _dtype_lines(types: dict[str, str], dtype: str) -> list[str]:
    """A ``dtype T a, b`` line for each float type other than the spec's, naming the tensors the program
    holds in it (a bf16 activation in an f32 program, an FP8 weight in a bf16 one); integer tensors (token
    ids) keep their own type and are never named."""
    by_type: dict[str, list[str]] = {}
    for name, jax_type in types.items():
        kind = _DTYPES.get(jax_type)
        if kind is not None and kind != dtype:
            by_type.setdefault(kind, []).append(name)
    return [f"dtype {kind} {', '.join(names)}" for kind, names in sorted(by_type.items())]


def _over(reader: Reading, names: dict[int, str], s: Statement, dim: int) -> str:
    """The name of the dim ``dim`` a statement names (its reduced one, route's tokens and capacity)."""
    atoms = reader.atoms(dim)
    if len(atoms) != 1:
        raise ShardcError(f"`{s.fn or s.kind}` over a dim the program reshapes into {len(atoms)} dims"
                          + (f" at {s.line}" if s.line else "") + " has no form in the spec language",
                          fix="reshape after the reduction, or explain a program without it")
    return names[atoms[0]]
