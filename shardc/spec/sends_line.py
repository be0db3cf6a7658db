"""The ``sends HOW`` ending of a ``schedule`` line: how the pipeline's point-to-point sends run.

``async`` (the default) each send beside the compute; ``blocking`` one transfer at a time, holding both its
devices (DeepSpeed's pipeline engine); ``paired`` a step's send and receive with one neighbour posted together,
both devices waiting for the exchange (Megatron-LM's 1F1B).  Both of the last run one schedule only, 1F1B: the
engine's TrainSchedule, Megatron-LM's ``forward_backward_pipelining_without_interleaving`` (its interleaved
schedule exchanges with both neighbours at once, which ``paired`` does not price).

>>> from shardc.spec.parser import parse
>>> spec = parse("mesh P=2 pipeline, X=2\\nschedule 1f1b sends paired\\nlayers 2 {\\n"
...              "  H[B, F] = X0[B, D] · W_in[D, F]\\n  X1[B, D] = H[B, F] · W_out[F, D]\\n}\\n")
>>> spec.schedule.sends, str(spec.schedule)
('paired', '1f1b sends paired')
"""

from __future__ import annotations

from collections.abc import Callable

from lark import Token

from shardc.errors import ShardcError, Span, clip
from shardc.ir.spec import SENDS

__all__ = ["held_sends"]

# whose pipeline runs each way of sending, the one schedule it runs them under
_FRAMEWORKS = {"blocking": "DeepSpeed's pipeline engine's TrainSchedule",
               "paired": "Megatron-LM's forward_backward_pipelining_without_interleaving"}


def held_sends(schedule: Token, keyword: Token, word: Token, span: Callable[..., Span]) -> str:
    """The way ``word`` names (one of ``SENDS``), checked against the ``schedule`` name it ends;
    ``span(token, end=None)`` places an error."""
    how = str(word)
    if how not in SENDS:
        raise ShardcError(f"unknown schedule ... sends `{clip(how)}`", span(word),
                          fix="use one of " + ", ".join(f"`sends {k}`" for k in SENDS))
    if how in _FRAMEWORKS and str(schedule) != "1f1b":
        raise ShardcError(f"`sends {how}`: only under 1f1b ({_FRAMEWORKS[how]}), not `{clip(str(schedule))}`",
                          span(keyword, word), fix=f"write `schedule 1f1b sends {how}`, or drop `sends {how}`")
    return how
