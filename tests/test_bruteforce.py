"""An exhaustive search over move sequences, independent of the planner, as its oracle.

Per einsum, the oracle tries every sequence of moves on each operand (slices,
AllGathers of one dim or several, AllToAlls, ReduceScatters, AllReduces, in
any order), every valid local einsum of the values reached, and every sequence
of moves on its result to the declared value.  Its moves and its rules of a
valid local einsum are written here from the collectives' semantics, sharing
no code with ``shardc.sharding.layout`` or ``shardc.sharding.einsum``; the one
things shared are the price of a single move (:func:`move_seconds`) and of a
local einsum's compute where the objective counts it (:func:`einsum_seconds`), so
the two compare under one objective.

Depth.  Moves cost no less than zero, so a cheapest sequence never visits a
value twice: Dijkstra over the (finite) graph of values is exhaustive over
sequences of every length.  For a tensor of d dims on a mesh of n <= 3 axes there
are at most (d+1)^n * n! layouts times 2^n partial sums (a few thousand), so the
search needs no depth bound; it stops instead at the planner's own forward
time (:data:`SLACK` above it), since the test only asks whether anything is cheaper.

The planner's search plans a phase einsum by einsum and reuses what earlier einsums
made, so its forward is checked against the sum of the oracle's per-einsum
optima: it must never be above.

Sums and means over an index are a one-operand contraction to the oracle (the index's axes
become partial sums).  A result of one or of an einsum that one sum or mean alone reads, declared plain, may
reach its reader in any value (partial sums too): the oracle hands it on in every value it
reaches, each at its cost so far, and counts the chain's moves once, at its end.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import shardc
from shardc.costmodel.fitting import plan_memory
from shardc.ir.plan import Monomial, Op, Plan, Step, unfused
from shardc.ir.spec import Call, Contract, Expr, Mesh, MeshAxis, Network, Spec, Statement, TensorRef
from shardc.planner.candidates import objective
from shardc.planner.memory_fit import ranked
from shardc.planner.plan_text import render_explain
from shardc.planner.planner import plan as planner_plan
from shardc.planner.planner import shared_search
from shardc.sharding.layout import CostContext, Move, Value
from shardc.spec.walk import leaves
from shardc.testing import specs
from shardc.timing import plan_time
from shardc.units import fmt_bytes

ROOT = Path(__file__).resolve().parent.parent
SLACK = 1e-9  # relative: sums of the same seconds in another order differ in the last bits


@dataclass(frozen=True, order=True)
class State:
    """A sharded value: each dim's axes (major to minor) and the partial-sum axes."""

    layout: tuple[tuple[str, ...], ...]
    partial: frozenset[str]

    def used(self) -> set[str]:
        return {a for axes in self.layout for a in axes} | set(self.partial)


def move_seconds(ctx: CostContext, tensor: str, idx: tuple[str, ...], op: Op, src: State, dst: State,
                 axes: tuple[str, ...], volume: Monomial) -> float:
    """The planner's price of one move: the single function both searches are judged by."""
    move = Move(op, Value(src.layout, tuple(sorted(src.partial))), Value(dst.layout, tuple(sorted(dst.partial))),
                axes, volume=volume)
    return ctx.move_cost(move, tensor, idx)[0]


def einsum_seconds(ctx: CostContext, operands: tuple[tuple[str, tuple[str, ...], State], ...],
                   result: tuple[str, tuple[str, ...], State]) -> float:
    """The planner's price of a local einsum's compute (its FLOPs, or its operands' and result's HBM bytes
    where they take longer: hence the result and each tensor's element bytes; at its operands' type), where
    its objective has one (else 0)."""
    price = getattr(ctx, "einsum_seconds", None)
    if price is None:
        return 0.0
    name, idx, state = result
    return float(price(tuple((i, _value(s), ctx.nbytes(n)) for n, i, s in operands),
                       (idx, _value(state), ctx.nbytes(name)), ctx.matmul_dtype(n for n, _, _ in operands)))


def _value(s: State) -> Value:
    return Value(s.layout, tuple(sorted(s.partial)))


class Oracle:
    """Cheapest move sequences for one spec's tensors, on the mesh without size-1 axes."""

    def __init__(self, spec: Spec, ctx: CostContext) -> None:
        self.spec, self.ctx = spec, ctx
        self.sizes = {a.name: a.size for a in spec.mesh.axes if a.size > 1}
        self.nbytes = spec.dtype.nbytes

    def state(self, ref: TensorRef) -> State:
        """A reference without its size-1 axes (one device: the block is whole, the sum complete)."""
        return State(tuple(tuple(a for a in d.axes if a in self.sizes) for d in ref.dims),
                     frozenset(a for a in ref.unreduced if a in self.sizes))

    def volume(self, indices: tuple[str, ...], s: State, extra: tuple[str, ...] = ()) -> Monomial:
        return Monomial.of(self.nbytes, num=indices + extra, den=tuple(a for axes in s.layout for a in axes))

    def divides(self, index: str, axes: tuple[str, ...]) -> bool:
        count = 1
        for a in axes:
            count *= self.sizes[a]
        return self.spec.sizes[index] % count == 0

    def moves(self, tensor: str, indices: tuple[str, ...], s: State) -> Iterator[tuple[State, float]]:
        """Every single move out of ``s`` with its price."""
        for op, dst, axes, volume in self._moves(indices, s):
            yield dst, 0.0 if op is Op.SLICE else move_seconds(self.ctx, tensor, indices, op, s, dst, axes, volume)

    def _moves(self, idx: tuple[str, ...], s: State) -> Iterator[tuple[Op, State, tuple[str, ...], Monomial]]:
        lay = s.layout
        # AllGather: any set of dims, each giving up a minor suffix of its axes
        for keep in itertools.product(*[range(len(axes) + 1) for axes in lay]):
            if all(k == len(axes) for k, axes in zip(keep, lay, strict=True)):
                continue
            dst = State(tuple(axes[:k] for k, axes in zip(keep, lay, strict=True)), s.partial)
            gathered = tuple(a for k, axes in zip(keep, lay, strict=True) for a in axes[k:])
            yield Op.ALL_GATHER, dst, gathered, self.volume(idx, dst)
        free = [a for a in self.sizes if a not in s.used()]
        for d, axes in enumerate(lay):
            for a in free:  # a slice: this device's block of a replicated axis, at a dim's minor end
                if self.divides(idx[d], axes + (a,)):
                    yield Op.SLICE, State(_put(lay, d, axes + (a,)), s.partial), (a,), self.volume(idx, s)
            for k in range(len(axes)):  # AllToAll: a minor suffix of dim d to another dim's minor end
                moved = axes[k:]
                for e, other in enumerate(lay):
                    if e != d and self.divides(idx[e], other + moved):
                        dst = State(_put(_put(lay, d, axes[:k]), e, other + moved), s.partial)
                        yield Op.ALL_TO_ALL, dst, moved, self.volume(idx, s, moved)
        for n in range(1, len(s.partial) + 1):
            for group in itertools.combinations(sorted(s.partial), n):
                rest = s.partial - set(group)
                yield Op.ALL_REDUCE, State(lay, rest), group, self.volume(idx, s)
                for order in itertools.permutations(group):
                    for d, axes in enumerate(lay):
                        if self.divides(idx[d], axes + order):
                            yield Op.REDUCE_SCATTER, State(_put(lay, d, axes + order), rest), order, self.volume(idx, s)

    def reach(self, tensor: str, idx: tuple[str, ...], starts: dict[State, float], bound: float) -> dict[State, float]:
        """Least cost of every value reachable from ``starts`` at no more than ``bound``."""
        best = dict(starts)
        heap = [(c, s) for s, c in starts.items()]
        heapq.heapify(heap)
        done: dict[State, float] = {}
        while heap:
            cost, s = heapq.heappop(heap)
            if s in done or cost > bound:
                continue
            done[s] = cost
            for dst, price in self.moves(tensor, idx, s):
                new = cost + price
                if dst not in done and new < best.get(dst, float("inf")) and new <= bound:
                    best[dst] = new
                    heapq.heappush(heap, (new, dst))
        return done


def _put(layout: tuple[tuple[str, ...], ...], d: int, axes: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    return layout[:d] + (axes,) + layout[d + 1:]


def local_einsum(ia: tuple[str, ...], a: State, ib: tuple[str, ...], b: State, out: tuple[str, ...]) -> State | None:
    """The local result of a valid sharded einsum of ``a`` and ``b``, or None (the four cases of
    sharded matmul): shared indices sharded alike, no axis on two indices, partial sums over an
    axis only where the other operand does not use it, contracted axes become partial sums."""
    where: dict[str, str] = {}
    for idx, s in ((ia, a), (ib, b)):
        for i, axes in zip(idx, s.layout, strict=True):
            for ax in axes:
                if where.setdefault(ax, i) != i:
                    return None
    la, lb = dict(zip(ia, a.layout, strict=True)), dict(zip(ib, b.layout, strict=True))
    if any(la[i] != lb[i] for i in set(ia) & set(ib)):
        return None
    if a.partial & b.used() or b.partial & a.used():
        return None
    both = {**la, **lb}
    summed = {ax for i, axes in both.items() if i not in out for ax in axes}
    return State(tuple(both[i] for i in out), a.partial | b.partial | frozenset(summed))


def _core(expr: Expr) -> Expr:
    """Functions keep the layout and are applied to reduced values: moving before or after one
    costs the same, so the search looks through them."""
    while isinstance(expr, Call):
        expr = expr.arg
    return expr


LINEAR = ("sum", "mean")  # reductions whose partial sums in are partial sums out, over the same axes


def reduced(idx: tuple[str, ...], s: State, over: str, out: tuple[str, ...]) -> State:
    """The local result of a linear reduction over ``over`` of ``s``: its axes become partial sums."""
    by_index = dict(zip(idx, s.layout, strict=True))
    return State(tuple(by_index[i] for i in out), s.partial | frozenset(by_index[over]))


def handed_on(spec: Spec) -> set[str]:
    """The results a linear reduction or an einsum of two tensors makes that one linear reduction alone
    reads, declared without mesh axes and no output of the spec: any value of theirs may be handed to their
    reader (partial sums too)."""
    linear = {s.result.name for s in spec.statements if isinstance(s.expr, Call) and s.expr.func in LINEAR}
    makers = {s.result.name: s for s in spec.statements if s.result.name in linear
              or isinstance(s.expr, Contract) and len(s.expr.operands) == 2}
    readers: dict[str, list[str]] = {}
    for s in spec.statements:
        for r in leaves(s.expr):
            readers.setdefault(r.name, []).append(s.result.name)
    return {name for name, s in makers.items() if len(readers.get(name, [])) == 1 and readers[name][0] in linear
            and not s.result.unreduced and not any(d.axes for d in s.result.dims)}


def _reduction(oracle: Oracle, statement: Statement, starts: dict[State, float], room: float) -> dict[State, float]:
    """Every value of a linear reduction's result reachable within ``room`` from its input's ``starts``."""
    call = statement.expr
    assert isinstance(call, Call) and isinstance(call.arg, TensorRef) and call.over is not None
    arg, out = call.arg, statement.result.indices
    ends: dict[State, float] = {}
    for s, c in oracle.reach(arg.name, arg.indices, starts, room).items():
        r = reduced(arg.indices, s, call.over, out)
        ends[r] = min(c, ends.get(r, float("inf")))
    return oracle.reach(statement.result.name, out, ends, room)


def on_the_way(oracle: Oracle, result: TensorRef, ends: dict[State, float]) -> dict[State, float]:
    """Each value of ``ends`` a way to the declared ``result`` passes, at what that way costs above the cheapest:
    the planner holds every value a tensor is moved through, and a sum or mean reads any of them (the declared
    one at 0, the whole value an ``M1[F_X]`` is sliced from at 0 too)."""
    target = oracle.state(result)
    back: dict[State, list[tuple[State, float]]] = {}
    for s in ends:
        for dst, price in oracle.moves(result.name, result.indices, s):
            if dst in ends:
                back.setdefault(dst, []).append((s, price))
    rest, heap, done = {target: 0.0}, [(0.0, target)], {}
    while heap:  # the cheapest way from each value to the target: Dijkstra over the moves reversed
        cost, s = heapq.heappop(heap)
        if s in done:
            continue
        done[s] = cost
        for src, price in back.get(s, ()):
            if src not in done and cost + price < rest.get(src, float("inf")):
                rest[src] = cost + price
                heapq.heappush(heap, (cost + price, src))
    return {s: max(0.0, ends[s] + c - ends[target]) for s, c in done.items()}


def oracle_forward(spec: Spec, ctx: CostContext, bound: float) -> float:
    """The sum over statements of the cheapest move sequences: declared values in, declared out; a value
    :func:`handed_on` goes to its reader in every layout reached, each at its cost so far, and a declared
    sum's or mean's reader starts from every value on a way to it (:func:`on_the_way`)."""
    oracle = Oracle(spec, ctx)
    declared: dict[str, TensorRef] = {}
    handed, held = handed_on(spec), {}
    total = 0.0
    for statement in spec.statements:
        if isinstance(statement.expr, Call) and statement.expr.func in LINEAR:
            arg = statement.expr.arg
            assert isinstance(arg, TensorRef)
            starts = held.pop(arg.name, None) or {oracle.state(declared.get(arg.name, arg)): 0.0}
            declared[statement.result.name] = statement.result
            ends = _reduction(oracle, statement, starts, bound - total)
            if statement.result.name in handed:
                held[statement.result.name] = ends  # its cost is counted once, in its reader's
                continue
            if oracle.state(statement.result) not in ends:
                return float("inf")
            total += ends[oracle.state(statement.result)]
            held[statement.result.name] = on_the_way(oracle, statement.result, ends)
            continue
        core = _core(statement.expr)
        refs = [core] if isinstance(core, TensorRef) else list(core.operands) if isinstance(core, Contract) else []
        assert all(isinstance(r, TensorRef) for r in refs), statement
        for r in refs:
            declared.setdefault(r.name, r)  # type: ignore[union-attr]
        declared[statement.result.name] = statement.result
        target, out = oracle.state(statement.result), statement.result.indices
        room = bound - total
        if len(refs) == 1:
            ref = declared[refs[0].name]  # type: ignore[union-attr]
            src = oracle.state(ref)
            by_index = dict(zip(ref.indices, src.layout, strict=True))
            start = State(tuple(by_index[i] for i in out), src.partial)  # a local transpose
            ends = oracle.reach(statement.result.name, out, {start: 0.0}, room)
        else:
            ends = _einsum_results(oracle, [declared[r.name] for r in refs], statement.result.name,  # type: ignore[union-attr]
                                   out, room)
            ends = oracle.reach(statement.result.name, out, ends, room)
            if statement.result.name in handed:
                held[statement.result.name] = ends  # its cost is counted once, in its reader's
                continue
        if target not in ends:
            return float("inf")  # nothing within the planner's time: the planner is not beaten here
        total += ends[target]
    return total


def _einsum_results(oracle: Oracle, refs: list[TensorRef], name: str, out: tuple[str, ...],
                    room: float) -> dict[State, float]:
    """Every local result reachable within ``room``, at its least cost."""
    (ra, rb) = refs
    a = oracle.reach(ra.name, ra.indices, {oracle.state(ra): 0.0}, room)
    b = oracle.reach(rb.name, rb.indices, {oracle.state(rb): 0.0}, room)
    shared = [i for i in ra.indices if i in rb.indices]
    by_key: dict[tuple[tuple[str, ...], ...], list[tuple[State, float]]] = {}
    for s, c in b.items():
        lb = dict(zip(rb.indices, s.layout, strict=True))
        by_key.setdefault(tuple(lb[i] for i in shared), []).append((s, c))
    results: dict[State, float] = {}
    for s, c in a.items():
        la = dict(zip(ra.indices, s.layout, strict=True))
        for t, d in by_key.get(tuple(la[i] for i in shared), ()):
            if c + d > room:
                continue
            r = local_einsum(ra.indices, s, rb.indices, t, out)
            if r is None:
                continue
            total = c + d + einsum_seconds(oracle.ctx, ((ra.name, ra.indices, s), (rb.name, rb.indices, t)),
                                           (name, out, r))
            if total < results.get(r, float("inf")):
                results[r] = total
    return results


def forward_seconds(plan: Plan, ctx: CostContext) -> float:
    """The planner's forward, priced move by move with :func:`move_seconds`."""
    oracle = Oracle(plan.spec, ctx)
    total = 0.0
    # a collective matmul is priced as the collective and the einsum it fuses (the moves the oracle knows):
    # a pass after the search, where it is faster by the step time, and a gather einsums share counted once
    for step in dict.fromkeys(part for s in plan.forward for part in unfused(s)):
        if step.is_collective:
            total += _step_seconds(oracle, ctx, step)
        elif step.op is Op.EINSUM and len(step.operands) == 2:
            total += einsum_seconds(ctx, tuple((r.name, r.indices, oracle.state(r)) for r in step.operands),
                                    (step.dst.name, step.dst.indices, oracle.state(step.dst)))
    return total


def _step_seconds(oracle: Oracle, ctx: CostContext, step: Step) -> float:
    assert step.src is not None and step.volume is not None
    return move_seconds(ctx, step.tensor, step.src.indices, step.op, oracle.state(step.src), oracle.state(step.dst),
                        step.axes, step.volume)


def _context(spec: Spec, plan: Plan) -> CostContext:
    mesh = Mesh(tuple(a for a in spec.mesh.axes if a.size > 1))
    weights = frozenset(i.name for i in plan.tensors if i.role == "param")
    return CostContext(mesh, spec.dtype, spec.sizes, weights)


def _check(spec: Spec) -> tuple[float, float]:
    # the search's own plan: ``auto`` may prefer the rules' when the whole step (backward
    # included) is cheaper so, which is a choice across phases, not a per-einsum one
    plan = shardc.plan(spec, strategy="search")
    ctx = _context(spec, plan)
    planned = forward_seconds(plan, ctx)
    best = oracle_forward(spec, ctx, planned * (1 + SLACK) + 1e-15)
    assert planned <= best * (1 + SLACK) + 1e-15, (planned, best)
    return planned, best


@st.composite
def small_meshes(draw: st.DrawFn) -> Mesh:
    """1 to 3 axes of 2, 4 or 8 devices (16 in all at most), now and then over DCN or of size 1."""
    names = draw(st.lists(st.sampled_from(("X", "Y", "Z", "data", "model")), min_size=1, max_size=3, unique=True))
    axes, devices = [], 1
    for name in names:
        size = draw(st.sampled_from([s for s in (2, 4, 8) if devices * s <= 16] or [1]))
        if draw(st.integers(0, 9)) == 0:
            size = 1
        devices *= size
        network = Network.DCN if draw(st.integers(0, 5)) == 0 else Network.ICI
        axes.append(MeshAxis(name, size, network))
    return Mesh(tuple(axes))


@pytest.mark.slow
@settings(max_examples=380, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(small_meshes().flatmap(lambda m: specs(max_statements=2, dims=True, chains=False, headers=False, mesh=m,
                                              sums=False, renames=False, masks=False)))  # the oracle: einsums
def test_planner_is_never_above_the_exhaustive_search(spec: Spec) -> None:
    note(str(spec))
    planned, _ = _check(spec)
    RUN.append((spec, planned))


RUN: list[tuple[Spec, float]] = []


@pytest.mark.slow
def test_the_oracle_ran_on_300_specs() -> None:
    """Hypothesis runs every example asked for (none filtered away): at least 300 distinct specs."""
    if not RUN:
        test_planner_is_never_above_the_exhaustive_search()
    assert len({str(s) for s, _ in RUN}) >= 300
    assert sum(1 for _, t in RUN if t > 0) >= 150  # and most of them communicate


@st.composite
def reduction_chains(draw: st.DrawFn, product: bool = False) -> Spec:
    """An input of 2 or 3 indices, each mesh axis on one of them, partial sums or unused, then 1 to 3 sums and
    means, each of the result before it, and now and then one more of the first result (read twice then);
    results plain, now and then with an axis on an index.  ``product``: the input is instead an einsum's result
    ``Y[B, F] = A[B, D] · W[D, F]`` (plain, now and then with an axis on an index), each axis of A and of W
    drawn as the input's are."""
    mesh = draw(small_meshes())
    axes = [a.name for a in mesh.axes]
    idx = ["B", "F"] if product else ["B", "S", "T"][:draw(st.integers(2, 3))]

    def ref(name: str, indices: list[str], on: dict[str, str]) -> str:
        dims = [f"{i}_{{{','.join(a for a in axes if on.get(a) == i)}}}" if i in on.values() else i for i in indices]
        partial = ",".join(a for a in axes if on.get(a) == "U")
        return f"{name}[{', '.join(dims)}]" + (f"{{U_{{{partial}}}}}" if partial else "")

    def drawn(indices: list[str]) -> dict[str, str]:
        return {a: draw(st.sampled_from([*indices, "U", ""])) for a in axes}

    lines: list[str] = []
    if product:
        on = {draw(st.sampled_from(axes)): draw(st.sampled_from(idx))} if draw(st.integers(0, 3)) == 0 else {}
        made = [ref("Y", idx, on)]
        a, w = ref("A", ["B", "D"], drawn(["B", "D"])), ref("W", ["D", "F"], drawn(["D", "F"]))
        lines.append(f"{made[0]} = {a} · {w}")
    else:
        made = [ref("X", idx, drawn(idx))]
    shapes = [idx]
    for k in range(draw(st.integers(1, 3)) + 1):
        last = 0 if k == 3 or (k and draw(st.integers(0, 4)) == 0) else len(made) - 1  # read the first again
        if not shapes[last] or (k == 3 and len(made) < 3):
            break
        over = draw(st.sampled_from(shapes[last]))
        out = [i for i in shapes[last] if i != over]
        on = {draw(st.sampled_from(axes)): draw(st.sampled_from(out))} if out and draw(st.integers(0, 3)) == 0 else {}
        made.append(ref(f"M{k + 1}", out, on))
        shapes.append(out)
        lines.append(f"{made[-1]} = {draw(st.sampled_from(LINEAR))}({made[last]} over {over})")
        if last == 0 and k:
            break
    every = idx + (["D"] if product else [])
    sizes = ", ".join(f"{i}={mesh.devices * draw(st.sampled_from([1, 3, 512, 4096]))}" for i in every)  # past latency
    return shardc.parse(f"{mesh}\ndims {sizes}\n" + "\n".join(lines) + "\n")


@pytest.mark.slow
@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(reduction_chains())
def test_a_chain_of_sums_is_planned_as_the_exhaustive_search_would(spec: Spec) -> None:
    """Sums and means, a value one of them alone reads handed on in any layout (partial sums too): the planner
    is never above the oracle, which reduces each partial sum wherever it is cheapest."""
    note(str(spec))
    _check(spec)
    CHAINS.append(bool(handed_on(spec)))


CHAINS: list[bool] = []


@pytest.mark.slow
@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(reduction_chains(product=True))
def test_an_einsum_then_sums_is_planned_as_the_exhaustive_search_would(spec: Spec) -> None:
    """An einsum's result one sum or mean alone reads, handed on in any layout (partial sums too), then sums and
    means: the planner is never above the oracle, which reduces each partial sum wherever it is cheapest."""
    note(str(spec))
    _check(spec)
    PRODUCTS.append("Y" in handed_on(spec))


PRODUCTS: list[bool] = []


@pytest.mark.slow
def test_many_einsums_hand_their_result_on() -> None:
    """The drawn einsums do hand their result on (read by one sum alone, declared plain), a quarter at least:
    the others are read twice or declared with an axis, and made as before."""
    if not PRODUCTS:
        test_an_einsum_then_sums_is_planned_as_the_exhaustive_search_would()
    assert len(PRODUCTS) == 40 and sum(PRODUCTS) >= 10, PRODUCTS


@pytest.mark.slow
def test_most_chains_hand_a_value_on() -> None:
    """The drawn chains do hand values on (a sum read by one sum alone), most of them."""
    if not CHAINS:
        test_a_chain_of_sums_is_planned_as_the_exhaustive_search_would()
    assert len(CHAINS) == 60 and sum(CHAINS) >= 30, CHAINS


def test_the_oracle_hands_a_sum_on_unreduced() -> None:
    """The oracle's handing on is not blind: it all-reduces the scalar, cheaper than the vector before it."""
    spec = shardc.parse("mesh d=8\ndims B=64, S=16777216\nM1[S] = sum(X[B_d, S] over B)\nM2[] = sum(M1[S] over S)\n")
    planned, best = _check(spec)
    ctx = _context(spec, shardc.plan(spec))
    oracle = Oracle(spec, ctx)
    vector = dict(oracle.moves("M1", ("S",), State(((),), frozenset({"d"}))))[State(((),), frozenset())]
    assert handed_on(spec) == {"M1"} and best == pytest.approx(planned) and best < vector


def test_an_einsum_read_by_a_sum_alone_is_reduced_after_it() -> None:
    """Past latency, the planner reduces the sum of an einsum's partial sums (B elements), as the oracle does,
    not the product (B x F) before it, which the planner before handing einsums on did (169 us against 47 us)."""
    spec = shardc.parse("mesh X=8\ndims B=4096, D=4096, F=4096\nY[B, F] = A[B, D_X] · W[D_X, F]\n"
                        "Z[B] = sum(Y[B, F] over F)\n")
    planned, best = _check(spec)
    ctx = _context(spec, shardc.plan(spec))
    whole = ((), ())
    product = dict(Oracle(spec, ctx).moves("Y", ("B", "F"), State(whole, frozenset({"X"}))))[State(whole, frozenset())]
    assert handed_on(spec) == {"Y"} and best == pytest.approx(planned) and best < product


def test_a_declared_mean_read_by_a_sum_keeps_its_whole_value() -> None:
    """An einsum read by a mean declared with an axis, read in turn by a sum: moved as asked, the mean is made
    whole and sliced, and the sum reads the whole value held on the way for free (4.77 us); the einsum's search,
    pricing the mean's moves but not the sum's after, handed the product on (5.77 us: the sum then all-reduced).
    The oracle starts the sum from every value on the mean's way to its declared layout, as the planner may."""
    spec = shardc.parse("mesh model=2, Z=2\ndims B=12, F=2048, D=2048\n"
                        "Y[B, F] = A[B_{model}, D_Z] · W[D_{model}, F_Z]\n"
                        "M1[F_{model}] = mean(Y[B, F] over B)\nM2[] = sum(M1[F_{model}] over F)\n")
    planned, best = _check(spec)
    assert best == pytest.approx(planned) and planned == pytest.approx(4.7665e-6, rel=1e-4)
    ctx = _context(spec, shardc.plan(spec))
    oracle, whole = Oracle(spec, ctx), State(((),), frozenset())
    ends = oracle.reach("M1", ("F",), {whole: 0.0}, 1.0)
    assert on_the_way(oracle, spec.statements[1].result, ends)[whole] == 0.0  # sliced from it


def test_the_oracle_finds_the_two_axis_gather() -> None:
    """The oracle itself is not blind: one AllGather over both axes beats two."""
    spec = shardc.parse("mesh X=2, Y=2\ndims B=8192, D=8192\nA2[B, D] = A[B_X, D_Y]\n")  # past latency
    planned, best = _check(spec)
    ctx = _context(spec, shardc.plan(spec))
    oracle = Oracle(spec, ctx)
    half = State(((), ("Y",)), frozenset())
    first = dict(oracle.moves("A2", ("B", "D"), State((("X",), ("Y",)), frozenset())))[half]
    second = dict(oracle.moves("A2", ("B", "D"), half))[State(((), ()), frozenset())]
    assert best == planned and best < first + second  # one collective over both axes beats two


# The constrained problem: the fastest plan whose memory a device fits a limit.  The oracle plans every
# plan of the planner's memory choices (residual policy, collective matmul, each of the search's
# candidates: :mod:`shardc.planner.memory_fit`) through the public planner, one by one, counts each one's
# memory from its whole `shardc cost` report, and takes the fastest that fits: the unconstrained plan where
# it fits, else the least step time (ties: the earlier of the enumeration below), the fastest with a note
# where nothing fits.  The planner, which counts memory only in order of step time, must pick the same.

MOST_CANDIDATES = 5  # the sum's search, up to 3 other weights (candidate_weights), the book's rules


def every_fitting_choice(spec: Spec, save: str = "default") -> list[tuple[tuple[float, float], float, Plan]]:
    """Each plan of the space, in the planner's order of preference on a tie: (its objective, its memory, it)."""
    rows = []
    with shared_search():
        for policy in (save,) + (("none",) if save == "default" else ()):
            for fused in (True, False):
                for rank in range(MOST_CANDIDATES):  # past the last candidate: the last again (no other plan)
                    with ranked(rank):
                        p = planner_plan(spec, save=policy, collective_matmul=fused)
                    report = shardc.cost(p)
                    held = report.pipeline.fullest.memory_bytes if report.pipeline else report.memory.total_bytes
                    assert plan_memory(p) == held  # the planner's count of memory is the report's
                    rows.append((objective(plan_time(p)), held, p))
    return rows


def oracle_fit(rows: list[tuple[tuple[float, float], float, Plan]], limit: float) -> tuple[Plan, bool]:
    """The plan the constrained problem asks for, and whether it fits."""
    if rows[0][1] <= limit:
        return rows[0][2], True
    fitting = [(t, i) for i, (t, held, _) in enumerate(rows) if held <= limit]
    return (rows[min(fitting)[1]][2], True) if fitting else (rows[0][2], False)


def _fitted(spec: Spec, limit: float) -> Plan:
    return planner_plan(spec, memory=plan_memory, memory_limit=limit)


def _same_plan(a: Plan, b: Plan) -> bool:
    return (a.forward, a.backward, a.recomputed, a.save) == (b.forward, b.backward, b.recomputed, b.save)


def _check_fit(spec: Spec) -> int:
    """The planner against the oracle under each limit between the plans' memories (and below all of them);
    returns how many limits made the planner leave its fastest plan."""
    rows = every_fitting_choice(spec)
    held = sorted({h for _, h, _ in rows})
    moved = 0
    for limit in [held[0] * 0.5] + held:
        want, fits = oracle_fit(rows, limit)
        got = _fitted(spec, limit)
        assert _same_plan(got, want), (limit, got.save, want.save)
        assert plan_memory(got) == plan_memory(want) and objective(plan_time(got)) == objective(plan_time(want))
        if not fits:
            assert got.memory_choices and f"least any plan of the planner's choices needs is {fmt_bytes(held[0])}" \
                in got.notes[-1], got.notes
        moved += fits and not _same_plan(got, rows[0][2])
    return moved


FIT_RUN: list[int] = []


@pytest.mark.slow
@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(small_meshes().flatmap(lambda m: specs(max_statements=3, dims=True, chains=False, headers=False, mesh=m,
                                              masks=False)))
def test_the_fastest_plan_that_fits_is_the_exhaustive_searchs(spec: Spec) -> None:
    note(str(spec))
    FIT_RUN.append(_check_fit(spec))


def test_memory_moves_the_choice_as_the_oracle_does() -> None:
    """The book's chapter-5 layer (FSDP x TP): under a limit between its plans' memories the planner leaves
    its fastest plan for the fastest that fits, says so, and shows both in --explain."""
    spec = shardc.parse((ROOT / "tests/specs/book_ch5_fsdp_tp.shard").read_text())
    assert _check_fit(spec) >= 1
    rows = every_fitting_choice(spec)
    limit = min(h for _, h, _ in rows)
    got = _fitted(spec, limit)
    fastest, chosen = got.memory_choices
    assert chosen.chosen and not fastest.chosen and fastest.memory_bytes > limit >= chosen.memory_bytes
    assert "the fastest plan needs" in got.notes[-1]
    assert _same_plan(shardc.plan(spec, memory_limit=limit), got)  # the API's, asked for a limit
    assert _same_plan(shardc.plan(spec), every_fitting_choice(spec)[0][2])  # and without: the fastest
    text = render_explain(got)
    assert "[memory]" in text and fmt_bytes(fastest.memory_bytes) in text and fmt_bytes(chosen.memory_bytes) in text


def test_a_plan_that_fits_is_left_alone() -> None:
    """Memory weighed, a plan that fits is the step-time plan itself (no note, no other plan)."""
    spec = shardc.parse((ROOT / "tests/specs/book_ch5_fsdp_tp.shard").read_text())
    plain = planner_plan(spec)
    got = _fitted(spec, plan_memory(plain))
    assert _same_plan(got, plain) and got.notes == plain.notes and not got.memory_choices


@pytest.mark.slow
def test_the_fit_oracle_saw_memory_move_the_choice() -> None:
    """The limits asked of the drawn specs did make the planner leave its fastest plan, several times."""
    if not FIT_RUN:
        test_the_fastest_plan_that_fits_is_the_exhaustive_searchs()
    assert len(FIT_RUN) == 25 and sum(FIT_RUN) >= 5, FIT_RUN
