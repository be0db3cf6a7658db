"""The transformer-layer syntax: sums, reductions, masks, dropout, lookups, loss, renames, layers."""

from __future__ import annotations

import pytest

from shardc.errors import ShardcError
from shardc.ir.spec import Add, Call, Contract, TensorRef
from shardc.spec.parser import parse
from shardc.spec.walk import chain_indices

HEAD = "mesh X=2, Y=2\n"

GOOD = [
    "R[B, S, D] = X[B, S, D] + Att[B, S, D]",
    "Y[B, S, D] = X[B, S, D] + Bias[D]",
    "Y[B, D] = X[B, D] - Bias[D] + C[B, D]",
    "Y[B, D] = X[B, D] - (Bias[D] + C[B, D])",
    "O[B, F] = (A[B, D] + C[B, D]) · W[D, F]",
    "A[B, D] · W[D, F] + Bi[F] -> R[B, F]",
    "P[B, N, S, T] = softmax(causal(Sc[B, N, S, T], S, T) over T)",
    "N[B, S, D] = rmsnorm(X[B, S, D] over D)",
    "N[B, S, D] = layernorm(X[B, S, D] over D)",
    "M[B] = sum(X[B, D] over D)",
    "M[B] = logsumexp(X[B, D] over D)",
    "M[B] = max(A[B, D] · W[D, F] over F)",
    "Y[B, S, D] = dropout(X[B, S, D], 0.1)",
    "E[B, S, D] = embed(Tok[B, S], W_emb[V, D])",
    "L[] = cross_entropy(Lg[B, S, V], Tok[B, S])",
    "Kx[B, T, D] = X[B, S, D]",
    "H[B, F] = gelu(In[B, D] · W[D, F])",
]


@pytest.mark.parametrize("line", GOOD)
def test_new_syntax_round_trips(line: str) -> None:
    spec = parse(HEAD + line + "\n")
    assert parse(str(spec)) == spec
    assert str(spec.statements[0]) == line


def test_shapes_of_the_new_nodes() -> None:
    (st,) = parse(HEAD + "Y[B, D] = X[B, D] - Bias[D] + C[B, D]\n").statements
    assert isinstance(st.expr, Add) and st.expr.signs == (1, -1, 1)
    (st,) = parse(HEAD + "O[B, F] = A[B, D] · W[D, F] + Bi[F]\n").statements
    assert isinstance(st.expr, Add) and isinstance(st.expr.terms[0], Contract)  # `+` binds looser
    (st,) = parse(HEAD + "P[S, T] = softmax(causal(Sc[S, T], S, T) over T)\n").statements
    assert isinstance(st.expr, Call) and st.expr.over == "T"
    assert isinstance(st.expr.arg, Call) and st.expr.arg.names == ("S", "T")
    (st,) = parse(HEAD + "Y[B] = dropout(X[B], 0.25)\n").statements
    assert isinstance(st.expr, Call) and st.expr.numbers == (0.25,)
    (st,) = parse(HEAD + "E[B, S, D] = embed(Tok[B, S], W_emb[V, D])\n").statements
    assert isinstance(st.expr, Call) and isinstance(st.expr.more[0], TensorRef)
    assert chain_indices(st.expr, ()) == ("B", "S", "D")
    (st,) = parse(HEAD + "M[B] = sum(A[B, D] · W[D, F] over F)\n").statements
    assert chain_indices(st.expr, ("B",)) == ("B",)


BAD = [
    ("Y[B, D] = X[B, D] + Z[B, F]", "its widest term lacks", "2:21"),
    ("Y[B] = X[B, D] + Z[B]", "not in the result", "2:13"),
    ("M[B, D] = sum(X[B, D] over D)", "gives B", "2:1"),
    ("M[B] = sum(X[B, D])", "`sum` takes 1 tensor and `over` an index", "2:8"),
    ("M[B, D] = softmax(X[B, D] over T)", "T is not an index", "2:11"),
    ("M[B, D] = causal(X[B, D], B, B)", "two different indices", "2:11"),
    ("M[B, D] = causal(X[B, D], B)", "2 index names", "2:11"),
    ("Y[B] = dropout(X[B], 1.5)", "not in [0, 1)", "2:8"),
    ("Y[B] = dropout(0.1, X[B])", "tensors first", "2:16"),
    ("E[B, D] = embed(Tok[B], W_emb[B, D])", "first index is the vocabulary", "2:11"),
    ("L[] = cross_entropy(Lg[B, V, D], Tok[B])", "every index of Logits but", "2:7"),
    ("L[B] = cross_entropy(Lg[B, V], Tok[B])", "gives a scalar", "2:1"),
    ("Kx[T, B, D] = X[B, S, D]", "moves", "2:4"),
    ("A[B] = softplus(X[B])", "unknown function", "2:8"),
]


@pytest.mark.parametrize(("line", "message", "where"), BAD)
def test_bad_new_syntax(line: str, message: str, where: str) -> None:
    with pytest.raises(ShardcError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")) as err:
        parse(HEAD + line + "\n", "bad.shard")
    assert str(err.value).startswith(f"bad.shard:{where}: error: "), str(err.value)
    assert err.value.fix


def test_rename_sizes_must_agree() -> None:
    with pytest.raises(ShardcError, match="keeps the size"):
        parse("mesh X=2\ndims B=4, S=8, T=4, D=2\nKx[B, T, D] = X[B, S, D]\n")
    parse("mesh X=2\ndims B=4, S=8, T=8, D=2\nKx[B, T, D] = X[B, S, D]\n")


def test_layers_outputs_feed_inputs() -> None:
    ok = "mesh X=2, Y=2\nlayers 4\nH[B_X, F_Y] = In[B_X, D] · W_in[D, F_Y]\nOut[B_X, D] = H[B_X, F_Y] · W_out[F_Y, D]\n"
    parse(ok)
    with pytest.raises(ShardcError, match="shardings differ") as err:
        parse(ok.replace("Out[B_X, D]", "Out[B, D_X]"))
    assert "Out[B_X, D]" in (err.value.fix or "")
    with pytest.raises(ShardcError, match="no output has the indices"):
        parse("mesh X=2\nlayers 4\nH[B_X, F] = In[B_X, D] · W_in[D, F]\n")
    parse("mesh X=2\nconst In\nlayers 4\nH[B_X, F] = In[B_X, D] · W_in[D, F]\n")  # every layer reads In


@pytest.mark.slow
def test_a_sum_of_products_may_stay_partial() -> None:
    """`{U_Y}` on a sum whose terms contract over Y: the partial products add, nothing is reduced
    (a reduced term is added on one coordinate of Y only, so the sum counts it once)."""
    import shardc
    from shardc.verification.verify import verify

    for text in ("O[B, D]{U_Y} = A[B, F_Y] · W1[F_Y, D] + C[B, G_Y] · W2[G_Y, D]",
                 "O[B, D]{U_Y} = A[B, F_Y] · W1[F_Y, D] + X[B, D]"):
        spec = parse("mesh Y=2\ndims B=8, F=4, G=6, D=4\n" + text + "\n")
        plan = shardc.plan(spec)
        assert not [s for s in plan.forward if s.is_collective]
        assert verify(plan).ok
    with pytest.raises(ShardcError, match="nothing is summed"):
        parse("mesh Y=2\nO[B, D]{U_Y} = A[B, D] + X[B, D]\n")
