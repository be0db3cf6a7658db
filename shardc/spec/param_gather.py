"""The ``param_gather`` line: when ZeRO-1/2's updated params are gathered back, and in which type ZeRO's
param AllGathers move.

``param_gather overlapped`` (or ``exposed``, the default) says when (:data:`shardc.ir.spec.PARAM_GATHERS`);
``in T`` after it, or ``param_gather in T`` alone, the element type the params' AllGathers over the ``zero``
line's axes move (FSDP's, and ZeRO-1/2's after the step; :func:`shardc.spec.walk.gather_nbytes_of`) where the
framework casts a param's shard before gathering it: torchao's float8 all-gather under FSDP2
(``enable_fsdp_float8_all_gather``: ``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`` casts the shard to
float8_e4m3fn at a tensorwise scale, ``fsdp_post_all_gather`` hands the gathered float8 data to the float8
GEMM), Megatron-LM's ``--fp8-param-gather``.  Without it each param gathers in its own type.  As
``grad_reduce ... in T`` names the gradients' reduction type, this names the weights' gather type.

>>> from shardc.spec.parser import parse
>>> spec = parse("mesh X=2\\nparam_gather in f8\\nO[B, F] = I[B, D] · W[D, F]\\n")
>>> spec.param_gather, spec.param_gather_dtype
(None, <DType.F8: 'f8'>)
>>> text = "mesh X=2\\nzero 1 over X\\nparam_gather overlapped in f8\\nO[B, F] = I[B, D] · W[D, F]\\n"
>>> str(parse(text)).splitlines()[2]
'param_gather overlapped in f8'
"""

from __future__ import annotations

from collections.abc import Callable

from lark import Token

from shardc.errors import Span
from shardc.ir.spec import PARAM_GATHERS, DType
from shardc.spec.dtypes import typed_words

__all__ = ["param_gather_line"]


def param_gather_line(children: list[Token], span: Callable[..., Span]) -> tuple[str | None, DType | None]:
    """The line's timing word (None where it names none: exposed, the default) and gather type (None: not
    written); ``span(token, end=None)`` places an error."""
    words, kind = typed_words(children, span, "param_gather", PARAM_GATHERS, "param gather type", "f8",
                              "f8: torchao's float8 all-gather under FSDP2, Megatron-LM's --fp8-param-gather")
    return (str(words[0]) if words else None), kind
