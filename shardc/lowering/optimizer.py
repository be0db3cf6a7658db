"""ZeRO-1/2's optimizer phase, lowered: ``optimizer_step(params, grads)`` in the module.

The module's ``forward`` and ``grad`` run the spec without its ``zero`` line
(:func:`shardc.lowering.replan.unlowered_optimizer`: their backward reduces every
gradient, so ``jax.grad`` stays a true gradient).  The optimizer phase of the ZeRO
plan is lowered beside them as its own ``shard_map``, one line a step: the
ReduceScatter of each gradient as the ZeRO backward leaves it (stage 1: partial
sums, passed stacked; stage 2: already on the shard), the update on each shard
(plain SGD, ``W - LEARNING_RATE * dW``, so values can be checked), and the
AllGather of the updated param.  ``shardc verify`` checks its values against
numpy and its collectives against the compiled HLO.  The module's section is written by
:mod:`shardc.lowering.template`; its program by :meth:`shardc.lowering.driver.Program.optimizer`.
"""

from __future__ import annotations

__all__ = ["LEARNING_RATE"]

LEARNING_RATE = 0.5  # the SGD step of the lowered update: large enough that a wrong update shows
