"""A table's rows at integer ids, read as the language's ``embed``: a gather of them (the one gather of a
program, beside the mean cross entropy's and an MoE router's, that a spec writes), or a one-hot of the
ids times the table."""

from __future__ import annotations

from typing import Any

from jax.extend import core as jex

from shardc.explanation.dim_classes import unwritable
from shardc.explanation.patterns import is_lookup

__all__ = ["embed", "read_lookup"]


def read_lookup(reader: Any, eqn: Any, line: str) -> None:
    """Rows of a table at integer ids (``jnp.take(table, ids, axis=0)``, ``table[ids]``): the
    language's ``embed(Ids[...], Table[V, D])``; the ids are read through jnp's index clamp."""
    table, indices = eqn.invars
    out = eqn.outvars[0]
    if not is_lookup(eqn):
        raise unwritable("a gather other than a table's rows at ids (jnp.take(table, ids, axis=0)) or the "
                         "mean cross entropy's take_along_axis picks elements at positions, which no tensor of "
                         "the spec language holds",
                         fix="take_along_axis is read in the mean cross entropy and in an MoE router's routing "
                             "(the gates at its top-k); elsewhere write the .shard spec, its routing with "
                             "`route`, `dispatch` and `combine`")
    ids = reader.source(indices)
    if isinstance(ids, jex.Literal) or tuple(ids.aval.shape) != tuple(indices.aval.shape[:-1]):
        raise unwritable("the ids of a lookup are not an array of the program")
    embed(reader, ids, reader.dims_of(indices)[:-1], table, out, line)


def embed(reader: Any, ids: Any, id_dims: list[int], table: Any, out: Any, line: str) -> None:
    """``out = embed(ids, table)``: the ids' dims (``id_dims``) the result's first, the table's second
    its last; a gather's, or a one-hot of the ids times the table (:mod:`shardc.explanation.patterns`)."""
    outs = reader.dims_of(out)
    for d, e in zip(id_dims, outs[:-1], strict=True):
        reader.join(d, e)
    reader.join(reader.dims_of(table)[1], outs[-1])
    reader.hints.setdefault(reader.dims_of(table)[0], "V")  # the vocabulary, as the language's examples name it
    ids = reader.source(ids)  # the program's array (a call's argument, through its views)
    reader.ids.add(ids)
    reader.make(out, "embed", (ids, reader.tensor(table)), line=line)
