"""The backward pass, derived mechanically from the forward nodes.

For ``C = A · B`` the gradients are einsums too, ``dA = dC · B`` and
``dB = A · dC`` (the index classes follow: the forward's free indices of A
become contracted, its contracted ones free), with ``dC`` sharded like ``C``
and each gradient required in its primal's sharding.  So the backward is not
a second rule set: it is the same einsum planning on transformed data, with
unreduced results where the forward had replicated ones.  An elementwise
``H = f(Z)`` gives ``dZ = f_vjp(Z, dH)`` in H's layout.

Every param and every input not declared ``const`` gets a gradient.  A tensor
read by several nodes sums its gradient contributions (``add``), and sums them
before moving them: each contribution stays as its einsum made it (partial sums
over the contracted axes, say), contributions made alike are added, and only the
sum is reduced to the primal's sharding.  Every collective is linear, so one
AllReduce of ``dX_1 + dX_2`` is the two AllReduces of the parts, at half the
bytes (a SwiGLU's gate and up projections both give partial ``dX``).  A tensor whose
node's backward reads its cotangent as held (``Family.held_cotangent``: a norm's) gets
it unreduced instead, and that rule's search chooses the reduction: a ReduceScatter
where the norm's backward runs sharded, not an AllReduce to its declared layout.

What the backward may read of the forward (the residual policy):
``default`` keeps every value the forward made of activations (so a gathered
activation is not gathered again) but not gathered weights (FSDP gathers
them again); ``none`` keeps only the declared shardings; ``all`` keeps
everything the forward made.

Under ZeRO-1 (:mod:`shardc.planner.zero`) a param's gradient is left partial over the
ZeRO axes its einsum sums over (``partial``): the optimizer phase reduce-scatters it,
from the layout the einsum made it in where that slices the param's further (no AllGather
back to the param's layout that the move onto the shard would slice again).
Under ZeRO-2 it is made on the param's ZeRO shard (``shards``): reduce-scattered as
it is made, as DeepSpeed's stage 2 does, so no device holds the whole gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.ir.localops import add_op
from shardc.ir.plan import Op, Step
from shardc.ir.spec import TensorRef
from shardc.names import fresh
from shardc.ops.registry import Node
from shardc.planner.graph import Graph
from shardc.sharding.einsum import EinsumProblem, NoPlan
from shardc.sharding.layout import Layout, Value
from shardc.sharding.phase import Phase
from shardc.sharding.search import reshard

__all__ = ["Backward", "plan_backward"]


@dataclass(frozen=True)
class Backward:
    phase: Phase
    residuals: tuple[TensorRef, ...]
    cotangents: tuple[TensorRef, ...]
    grads: tuple[TensorRef, ...]


def _needs_grad(graph: Graph) -> set[str]:
    """Params, inputs not declared ``const``, and every tensor computed from one of them
    (but a family's result without a gradient, such as a ``route`` mask: a 0/1 function of its
    gates, like token ids), each only where an output's gradient reaches it (gates read by a
    route alone get none)."""
    needs = set(graph.params) | set(graph.differentiable)
    for node in graph.nodes:
        if _has_gradient(node) and any(o in needs for o in node.operands):
            needs.add(node.result)
    live = set(graph.outputs)
    for node in reversed(graph.nodes):
        if _has_gradient(node) and node.result in live:
            live.update(_reached(node))
    return needs & live


def _reached(node: Node) -> tuple[str, ...]:
    """The operands a node's gradient reaches (its family says; by default all)."""
    reaches = node.family.reaches
    return node.operands if reaches is None else tuple(o for o, r in zip(node.operands, reaches(node), strict=True)
                                                       if r)


def _has_gradient(node: Node) -> bool:
    return node.family.backward is not None


def _contributors(graph: Graph, needs: set[str]) -> dict[str, int]:
    """How many gradient contributions each tensor receives."""
    count: dict[str, int] = {}
    for node in graph.nodes:
        if node.result in needs:
            for o in _reached(node):
                if o in needs:
                    count[o] = count.get(o, 0) + 1
    return count


def _renames(graph: Graph, needs: set[str], count: dict[str, int]) -> frozenset[str]:
    """Renames' results: their gradient's contributions are kept as made, to become their source's."""
    renamed = set()
    for node in graph.nodes:
        if node.family.aliases(node) and node.result in needs:
            (src,) = node.operands
            made = count.get(node.result, 0)
            count[src] = count.get(src, 0) + max(made, 1) - 1  # one per contribution to the alias
            count[node.result] = max(made, 2)  # kept as made (see shardc.ops.sums)
            renamed.add(node.result)
    return frozenset(renamed)


class _Backward:
    def __init__(self, graph: Graph, forward: Phase, declared: dict[str, TensorRef], save: str,
                 partial: dict[str, tuple[tuple[str, ...], Layout]], shards: dict[str, Layout]) -> None:
        self.graph, self.forward, self.declared = graph, forward, declared
        self.shards = shards  # param -> the ZeRO-2 shard its gradient is made on
        self.partial = partial  # param -> (ZeRO axes its gradient may be left partial over, its ZeRO shard)
        self.final: dict[str, Value] = {}  # a tensor's gradient as the backward leaves it, where not its target
        self.needs = _needs_grad(graph)
        self.count = _contributors(graph, self.needs)
        self.renamed = _renames(graph, self.needs, self.count)
        self.grads = graph.grads
        outputs = set(graph.outputs)
        # tensors whose gradient its node's backward reads as held (Family.held_cotangent): not reduced here
        self.deferred = frozenset(n.result for n in graph.nodes if n.family.held_cotangent and n.result not in outputs
                                  and n.result not in partial and n.result not in shards)
        self.taken = set(graph.names) | set(graph.grads.values())  # for the parts' names
        self.parts: dict[str, list[tuple[str, Value]]] = {}  # tensor -> its contributions, as made
        indices = dict(forward.indices)
        indices.update({grad: graph.indices[name] for name, grad in graph.grads.items()})
        ahead = frozenset(graph.params) | frozenset(graph.grads[p] for p in graph.params)
        self.phase = Phase("backward", forward.ctx, indices, forward.sized, ahead, trace=forward.trace,
                           aliases={k: list(v) for k, v in forward.aliases.items()})  # renames stay one array
        for name, ref in declared.items():
            self.phase.hold(name, Value.of(ref))
        for name, values in forward.held.items():
            for value in values:
                if (name, value) in forward.made and self._kept(name, save):
                    self.phase.hold(name, value)

    def _kept(self, name: str, save: str) -> bool:
        return save == "all" or (save == "default" and name not in self.graph.params)

    def target(self, name: str) -> Value:
        shard = self.shards.get(name)
        return Value(shard if shard is not None else self.declared[name].layout, ())

    def left_partial(self, name: str, made: list[Value]) -> Value:
        """``name``'s gradient target under ZeRO-1/2: partial over the ZeRO axes every value in
        ``made`` is partial over, or the ZeRO shard itself when that is what was made."""
        target = self.target(name)
        if name not in self.partial:
            return target
        axes, shard = self.partial[name]
        keep = tuple(a for a in sorted(axes) if all(a in v.unreduced for v in made))
        if keep:
            target = Value(_finer(target.layout, made), keep)
        elif all(v == Value(shard, ()) for v in made):
            target = Value(shard, ())
        else:
            return target
        self.final[name] = target
        return target

    def part_name(self, name: str) -> str:
        """The gradient's name, or ``dX_k`` for the k-th of several contributions."""
        if self.count.get(name, 0) <= 1:
            return self.grads[name]
        part = fresh(f"{self.grads[name]}_{len(self.parts.get(name, ())) + 1}", self.taken)
        self.phase.indices[part] = self.phase.indices[name]
        return part

    def contribute(self, primal: str, operands: tuple[str, ...], label: tuple[str, ...]) -> None:
        """One einsum contribution to ``primal``'s gradient (kept as made when there are several)."""
        dst = self.part_name(primal)
        want = self.target(primal)
        if self.count.get(primal, 0) > 1 or primal in self.deferred:
            want = self._local_result(dst, operands, want)
        elif primal in self.partial:
            want = self.left_partial(primal, [self._local_result(dst, operands, want)])
        text = f"{self.phase.text(dst, want)} = " + " · ".join(self._text(n) for n in label)
        made = self.phase.einsum(dst, operands, want, text)
        if self.count.get(primal, 0) > 1:
            self.parts.setdefault(primal, []).append((dst, made))

    def _local_result(self, dst: str, operands: tuple[str, ...], target: Value) -> Value:
        """What the einsum planned for ``target`` computes before moving its result there (its operands as
        :meth:`shardc.sharding.phase.Phase.einsum` reads them, so the solution is the one it makes)."""
        gemm = self.phase.gemm(dst, operands)
        problem = EinsumProblem(tuple(self.phase.operand(n, gemm) for n in operands), dst, self.phase.indices[dst],
                                target)
        try:
            solution, _ = self.phase.solve(problem, None)
        except NoPlan:
            return target  # the einsum itself reports it, with the statement's span
        return solution.local_result

    def _text(self, name: str) -> str:
        return self.phase.text(name, self.phase.held[name][0])

    def settle(self, primal: str, dst: str, value: Value) -> None:
        """A contribution ``dst`` to ``primal``'s gradient, made as ``value``: kept as made to be
        summed when there are several, else moved to the primal's sharding."""
        if self.count.get(primal, 0) > 1:
            self.parts.setdefault(primal, []).append((dst, value))
        elif value != self.target(primal) and primal not in self.deferred:
            self._move(dst, value, self.target(primal))

    def _move(self, name: str, src: Value, dst: Value) -> None:
        _, moves = reshard(self.phase.ctx, name, self.phase.indices[name], (src,), dst)
        self.phase.moves(name, moves)

    def _add(self, name: str, parts: list[str], value: Value, values: list[Value] | None = None) -> None:
        """``name`` = the sum of ``parts``, each held as ``value`` (or as its entry of ``values``: partial over
        fewer axes than the sum, it is added on coordinate 0 of the others, :mod:`shardc.ops.sums`)."""
        operands = tuple(self.phase.ref(p, v) for p, v in zip(parts, values or [value] * len(parts), strict=True))
        self.phase.emit(Step(Op.ELEMENTWISE, name, self.phase.ref(name, value), operands=operands,
                             fn=add_op(len(operands))))

    def finish(self, name: str, into: str | None = None) -> None:
        """Sum the contributions of ``name``'s gradient, once all have arrived, into its gradient (or
        ``into``).

        Contributions made alike (same layout, same partial sums) are added first and
        moved once; only then do the sums meet in the primal's sharding.
        """
        parts = self.parts.pop(name, None)
        if not parts:
            return
        target, grad = self.left_partial(name, [v for _, v in parts]), into or self.grads[name]
        groups: dict[Value, list[str]] = {}
        for part, value in parts:
            groups.setdefault(value, []).append(part)
        if name in self.deferred:
            target = _still_partial(target, list(groups))
        if len(groups) == 1 and name in self.deferred:
            ((value, names),) = groups.items()
            self._add(grad, names, value)  # handed over as made
            return
        if len(groups) == 1:
            ((value, names),) = groups.items()
            self._add(grad, names, value)
            self._move(grad, value, target)
            return
        sums, held = [], []
        for value, names in groups.items():
            total = names[0]
            if len(names) > 1:
                total = fresh(f"{grad}_sum", self.taken)
                self.phase.indices[total] = self.phase.indices[name]
                self._add(total, names, value)
            want = Value(target.layout, tuple(a for a in target.unreduced if a in value.unreduced))
            self._move(total, value, want)
            sums.append(total)
            held.append(want)
        self._add(grad, sums, target, held)

    def close_layer(self, name: str, since: int) -> None:
        """``name``, a ``layers`` block's input that statements before the block read too: the
        contributions the block's backward made (those after the first ``since``) summed into one, in
        the input's sharding, as each layer hands its input's gradient back; those of the statements
        before the block add to it once."""
        every = self.parts.get(name, [])
        made = every[since:]
        if len(made) < 2 and all(v == self.target(name) for _, v in made):
            return
        total = fresh(f"{self.grads[name]}_layer", self.taken)
        self.phase.indices[total] = self.phase.indices[name]
        self.parts[name] = made
        self.finish(name, into=total)
        self.parts[name] = [*every[:since], (total, self.target(name))]

    def hand_back(self, name: str) -> None:
        """A ``layers`` block's input ``name``: each layer hands its gradient to the layer before as
        that layer made its output, in the declared sharding (moved there as the block's last step),
        and the statements before the block read it so, never as a layer held it on the way."""
        grad = self.grads[name]
        held, target = self.phase.held.get(grad), self.target(name)
        if not held or name in self.partial or name in self.shards:
            return
        if target not in held:
            self._move(grad, held[0], target)
        self.phase.held[grad] = [target]

    def node(self, node: Node) -> None:
        if node.result not in self.needs:
            return
        if node.result in self.renamed:  # its gradient's contributions pass on as made, never summed here
            assert node.family.backward is not None
            node.family.backward(self, node, self.grads[node.result])
            return
        self.finish(node.result)
        grad = self.grads[node.result]
        if node.family.backward is not None:
            node.family.backward(self, node, grad)


def plan_backward(graph: Graph, forward: Phase, declared: dict[str, TensorRef], save: str,
                  partial: dict[str, tuple[tuple[str, ...], Layout]] | None = None,
                  shards: dict[str, Layout] | None = None, blocks: tuple[int | None, ...] = ()) -> Backward:
    """The backward; under ZeRO-1 ``partial`` params' gradients may stay partial sums, under ZeRO-2
    ``shards`` params' gradients are made on their ZeRO shard (:mod:`shardc.planner.zero`); ``blocks``
    gives each node's ``layers`` block (None: outside every block, its steps run once, not once a layer;
    empty: every node repeats alike)."""
    bw = _Backward(graph, forward, declared, save, partial or {}, shards or {})
    cotangents = []
    for out in graph.outputs:
        if out in bw.needs:
            name = graph.grads[out]
            cotangents.append(bw.phase.ref(name, bw.target(out)))
            bw.phase.hold(name, bw.target(out))
    readers = _readers(graph, blocks)
    repeated = {n for n, where in readers.items() if where - {None}}
    # a data input a block and a statement before it both read: its contributions before the block's
    # backward began (from statements after the block), counted when it begins; a param only one block
    # reads is each layer's own, its gradient summed in that layer (read twice there: W · W · X)
    own = {n for n in graph.params if len(readers.get(n, ())) == 1 and None not in readers[n]}
    inputs = sorted(n for n in repeated & set(graph.inputs) - own if n not in bw.partial and n not in bw.shards)
    inputs += _read_around(graph, blocks, readers)  # a value made outside, read in a block and outside it, so too
    entered: dict[str, int] = {}
    last = len(graph.nodes) - 1
    after = _read_after(graph, blocks)
    for k in reversed(range(len(graph.nodes))):
        here, later = (blocks[k], blocks[k + 1] if k < last else None) if blocks else (None, None)
        if here is not None and after:  # leaving the statements after the block: the gradients only
            start = len(bw.phase.steps)  # they contribute to (a head two losses share) summed there
            for name in after:
                bw.finish(name)
            bw.phase.mark_block(start, None)
            after = []
        if later is not None and here != later:
            start = len(bw.phase.steps)
            for name in (n for n in inputs if later in readers[n]):  # block `later`'s backward ends: each
                bw.close_layer(name, entered[name])  # layer's sum of its input's gradient
            for name in (n for n in own if later in readers[n]):  # and of its own params' (W · W · X)
                bw.finish(name)
            for name in _fed_only(graph, readers, later, k):  # and of the values made before it it alone
                bw.finish(name)  # reads (X0, E), before any statement before it runs its backward
                bw.hand_back(name)
            bw.phase.mark_block(start, later)  # each layer of that block runs them
        if here is not None and here != later:
            entered = {n: len(bw.parts.get(n, ())) for n in inputs}
        reading = readers.get(graph.nodes[k].result, set()) - {None, here}
        if blocks and reading:  # a block's input made outside it: summed once a layer of that block
            start = len(bw.phase.steps)
            bw.finish(graph.nodes[k].result)
            bw.hand_back(graph.nodes[k].result)
            layered = len(reading) == 1 and graph.nodes[k].result not in inputs  # else its layers' sum is made
            bw.phase.mark_block(start, next(iter(reading)) if layered else None)  # and this adds the rest once
        if here is not None and None in readers.get(graph.nodes[k].result, set()):
            start = len(bw.phase.steps)  # the block's output read after it: the contributions of the
            bw.finish(graph.nodes[k].result)  # statements after the block summed there, once
            bw.phase.mark_block(start, None)
        start = len(bw.phase.steps)
        bw.node(graph.nodes[k])
        if blocks:
            bw.phase.mark_block(start, here)
    wanted = [n for n in graph.inputs if n in bw.needs]
    for name in wanted:
        start = len(bw.phase.steps)
        bw.finish(name)
        inside = readers.get(name, set()) - {None}
        if blocks:  # a ZeRO param's gradient stays its block's; every other input's is summed once
            alone = next(iter(inside)) if len(inside) == 1 and name not in inputs else None
            bw.phase.mark_block(start, alone)
    grads = tuple(bw.phase.ref(graph.grads[n], bw.final.get(n, bw.target(n))) for n in wanted)
    residuals = _residuals(bw.phase, forward)
    return Backward(bw.phase, residuals, tuple(cotangents), grads)


def _finer(layout: Layout, made: list[Value]) -> Layout:
    """The layout every value in ``made`` holds where it shards ``layout``'s dims further (each dim's axes
    extend ``layout``'s), else ``layout``: the optimizer's reshard onto the ZeRO shard starts from there,
    so a gradient made sliced is not gathered whole only to be sliced again (the reshard may still gather)."""
    shapes = {v.layout for v in made}
    if len(shapes) != 1:
        return layout
    (finer,) = shapes
    extends = all(f[:len(d)] == d for d, f in zip(layout, finer, strict=True))
    return finer if extends else layout


def _still_partial(target: Value, made: list[Value]) -> Value:
    """The value a deferred gradient's contributions (made as ``made``) are summed in: the target's layout,
    partial over every axis a contribution is and the layout leaves free (the others added on coordinate 0
    there), so one reduction, chosen by the reader, follows."""
    used = {a for axes in target.layout for a in axes}
    return Value(target.layout, tuple(sorted({a for v in made for a in v.unreduced} - used)))


def _read_after(graph: Graph, blocks: tuple[int | None, ...]) -> list[str]:
    """The inputs only statements after the ``layers`` blocks read (none without a block)."""
    inside = [k for k, b in enumerate(blocks) if b is not None]
    if not inside:
        return []
    first: dict[str, int] = {}
    for k, node in enumerate(graph.nodes):
        for name in node.operands:
            first.setdefault(name, k)
    return [n for n in graph.inputs if first.get(n, -1) > inside[-1]]


def _fed_only(graph: Graph, readers: dict[str, set[int | None]], block: int, k: int) -> list[str]:
    """The values made at or before node ``k`` (before ``block``) that ``block`` alone reads: their
    gradients are whole when its backward ends, so they are summed there, as its steps; left to each one's
    own node they would sum after the backward of a later-made one (``E`` made after ``X0``), a step of the
    block among those of the statements before it."""
    return [n.result for n in graph.nodes[:k + 1] if readers.get(n.result) == {block}]


def _read_around(graph: Graph, blocks: tuple[int | None, ...], readers: dict[str, set[int | None]]) -> list[str]:
    """The values made outside every block that a block and a statement outside every block both read
    (``E`` read by the block and by ``X0 = embed(...) + E`` before it): as a data input so read, the block's
    contributions are summed as its backward ends (:meth:`_Backward.close_layer`), the rest added once at the
    value's own node, after the backward of the statements before the block that read it."""
    return [n.result for k, n in enumerate(graph.nodes)
            if blocks and blocks[k] is None and None in readers.get(n.result, set()) and readers[n.result] - {None}]


def _readers(graph: Graph, blocks: tuple[int | None, ...]) -> dict[str, set[int | None]]:
    """Each value's readers' blocks (None: a statement outside every block); all 0 without ``blocks``."""
    out: dict[str, set[int | None]] = {}
    for k, node in enumerate(graph.nodes):
        for name in node.operands:
            out.setdefault(name, set()).add(blocks[k] if blocks else 0)
    return out


def _residuals(backward: Phase, forward: Phase) -> tuple[TensorRef, ...]:
    """Values the backward reads that the forward made (what must be kept between them)."""
    seen: dict[TensorRef, None] = {}
    for step in backward.steps:
        reads = step.operands + ((step.src,) if step.src is not None else ())
        for ref in reads:
            if ref in seen:
                continue
            key = (ref.name, Value.of(ref))
            if key in forward.made and key not in backward.made:  # made: every step's (tensor, result)
                seen[ref] = None
    return tuple(seen)
