"""The backward pass, derived mechanically from the forward nodes.

For ``C = A · B`` the gradients are einsums too, ``dA = dC · B`` and
``dB = A · dC`` (the index classes follow: the forward's free indices of A
become contracted, its contracted ones free), with ``dC`` sharded like ``C``
and each gradient required in its primal's sharding.  So the backward is not
a second rule set: it is the same einsum planning on transformed data, with
unreduced results where the forward had replicated ones.  An elementwise
``H = f(Z)`` gives ``dZ = f_vjp(Z, dH)`` in H's layout; a tensor read by
several nodes sums its gradient contributions (``add``).

What the backward may read of the forward (the residual policy):
``default`` keeps every value the forward made of activations (so a gathered
activation is not gathered again) but not gathered weights (FSDP gathers
them again); ``none`` keeps only the declared shardings; ``all`` keeps
everything the forward made.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.planner.graph import Graph, Node
from shardc.planner.ir import Op, Step
from shardc.planner.layout import Value, reshard
from shardc.planner.phase import Phase
from shardc.spec.functions import PASS_THROUGH
from shardc.spec.ir import TensorRef

__all__ = ["Backward", "plan_backward"]


@dataclass(frozen=True)
class Backward:
    phase: Phase
    residuals: tuple[TensorRef, ...]
    cotangents: tuple[TensorRef, ...]
    grads: tuple[TensorRef, ...]


def _needs_grad(graph: Graph) -> set[str]:
    needs = set(graph.params)
    if graph.inputs:
        needs.add(graph.inputs[0])
    for node in graph.nodes:
        if any(o in needs for o in node.operands):
            needs.add(node.result)
    return needs


def _contributors(graph: Graph, needs: set[str]) -> dict[str, int]:
    """How many gradient contributions each tensor receives."""
    count: dict[str, int] = {}
    for node in graph.nodes:
        if node.result in needs:
            for o in node.operands:
                if o in needs:
                    count[o] = count.get(o, 0) + 1
    return count


class _Backward:
    def __init__(self, graph: Graph, forward: Phase, declared: dict[str, TensorRef], save: str) -> None:
        self.graph, self.forward, self.declared = graph, forward, declared
        self.needs = _needs_grad(graph)
        self.count = _contributors(graph, self.needs)
        self.parts: dict[str, list[str]] = {}
        indices = dict(forward.indices)
        indices.update({f"d{n}": idx for n, idx in forward.indices.items()})
        ahead = frozenset(graph.params) | frozenset(f"d{p}" for p in graph.params)
        self.phase = Phase("backward", forward.ctx, indices, forward.sized, ahead)
        for name, ref in declared.items():
            self.phase.hold(name, Value.of(ref))
        for name, values in forward.held.items():
            for value in values:
                if (name, value) in forward.made and self._kept(name, save):
                    self.phase.hold(name, value)

    def _kept(self, name: str, save: str) -> bool:
        return save == "all" or (save == "default" and name not in self.graph.params)

    def target(self, name: str) -> Value:
        return Value(self.declared[name].layout, ())

    def grad_name(self, name: str) -> str:
        """``dX``, or ``dX_k`` for the k-th of several contributions."""
        if self.count.get(name, 0) <= 1:
            return f"d{name}"
        parts = self.parts.setdefault(name, [])
        part = f"d{name}_{len(parts) + 1}"
        parts.append(part)
        self.phase.indices[part] = self.phase.indices[name]
        return part

    def finish(self, name: str) -> None:
        """Sum the contributions of ``name``'s gradient, once all have arrived."""
        parts = self.parts.get(name)
        if not parts:
            return
        target = self.target(name)
        grad = f"d{name}"
        operands = tuple(self.phase.ref(p, target) for p in parts)
        self.phase.emit(Step(Op.ELEMENTWISE, grad, self.phase.ref(grad, target), operands=operands, fn="add"))

    def node(self, node: Node) -> None:
        if node.result not in self.needs:
            return
        self.finish(node.result)
        grad = f"d{node.result}"
        if node.kind == "elementwise":
            self.elementwise(node, grad)
            return
        if len(node.operands) == 1:
            (a,) = node.operands
            if a in self.needs:
                dst = self.grad_name(a)
                self.phase.einsum(dst, (grad,), self.target(a), f"{dst} from {grad}")
            return
        a, b = node.operands
        # The right operand first (usually the weight, as in the book's listings): its
        # gradient's reduction can then be issued while the rest of the backward runs.
        if b in self.needs:
            dst = self.grad_name(b)
            self.phase.einsum(dst, (a, grad), self.target(b), self.label(dst, b, a, grad))
        if a in self.needs:
            dst = self.grad_name(a)
            self.phase.einsum(dst, (grad, b), self.target(a), self.label(dst, a, grad, b))

    def label(self, dst: str, primal: str, left: str, right: str) -> str:
        def text(name: str) -> str:
            return str(self.phase.ref(name, self.phase.held[name][0]))

        return f"{self.phase.ref(dst, self.target(primal))} = {text(left)} · {text(right)}"

    def elementwise(self, node: Node, grad: str) -> None:
        (z,) = node.operands
        if z not in self.needs:
            return
        layout = self.target(node.result).layout
        by_index = dict(zip(node.indices, layout, strict=True))
        want = Value(tuple(by_index[i] for i in self.phase.indices[z]), ())
        dst = self.grad_name(z)
        cotangent = self.phase.ref(grad, self.target(node.result))
        if node.fn in PASS_THROUGH:  # the gradient is the cotangent, in the argument's index order
            self.phase.emit(Step(Op.ELEMENTWISE, dst, self.phase.ref(dst, want), operands=(cotangent,),
                                 fn=node.fn))
        else:
            _, moves = reshard(self.phase.ctx, z, self.phase.indices[z], self.phase.held[z], want)
            self.phase.moves(z, moves, note="residual for the elementwise gradient")
            self.phase.emit(Step(Op.ELEMENTWISE, dst, self.phase.ref(dst, want),
                                 operands=(self.phase.ref(z, want), cotangent), fn=f"{node.fn}_vjp"))
        if want != self.target(z):
            _, moves = reshard(self.phase.ctx, dst, self.phase.indices[dst], (want,), self.target(z))
            self.phase.moves(dst, moves)


def plan_backward(graph: Graph, forward: Phase, declared: dict[str, TensorRef], save: str) -> Backward:
    bw = _Backward(graph, forward, declared, save)
    cotangents = []
    for out in graph.outputs:
        if out in bw.needs:
            ref = bw.phase.ref(f"d{out}", bw.target(out))
            bw.phase.hold(f"d{out}", bw.target(out))
            cotangents.append(ref)
    for node in reversed(graph.nodes):
        bw.node(node)
    wanted = sorted(graph.params, key=lambda n: list(declared).index(n))
    if graph.inputs and graph.inputs[0] not in graph.params:
        wanted.insert(0, graph.inputs[0])
    for name in wanted:
        bw.finish(name)
    grads = tuple(bw.phase.ref(f"d{n}", bw.target(n)) for n in wanted)
    residuals = _residuals(bw.phase, forward)
    return Backward(bw.phase, residuals, tuple(cotangents), grads)


def _residuals(backward: Phase, forward: Phase) -> tuple[TensorRef, ...]:
    """Values the backward reads that the forward made (what must be kept between them)."""
    made_here = {(s.tensor, Value.of(s.dst)) for s in backward.steps}
    seen: dict[TensorRef, None] = {}
    for step in backward.steps:
        reads = list(step.operands) + ([step.src] if step.src is not None else [])
        for ref in reads:
            key = (ref.name, Value.of(ref))
            if key in forward.made and key not in made_here:
                seen.setdefault(ref, None)
    return tuple(seen)
