"""The tokens a step processes (`step.tokens`, tokens/s a chip): every dim of the token ids."""

from __future__ import annotations

import shardc

MODEL = """mesh X=4
dims B=8, S=16, D=32, V=64
const Tok, Next
X0[B_X, S, D] = embed(Tok[B_X, S], W_emb[V, D]){pos}
Lg[B_X, S, V] = X0[B_X, S, D] · W_out[D, V]
Loss[] = cross_entropy(Lg[B_X, S, V], Next[B_X, S])
"""


def test_a_learned_positional_table_does_not_hide_the_sequence_from_the_tokens() -> None:
    """MPT's and OPT's `W_pos[S, D]` is a param with S: the tokens were counted B alone (MPT-7B on 8 A100s
    printed 3 tokens/s a chip for its 5,555)."""
    for pos in ("", " + W_pos[S, D]"):
        report = shardc.cost(shardc.plan(shardc.parse(MODEL.format(pos=pos)))).to_json()["step"]
        assert report["tokens"] == 8 * 16
