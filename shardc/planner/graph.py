"""From statements to a flat list of nodes: binary einsums, elementwise maps, copies.

A statement's expression is a tree; planning wants one node per operation, each
producing a named tensor.  Contractions are folded left to right.  Chains of
three or more operands read as matrix chains: at each step, an index shared by
the two sides is a batch index only if the final result has it and no later
operand uses it again; otherwise it is contracted (so ``In[B, D] · W_in[D, F] ·
W_out[F, D] -> Out[B, D]`` contracts D, then F).  Intermediates get names
(``Tmp``, or ``<Result>_t1, ...``), and their shardings are left to the planner.
Every tensor, intermediates included, also gets its gradient's name here
(:func:`shardc.names.gradient_names`), distinct from every name above.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from shardc.accountings import reduce_dtype
from shardc.errors import ShardcError
from shardc.ir.precision import Precision, gradient_dtype
from shardc.ir.spec import Add, Call, Contract, DType, Expr, Spec, Statement, TensorRef
from shardc.names import gradient_names
from shardc.ops.registry import CONTRACT, RENAME, SUM, Family, Node, family_of, of_call
from shardc.spec.walk import chain_indices, element_bytes, fold, id_names, leaves, operand_outers

__all__ = ["Graph", "build_graph"]


@dataclass(frozen=True)
class Graph:
    nodes: tuple[Node, ...]
    declared: dict[str, TensorRef]  # name -> sharding as written (inputs, params, results)
    indices: dict[str, tuple[str, ...]]  # every tensor, intermediates included
    params: frozenset[str]
    inputs: tuple[str, ...]  # tensors read but never defined, in order of first read
    outputs: tuple[str, ...]  # statement results no statement reads
    const: frozenset[str] = frozenset()  # inputs declared without a gradient
    grads: dict[str, str] = field(default_factory=dict)  # tensor -> its gradient's name
    # tensor -> bytes an element, where not the spec's dtype: token ids 4 (int32,
    # shardc.spec.walk.element_bytes), a dropout's keep-mask 1; read through shardc.spec.walk.nbytes_of
    element_bytes: dict[str, int] = field(default_factory=dict)
    # tensor -> its element type, where not the spec's dtype (:meth:`_Builder.dtypes`)
    dtypes: dict[str, DType] = field(default_factory=dict)
    # a contraction's result -> the type its GEMMs quantize their inputs to (:meth:`_Builder.gemms`)
    gemms: dict[str, DType] = field(default_factory=dict)
    # param -> bytes an element its AllGathers move, where the spec's `param_gather ... in T` casts it before
    # gathering (:meth:`_Builder.gathered_bytes`); none: each its own
    gathered_bytes: dict[str, int] = field(default_factory=dict)

    def precision(self, default: DType) -> Precision:
        """Every tensor's type (``default`` the spec's) and every GEMM's (:class:`shardc.ir.precision.Precision`)."""
        return Precision(default, self.dtypes, self.gemms, {g: t for t, g in self.grads.items()})

    @property
    def names(self) -> frozenset[str]:
        """Every tensor name: the spec's and the intermediates'."""
        return frozenset(self.indices)

    @property
    def differentiable(self) -> tuple[str, ...]:
        """The inputs that get a gradient: all but the ``const`` ones, in first-read order."""
        return tuple(n for n in self.inputs if n not in self.const)


def build_graph(spec: Spec, gradients: Mapping[str, str] | None = None) -> Graph:
    """``gradients`` names some tensors' gradients: a part of a spec planned apart keeps the whole's names."""
    builder = _Builder(spec)
    for statement in spec.statements:
        builder.statement(statement)
    return builder.finish(gradients or {})


class _Builder:
    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.nodes: list[Node] = []
        self.declared: dict[str, TensorRef] = {}
        self.indices: dict[str, tuple[str, ...]] = {}
        self.inputs: list[str] = []
        self.read: set[str] = set()
        self.defined = {s.result.name for s in spec.statements}
        self.names = set(self.defined) | {r.name for s in spec.statements for r in leaves(s.expr)}

    def statement(self, st: Statement) -> None:
        self.current = st
        self.declared[st.result.name] = st.result
        self.indices[st.result.name] = st.result.indices
        self.expr(st.expr, st.result.name, st.result.indices, st.result, top=True)

    def fresh(self, base: str) -> str:
        k = 1
        name = f"{base}_t{k}"
        while name in self.names:
            k += 1
            name = f"{base}_t{k}"
        self.names.add(name)
        return name

    def leaf(self, ref: TensorRef) -> str:
        if ref.name not in self.defined and ref.name not in self.declared:
            self.inputs.append(ref.name)
            self.declared[ref.name] = ref
            self.indices[ref.name] = ref.indices
        self.read.add(ref.name)
        return ref.name

    def expr(self, e: Expr, name: str, indices: tuple[str, ...], target: TensorRef | None,
             top: bool = False) -> str:
        """Emit nodes computing ``e`` into tensor ``name`` with ``indices``; return the name."""
        if isinstance(e, TensorRef):
            if top and set(e.indices) != set(indices):
                return self.rename(e, name, indices, target)
            src = self.leaf(e)
            if not top:
                return src
            self.nodes.append(Node(family_of(CONTRACT), name, indices, (src,), target, self.current))
            return name
        if isinstance(e, Add):
            return self.add(e, name, indices, target)
        if isinstance(e, Call) and (family := of_call(e.func)) is not None:
            return self.family_call(e, family, name, indices, target)
        if isinstance(e, Call):
            what = f"`{e.func}`"
            raise ShardcError(f"{what} parse and validate, but the planner does not plan them yet", e.span,
                              fix="write the layer with einsums and elementwise functions for now")
        return self.contract(e, name, indices, target)

    def argument(self, e: Expr, name: str, indices: tuple[str, ...], target: TensorRef | None = None) -> str:
        """A call's argument: a tensor read as it is, else a fresh intermediate of ``name`` computed
        towards ``indices`` (in ``target``'s layout when given: f(A · B) makes A · B where f's result is)."""
        if isinstance(e, TensorRef):
            return self.leaf(e)
        arg = self.fresh(name)
        self.indices[arg] = indices
        self.expr(e, arg, indices, None if target is None else TensorRef(arg, target.dims))
        return arg

    def add(self, e: Add, name: str, indices: tuple[str, ...], target: TensorRef | None) -> str:
        """``A ± B ± ...``: one "add" node; a term that is a product may stay partial sums."""
        terms = []
        for term in e.terms:
            if isinstance(term, TensorRef):
                terms.append(self.leaf(term))
                continue
            made = self.expr(term, self.fresh(name), chain_indices(term, indices), None)
            last = self.nodes[-1]
            if last.result == made and last.family in (family_of(CONTRACT), family_of(SUM)) and len(last.operands) > 1:
                self.nodes[-1] = replace(last, partial=True)
            terms.append(made)
        self.indices[name] = indices
        self.nodes.append(Node(family_of(SUM), name, indices, tuple(terms), target, self.current, signs=e.signs))
        return name

    def rename(self, e: TensorRef, name: str, indices: tuple[str, ...], target: TensorRef | None) -> str:
        """``Kx[B, T, D] = X[B, S, D]``: an alias of X under new index names (by position)."""
        src = self.leaf(e)
        self.nodes.append(Node(family_of(RENAME), name, indices, (src,), target, self.current))
        return name

    def family_call(self, e: Call, family: Family, name: str, indices: tuple[str, ...],
                    target: TensorRef | None) -> str:
        """A call of an op family (``dropout(X, rate)``, ``route(Gate, S, C, k over E)``): one node, the
        call kept on it, and the tensors the family makes on the way (a dropout's keep-mask), named
        uniquely.  Its argument is computed towards the indices the family says (a route's gates: the
        mask's less the capacity index), in ``target``'s layout where those are the result's; or, for a
        node of the family's own shape, its operands and tensors as the family makes them."""
        if family.operands is not None:
            operands, tensors = family.operands(self, e, name, indices)
            self.indices[name] = indices
            self.nodes.append(Node(family, name, indices, operands, target, self.current, fn=e.func, call=e,
                                   aux=tensors))
            return name
        towards = family.argument(e, indices)
        arg = self.argument(e.arg, name, towards, target if towards == indices else None)
        self.indices[name] = indices
        aux = []
        for base in family.aux(e, name):
            made = base if base not in self.names else self.fresh(base)
            self.names.add(made)
            self.indices[made] = indices
            aux.append(made)
        self.nodes.append(Node(family, name, indices, (arg,), target, self.current, fn=e.func, call=e,
                               aux=tuple(aux)))
        return name

    def contract(self, e: Contract, name: str, indices: tuple[str, ...],
                 target: TensorRef | None) -> str:
        operand_indices = [chain_indices(o, towards) for o, towards in zip(e.operands, operand_outers(e, indices),
                                                                               strict=True)]
        names = [self.expr(o, self.fresh(name), operand_indices[k], None)
                 if not isinstance(o, TensorRef) else self.leaf(o) for k, o in enumerate(e.operands)]
        left, left_idx = names[0], operand_indices[0]
        steps = len(names) - 1
        for k in range(1, len(names)):
            last = k == steps
            later = {i for idx in operand_indices[k + 1:] for i in idx}
            out_idx = indices if last else fold(left_idx, operand_indices[k], set(indices), later)
            out = name if last else ("Tmp" if steps == 2 and "Tmp" not in self.names else self.fresh(name))
            self.names.add(out)
            self.indices[out] = out_idx
            self.nodes.append(Node(family_of(CONTRACT), out, out_idx, (left, names[k]),
                                   target if last else None, self.current, chain=0 if last else k))
            left, left_idx = out, out_idx
        return name

    def dtypes(self, grads: Mapping[str, str]) -> dict[str, DType]:
        """Each tensor's element type where a ``dtype T`` line makes it other than the spec's: the tensors
        it names, what their statements make on the way (``sigmoid(L · W)``'s product is of the result's
        type), and their gradients (a cotangent is of its value's type, but an FP8 value's is of the spec's:
        :func:`shardc.ir.precision.gradient_dtype`)."""
        declared = dict(self.spec.tensor_dtypes)
        found = dict(declared)
        for node in self.nodes:
            kind = declared.get(node.statement.result.name)
            if kind is not None:
                for made in (node.result, *node.aux):
                    found.setdefault(made, kind)
        storage = self.spec.dtype
        graded = {grads[t]: gradient_dtype(kind, storage) for t, kind in found.items() if t in grads}
        return found | {g: kind for g, kind in graded.items() if kind is not storage}

    def gemms(self) -> dict[str, DType]:
        """The type each contraction that sums an index (a GEMM, not an elementwise product) quantizes its
        inputs to, by its result (a chain's intermediates too), where a ``gemm T`` line gives its
        statement one (:meth:`shardc.ir.spec.Spec.gemm_of`)."""
        found = {}
        for node in self.nodes:
            kind = self.spec.gemm_of(node.statement.result.name)
            if kind is None or node.family is not family_of(CONTRACT) or len(node.operands) < 2:
                continue
            if {i for o in node.operands for i in self.indices[o]} - set(node.indices):
                found[node.result] = kind
        return found

    def element_bytes(self, dtypes: Mapping[str, DType]) -> dict[str, int]:
        """Bytes an element of each tensor not of the spec's dtype: the token ids, the keep-masks, the
        tensors of another type (``dtypes``)."""
        made = {k: v for node in self.nodes for k, v in node.family.aux_bytes(node).items()}
        return {t: kind.nbytes for t, kind in dtypes.items()} | element_bytes(self.spec) | made

    def finish(self, given: Mapping[str, str]) -> Graph:
        const = frozenset(self.spec.const) | id_names(self.spec)  # token ids: integers, no gradient
        params = self.spec.params
        if params is None:
            params = tuple(n for n in self.inputs if n.startswith("W") and n not in const)
        outputs = tuple(s.result.name for s in self.spec.statements if s.result.name not in self.read)
        taken = self.names | set(self.indices)
        grads = gradient_names(self.indices, taken=taken | set(given.values()))
        grads |= {t: g for t, g in given.items() if t in grads and g not in taken}
        dtypes = self.dtypes(grads)
        held = self.held_gradients({grads[p] for p in params if p in grads})
        return Graph(tuple(self.handed_on(outputs)), self.declared, self.indices, frozenset(params),
                     tuple(self.inputs), outputs, const, grads, self.element_bytes(dtypes) | held, dtypes, self.gemms(),
                     self.gathered_bytes(params))

    def handed_on(self, outputs: tuple[str, ...]) -> list[Node]:
        """The nodes, each linear one or einsum whose result one linear node alone reads marked ``partial``:
        ``sum(sum(X[B_X, S] over B) over S)`` may hand the inner sum on unreduced and all-reduce the scalar, not the
        vector, and ``sum(A[B, D_X] · W[D_X, F] over F)`` all-reduce the sum over F, not the product.  The spec's
        results are made as declared, and so is an intermediate declared with mesh axes or partial sums; one
        written plain (``M1[S] = sum(...)``, as `shardc explain` writes a program's) is the planner's to lay out."""
        readers: dict[str, list[Node]] = {}
        for node in self.nodes:
            for name in dict.fromkeys(node.operands):
                readers.setdefault(name, []).append(node)
        handed, onward = set(), set()
        for node in self.nodes:
            read = readers.get(node.result, [])
            ref = self.declared.get(node.result)
            plain = ref is None or not (ref.unreduced or any(d.axes for d in ref.dims))
            product = node.family is family_of(CONTRACT) and len(node.operands) > 1 and not node.chain
            if node.result in outputs or len(read) != 1 or not read[0].family.linear(read[0]):
                continue
            if plain and (node.family.linear(node) or product):
                handed.add(node.result)
            elif node.family.linear(node):  # made as declared, but an einsum handed on to it prices its reader too
                onward.add(node.result)
        marked = {n.result: replace(n, partial=True) if n.result in handed else n for n in self.nodes}
        for name in reversed(list(marked)):  # the last first: a reader's own reader is set before it is read
            if name in handed | onward:
                marked[name] = replace(marked[name], reader=marked[readers[name][0].result])
        return list(marked.values())

    def held_gradients(self, gradients: set[str]) -> dict[str, int]:
        """Bytes an element of the params' ``gradients`` where the framework reduces them in a type of its own
        (the spec's ``grad_reduce ... in T``, else its ``optimizer`` accounting's: BF16_Optimizer's fp32 buffer;
        :func:`shardc.accountings.reduce_dtype`), so that every count of their bytes, their reductions' volumes
        first, reads it; none where it is each param's own."""
        written = self.spec.grad_reduce_dtype
        name = reduce_dtype(None if written is None else written.value, self.spec.optimizer)
        return {} if name is None else dict.fromkeys(sorted(gradients), DType(name).nbytes)

    def gathered_bytes(self, params: Iterable[str]) -> dict[str, int]:
        """Bytes an element of each param's AllGathers where the spec's ``param_gather ... in T`` says (torchao's
        float8 all-gather under FSDP2 casts each shard before gathering it): the one rule that sizes a weight's
        gathers, in the search (:meth:`shardc.sharding.layout.CostContext.gather_nbytes`), the plan's steps and
        the gathered weights' memory (:meth:`shardc.ir.plan.Plan.moved_nbytes`); none where it is each
        param's own."""
        kind = self.spec.param_gather_dtype
        return {} if kind is None else dict.fromkeys(sorted(params), kind.nbytes)
