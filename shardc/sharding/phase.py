"""One phase being planned: the values it holds, the steps it emits.

Forward and backward are planned by the same code: a phase holds, per tensor,
every value it has made or been given (so a value is collected once and reused,
as the book gathers dOut once for both dW_out and dTmp), and turns each einsum
into steps through :func:`shardc.sharding.einsum.solve` (with sizes) or the book's
rules (without).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shardc.collectives import FACTOR
from shardc.errors import ShardcError, Span
from shardc.ir.localops import ALIAS
from shardc.ir.plan import Alternative, Choice, Op, Step, sum_formula
from shardc.ir.spec import DType, TensorRef
from shardc.sharding.einsum import EinsumProblem, NoPlan, Operand, Reader, Solution, solve
from shardc.sharding.einsum_rules import solve_rules
from shardc.sharding.layout import ZERO, Cost, CostContext, Move, Value, add_cost
from shardc.sharding.search import reshard

__all__ = ["Phase", "Traced"]

Traced = tuple[object, EinsumProblem, "tuple[Value, ...] | None", Solution]




@dataclass
class Phase:
    name: str  # "forward" or "backward"
    ctx: CostContext
    indices: dict[str, tuple[str, ...]]
    sized: bool
    ahead: frozenset[str]  # tensors whose collectives can be issued ahead
    steps: list[Step] = field(default_factory=list)
    held: dict[str, list[Value]] = field(default_factory=dict)
    made: set[tuple[str, Value]] = field(default_factory=set)  # values this phase made
    # a rename and its source, both ways: a value made of one is the other's too (one array)
    aliases: dict[str, list[str]] = field(default_factory=dict)
    choices: list[Choice] = field(default_factory=list)
    solved: dict[object, tuple[Solution, tuple[tuple[Alternative, ...], str]]] = field(default_factory=dict)
    sums: dict[object, object] = field(default_factory=dict)  # the sums searched (by the sums family, shardc.ops.sums)
    # every solve's (key, problem, given values, solution), in order: see shardc.planner.candidates.same_steps
    trace: list[Traced] | None = None
    # tensor -> the (value, contracted indices, type) its GEMMs of a `gemm` type quantized it for (Operand.quantized)
    quantized: dict[str, set[tuple[Value, frozenset[str], DType]]] = field(default_factory=dict)

    def hold(self, name: str, value: Value) -> None:
        values = self.held.setdefault(name, [])
        if value not in values:
            values.append(value)

    def natural(self, name: str, declared: TensorRef | None) -> Value:
        """The reduced layout a map with no declared result reads ``name`` in.

        Its declared sharding when held (a statement result as written: `dropout(A)` reads A as
        the statement made it, not the partial sums it was made from), else the first reduced
        value held, else the first value with its partial sums dropped (to be reduced).
        """
        values = self.held[name]
        if declared is not None and not declared.unreduced and Value.of(declared) in values:
            return Value.of(declared)
        reduced = next((v for v in values if not v.unreduced), None)
        return reduced if reduced is not None else Value(values[0].layout, ())

    def map_argument(self, arg: str, result: str, indices: tuple[str, ...], target: Value | None,
                     declared: TensorRef | None, what: str, span: Span | None) -> tuple[Value, Value]:
        """(the result's layout, the argument's) of a map computed where its result is, the argument
        moved there: reduced, read index by index (the result's indices may be the argument's permuted).
        No declared result: the argument's :meth:`natural` layout. ``what`` names the map in the error."""
        arg_idx = self.indices[arg]
        if target is None:
            held = dict(zip(arg_idx, self.natural(arg, declared).layout, strict=True))
            target = Value(tuple(held[i] for i in indices), ())
        if target.unreduced:
            raise ShardcError(f"{result} is {what} of partial sums", span,
                              fix="drop the {U_...} suffix: the function needs reduced values")
        by_index = dict(zip(indices, target.layout, strict=True))
        want = Value(tuple(by_index[i] for i in arg_idx), ())
        _, moves = reshard(self.ctx, arg, arg_idx, self.held[arg], want)
        self.moves(arg, moves)
        return target, want

    def ref(self, name: str, value: Value) -> TensorRef:
        key = (name, self.indices[name], value)
        hit = self.ctx.refs.get(key)
        if hit is None:  # candidate plans repeat: the same refs are made again and again
            hit = self.ctx.refs[key] = value.ref(name, key[1])
        return hit

    def text(self, name: str, value: Value) -> str:
        """``str(self.ref(name, value))``, made once: layers repeat the same labels."""
        key = (name, self.indices[name], value)
        hit = self.ctx.texts.get(key)
        if hit is None:
            hit = self.ctx.texts[key] = str(self.ref(name, value))
        return hit

    def emit(self, step: Step, value: Value | None = None) -> None:
        """Append ``step``; ``value`` is its destination's, when the caller has it at hand."""
        self.steps.append(step)
        if value is None:
            value = Value.of(step.dst)
        self.hold(step.tensor, value)
        self.made.add((step.tensor, value))
        for other in self.aliases.get(step.tensor, ()):
            if value not in self.held.get(other, ()):  # e.g. L1 gathered for Q is Kx gathered for K
                self.emit(Step(Op.ELEMENTWISE, other, self.ref(other, value),
                               operands=(self.ref(step.tensor, value),), fn=ALIAS), value)

    def link(self, source: str, rename: str) -> None:
        """From now on, every value held or made of ``source`` is also ``rename``'s, and back."""
        self.aliases.setdefault(source, []).append(rename)
        self.aliases.setdefault(rename, []).append(source)
        for name, other in ((source, rename), (rename, source)):
            for value in list(self.held.get(name, ())):
                if value not in self.held.get(other, ()):
                    self.emit(Step(Op.ELEMENTWISE, other, self.ref(other, value),
                                   operands=(self.ref(name, value),), fn=ALIAS), value)

    def mark_once(self, start: int) -> None:
        """The steps from ``start`` on run once, not once a layer (outside a ``layers`` block)."""
        self.steps[start:] = [replace(s, once=True) for s in self.steps[start:]]

    def mark_block(self, start: int, block: int | None) -> None:
        """The steps from ``start`` on repeat in ``block`` (:meth:`Spec.block_of`); None: they run once."""
        if block is None:
            self.mark_once(start)
        elif block:
            self.steps[start:] = [replace(s, block=block) for s in self.steps[start:]]

    def moves(self, tensor: str, moves: tuple[Move, ...], note: str = "") -> None:
        for m in moves:
            self.emit(Step(m.op, tensor, self.ref(tensor, m.dst), self.ref(tensor, m.src), m.axes,
                           dim=m.dim, dim2=m.dim2, volume=m.volume, ahead=tensor in self.ahead,
                           note=note, routed=self.ctx.routed(m.op, self.indices.get(tensor), (m.dim, m.dim2))),
                      m.dst)

    def einsum(self, result: str, operands: tuple[str, ...], target: Value | None,
               label: str, rule_given: tuple[Value, ...] | None = None, span: Span | None = None,
               partial: bool = False, reader: Reader | None = None) -> Value:
        """Plan one einsum into steps; returns the result value it ends in.

        ``partial``: without a target, the result may stay partial sums (a term of a sum).  ``reader``: the one
        sum or mean the result goes to (``graph.handed_on``); where moving that reader's result after is cheaper
        than moving this one as asked, the result is handed on as made, partial sums kept (:class:`Reader`).
        """
        gemm = self.gemm(result, operands)
        problem = EinsumProblem(tuple(self.operand(n, gemm) for n in operands), result, self.indices[result],
                                target, partial, reader)
        # Layers repeat: the same problem (up to names) is solved and explained once.
        key = self.key(problem, rule_given)
        hit = self.solved.get(key)
        if hit is None:
            try:
                sol, alternatives = self.solve(problem, rule_given)
            except NoPlan:
                raise ShardcError(
                    f"no sharding of the operands makes {label.split(' = ')[0]}", span,
                    fix="partial sums {U_..} can only come from axes that shard a contracted index "
                        "or an unreduced operand: drop the suffix or shard a contracted index") from None
            hit = (sol, self.explain(sol, alternatives) if self.ctx.explain else ((), ""))
            self.solved[key] = hit
        sol, (rows, reason) = hit
        for op, moves in zip(operands, sol.operand_moves, strict=True):
            self.moves(op, moves)
        local = tuple(self.ref(n, v) for n, v in zip(operands, sol.locals, strict=True))
        copy = len(operands) == 1 and set(self.indices[operands[0]]) == set(self.indices[result])
        self.emit(Step(Op.COPY if copy else Op.EINSUM, result, self.ref(result, sol.local_result), operands=local),
                  sol.local_result)
        if gemm is not None:
            self.record(operands, sol.locals, *gemm)
        self.moves(result, sol.result_moves)
        if self.ctx.explain:
            self.choices.append(Choice(self.name, label, rows, reason))
        return sol.final

    def gemm(self, result: str, operands: tuple[str, ...]) -> tuple[frozenset[str], DType] | None:
        """The indices of ``result`` and the type its einsum quantizes its inputs to, where that is a GEMM a
        ``gemm`` line names (:meth:`CostContext.gemm_kind`); None for any other einsum."""
        kept = frozenset(self.indices[result])
        if {i for n in operands for i in self.indices[n]} <= kept:
            return None
        kind = self.ctx.gemm_kind(result, operands)
        return None if kind is None else (kept, kind)

    def record(self, operands: tuple[str, ...], locals_: tuple[Value, ...], kept: frozenset[str], kind: DType) -> None:
        """A GEMM into ``kept`` quantized ``operands`` read as ``locals_`` to ``kind`` (:attr:`quantized`)."""
        for name, value in zip(operands, locals_, strict=True):
            along = frozenset(i for i in self.indices[name] if i not in kept)
            self.quantized.setdefault(name, set()).add((value, along, kind))

    def operand(self, name: str, gemm: tuple[frozenset[str], DType] | None) -> Operand:
        """``name`` as an einsum reads it; of a quantizing GEMM (``gemm``: :meth:`gemm`), also the value the
        last step made of it where a quantize pass fuses into that step, and the values of it the phase's
        GEMMs quantized already as this one does (the same contraction and type: those alone share a pass,
        :func:`shardc.sharding.einsum.quantize_bytes`)."""
        sources = tuple(self.held[name])
        if gemm is None:
            return Operand(name, self.indices[name], sources)
        last = self.steps[-1] if self.steps else None
        fusible = self.ctx.fusible
        fresh = Value.of(last.dst) if last is not None and last.tensor == name and fusible and fusible(last) else None
        along = frozenset(i for i in self.indices[name] if i not in gemm[0])
        done = frozenset(v for v, a, kind in self.quantized.get(name, ()) if (a, kind) == (along, gemm[1]))
        return Operand(name, self.indices[name], sources, fresh, done)

    def key(self, problem: EinsumProblem, rule_given: tuple[Value, ...] | None) -> object:
        """``problem`` up to names: what its solution depends on."""
        kind, readers, reader = self.ctx.kind, [], problem.reader
        while reader is not None:  # the sums it is handed on through, each as its search prices it
            readers.append((reader.over, reader.indices, reader.target, kind(reader.result)))
            reader = reader.then
        return (tuple((o.indices, o.sources, kind(o.name), o.fresh, o.quantized) for o in problem.operands),
                problem.indices, problem.target, kind(problem.result), self.name, rule_given, problem.partial,
                self.ctx.gemm_kind(problem.result, [o.name for o in problem.operands]), tuple(readers))

    def solve(self, problem: EinsumProblem,
              rule_given: tuple[Value, ...] | None) -> tuple[Solution, list[Solution]]:
        found = self._solve(problem, rule_given)
        if self.trace is not None:
            self.trace.append((self.key(problem, rule_given), problem, rule_given, found[0]))
        return found

    def _solve(self, problem: EinsumProblem,
               rule_given: tuple[Value, ...] | None) -> tuple[Solution, list[Solution]]:
        if len(problem.operands) == 1 and set(problem.indices) >= set(problem.operands[0].indices):
            return self.solve_copy(problem), []
        if self.sized:
            key = (self.key(problem, rule_given), self.ctx.compute_weight, self.ctx.ahead_weight, self.ctx.explain)
            hit = self.ctx.solutions.get(key)
            if hit is None:
                hit = self.ctx.solutions[key] = solve(self.ctx, problem)
            return hit
        # the rules read each operand's given (reduced) value, not a partial sum held on the way
        given = rule_given or tuple(next((v for v in op.sources if not v.unreduced), op.sources[0])
                                    for op in problem.operands)
        return solve_rules(self.ctx, problem, given), []

    def solve_copy(self, problem: EinsumProblem) -> Solution:
        """A copy or transpose: read a held value as it is, then reshard the result."""
        (op,) = problem.operands
        best: Solution | None = None
        for source in op.sources:
            if problem.target is not None and not source.reaches(problem.target):
                continue  # partial sums cannot be made from reduced values
            layout = {i: axes for i, axes in zip(op.indices, source.layout, strict=True)}
            local = Value(tuple(layout[i] for i in problem.indices), source.unreduced)
            cost: Cost = ZERO
            moves: tuple[Move, ...] = ()
            if problem.target is not None:
                cost, moves = reshard(self.ctx, problem.result, problem.indices, (local,), problem.target)
            sol = Solution(add_cost(ZERO, cost), ((),), (source,), local, moves, ())
            if best is None or sol.cost < best.cost:
                best = sol
        if best is None:
            raise NoPlan(problem.result)
        return best

    def explain(self, sol: Solution, alternatives: list[Solution]) -> tuple[tuple[Alternative, ...], str]:
        """The alternatives worth showing (at most six, cheapest first) and why ``sol`` won."""
        chosen = self._describe(sol)
        rows: dict[str, Alternative] = {}
        for alt in sorted(alternatives, key=lambda s: s.cost):
            text = self._describe(alt)
            if text not in rows and len(rows) < 6:
                rows[text] = self._alternative(alt, text, text == chosen)
        rows.setdefault(chosen, self._alternative(sol, chosen, True))
        if not self.sized:
            reason = "no sizes: the book's rules decide"
        elif len(alternatives) <= 1:
            reason = "the only valid local layout"
        else:
            reason = self._reason(sol, alternatives)
        return tuple(rows.values()), reason

    def _describe(self, sol: Solution) -> str:
        """Its moves, its readers' after it (counted in its time) marked as theirs, as a handed-on sum's are."""
        names = [m for moves in sol.operand_moves for m in moves] + list(sol.result_moves)
        parts = [f"{m.op.title}_{''.join(m.axes)}" for m in names if m.op is not Op.SLICE]
        parts += [f"{m.op.title}_{''.join(m.axes)} (its reader's)" for m in sol.reader_moves if m.op is not Op.SLICE]
        return ", ".join(parts) if parts else "no communication"

    def _alternative(self, sol: Solution, text: str, chosen: bool) -> Alternative:
        moves = [m for ms in sol.operand_moves for m in ms] + list(sol.result_moves) + list(sol.reader_moves)
        terms = [m.volume.scale(FACTOR[m.op]) for m in moves if m.volume is not None]
        volume = sum_formula(terms)
        time = sol.cost[0] if self.sized else None
        return Alternative(text, time, volume, sol.cost[1], chosen)

    def _reason(self, sol: Solution, alternatives: list[Solution]) -> str:
        others = [a for a in alternatives if self._describe(a) != self._describe(sol)]
        if not others:
            return "every valid local layout communicates the same way"
        runner = min(others, key=lambda s: s.cost)
        if runner.cost[0] > sol.cost[0] * (1 + 1e-9):
            what = "least time, compute + communication" if self.ctx.compute_weight else "least communication time"
            return f"{what} ({sol.cost[0]:.3g} s vs {runner.cost[0]:.3g} s next)"
        if runner.cost[1] != sol.cost[1]:
            return "tie in time: fewer collectives"
        return "tie in time and count: moves weights rather than activations"
