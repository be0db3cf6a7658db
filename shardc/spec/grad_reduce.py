"""The ``grad_reduce`` line: when the framework runs the gradient reductions, and in which type.

``grad_reduce after-backward`` (or ``overlapped``, the default; ``after-backward over dcn``) says when;
``in T`` after it, or ``grad_reduce in T`` alone, the element type the data-parallel AllReduces and
ReduceScatters of the params' gradients move, where the framework casts them to another than the
param's (PyTorch FSDP2's ``MixedPrecisionPolicy(reduce_dtype=torch.float32)``, as torchtitan runs it;
Megatron-LM's fp32 main gradients under bf16).  Without it the ``optimizer`` accounting's type is
taken (:func:`shardc.accountings.reduce_dtype`), else each param's own.

>>> from shardc.spec.parser import parse
>>> spec = parse("mesh X=2\\ngrad_reduce in f32\\nO[B, F] = I[B, D] · W[D, F]\\n")
>>> spec.grad_reduce, spec.grad_reduce_dtype
(None, <DType.F32: 'f32'>)
>>> str(parse("mesh X=2\\ngrad_reduce after-backward in f32\\nO[B, F] = I[B, D] · W[D, F]\\n")).splitlines()[1]
'grad_reduce after-backward in f32'
"""

from __future__ import annotations

from collections.abc import Callable

from lark import Token

from shardc.errors import ShardcError, Span, clip
from shardc.ir.spec import GRAD_REDUCES, DType
from shardc.spec.dtypes import typed_words

__all__ = ["grad_reduce_line"]


def grad_reduce_line(children: list[Token], span: Callable[..., Span]) -> tuple[str | None, DType | None]:
    """The line's timing word (None where it names none: overlapped, the default) and reduction type (None:
    not written); ``span(token, end=None)`` places an error."""
    words, kind = typed_words(children, span, "grad_reduce", GRAD_REDUCES, "gradient reduction type", "f32",
                              "f32: FSDP's reduce_dtype float32, Megatron-LM's fp32 main gradients")
    if not words:
        return None, kind
    word = str(words[0])
    if len(words) > 1:  # `after-backward over dcn`: only the reductions' DCN phase waits for the backward
        scope = words[1]
        if word != "after-backward" or str(scope) != "dcn":
            raise ShardcError(f"`grad_reduce {word} over {clip(str(scope))}`: only the after-backward reductions "
                              "take a scope, and only `over dcn`", span(words[0], scope),
                              fix="write `grad_reduce after-backward over dcn` (the DCN phase after the "
                                  "backward) or `grad_reduce after-backward` (all of them)")
        word = f"{word} over dcn"
    return word, kind
