"""A ``layers`` block's edges in the forward: which block each node runs in, what a layer reads as it
enters the block and what the statements after it read as they leave it (each value in its declared
sharding, as one layer hands it to the next).
"""

from __future__ import annotations

from shardc.ir.spec import Spec, TensorRef
from shardc.ops.registry import Node
from shardc.planner.graph import Graph
from shardc.sharding.layout import Value
from shardc.sharding.phase import Phase

__all__ = ["node_blocks", "enter_block", "leave_block"]


def enter_block(phase: Phase, rest: list[Node], blocks: tuple[int | None, ...],
                declared: dict[str, TensorRef]) -> None:
    """A ``layers`` block's every layer reads its inputs as the previous layer feeds them: in their
    declared sharding, never a value made before the block (the embedding's partial sums, say)."""
    inside = [n for n, b in zip(rest, blocks, strict=True) if b == blocks[0]]
    made_inside = {n.result for n in inside}
    for node in inside:
        for name in node.operands:
            ref = declared.get(name)
            if name not in made_inside and ref is not None and name in phase.held:
                phase.held[name] = [Value.of(ref)]


def leave_block(phase: Phase, before: list[Node], after: list[Node], declared: dict[str, TensorRef]) -> None:
    """The statements after a ``layers`` block read what the last layer hands on: each value made in
    the block in its declared sharding, never a layout a layer held on the way (the layer's result
    before its move into the declared one is the first layer's, not the last's).  Only what they read
    is forgotten: what a layer holds stays its own backward's to keep."""
    read = {name for node in after for name in node.operands}
    for node in before:
        ref = declared.get(node.result)
        if node.result in read and ref is not None and node.result in phase.held:
            phase.held[node.result] = [Value.of(ref)]


def node_blocks(spec: Spec, graph: Graph) -> tuple[int | None, ...]:
    """Each node's ``layers`` block (:meth:`Spec.block_of`; None: outside every block, run once); empty
    where every node repeats alike (no block, or one around every statement)."""
    if spec.block is None:
        return ()
    order = list(dict.fromkeys(id(n.statement) for n in graph.nodes))  # each statement makes a node
    blocks = tuple(spec.block_of(order.index(id(n.statement))) for n in graph.nodes)
    return blocks if any(b != 0 for b in blocks) else ()  # a block of every statement: the whole spec
