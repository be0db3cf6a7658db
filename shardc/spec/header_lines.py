"""The header lines of a spec, parsed: ``mesh``, ``dims``, ``dtype``, ``layers``, ``schedule``, ``zero`` and the rest.

Each callback of :class:`HeaderLines` (one a grammar rule, run inline by the LALR parse) turns a line into
``(kind, value, span)``; :mod:`shardc.spec.parser` gathers them into the spec, merging the lines that may
repeat.  A ``layers L {`` block is a :class:`Block` until then.  The statements' callbacks (tensors,
expressions, calls) are the parser's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lark import Token

from shardc.accountings import ACCOUNTINGS
from shardc.errors import ShardcError, Span, clip
from shardc.ir.spec import (
    ATTENTION_KERNELS,
    FUSIONS,
    SCHEDULES,
    Mesh,
    MeshAxis,
    Network,
    Schedule,
    Statement,
    Zero,
    parse_topology,
)
from shardc.spec.dtypes import dtype_line
from shardc.spec.grad_reduce import grad_reduce_line
from shardc.spec.param_gather import param_gather_line
from shardc.spec.sends_line import held_sends
from shardc.spec.source_spans import token_size, token_span

__all__ = ["HeaderLines", "Block"]


class HeaderLines:
    """The parser's callbacks for the header lines (mixed into its transformer)."""

    def mesh_axis(self, children: list[Token]) -> MeshAxis:
        pipeline = len(children) > 3 and children[3].type == "PIPELINE"
        if pipeline:
            children = children[:3] + children[4:]
        name, size = children[0], children[2]
        network = Network.ICI
        if len(children) > 3:
            word = children[4]
            if str(word) not in ("dcn", "ici"):
                raise ShardcError(f"unknown network `{word}` for mesh axis {name}", token_span(word),
                                  fix="write `over dcn` for an axis whose collectives cross the data-centre "
                                  "network, or nothing for the fast links")
            network = Network(str(word))
        return MeshAxis(str(name), token_size(size, f"mesh axis {name}"), network, span=token_span(name, children[-1]),
                        pipeline=pipeline)

    def mesh_line(self, children: list[Any]) -> tuple[str, Any, Span]:
        axes = tuple(c for c in children if isinstance(c, MeshAxis))
        return ("mesh", Mesh(axes), token_span(children[0]))

    def dim_size(self, children: list[Token]) -> tuple[str, int, Span]:
        name = children[0]
        return (str(name), token_size(children[2], f"dim {name}"), token_span(name, children[2]))

    def dims_line(self, children: list[Any]) -> tuple[str, Any, Span]:
        return ("dims", [c for c in children if isinstance(c, tuple)], token_span(children[0]))

    def dtype_line(self, children: list[Token]) -> tuple[str, Any, Span]:
        return dtype_line(children, token_span)

    def gemm_line(self, children: list[Token]) -> tuple[str, Any, Span]:
        return dtype_line(children, token_span)

    def param_line(self, children: list[Token]) -> tuple[str, Any, Span]:
        names = [(str(t), token_span(t)) for t in children[1:] if t.type == "NAME"]
        return ("param", names, token_span(children[0]))

    def const_line(self, children: list[Token]) -> tuple[str, Any, Span]:
        names = [(str(t), token_span(t)) for t in children[1:] if t.type == "NAME"]
        return ("const", names, token_span(children[0]))

    def recompute_line(self, children: list[Token]) -> tuple[str, Any, Span]:
        names = [(str(t), token_span(t)) for t in children[1:] if t.type == "NAME"]
        return ("recompute", names, token_span(children[0]))

    def hardware_line(self, children: list[Token]) -> tuple[str, Any, Span]:
        return ("hardware", str(children[1]), token_span(children[0]))

    def topology_line(self, children: list[Token]) -> tuple[str, Any, Span]:
        shape = parse_topology(str(children[1]), token_span(children[1]))
        return ("topology", shape, token_span(children[0], children[1]))

    def layers_line(self, children: list[Token]) -> tuple[str, Any, Span]:
        word = children[1]
        value: int | str = token_size(word, "layers") if word.type == "SIZE" else str(word)
        return ("layers", value, token_span(children[0], word))

    def layers_block(self, children: list[Any]) -> Block:
        word = children[1]
        value: int | str = token_size(word, "layers") if word.type == "SIZE" else str(word)
        body = [c for c in children if isinstance(c, Statement)]
        return Block(value, token_span(children[0], word), body)

    def microbatches_line(self, children: list[Token]) -> tuple[str, Any, Span]:
        return ("microbatches", token_size(children[1], "microbatches"), token_span(children[0], children[1]))

    def stage_layers_line(self, children: list[Token]) -> tuple[str, Any, Span]:
        counts = tuple(token_size(c, "stage_layers") for c in children[1:] if c.type == "SIZE")
        return ("stage_layers", counts, token_span(children[0], children[-1]))

    def schedule_line(self, children: list[Token]) -> tuple[str, Any, Span]:
        return ("schedule", _schedule(children), token_span(children[0], children[-1]))

    def fusion_line(self, children: list[Token]) -> tuple[str, Any, Span]:
        return ("fusion", _choice(children[1], "fusion", FUSIONS), token_span(children[0], children[1]))

    def grad_reduce_line(self, children: list[Token]) -> tuple[str, Any, Span]:
        return ("grad_reduce", grad_reduce_line(children, token_span), token_span(children[0], children[-1]))

    def attention_kernel_line(self, children: list[Token]) -> tuple[str, Any, Span]:
        return ("attention_kernel", _choice(children[1], "attention_kernel", ATTENTION_KERNELS),
                token_span(children[0], children[1]))

    def param_gather_line(self, children: list[Token]) -> tuple[str, Any, Span]:
        return ("param_gather", param_gather_line(children, token_span), token_span(children[0], children[-1]))

    def optimizer_line(self, children: list[Token]) -> tuple[str, Any, Span]:
        return ("optimizer", _choice(children[1], "optimizer", tuple(ACCOUNTINGS)),
                token_span(children[0], children[1]))

    def zero_line(self, children: list[Token]) -> tuple[str, Any, Span]:
        stage = children[1]
        if str(stage) not in ("1", "2", "3"):
            raise ShardcError(f"`zero {stage}`: ZeRO has stages 1, 2 and 3", token_span(stage),
                              fix="write `zero 1 over X` (optimizer state), `zero 2 over X` (and gradients) "
                                  "or `zero 3 over X` (and params)")
        axes = tuple(str(t) for t in children[3:] if t.type == "NAME")
        return ("zero", Zero(int(str(stage)), axes, span=token_span(children[0], children[-1])),
                token_span(children[0], children[-1]))


class Block:
    """``layers L {`` statements ``}``, while parsing."""

    def __init__(self, layers: int | str, span: Span, statements: list[Statement]) -> None:
        self.layers, self.span, self.statements = layers, span, statements


def _choice(token: Token, keyword: str, known: tuple[str, ...]) -> str:
    """The word of a ``KEYWORD WORD`` line, one of ``known``."""
    word = str(token)
    if word not in known:
        raise ShardcError(f"unknown {keyword} `{clip(word)}`", token_span(token),
                          fix="use one of " + ", ".join(f"`{keyword} {k}`" for k in known))
    return word


def _schedule(children: list[Token]) -> Schedule:
    """``schedule NAME [V] [sends HOW]``: a known name; V for ``interleaved`` only (at least 2); blocking or
    paired sends under ``1f1b`` only (:mod:`shardc.spec.sends_line`)."""
    if children[-2].type == "SENDS":
        return replace(_schedule(children[:-2]), sends=held_sends(children[1], children[-2], children[-1], token_span))
    word, span = str(children[1]), token_span(children[1])
    if word not in SCHEDULES:
        raise ShardcError(f"unknown pipeline schedule `{word}`", span,
                          fix="use one of gpipe, 1f1b, interleaved V, zb-h1, zbv, dualpipe, dualpipev")
    if word != "interleaved":
        if len(children) > 2:
            raise ShardcError(f"schedule {word} takes no number", token_span(children[2]),
                              fix=f"write `schedule {word}`; only `interleaved V` has virtual stages")
        return Schedule(word, span=span)
    if len(children) < 3:
        raise ShardcError("schedule interleaved needs its virtual stages per device", span,
                          fix="write e.g. `schedule interleaved 2`")
    virtual = token_size(children[2], "schedule interleaved")
    if virtual < 2:
        raise ShardcError("interleaved needs at least 2 virtual stages a device", token_span(children[2]),
                          fix="write `schedule interleaved 2`, or `schedule 1f1b` for one stage a device")
    return Schedule(word, virtual, span=span)
