"""Hypothesis strategies for shardc specs, for your own property tests.

Every strategy builds valid IR (``validate`` accepts it, ``parse(str(x)) == x``).
Importing this module pulls in hypothesis but not jax or sympy.

>>> from hypothesis import given
>>> from shardc.spec.parser import parse
>>> @given(specs())
... def test_round_trip(spec):
...     assert parse(str(spec)) == spec
>>> test_round_trip()

>>> @given(meshes(max_devices=8))
... def test_small_mesh(mesh):
...     assert mesh.devices <= 8
>>> test_small_mesh()

>>> @given(specs(routes=True, max_statements=2))
... def test_routed_specs_compute_in_f32(spec):
...     assert any("route(" in str(s) for s in spec.statements) and str(spec.dtype) == "f32"
>>> test_routed_specs_compute_in_f32()

Narrow what you get with keywords, e.g. ``specs(calls=False, unreduced=False)``
for plain contractions, ``specs(layer_ops=True)`` to draw reductions over an index
(softmax, norms, sum, max, ...), ``embed``, ``cross_entropy`` and ``route`` as well,
``specs(routes=True)`` for a top-k ``route`` in every spec (computed in f32) and the
combine and dispatch products reading its mask,
``specs(mesh=Mesh((MeshAxis("X", 8),)), dims=True)`` for a fixed mesh with sizes.
``shardings(("B", "D"), mesh)`` draws the dims of one tensor reference (each mesh axis
at most once).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hypothesis import assume
from hypothesis import strategies as st

from shardc.errors import LAYERS_FEED, ShardcError
from shardc.ir.spec import (
    Add,
    Call,
    Contract,
    Dim,
    DType,
    Expr,
    Mesh,
    MeshAxis,
    Network,
    Spec,
    Statement,
    TensorRef,
)
from shardc.names import book_name
from shardc.spec.functions import ELEMENTWISE, signature
from shardc.spec.validate import validate
from shardc.spec.walk import leaves

__all__ = ["meshes", "shardings", "tensor_refs", "specs", "spec_texts"]

ONE_LETTER_AXES = ("X", "Y", "Z", "P", "Q")
LONG_AXES = ("data", "model", "pipe", "expert")
INDEX_NAMES = ("B", "D", "F", "I", "J", "K", "M", "N", "S", "H", "E", "Seq", "V2")
INPUT_NAMES = ("In", "W", "W_in", "W_out", "x", "emb", "A", "Bias")
OPS = ("·", "@", "*", "×")
HARDWARE = ("tpu-v5p", "tpu-v5e", "h100")


@st.composite
def meshes(draw: st.DrawFn, max_axes: int = 3, max_devices: int = 64, long_names: bool | None = None,
           dcn: bool = True) -> Mesh:
    """A mesh of 1..max_axes axes (one-letter and/or long names) with at most ``max_devices`` devices."""
    pool = {None: ONE_LETTER_AXES + LONG_AXES, True: LONG_AXES, False: ONE_LETTER_AXES}[long_names]
    names = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=min(max_axes, len(pool)), unique=True))
    axes: list[MeshAxis] = []
    devices = 1
    for name in names:
        size = draw(st.sampled_from([s for s in (1, 2, 4, 8) if devices * s <= max_devices]))
        devices *= size
        slow = dcn and draw(st.integers(0, 5)) == 0
        axes.append(MeshAxis(name, size, Network.DCN if slow else Network.ICI))
    return Mesh(tuple(axes))


@st.composite
def shardings(draw: st.DrawFn, indices: tuple[str, ...] | list[str], mesh: Mesh,
              exclude: tuple[str, ...] = ()) -> tuple[Dim, ...]:
    """Dims for ``indices``: each mesh axis (not in ``exclude``) shards at most one dim, in a random order."""
    owned: list[list[str]] = [[] for _ in indices]
    for axis in draw(st.permutations(mesh.names)):
        if axis in exclude or not indices:
            continue
        owner = draw(st.integers(-1, len(indices) - 1))  # -1: the axis shards nothing
        if owner >= 0:
            owned[owner].append(axis)
    return tuple(Dim(name, tuple(axes)) for name, axes in zip(indices, owned, strict=True))


@st.composite
def tensor_refs(draw: st.DrawFn, name: str, indices: tuple[str, ...] | list[str], mesh: Mesh,
                unreduced: bool = False) -> TensorRef:
    """A reference ``name[...]``, with an optional ``{U_..}`` over axes its dims do not use."""
    dims = draw(shardings(indices, mesh))
    partial: tuple[str, ...] = ()
    if unreduced and draw(st.integers(0, 3)) == 0:
        free = [a for a in mesh.names if all(a not in d.axes for d in dims)]
        partial = tuple(draw(st.lists(st.sampled_from(free), unique=True, max_size=2))) if free else ()
    return TensorRef(name, dims, partial)


@dataclass
class _State:
    """What a spec under construction has so far: readable tensors and name counters."""

    mesh: Mesh
    unreduced: bool
    tensors: dict[str, TensorRef] = field(default_factory=dict)
    defined: set[str] = field(default_factory=set)
    counter: int = 0
    same: dict[str, str] = field(default_factory=dict)  # a renamed index -> the one it renames (one size)
    least: dict[str, int] = field(default_factory=dict)  # a route's expert index -> its k (the size's floor)
    routes: list[tuple[Call, TensorRef]] = field(default_factory=list)  # each route drawn, and its mask

    def fresh(self, base: str) -> str:
        self.counter += 1
        return f"{base}{self.counter}"


def _input_name(draw: st.DrawFn, state: _State) -> str:
    name = state.fresh(draw(st.sampled_from(INPUT_NAMES)))
    if state.tensors and draw(st.integers(0, 7)) == 0:
        # now and then the book's name of another tensor's gradient: `dIn1` beside `In1`
        taken = book_name(draw(st.sampled_from(sorted(state.tensors))))
        if taken not in state.tensors:
            return taken
    return name


def _input(draw: st.DrawFn, state: _State, indices: list[str]) -> TensorRef:
    # inputs may arrive as partial sums too (the output of a row-parallel layer, unreduced)
    ref = draw(tensor_refs(_input_name(draw, state), indices, state.mesh, unreduced=state.unreduced))
    state.tensors[ref.name] = ref
    return ref


def _index_lists(exclude: list[str] | tuple[str, ...] = ()) -> st.SearchStrategy[list[str]]:
    return st.lists(st.sampled_from([i for i in INDEX_NAMES if i not in exclude]), max_size=3, unique=True)


def _existing_or_none(draw: st.DrawFn, state: _State) -> TensorRef | None:
    if not state.tensors or not draw(st.booleans()):
        return None
    return state.tensors[draw(st.sampled_from(sorted(state.tensors)))]


def _contraction(draw: st.DrawFn, state: _State, count: int) -> tuple[Contract, list[str]]:
    """``count`` operands whose indices are contracted, batch or free; returns the result's indices."""
    first = _existing_or_none(draw, state)
    fixed = list(first.indices) if first else draw(_index_lists())
    owners: list[list[str]] = [[] for _ in range(count - 1)]  # indices of operands 1..count-1
    result: list[str] = []
    extra = draw(_index_lists(exclude=fixed))
    for index in fixed + extra:
        others = draw(st.sets(st.integers(0, count - 2), min_size=0 if index in fixed else 1))
        for j in others:
            owners[j].append(index)
        alone = len(others) + (index in fixed) == 1
        if alone or draw(st.booleans()):  # an index in one operand only must be kept: it is free
            result.append(index)
    head = first if first else _input(draw, state, fixed)
    operands = [head] + [_input(draw, state, draw(st.permutations(o))) for o in owners]
    operands = draw(st.permutations(operands))
    op = draw(st.sampled_from(OPS))
    return Contract(tuple(operands), op=op), draw(st.permutations(result))


def _single(draw: st.DrawFn, state: _State) -> tuple[TensorRef, list[str]]:
    ref = _existing_or_none(draw, state)
    if ref is None:
        ref = _input(draw, state, draw(_index_lists()))
    return ref, draw(st.permutations(ref.indices))


def _sum(draw: st.DrawFn, state: _State) -> tuple[Add, list[str]]:
    """``T ± U``: a contraction or a tensor, plus a new input with all or a subset of its indices."""
    inner: Expr
    inner, indices = _contraction(draw, state, 2) if draw(st.booleans()) else _single(draw, state)
    sub = draw(st.permutations(indices)) if draw(st.booleans()) else draw(
        st.lists(st.sampled_from(indices), unique=True) if indices else st.just([]))
    term = _input(draw, state, list(sub))
    terms = (inner, term) if draw(st.booleans()) else (term, inner)
    return Add(terms, (1, draw(st.sampled_from((1, -1))))), indices


def _rename(draw: st.DrawFn, state: _State) -> Statement | None:
    """``Kx[B, T] = X[B, S]``: an existing tensor with one index renamed (the sizes agree)."""
    named = sorted(n for n, r in state.tensors.items() if r.indices and not r.unreduced)
    if not named:
        return None
    source = state.tensors[draw(st.sampled_from(named))]
    k = draw(st.integers(0, len(source.indices) - 1))
    new = state.fresh("Ix")
    state.same[new] = source.indices[k]
    indices = list(source.indices)
    indices[k] = new
    result = draw(tensor_refs(state.fresh("Kx"), indices, state.mesh))
    state.tensors[result.name] = result
    state.defined.add(result.name)
    return Statement(result, source)


def _call(draw: st.DrawFn, func: str, expr: Expr, indices: list[str]) -> Expr:
    """``func(expr)``: dropout with a rate, causal over two of the indices (else an elementwise call)."""
    if func == "dropout":
        return Call(func, expr, numbers=(draw(st.sampled_from((0.0, 0.1, 0.5))),))
    if func == "causal":
        if len(indices) < 2:
            return expr
        query, key = draw(st.permutations(indices))[:2]
        return Call(func, expr, names=(query, key))
    return Call(func, expr)


REDUCTIONS = ("softmax", "rmsnorm", "layernorm", "sort", "sum", "mean", "max", "logsumexp")


def _reduction(draw: st.DrawFn, state: _State) -> tuple[Expr, list[str]] | None:
    """``f(X over I)`` of a tensor or a product: same indices (normalize) or I dropped (reduce)."""
    inner: Expr
    inner, indices = _contraction(draw, state, 2) if draw(st.booleans()) else _single(draw, state)
    if not indices:
        return None
    over = draw(st.sampled_from(indices))
    func = draw(st.sampled_from(REDUCTIONS))
    kept = indices if signature(func).kind == "normalize" else [i for i in indices if i != over]
    return Call(func, inner, over=over), draw(st.permutations(kept))


def _ids(draw: st.DrawFn, state: _State, indices: list[str]) -> TensorRef:
    """Token ids: an input read by embed or cross_entropy only (never by a product)."""
    return TensorRef(state.fresh("Tok"), draw(shardings(indices, state.mesh)))


def _vocabulary(draw: st.DrawFn, state: _State) -> tuple[Expr, list[str]]:
    """``embed(Tok, W_emb)`` or ``cross_entropy(Logits, Tok)``."""
    if draw(st.booleans()):
        tok = draw(st.lists(st.sampled_from([i for i in INDEX_NAMES if i not in ("D", "V2")]), min_size=1,
                            max_size=2, unique=True))
        table = _input(draw, state, ["V2", "D"])
        return Call("embed", _ids(draw, state, tok), more=(table,)), draw(st.permutations(tok + ["D"]))
    wide = sorted(n for n, r in state.tensors.items() if len(r.indices) >= 2)
    if wide and draw(st.booleans()):  # type: ignore[arg-type]
        logits = state.tensors[draw(st.sampled_from(wide))]
    else:
        logits = _input(draw, state, draw(st.permutations(["B", "V2"])))
    vocab = draw(st.sampled_from(list(logits.indices)))
    tok = draw(st.permutations([i for i in logits.indices if i != vocab]))
    return Call("cross_entropy", logits, more=(_ids(draw, state, tok),)), []


def _gates(draw: st.DrawFn, state: _State) -> tuple[Expr, list[str]]:
    """Route's argument, of two or more indices: a tensor, or softmax of a product (a router)."""
    wide = sorted(n for n, r in state.tensors.items() if len(r.indices) >= 2 and not r.unreduced)
    choice = draw(st.integers(0, 2))
    if choice == 0 and wide:
        ref = state.tensors[draw(st.sampled_from(wide))]
        return ref, draw(st.permutations(ref.indices))
    if choice == 1:
        inner, indices = _contraction(draw, state, 2)
        if len(indices) >= 2:
            return Call("softmax", inner, over=draw(st.sampled_from(indices))), indices
    indices = draw(st.lists(st.sampled_from(INDEX_NAMES), min_size=2, max_size=3, unique=True))
    ref = draw(tensor_refs(_input_name(draw, state), indices, state.mesh))  # reduced: route reads whole gates
    state.tensors[ref.name] = ref
    return ref, indices


def _route(draw: st.DrawFn, state: _State) -> tuple[Expr, list[str]]:
    """``route(Gate, S, C, k over E)``: a fresh capacity index C, k at most E's size (see :func:`specs`)."""
    gates, indices = _gates(draw, state)
    order, experts = draw(st.permutations(indices))[:2]
    k = draw(st.integers(1, 4))
    state.least[experts] = max(k, state.least.get(experts, 1))
    slots = state.fresh("C")
    call = Call("route", gates, names=(order, slots), numbers=(float(k),), over=experts)
    return call, draw(st.permutations(indices + [slots]))


def _routed(draw: st.DrawFn, state: _State) -> tuple[Expr, list[str]] | None:
    """A statement reading a mask drawn before: the combine ``Gate * Disp`` or the dispatch ``Disp · X``."""
    if not state.routes:
        return None
    call, mask = state.routes[draw(st.integers(0, len(state.routes) - 1))]
    if isinstance(call.arg, TensorRef) and draw(st.booleans()):  # Comb[G, S, E, C] = Gate * Disp
        operands = draw(st.permutations([call.arg, mask]))
        return Contract(tuple(operands), op="*"), draw(st.permutations(list(mask.indices)))
    (order, slots), experts = call.names, call.over
    # In[G, E, C, D] = Disp[G, S, E, C] · X[G, S, D]: the tokens, gathered into the experts' slots
    model = draw(st.sampled_from([i for i in INDEX_NAMES if i not in mask.indices]))
    x = _input(draw, state, draw(st.permutations([i for i in mask.indices if i not in (experts, slots)] + [model])))
    kept = [i for i in mask.indices if i != order] + [model]
    return Contract(tuple(draw(st.permutations([mask, x]))), op=draw(st.sampled_from(OPS))), draw(st.permutations(kept))


def _statement(draw: st.DrawFn, state: _State, kinds: list[str], chains: bool, masks: bool = True,
               route: bool = False) -> Statement:
    kind = "route" if route else draw(st.sampled_from(kinds))
    expr: Expr
    if kind == "route":  # a new mask (always when forced), or more often a statement reading one
        drawn_route = None if route or draw(st.integers(0, 2)) == 0 else _routed(draw, state)
        expr, indices = drawn_route if drawn_route is not None else _route(draw, state)
        return _result(draw, state, expr, indices, chains, "Disp" if drawn_route is None else "")
    if kind == "rename":
        renamed = _rename(draw, state)
        if renamed is not None:
            return renamed
        kind = "contract"
    drawn = _reduction(draw, state) if kind == "reduce" else _vocabulary(draw, state) if kind == "vocab" else None
    if kind in ("reduce", "vocab") and drawn is None:
        kind = "contract"
    if drawn is not None:
        expr, indices = drawn
    elif kind == "sum":
        expr, indices = _sum(draw, state)
    elif kind == "reshard":
        expr, indices = _single(draw, state)
    elif kind == "contract":
        expr, indices = _contraction(draw, state, draw(st.integers(2, 3 if chains else 2)))
    else:  # an elementwise call (maybe nested) on a contraction or on one tensor
        inner, indices = _contraction(draw, state, 2) if draw(st.booleans()) else _single(draw, state)
        expr = inner
        # a map defined on part of the reals (log) is left out: of a drawn contraction it is NaN, whatever the draw
        pool = sorted(f for f in ELEMENTWISE if not signature(f).domain) + ["dropout", "causal"] * masks
        funcs = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=2))
        for k, func in enumerate(funcs):
            if func != "causal" or k == len(funcs) - 1:  # -inf feeds only a softmax: causal goes last
                expr = _call(draw, func, expr, indices)
    return _result(draw, state, expr, indices, chains)


def _result(draw: st.DrawFn, state: _State, expr: Expr, indices: list[str], chains: bool,
            base: str = "") -> Statement:
    """The statement ``Result[indices] = expr``, its result readable by later statements."""
    # Only a contraction leaves partial sums (a function of partial sums is an error); the planner
    # makes them by contracting locally, so give {U_..} to binary contractions with a contracted index.
    partial = state.unreduced and _contracts_an_index(expr, indices)
    result = draw(tensor_refs(state.fresh(base or draw(st.sampled_from(("T", "H", "Out")))), indices, state.mesh,
                              unreduced=partial))
    if not (isinstance(expr, Call) and expr.func == "causal"):  # its -inf is read by nothing drawn here
        state.tensors[result.name] = result
    if isinstance(expr, Call) and expr.func == "route":
        state.routes.append((expr, result))
    state.defined.add(result.name)
    arrow = chains and not isinstance(expr, TensorRef) and draw(st.booleans())
    return Statement(result, expr, arrow=arrow)


def _contracts_an_index(expr: Expr, result: list[str]) -> bool:
    if not isinstance(expr, Contract) or len(expr.operands) != 2:
        return False
    left, right = (set(next(leaves(o)).indices) for o in expr.operands)
    return bool((left & right) - set(result))


@st.composite
def specs(draw: st.DrawFn, max_statements: int = 4, mesh: Mesh | None = None, dims: bool | None = None,
          chains: bool = True, calls: bool = True, unreduced: bool = True, reshards: bool = True,
          headers: bool = True, max_devices: int = 64, sums: bool = True, renames: bool = True,
          masks: bool = True, layer_ops: bool = False, routes: bool | None = None) -> Spec:
    """A valid spec of 1..max_statements statements (``dims``: None = maybe, True/False = always/never).

    ``sums`` draws ``A ± B`` (a term may broadcast), ``renames`` ``Kx[B, T] = X[B, S]``, ``masks``
    ``dropout(X, rate)`` and ``causal(X, S, T)`` among the calls; ``layer_ops`` draws reductions over
    an index (softmax, norms, sum, ...), embed and cross_entropy too.  ``routes`` draws
    ``route(Gate, S, C, k over E)`` (None: with ``layer_ops``; True: in every spec) and statements
    reading its mask, the combine ``Gate * Disp`` and the dispatch ``Disp · X``.
    """
    state = _State(mesh if mesh is not None else draw(meshes(max_devices=max_devices)), unreduced)
    kinds = ["contract"] + ["reshard"] * reshards + ["call"] * calls + ["sum"] * sums + ["rename"] * renames
    kinds += ["reduce", "reduce", "vocab"] * layer_ops
    routes = layer_ops if routes is None else routes
    kinds += ["route", "route"] * routes
    count = draw(st.integers(1, max_statements))
    forced = draw(st.integers(0, count - 1)) if routes is True and "route" in kinds else -1  # one route at least
    statements = tuple(_statement(draw, state, kinds, chains, masks, k == forced) for k in range(count))
    used = dict.fromkeys(i for s in statements for r in [s.result, *leaves(s.expr)] for i in r.indices)
    with_dims = draw(st.booleans()) if dims is None else dims
    least = _least_sizes(state)
    devices = state.mesh.devices
    drawn = {i: devices * draw(st.integers(-(-least.get(i, 1) // devices), 4)) for i in used} if with_dims else {}
    for new, old in state.same.items():  # a rename keeps the size
        if new in drawn:
            drawn[new] = drawn.get(old, drawn[new])
    sizes = tuple(drawn.items())
    if with_dims and not sizes:  # only zero-dim tensors: a dims line still says "sizes are known"
        sizes = (("L", draw(st.integers(1, 96))),)
    # A route's top k flips between near-equal gates when the lowered program rounds them otherwise
    # than the float64 reference: bf16 (8 bits of mantissa) and f16 rounds give ties often, and f8
    # computes in bf16.  A reference rounding its gates to the dtype would not help, since the lowered
    # program's sums round in another order.  So a spec with a route computes in f32, as Switch
    # computes its router (Fedus et al. 2021); in f32 a flip needs two gates within about 2**-24
    # of each other, far rarer than verify's small sizes draw.
    dtypes = [DType.F32] if state.routes else list(DType)
    spec = Spec(state.mesh, statements, dims=sizes, dtype=dtypes[0])
    if not headers:
        return _valid(spec)
    inputs = sorted(state.tensors.keys() - state.defined)
    params = draw(st.none() | st.lists(st.sampled_from(inputs), min_size=1, unique=True)) if inputs else None
    others = [n for n in inputs if params is None or n not in params]
    const = tuple(draw(st.lists(st.sampled_from(others), unique=True))) if others else ()
    layers: int | str | None = draw(st.none() | st.integers(1, 96))
    if with_dims and draw(st.booleans()):
        sizes = sizes if "L" in dict(sizes) else sizes + (("L", draw(st.integers(1, 96))),)
        layers = "L"
    block = None
    if layers is not None and count > 1 and draw(st.booleans()):  # `layers L { ... }` around some statements
        first = draw(st.integers(0, count - 1))
        block = (first, draw(st.integers(first + 1, count)))
    spec = Spec(state.mesh, statements, dims=sizes, dtype=draw(st.sampled_from(dtypes)),
                params=None if params is None else tuple(params), const=const,
                hardware=draw(st.none() | st.sampled_from(HARDWARE)), layers=layers, block=block)
    if layers is not None and not _feeds(spec):
        spec = replace(spec, layers=None, block=None)  # this block's outputs cannot feed its inputs
    return _valid(spec)


def _least_sizes(state: _State) -> dict[str, int]:
    """Each index's least size: a route's expert index at least its k, and so the index it renames."""
    least = dict(state.least)
    for new, old in reversed(state.same.items()):  # a rename's size is its source's: the floor moves there
        least[old] = max(least.get(old, 1), least.get(new, 1))
    return least


def _feeds(spec: Spec) -> bool:
    """Whether ``layers`` is valid for this block (each output feeds an input sharded alike)."""
    try:
        validate(spec)
    except ShardcError as err:
        return err.kind != LAYERS_FEED
    return True


def _valid(spec: Spec) -> Spec:
    """Reject the rare draw validate refuses (a chain that would sum inside one operand)."""
    try:
        validate(spec)
    except ShardcError:
        assume(False)
    return spec


@st.composite
def spec_texts(draw: st.DrawFn, **spec_options: object) -> str:
    """``str()`` of a spec from :func:`specs`, decorated with comments, blank lines and spacing."""
    spec = draw(specs(**spec_options))  # type: ignore[arg-type]
    lines: list[str] = []
    for line in str(spec).splitlines():
        if draw(st.integers(0, 4)) == 0:
            lines.append(draw(st.sampled_from(["", "# a comment", "   ", "\t# indented comment"])))
        if draw(st.booleans()):
            line = line.replace(", ", ",").replace(" = ", "=")
        if draw(st.integers(0, 3)) == 0:
            line += "   # trailing comment · [B_X]"
        lines.append(draw(st.sampled_from(["", "  "])) + line)
    return "\n".join(lines) + draw(st.sampled_from(["\n", "", "\n\n", "\r\n"]))
