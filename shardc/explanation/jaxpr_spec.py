"""A jitted jax program read back as a ``.shard`` spec: its contractions, maps, sums, reductions, shardings.

The program's jaxpr is walked once.  Every array dim gets an id; a ``dot_general`` joins the ids of
its contracted and batch dims, an elementwise op those of its operands and result, a transpose or
a broadcast those it carries over, so each class of joined ids is one named dim of the spec (named
and written by :mod:`shardc.explanation.spec_text`).  A run of elementwise ops over one array
(``x * (1 + tanh(c * x**3))``) is one function of the language, named by its primitives (gelu,
relu, silu, ...; ``identity`` when none fits: its sharding is all the spec needs); two arrays added
are a sum, multiplied an einsum over shared indices; a reduction over one dim is ``sum``/``max``.
A tensor's sharding is its argument's, its ``with_sharding_constraint``'s, the compiled program's
for an output, else carried from its operands as explicit sharding mode would (each dim keeps an
operand's axes, an axis at most once).  A reshape that splits a dim or merges several is the same
tensor, the dim written as its parts (:mod:`shardc.explanation.dim_classes`); a gather of a table's
rows at ids is ``embed``; a scan of a layer, a ``layers`` block; the halves of an array put back
together (rotary embedding's rotate-half) a map of it (:mod:`shardc.explanation.slices`); an MoE router's top-k
routing its ``route`` mask (:mod:`shardc.explanation.routing`), or, held as indices, its ``dispatch`` and
``combine`` (:mod:`shardc.explanation.expert_moves`).  A training step's backward and
update are left out (:mod:`shardc.explanation.training`).  Anything else is a clear error naming the
equation and its line.
"""

from __future__ import annotations

from typing import Any

from jax.extend import core as jex

from shardc.errors import ShardcError
from shardc.explanation.causal_masks import Constants, read_mask
from shardc.explanation.constants import norm_of, scaled, write_run
from shardc.explanation.contractions import apart, read_dot, rename
from shardc.explanation.dim_classes import UNWRITABLE, reshape_groups, unwritable
from shardc.explanation.expert_moves import moves, read_move
from shardc.explanation.fresh import CALLS, Walked
from shardc.explanation.layers import read_scan
from shardc.explanation.lookups import embed, read_lookup
from shardc.explanation.patterns import Run, mean_sums, primitives, runs
from shardc.explanation.refusals import refusal_fix
from shardc.explanation.rotary_runs import enter_constants, passed_positions
from shardc.explanation.routing import read_routing, regions
from shardc.explanation.slices import Piece, concatenate, cut, reverse, sort
from shardc.explanation.sources import equation_text, shape_text, source_line
from shardc.explanation.spec_text import Made, ProgramSpec, Reading, Statement, render
from shardc.explanation.training import TrainingStep

__all__ = ["ProgramSpec", "read_program"]

_UNARY = {"exp", "log", "tanh", "logistic", "integer_pow", "pow", "sqrt", "rsqrt", "erf", "abs", "neg", "sin", "cos",
          "convert_element_type", "copy", "copy_p", "square", "stop_gradient", "max", "min", "add", "sub", "mul",
          "div", "select_n", "ge", "gt", "le", "lt", "eq", "ne", "erf_inv", "sign", "log1p", "expm1", "cbrt",
          "and", "or", "not"}
_ALIASES = {"convert_element_type", "copy", "copy_p", "stop_gradient"}
_ONE_HOT = ("a one-hot of ids (jax.nn.one_hot over the last axis) is read times a 2-d table (embed) and in the mean "
            "-sum(one_hot * log_softmax(logits), -1) (cross_entropy); elsewhere explain a program without it")


class _Reader(Reading):
    def __init__(self, mesh: dict[str, int], approximate: bool = False) -> None:
        super().__init__(mesh, approximate)
        self.alias: dict[Any, Any] = {}  # a view (transpose, broadcast, reshape, cast, constraint) -> its array
        self.region: dict[Any, tuple[Any, frozenset[str], str]] = {}  # elementwise run -> (its array, ops, line)
        self.counts: dict[str, int] = {}
        self.used: set[Any] = set()  # tensors a statement reads
        self.made: set[Any] = set()  # tensors a statement makes
        self.caller = ""  # the source line of the call whose inner jaxpr is walked (jnp's own jits have none)
        self.stacked_outputs: set[Any] = set()  # a scan's per-layer outputs
        self.pieces: dict[Any, Piece] = {}  # a slice's result, and maps of it: a part of an array
        self.walked = Walked()  # the calls' jaxprs read, a second call's read as a copy
        self.constants = Constants()

    # tensors ---------------------------------------------------------------------------------------
    def base(self, var: Any) -> Any:
        while var in self.alias:
            var = self.alias[var]
        return var

    def tensor(self, var: Any) -> Any:
        """The spec tensor holding ``var``: its array, an elementwise run made a function statement."""
        var = self.base(var)
        if var in self.pieces:
            raise unwritable("a part of a dim (a slice, a split) is read as a tensor of its own: a dim of a size "
                             "no other tensor has, which no op of the spec language makes")
        if var in self.unreadable:  # a fused product read whole beside its parts, a random draw
            raise unwritable(*self.unreadable[var])
        if var in self.region:
            source, ops, line = self.region.pop(var)
            write_run(self, var, source, ops, line)
        return var

    def make(self, var: Any, kind: str, operands: tuple[Any, ...], **extra: Any) -> None:
        prefix = {"dot": "Y", "mul": "Y", "fn": "H", "sum": "R", "reduce": "M", "norm": "N", "copy": "C",
                  "embed": "E", "loss": "L", "route": "Disp", "dispatch": "In",
                  "combine": "Comb", "causal": "Sc", "dropout": "Dr", "rotary": "H"}[kind]
        self.used.update(operands)
        self.made.add(var)
        self.counts[prefix] = self.counts.get(prefix, 0) + 1
        self.names[var] = f"{prefix}{self.counts[prefix]}"
        self.statements.append(Statement(kind, var, operands, **extra))
        carried: dict[int, tuple[str, ...]] = {}
        used: set[str] = set()
        atoms = {a for d in self.dims_of(var) for a in self.atoms(d)}
        for operand in operands:
            for atom, axes in self.layout(operand):
                if atom in atoms and atom not in carried and not used & set(axes):
                    carried[atom] = axes
                    used |= set(axes)
        self.axes[var] = {a: carried.get(a, ()) for a in atoms}

    def shard(self, var: Any, spec: Any, into: Any = None) -> None:
        """A declared sharding (an argument's, a constraint's, an output's) of ``var``, on its tensor
        ``into`` (``var`` itself, or the array ``var`` is a view of)."""
        parts = list(spec.partitions) if hasattr(spec, "partitions") else list(spec)
        parts += [None] * (len(self.dims_of(var)) - len(parts))
        self.axes[var if into is None else into] = {
            d: (() if p is None else (p,) if isinstance(p, str) else tuple(p))
            for d, p in zip(self.dims_of(var), parts, strict=True)}

    # equations -------------------------------------------------------------------------------------
    def walk(self, jaxpr: Any, needed: set[int] | None = None, results: int | None = None) -> None:
        """Read ``jaxpr``'s equations (those ``needed``, by id, when given; its first ``results`` results
        the ones read after it, when given)."""
        eqns = [e for e in self.step.forward(jaxpr) if needed is None or id(e) in needed]
        outs = [*list(jaxpr.outvars)[:results], *(v for e in eqns for v in e.outvars if v in self.step.losses)]
        found, routings = runs(eqns, outs), regions(eqns, outs)
        moved = {id(m.eqns[-1]): m for r in routings.values() for m in moves(r, eqns, outs)}
        inside = {id(e) for run in found.values() for e in run.run[:-1]}
        means = {k: e for k, e in mean_sums(eqns, outs).items() if k not in inside}
        for eqn in eqns:
            try:
                if id(eqn) in routings:
                    read_routing(self, routings[id(eqn)], source_line(eqn) or self.caller)
                elif id(eqn) in moved:
                    read_move(self, moved[id(eqn)], eqns, source_line(eqn) or self.caller)
                elif any(id(eqn) in r.skipped for r in routings.values()):  # settled at its top-k
                    continue
                elif eqn in found:
                    self.function(eqn.outvars[0], found[eqn], source_line(eqn))
                elif id(eqn) in means:  # jnp.mean: its sum a mean, its division by the count that mean
                    self.reduce(eqn, "mean") if eqn is means[id(eqn)] else self.view(eqn.outvars[0], eqn.invars[0],
                                                                                       list(range(eqn.outvars[0].aval.ndim)))
                elif id(eqn) not in inside:
                    self.equation(eqn)
            except ShardcError as err:
                if err.kind != UNWRITABLE:
                    raise
                line = source_line(eqn) or self.caller
                raise ShardcError(f"`{eqn.primitive.name}` ({equation_text(eqn)})" + (f" at {line}" if line else "")
                                  + f": {err.message}", fix=err.fix) from None

    def function(self, out: Any, run: Run, line: str) -> None:
        """``out = softmax(source over axis)`` (or rmsnorm): one function over the run that computes it;
        ``out = cross_entropy(source, labels)``: the loss, the labels' dims the logits' others; ``out =
        embed(ids, source)``: a one-hot of the ids times the table."""
        if run.function == "embed":  # a one-hot of ids times a table
            embed(self, run.ids, self.dims_of(run.ids), run.source, out, line)
            return
        source = self.tensor(run.source)
        if run.ids is not None:
            labels = self.source(run.ids)
            for d, e in zip(self.dims_of(run.ids), self.dims_of(run.source), strict=False):
                self.join(d, e)
            self.ids.add(labels)
            self.make(out, "loss", (source, labels), line=line)
            return
        for d, e in zip(self.dims_of(run.source), self.dims_of(out), strict=True):
            self.join(d, e)
        over = self.dims_of(run.source)[run.axis]
        if run.scale is None:
            self.make(out, "norm", (source,), fn=norm_of(self, run), over=over, line=line)
            return
        norm = Made()  # rmsnorm(x over D), then its product with the scale (an einsum, batch index D)
        self.dims[norm] = list(self.dims_of(out))
        self.make(norm, "norm", (source,), fn=norm_of(self, run), over=over, line=line)
        for d, e, n, m in zip(self.dims_of(run.scale), self.dims_of(out), run.scale.aval.shape, out.aval.shape,
                              strict=True):
            if n == m:
                self.join(d, e)
        self.make(out, "mul", (norm, self.tensor(run.scale)), line=line)

    def equation(self, eqn: Any) -> None:
        name = eqn.primitive.name
        line = source_line(eqn) or self.caller
        if self.constants.fold(self, eqn):  # a mask's values; a random key or a dropout's draw, read at its where
            return
        if any(v in self.stacked_outputs for v in eqn.invars if not isinstance(v, jex.Literal)):
            raise unwritable("it reads a scan's per-layer outputs; a `layers` block hands on its carry alone")
        kept = self.made if eqn.outvars and not eqn.outvars[0].aval.shape else set()  # a scalar of a scalar made
        arrays = [v for v in eqn.invars if not isinstance(v, jex.Literal) and (v.aval.shape or self.base(v) in kept)]
        out: Any = eqn.outvars[0] if eqn.outvars else None
        if name in ("top_k", "argsort") or eqn.params.get("name") == "argsort":
            raise unwritable("a top-k or an argsort makes positions along a dim (a dim of k, integer indices), "
                             "which the language has no tensor for; an MoE router's top-k is read where its "
                             "one-hot mask is the language's `route` (else write the routing with `route`, "
                             "`dispatch` and `combine` in a .shard spec)")
        if name in CALLS and not self.unary_call(eqn, arrays, line):
            self.call(eqn)
        elif name in CALLS:
            return
        elif name in ("dot_general", "concatenate") and all(self.is_constant(v) for v in eqn.invars):
            self.constant(out)  # a rotary embedding's angles (positions times frequencies), their halves twice
        elif name == "dot_general":
            read_dot(self, eqn, line)
        elif name in ("reduce_sum", "reduce_max"):
            self.reduce(eqn)
        elif name == "sort":
            sort(self, eqn, line)
        elif name == "rev":
            reverse(self, eqn, line)
        elif name == "transpose":
            self.view(out, eqn.invars[0], list(eqn.params["permutation"]))
        elif name == "broadcast_in_dim":
            self.broadcast(eqn)
        elif name == "iota":  # positions (a rotary embedding's): a constant, no tensor of the spec
            self.constant(out)
        elif name in ("reshape", "squeeze"):
            self.reshape(eqn.invars[0], out, line)
        elif name == "gather":
            read_lookup(self, eqn, line)
        elif name == "scan":
            read_scan(self, eqn)
        elif name in ("slice", "split"):
            cut(self, eqn, line)
        elif name == "concatenate":
            concatenate(self, eqn, line)
        elif name == "sharding_constraint" or (name == "reshard" and arrays):
            sharding = eqn.params["sharding" if name == "sharding_constraint" else "dst_sharding"]
            self.constrain(eqn.invars[0], out, sharding.spec, line)
        elif name == "reshard":  # of a scalar (jax's jvp reshards the constant 1.0): no tensor of the spec
            self.elementwise(eqn, name, arrays, line)
        elif name in _ALIASES and arrays:
            self.view(out, arrays[0], list(range(len(out.aval.shape))))
        elif name == "select_n" and read_mask(self, eqn, line):  # a causal mask's where
            return
        elif name in _UNARY:
            self.elementwise(eqn, name, arrays, line)
        else:
            raise ShardcError("`shardc explain` reads contractions, elementwise ops, sums, reductions, transposes, "
                              "reshapes, embedding lookups, an array's halves put back together and sharding "
                              f"constraints; the program has `{name}`" + (f" at {line}" if line else ""),
                              fix=refusal_fix(name))

    def constrain(self, source: Any, out: Any, spec: Any, line: str) -> None:
        """A just-made result takes the constraint's sharding; an input, or a tensor already read as it
        is, is copied into one that has it (the language's reshard, ``A2[I, J_X] = A[I_X, J]``)."""
        tensor = self.tensor(source)
        self.view(out, source, list(range(len(out.aval.shape))))
        if tensor in self.used or tensor not in self.made:
            del self.alias[out]
            self.make(out, "copy", (tensor,), line=line)
            tensor = out
        self.shard(out, spec, into=tensor)

    def call(self, eqn: Any) -> None:
        closed = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
        inner = self.walked.once(getattr(closed, "jaxpr", closed))
        self.constants.enter(self, list(eqn.invars), list(inner.invars))
        enter_constants(self, closed, inner)
        for outer_var, inner_var in zip(eqn.invars, inner.invars, strict=False):
            if not isinstance(outer_var, jex.Literal) and outer_var.aval.shape:
                self.step.enter(outer_var, inner_var)
                self.view(inner_var, outer_var, list(range(len(outer_var.aval.shape))))
        caller, self.caller = self.caller, source_line(eqn) or self.caller
        self.walk(inner)
        self.caller = caller
        for outer_var, inner_var in zip(eqn.outvars, inner.outvars, strict=True):
            self.step.leave(outer_var, inner_var)
            if not isinstance(inner_var, jex.Literal) and inner_var.aval.shape and inner_var not in self.step.tainted:
                self.view(outer_var, inner_var, list(range(len(inner_var.aval.shape))))

    def unary_call(self, eqn: Any, arrays: list[Any], line: str) -> bool:
        """A custom_jvp/vjp function of one array, result of its shape (relu, gelu, silu): one function."""
        if not eqn.primitive.name.startswith("custom") or len(arrays) != 1 or len(eqn.outvars) != 1:
            return False
        if eqn.outvars[0].aval.shape != arrays[0].aval.shape:
            return False
        inner = eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
        self.customs[eqn.outvars[0]] = eqn  # its own function (gelu, then relu), its values its body's (run_values)
        self.region_of(eqn.outvars[0], [self.tensor(arrays[0])], primitives(getattr(inner, "jaxpr", inner)), line)
        return True

    def reshape(self, source: Any, out: Any, line: str) -> None:
        """A reshape that splits dims or merges them: the same tensor, its dims written as their parts."""
        groups = reshape_groups(tuple(source.aval.shape), tuple(out.aval.shape))
        if groups is None:
            raise unwritable(f"{shape_text(source)} to {shape_text(out)} neither splits nor merges whole dims")
        ins, outs = self.dims_of(source), self.dims_of(out)
        origin = f"`reshape` {shape_text(source)} to {shape_text(out)}" + (f" at {line}" if line else "")
        for i, o in groups:
            if len(i) == 1 and len(o) == 1:
                self.join(ins[i[0]], outs[o[0]])
            elif len(i) == 1:
                self.split(ins[i[0]], [outs[k] for k in o], origin)
            elif len(o) == 1:
                self.split(outs[o[0]], [ins[k] for k in i], origin)
            else:
                raise unwritable(f"{shape_text(source)} to {shape_text(out)} regroups its dims {i} as {o}: neither "
                                 "a split of one dim nor a merge of several")
        self.alias[out] = source

    def view(self, out: Any, source: Any, perm: list[int]) -> None:
        ids = self.dims_of(source)
        self.dims[out] = [ids[p] for p in perm]
        self.alias[out] = source

    def broadcast(self, eqn: Any) -> None:
        source, out = eqn.invars[0], eqn.outvars[0]
        if isinstance(source, jex.Literal) or not source.aval.shape:
            self.constant(out)
            return
        ids = self.dims_of(out)
        for i, position in enumerate(eqn.params["broadcast_dimensions"]):
            if source.aval.shape[i] == out.aval.shape[position]:
                self.join(self.dims_of(source)[i], ids[position])
        self.alias[out] = source

    def constant(self, out: Any) -> None:
        """An array the program makes of literals alone (a broadcast scalar, positions): no tensor of the spec."""
        self.dims_of(out)
        self.region[out] = (out, frozenset(), "")

    def is_constant(self, var: Any) -> bool:
        return self.base(var) in self.region and self.region[self.base(var)][0] is self.base(var)

    def elementwise(self, eqn: Any, name: str, arrays: list[Any], line: str) -> None:
        out = eqn.outvars[0]
        arrays = [a for a in arrays if not self.is_constant(a)]  # broadcast constants
        sources = {self.source(a) for a in arrays}
        if len(sources) <= 1 and all(a.aval.shape == out.aval.shape for a in arrays):
            name = scaled(self, eqn, name, arrays, line)  # times a constant: a scale, not a square
            ops = {name}.union(*(self.region.get(self.base(a), (None, frozenset(), ""))[1] for a in arrays))
            self.region_of(out, arrays, frozenset(ops), line)
            return
        if name in ("add", "sub", "mul") and len(arrays) == 2:
            operands = [self.tensor(a) for a in arrays]
            for k, a in enumerate(arrays):  # a size-1 dim broadcasts (jnp adds a bias as b[None, :]): equal sizes join
                if len(a.aval.shape) != len(out.aval.shape):
                    continue
                pairs = [(d, e) for d, e, n, m in zip(self.dims_of(a), self.dims_of(out), a.aval.shape,
                                                      out.aval.shape, strict=True) if n == m]
                clashes = {d for d, e in pairs if apart(self, d, e)}
                if clashes:  # x + relu(x @ w), w[D, D]: the product's dim read as x's through a rename
                    operands[k], view = rename(self, operands[k], self.dims_of(a), clashes, line)
                    pairs = [(view[self.dims_of(a).index(d)], e) for d, e in pairs]
                for d, e in pairs:
                    self.join(d, e)
            kind = "mul" if name == "mul" else "sum"
            self.make(out, kind, tuple(operands), signs=(1, -1 if name == "sub" else 1), line=line)
            return
        raise unwritable("a map of several arrays, or of one broadcast, other than the sum, difference or product "
                         "of two, has no form in the spec language", fix=_ONE_HOT if name == "eq" else
                         passed_positions(self, arrays))  # MaxText's rotary angles: positions / timescale

    def source(self, var: Any) -> Any:
        var = self.base(var)
        return self.region[var][0] if var in self.region else var

    def region_of(self, out: Any, arrays: list[Any], ops: frozenset[str], line: str) -> None:
        source = self.source(arrays[0]) if arrays else out
        ids = self.dims_of(out)
        if arrays:  # arrays[0] has the result's shape (its source may have another: a reshape's)
            for d, e in zip(self.dims_of(arrays[0]), ids, strict=True):
                self.join(d, e)
        parts = {self.pieces[self.base(a)] for a in arrays if self.base(a) in self.pieces}
        if parts:  # a map of one part of an array (-x2 of rotate-half); of two parts, a part of none
            self.pieces[out] = parts.pop() if len(parts) == 1 else Piece(None, (), -1, 0, 0)
        prior = self.region.get(self.base(arrays[0]), (None, frozenset(), ""))[2] if arrays else ""
        self.region[out] = (source, ops, line or prior)

    def reduce(self, eqn: Any, fn: str = "") -> None:
        """A reduction over one dim, or over several as the language writes it: one dim at a time (a sum
        of sums, a max of maxes, a mean of means), the partial results tensors of their own."""
        source, out, line = eqn.invars[0], eqn.outvars[0], source_line(eqn) or self.caller
        ids = self.dims_of(source)
        over = [ids[i] for i in eqn.params["axes"]]
        fn = fn or ("sum" if eqn.primitive.name == "reduce_sum" else "max")
        tensor, held = self.tensor(source), list(ids)
        for k, d in enumerate(over):
            held = [e for e in held if e != d]
            target = out if k == len(over) - 1 else Made()
            if target is out:
                for e, f in zip(held, self.dims_of(out), strict=True):
                    self.join(e, f)
            else:
                self.dims[target] = list(held)
            self.make(target, "reduce", (tensor,), fn=fn, over=d, line=line)
            tensor = target


def read_program(closed: Any, in_specs: list[Any], out_specs: list[Any], names: list[str],
                 mesh: dict[str, int], origin: str, approximate: bool = False) -> ProgramSpec:
    """The spec of a closed jaxpr whose inputs are sharded by ``in_specs`` and outputs by ``out_specs``."""
    reader = _Reader(mesh, approximate)
    jaxpr = closed.jaxpr
    for var, spec, name in zip(jaxpr.invars, in_specs, names, strict=True):
        reader.names[var] = name
        reader.shard(var, spec)
    reader.step = TrainingStep(list(jaxpr.invars))
    enter_constants(reader, closed, jaxpr)
    reader.walk(jaxpr)
    reader.step.write_losses(reader, jaxpr)
    for var, spec in zip(jaxpr.outvars, out_specs, strict=True):
        if isinstance(var, jex.Literal) or not var.aval.shape or var in reader.step.tainted or reader.is_constant(var):
            continue  # a scalar, the backward's, or literals alone (jnp.zeros): no tensor of the spec
        if reader.base(var) in reader.stacked_outputs:
            reader.notes.append(f"a result of {shape_text(var)}, a scan's per-layer outputs, is left out: a `layers` "
                                "block hands on its carry alone")
            continue
        tensor = reader.tensor(var)
        if tensor in reader.carries:  # the layers' carry keeps its layout: the result, sharded otherwise, a copy
            held = reader.layout(tensor)
            reader.shard(var, spec, into=tensor)
            if reader.layout(tensor) != held:
                reader.axes[tensor] = dict(held)
                del reader.alias[var]
                reader.make(var, "copy", (tensor,))
                tensor = var
        reader.shard(var, spec, into=tensor)
    return render(reader, jaxpr, origin)
