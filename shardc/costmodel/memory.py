"""Memory per device: weights and optimizer state, residual activations, gathered weights.

Two accountings of the training state, both from the book, chosen by name:

* ``adam10``: 10 bytes a parameter, a bf16 param and fp32 Adam m and v (the
  the book's "data parallel fits about HBM/10 params"); gradients are not counted
  apart (they are reduced and applied as they are made).
* ``adam16``: 16 bytes, adding a bf16 gradient and an fp32 master copy.

Each byte is sharded as its param is declared.  Residuals are the forward
values the backward reads under the plan's save policy (``plan.residuals``,
statement results read in their declared sharding, and the block's inputs),
each at its local size and the spec's dtype.  ``layers`` multiplies the
per-layer state and residuals; the gathered weights (and unreduced weight
gradients) alive at once are counted for one layer, since layers run one at a
time.  Transient activations of the running layer are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.costmodel.collective import local_elements
from shardc.errors import ShardcError
from shardc.planner.ir import Plan, Step
from shardc.planner.sums import ALIAS
from shardc.spec.ir import TensorRef
from shardc.spec.validate import leaves

__all__ = ["ACCOUNTINGS", "Memory", "memory"]

# bytes a parameter: (param, grad, optimizer state)
ACCOUNTINGS: dict[str, tuple[int, int, int, str]] = {
    "adam10": (2, 0, 8, "10 bytes/param: bf16 param + fp32 Adam m, v"),
    "adam16": (2, 2, 12, "16 bytes/param: bf16 param + bf16 grad + fp32 master, m, v"),
}


@dataclass(frozen=True)
class Memory:
    accounting: str
    accounting_text: str
    params: float  # parameter count on one device (after sharding), all layers
    params_total: float  # parameter count of the model, all layers
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    residual_bytes: float
    gathered_bytes: float
    residuals: tuple[tuple[str, float], ...]  # (value, bytes for one layer)
    hbm_bytes: float

    @property
    def total_bytes(self) -> float:
        return (self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.residual_bytes
                + self.gathered_bytes)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.hbm_bytes

    def to_json(self) -> dict[str, object]:
        return {"accounting": self.accounting, "accounting_text": self.accounting_text,
                "params_per_device": self.params, "params_total": self.params_total,
                "param_bytes": self.param_bytes, "grad_bytes": self.grad_bytes,
                "optimizer_bytes": self.optimizer_bytes, "residual_bytes": self.residual_bytes,
                "gathered_bytes": self.gathered_bytes, "total_bytes": self.total_bytes,
                "hbm_bytes": self.hbm_bytes, "fits": self.fits,
                "residuals": [{"value": v, "bytes_per_layer": b} for v, b in self.residuals]}


def memory(plan: Plan, sizes: dict[str, int], layers: int, hbm_bytes: float,
           accounting: str = "adam10") -> Memory:
    """The per-device memory of a training step of ``plan`` (see the module docstring)."""
    if accounting not in ACCOUNTINGS:
        raise ShardcError(f"unknown optimizer accounting {accounting!r}",
                          fix="use " + " or ".join(ACCOUNTINGS))
    per_param, per_grad, per_opt, text = ACCOUNTINGS[accounting]
    params = [info for info in plan.tensors if info.role == "param"]
    repeated = _block_reads(plan)
    times = {p.name: layers if p.name in repeated else 1 for p in params}  # a `layers` block's params: L
    local = sum(float(local_elements(p.ref, sizes)) * times[p.name] for p in params)
    total = sum(float(_global_elements(p.ref, sizes)) * times[p.name] for p in params)
    nbytes = plan.spec.dtype.nbytes
    made = {s.dst: s.once for s in plan.forward}  # a value a step outside the block made is kept once
    once = {ref for ref in residual_values(plan) if made.get(ref, ref.name not in repeated)}
    values = residual_values(plan)
    kept = tuple((str(ref), float(local_elements(ref, sizes)) * plan.nbytes(ref.name)) for ref in values)
    names = {p.name for p in params} | {plan.grad_name(p.name) for p in params}
    gathered = max(peak_weights(plan.forward, names, sizes), peak_weights(plan.backward, names, sizes))
    return Memory(accounting, text, local, total, local * per_param, local * per_grad, local * per_opt,
                  sum(b * (1 if ref in once else layers) for ref, (_, b) in zip(values, kept, strict=True)),
                  gathered * nbytes, kept, hbm_bytes)


def _block_reads(plan: Plan) -> set[str]:
    """Tensors a repeated statement reads (every one's, without a ``layers`` block)."""
    spec = plan.spec
    return {r.name for k, s in enumerate(spec.statements) if spec.repeats(k) for r in leaves(s.expr)}


def residual_values(plan: Plan) -> list[TensorRef]:
    """Forward values the backward reads, each once, in the order first read.

    A rename's value (an alias step, :data:`shardc.planner.sums.ALIAS`) is its source's
    array under another name: it is counted as that source, once.
    """
    made = {s.dst for s in plan.backward}
    declared_params = {info.ref for info in plan.tensors if info.role == "param"}
    skip = made | set(plan.cotangents) | declared_params
    aliases = {s.dst: s.operands[0] for s in plan.forward if s.fn == ALIAS}

    def root(ref: TensorRef) -> TensorRef:
        while ref in aliases:
            ref = aliases[ref]
        return ref

    out: list[TensorRef] = list(dict.fromkeys(root(r) for r in plan.residuals if r not in skip))
    for step in plan.backward:
        for ref in _reads(step):
            if ref not in skip and root(ref) not in out:
                out.append(root(ref))
    return out


def peak_weights(steps: tuple[Step, ...], weights: set[str], sizes: dict[str, int]) -> float:
    """Most elements of gathered weights / unreduced weight gradients alive at one step of a phase.

    ``weights`` names the params and their gradients (:meth:`Plan.grad_name`)."""
    born: dict[TensorRef, int] = {}
    last: dict[TensorRef, int] = {}
    for i, step in enumerate(steps):
        for ref in _reads(step):
            if ref in born:
                last[ref] = i
        if step.tensor in weights and (step.is_collective or step.dst.unreduced):
            born.setdefault(step.dst, i)
            last.setdefault(step.dst, i)
    peak = 0.0
    for i in range(len(steps)):
        alive = sum(float(local_elements(r, sizes)) for r in born if born[r] <= i <= last[r])
        peak = max(peak, alive)
    return peak


def _reads(step: Step) -> tuple[TensorRef, ...]:
    return (*step.operands, *((step.src,) if step.src is not None else ()))


def _global_elements(ref: TensorRef, sizes: dict[str, int]) -> int:
    count = 1
    for dim in ref.dims:
        count *= sizes[dim.name]
    return count
