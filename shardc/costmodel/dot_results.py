"""What XLA's CPU backend does with a dot's result that ``jnp.einsum`` transposes after the dot
(:func:`shardc.costmodel.phase_memory.phase_memory` counts these buffers under
:attr:`~shardc.costmodel.phase_memory.Buffers.results_turned`), each read off the compiled examples'
buffer assignment and live ranges (``XLA_FLAGS=--xla_dump_to=DIR``: ``*-buffer-assignment.txt``,
``*-live-range.txt``):

- the transpose reads only the dot's product, so it runs after the dot, when the operands and their
  copies that the dot was the last to read are freed: the product and its transpose are alive together,
  the operands' copies not (``moe_transformer.shard``'s backward: dAt's copies freed at dP's dot, then
  dP's product transposed into dP's layout);
- layout assignment gives the transpose the product's own layout (a bitcast of it), so every later dot
  reading the value takes a copy of its own, in the order it reads the operand in, made from the product
  at once (one a distinct order: copies alike are merged by CSE) and alive to its dot; the value in its
  own layout is made only where something other than a dot reads it or the phase returns it
  (``llama_layer_fsdp_tp.shard``'s forward: C's product copied as [B*S, G*R*H] for W_o's dot beside C's
  transpose, both alive at the forward's peak; ``gpt_layer_tp_sp.shard``'s backward: dV's product copied
  as [B*T, N*H] for dW_v's dot and as [B*T, H*N] for dKx's, no dV of its own); the product dies into
  those copies, which shardc does not count yet: it keeps the value to its last reader;
- its breadth-first scheduler runs such a dot as soon as its copy is made where its other operands are
  there already (the phase's arguments, a gathered param, a value made before), not where the program
  puts it (``gpt_layer_tp_sp.shard``'s backward: dW_v's and dKx's dots right after dV's copies, before
  dP's softmax gradient).
"""

from __future__ import annotations

from shardc.collectives import Op
from shardc.costmodel.layout_copies import layout_copies, read_order
from shardc.fusion import is_product
from shardc.ir.plan import Step
from shardc.ir.spec import TensorRef

__all__ = ["is_dot", "turned", "DotResult"]


def is_dot(step: Step) -> bool:
    """Whether a step is a contraction (a dot), not an elementwise product."""
    return step.op is Op.EINSUM and not is_product(step) and len(step.operands) == 2


def turned(steps: tuple[Step, ...]) -> dict[TensorRef, int]:
    """Each value a dot makes in an order other than its product's (a layout copy of its result), and its step."""
    return {s.dst: k for k, s in enumerate(steps) if is_dot(s) and s.dst in layout_copies(s, True)}


class DotResult:
    """Where a phase's transposed dot results are copied and read (the module's rules), for its ``steps``, the
    values it takes (``args``) and those it returns (``outs``)."""

    def __init__(self, steps: tuple[Step, ...], args: set[TensorRef], outs: set[TensorRef]) -> None:
        self.steps = steps
        self.turned = turned(steps)
        self.made = {s.dst: k for k, s in enumerate(steps)}
        self.args = args
        self.outs = outs
        self.ready = {s.dst for s in steps if s.op is Op.ALL_GATHER and s.src in args}  # gathered at the start

    def readers(self, ref: TensorRef) -> list[int]:
        """The later dots reading ``ref``, in program order."""
        k = self.turned[ref]
        return [j for j in range(k + 1, len(self.steps)) if is_dot(self.steps[j]) and ref in self.steps[j].operands]

    def only_dots(self, ref: TensorRef) -> bool:
        """Whether only dots read ``ref`` and the phase does not return it: its own layout is never made."""
        k = self.turned[ref]
        reads = [s for s in self.steps[k + 1:] if ref in s.reads]
        return ref not in self.outs and bool(reads) and all(is_dot(s) for s in reads)

    def run_soon(self, ref: TensorRef) -> list[int]:
        """The later dots reading ``ref`` whose other operands are there before its dot: the breadth-first
        scheduler runs them right after their copies of it."""
        k = self.turned[ref]
        return [j for j in self.readers(ref)
                if all(r == ref or r in self.args or r in self.ready or self.made.get(r, k) < k
                       for r in self.steps[j].reads)]

    def copies(self, ref: TensorRef) -> list[list[int]]:
        """The copies of ``ref`` the later dots read, one a distinct order: each the dots reading it."""
        groups: dict[tuple[str, ...], list[int]] = {}
        for j in self.readers(ref):
            groups.setdefault(read_order(self.steps[j], ref), []).append(j)
        return list(groups.values())
