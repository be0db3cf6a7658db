"""ZeRO-1/2's optimizer phase, lowered: ``optimizer_step(params, grads)`` in the module.

The module's ``forward`` and ``grad`` run the spec without its ``zero`` line
(:func:`shardc.lowering.replan.unlowered_optimizer`: their backward reduces every
gradient, so ``jax.grad`` stays a true gradient).  The optimizer phase of the ZeRO
plan is lowered beside them as its own ``shard_map``, one line a step: the
ReduceScatter of each gradient as the ZeRO backward leaves it (stage 1: partial
sums, passed stacked; stage 2: already on the shard), the update on each shard
(plain SGD, ``W - LEARNING_RATE * dW``, so values can be checked), and the
AllGather of the updated param.  ``shardc verify`` checks its values against
numpy and its collectives against the compiled HLO.
"""

from __future__ import annotations

__all__ = ["LEARNING_RATE", "OPTIMIZER_GLOBALS", "optimizer_text"]

LEARNING_RATE = 0.5  # the SGD step of the lowered update: large enough that a wrong update shows
OPTIMIZER_GLOBALS = ("OPTIMIZER_IN", "OPTIMIZER_OUT", "LEARNING_RATE", "optimizer_local", "optimizer_program",
                     "optimizer_step")

_DRIVER = '''

@functools.cache
def optimizer_program():
    """The optimizer phase as ``jit(shard_map(...))`` on the module's mesh."""
    mesh = programs()[0]
    return jax.jit(jax.shard_map(optimizer_local, mesh=mesh, in_specs=tuple(OPTIMIZER_IN.values()),
                                 out_specs=tuple(OPTIMIZER_OUT.values())))


def optimizer_step(params, grads):
    """The updated params (global arrays keyed by name), from the params and the gradients as
    the ZeRO plan's backward leaves them (keyed by gradient name; stacked where partial sums)."""
    mesh = programs()[0]
    pool = {**params, **grads}
    args = [_put(pool[key], spec, mesh) for key, spec in OPTIMIZER_IN.items()]
    return dict(zip(OPTIMIZER_OUT, optimizer_program()(*args)))
'''


def optimizer_text(heading: str, specs: str, function: str) -> str:
    """The module's optimizer section: its heading comment, boundary specs, the local function, the driver."""
    head = "\n\n# ---- optimizer " + "-" * 58 + "\n" + heading + "\n\n"
    rate = f"LEARNING_RATE = {LEARNING_RATE!r}  # the lowered update is plain SGD: W - LEARNING_RATE * dW\n\n\n"
    return head + specs + rate + function + _DRIVER
