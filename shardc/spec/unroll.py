"""A pipeline's end blocks written out: the one-block spec a pipeline of several ``layers`` blocks lowers as.

Every stage of a lowered pipeline runs one program, one layer of one block in each of its layer
slots.  A spec whose other blocks all lie on the first stage (the blocks before its longest one)
or on the last stage (those after it) is the same model as the spec with those blocks written
out, layer by layer, before or after the longest block: statements that run once, on the first
or last stage, as the statements around a block do (DeepSeek-V3's 3 dense layers beside the
embedding on stage 0, before its 58 MoE layers).  :func:`unrolled` writes that spec; a block
that lies across stages has no such form, and :func:`unrolled` says so.
"""

from __future__ import annotations

from dataclasses import replace

from shardc.errors import ShardcError
from shardc.ir.spec import Add, Call, Contract, Expr, Spec, Statement, TensorRef
from shardc.spec.stages import block_layers, pipeline_of
from shardc.spec.walk import block_feeds, leaves, spec_params

__all__ = ["unrolled"]


def unrolled(spec: Spec) -> Spec:
    """``spec`` with every ``layers`` block but its longest written out before or after it, where they
    lie on the first or the last stage (see the module docstring); ``spec`` itself with one block."""
    blocks, pipe = spec.blocks(), pipeline_of(spec)
    if len(blocks) < 2 or pipe is None:
        return spec
    counts = block_layers(spec)
    kept = counts.index(max(counts))
    split = pipe.stage_layers
    before, after = sum(counts[:kept]), sum(counts[kept + 1:])
    for j in range(len(blocks)):
        ends = (j < kept and before < split[0]) or (j > kept and after < split[-1])
        if j != kept and (pipe.cuts > 1 or not ends):
            where = "the first" if j < kept else "the last"
            raise ShardcError(f"lowering a pipeline of several `layers` blocks writes out all but the longest, which "
                              f"must then lie on {where} stage beside at least one layer of the longest; block "
                              f"{j + 1} ({counts[j]} layers) does not ({pipe.split_text()}, schedule "
                              f"{pipe.schedule})", spec.span_of("layers" if j == 0 else f"layers:{j}"),
                              fix="`shardc plan` and `shardc cost` take this spec; to lower or verify it, give the "
                              f"{'first' if j < kept else 'last'} stage more layers with `stage_layers`, or use one "
                              "`layers` block")
    return _written_out(spec, kept, counts, (split[0] - before, *split[1:-1], split[-1] - after)
                        if len(split) > 1 else (split[0] - before - after,))


def _written_out(spec: Spec, kept: int, counts: tuple[int, ...], split: tuple[int, ...]) -> Spec:
    """The statements, params, ``recompute`` and ``dtype`` names with every block but ``kept`` written out."""
    blocks = spec.blocks()
    statements: list[Statement] = list(spec.statements[:blocks[0][0]])
    copies: dict[str, list[str]] = {}  # a param or tensor of a block written out: its names, layer by layer
    span = (0, 0)
    for j, (first, end, _) in enumerate(blocks):
        block = spec.statements[first:end]
        if j == kept:
            span = (len(statements), len(statements) + len(block))
            statements += block
        else:
            statements += _layers(spec, block, counts[j], f"_b{j + 1}l", copies)
        following = blocks[j + 1][0] if j + 1 < len(blocks) else len(spec.statements)
        statements += spec.statements[end:following]
    names = {r.name for s in spec.statements for r in (s.result, *leaves(s.expr))}
    made = {n for name, many in copies.items() for n in many if n != name}
    if made & names:  # a written-out name the spec already uses
        clash = sorted(made & names)[0]
        raise ShardcError(f"writing the end blocks out names a tensor {clash}, a name the spec already uses",
                          fix=f"rename {clash} in the spec")

    def expand(listed: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(n for name in listed for n in copies.get(name, [name]))

    return replace(spec, statements=tuple(statements), layers=spec.layer_counts()[kept], block=span, more_blocks=(),
                   stage_layers=split, params=None if spec.params is None else expand(spec.params),
                   recompute=expand(spec.recompute),
                   tensor_dtypes=tuple((n, kind) for name, kind in spec.tensor_dtypes
                                       for n in copies.get(name, [name])))


def _layers(spec: Spec, block: tuple[Statement, ...], layers: int, suffix: str,
            copies: dict[str, list[str]]) -> list[Statement]:
    """``block`` written out ``layers`` times: each layer's params and tensors named apart (``W_q_b1l0``), its
    inputs the previous layer's outputs; the last layer's outputs keep their names, which later statements read."""
    params = spec_params(spec)
    feeds = [(given.name, made.name) for given, made in block_feeds(spec, block) if made is not None]
    defined = [s.result.name for s in block]
    read = {r.name for s in block for r in leaves(s.expr)}
    own = [n for n in dict.fromkeys(r.name for s in block for r in leaves(s.expr)) if n in params]
    outputs = {n for n in defined if n not in read}
    out: list[Statement] = []
    previous: dict[str, str] = {}
    for layer in range(layers):
        names = {n: f"{n}{suffix}{layer}" for n in own + defined}
        if layer == layers - 1:
            names.update({n: n for n in outputs})
        names.update({given: previous[made] for given, made in feeds if layer > 0})
        for n in own + defined:
            copies.setdefault(n, []).append(names[n])
        previous = names
        out += [replace(s, result=_ref(s.result, names), expr=_expr(s.expr, names)) for s in block]
    return out


def _ref(ref: TensorRef, names: dict[str, str]) -> TensorRef:
    return replace(ref, name=names.get(ref.name, ref.name))


def _expr(expr: Expr, names: dict[str, str]) -> Expr:
    """``expr`` with its tensors renamed by ``names``."""
    if isinstance(expr, TensorRef):
        return _ref(expr, names)
    if isinstance(expr, Contract):
        return replace(expr, operands=tuple(_expr(o, names) for o in expr.operands))
    if isinstance(expr, Add):
        return replace(expr, terms=tuple(_expr(t, names) for t in expr.terms))
    assert isinstance(expr, Call)
    return replace(expr, arg=_expr(expr.arg, names), more=tuple(_expr(m, names) for m in expr.more))
