"""A dropout outside a pipelined block does not lower yet: the error points at its statement."""

from __future__ import annotations

import pytest

import shardc
from shardc.errors import ShardcError

SPEC = """mesh P=2 pipeline, X=2
dims B=8, S=4, D=8, F=8, V=16
microbatches 2
const Tok, Next
X0[B_X, S, D] = dropout(embed(Tok[B_X, S], W_emb[V, D]), 0.1)
layers 2 {
  H[B_X, S, F] = X0[B_X, S, D] · W_in[D, F]
  X1[B_X, S, D] = H[B_X, S, F] · W_o[F, D]
}
Lg[B_X, S, V] = X1[B_X, S, D] · W_out[D, V]
Loss[] = cross_entropy(Lg[B_X, S, V], Next[B_X, S])
"""


def test_the_refused_dropout_is_pointed_at() -> None:
    """MT-NLG's and GPT-3's embedding dropout (benchmarks/runs/mtnlg_530b.shard): the error had no span."""
    spec = shardc.parse(SPEC, "ends.shard")
    with pytest.raises(ShardcError, match="dropout outside the pipelined block") as err:
        shardc.lower(shardc.plan(spec))
    assert err.value.span is not None and err.value.span.line == 5
