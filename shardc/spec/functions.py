"""The functions a spec may call, and what each one takes.

Only names and signatures live here (validation needs them and must not import
jax); lowering maps each name to its jax/numpy implementation.  Each function
has a kind, which fixes how its result's indices follow from its arguments:

- ``elementwise``: one tensor, the same indices (``gelu(X)``);
- ``normalize``: one tensor and ``over I``, the same indices, each row along I
  normalised (``softmax``, ``rmsnorm``, ``layernorm``) or sorted (``sort``);
- ``reduce``: one tensor and ``over I``, I dropped (``sum``, ``mean``, ``max``,
  ``logsumexp``);
- ``mask``: ``causal(Sc, S, T)``, query index S and key index T; the same indices;
- ``dropout``: ``dropout(X, rate)``, the same indices;
- ``rotary``: ``rotary(X[B, T, N, H], T)`` or ``rotary(X, T, theta)``, a rotary position embedding of the
  argument's last index H by the position index T (theta 10000 where not given), the same indices
  (:mod:`shardc.ops.rotary`);
- ``affine``: ``scale(X, a)`` (x * a) and ``shift(X, b)`` (x + b), a constant of the program (a query's
  1 / sqrt(H), a GELU's 0.5), the same indices;
- ``embed``: ``embed(Tok, W_emb)``, a lookup of the ids ``Tok`` in the rows of the
  table (its first index): Tok's indices, then the table's others;
- ``loss``: ``cross_entropy(Logits, Tok)``, the mean over tokens of the softmax
  cross entropy along the one index of Logits that Tok lacks: a scalar;
- ``route``: ``route(Gate[G, S, E], S, C, k over E)``, top-k routing to experts with
  capacity (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021): the 0/1 dispatch
  mask ``[G, S, E, C]``, 1 where token s goes to slot c of expert e.  Each token picks
  the k largest gates along E (ties: the lower expert), and takes the next free slot
  of each expert it picked, tokens in order of S (the first index name), the
  capacity index C (the second, not an index of the argument) counting slots; a
  token past an expert's capacity is dropped there.  A mask: no gradient.
- ``route_by_choice``: ``route``'s arguments and mask, the slots taken choice by choice: every
  token's first choice (in order of S) before any token's second one, and so on, as GShard's top-2
  (its second expert's slots counted after all first ones) and flaxformer's masked router take
  them; with k = 1 it is ``route``.
- ``attention``: ``attention(Q[B, S, N, H], K[B, T, N, H], V[B, T, N, H] over T, causal)``,
  ``softmax(Q·K / sqrt(H) over T) · V`` computed blockwise (no S x T scores held); the flag
  ``causal`` is optional, and so is a second (query, key) pair whose scores add to Q·K
  (``attention(Qn, Kn, V, Qr, Kr over T)``, MLA's decoupled rotary part).  Each index's role:
  :mod:`shardc.spec.attention_call`.
- ``dispatch``: ``dispatch(Gate[G, S, E], X[G, S, D], S, C, k over E)``, the same routing held as
  indices, not a mask: token s's row of X copied into slot c of expert e, ``[G, E, C, D]`` (the
  gates' indices less S, then C, then X's indices the gates lack); an empty slot is 0.  X gets the
  gradient (its rows gathered back); the gates get none.  ``k over E, M, G`` (two more numbers) is
  node-limited routing (DeepSeek-V3, arXiv 2412.19437, section 2.1.2): the E experts in G groups of
  E/G, a node's each, and each token's k experts taken from the M groups whose k/M largest gates sum
  highest.
- ``combine``: ``combine(Gate[G, S, E], Ex[G, E, C, D], S, C, k over E)``, the inverse: each token's
  k expert outputs (its slot of each expert it went to) weighted by its gates and summed,
  ``[G, S, D]`` (the gates' indices less E, then Ex's indices the gates lack, less C).  Both the
  gates and Ex get gradients.
- ``dispatch`` of a tensor that carries E too, ``dispatch(Gate[G, S, E], W[G, S, E], S, C, k over E)``:
  a value per token and expert (the gates themselves), each slot given its own expert's, ``[G, E, C]``
  (W gets the gradient); with ``collect``, the gates applied at the experts, as DeepEP (the expert-parallel
  library DeepSeek-V3 was trained with) sends each token's top-k weights with it and sums the rows back.
- ``collect``: ``collect(Gate[G, S, E], Ex[G, E, C, D], S, C, k over E)``, combine unweighted: each token's
  k expert outputs summed, ``[G, S, D]``; Ex gets the gradient (``dY``'s rows into the slots), the gates
  none, so nothing is kept for them (the experts weighed their rows).

>>> is_known("gelu"), signature("softmax").kind, signature("embed").tensors
(True, 'normalize', 2)
>>> "identity" in FUNCTIONS
True
>>> known_list().split(', ')[:3]
['abs', 'attention', 'causal']
>>> signature("route").usage("route")
'route(Gate[G, S, E], S, C, 2 over E)'
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["FUNCTIONS", "DOMAINS", "INDEXED", "PASS_THROUGH", "ELEMENTWISE", "Signature", "signature", "is_known",
           "known_list", "is_elementwise", "integer_args", "dropout_salt", "ID_DTYPE", "ID_BYTES", "MASK_BYTES",
           "ROUTINGS"]


@dataclass(frozen=True)
class Signature:
    """What a function takes: its kind, tensor and index argument counts, numbers, ``over``."""

    kind: str
    meaning: str
    tensors: int = 1
    names: int = 0
    numbers: int = 0
    over: bool = False
    # where an elementwise map is defined: "" every real, "positive" x > 0 (log, sqrt, rsqrt: the value or the
    # derivative is NaN or infinite elsewhere), "nonzero" x != 0 (reciprocal)
    domain: str = ""

    def usage(self, name: str) -> str:
        """How a call of this function is written, e.g. ``softmax(X[B, T] over T)``."""
        examples = {"elementwise": "X[B, D]", "normalize": "X[B, S, D] over D", "reduce": "X[B, D] over D",
                    "mask": "Sc[B, N, S, T], S, T", "dropout": "X[B, S, D], 0.1",
                    "rotary": "X[B, T, N, H], T",
                    "affine": "X[B, D], 0.125",
                    "embed": "Tok[B, S], W_emb[V, D]", "loss": "Logits[B, S, V], Tok[B, S]",
                    "route": "Gate[G, S, E], S, C, 2 over E",
                    "attention": "Q[B, S, N, H], K[B, T, N, H], V[B, T, N, H] over T, causal",
                    "dispatch": "Gate[G, S, E], X[G, S, D], S, C, 2 over E",
                    "combine": "Gate[G, S, E], Ex[G, E, C, D], S, C, 2 over E"}
        return f"{name}({examples[self.kind]})"


def _e(meaning: str, domain: str = "") -> Signature:
    return Signature("elementwise", meaning, domain=domain)


FUNCTIONS: dict[str, Signature] = {
    "abs": _e("|x|"),
    "cos": _e("cosine"),
    "exp": _e("e**x"),
    "gelu": _e("Gaussian error linear unit (tanh approximation, as jax.nn.gelu)"),
    "identity": _e("x"),
    "log": _e("natural logarithm, for x > 0", "positive"),
    "negative": _e("-x"),
    "reciprocal": _e("1 / x, for x != 0", "nonzero"),
    "relu": _e("max(x, 0)"),
    "rsqrt": _e("1 / sqrt(x), for x > 0", "positive"),
    "sigmoid": _e("1 / (1 + e**-x)"),
    "silu": _e("x * sigmoid(x) (swish)"),
    "sin": _e("sine"),
    "sqrt": _e("square root, for x > 0", "positive"),
    "square": _e("x**2"),
    "tanh": _e("hyperbolic tangent"),
    "softmax": Signature("normalize", "exp(x) / sum(exp(x)) along the index", over=True),
    "rmsnorm": Signature("normalize", "x / sqrt(mean(x**2) + 1e-6) along the index (no scale)", over=True),
    "layernorm": Signature("normalize", "(x - mean) / sqrt(var + 1e-5) along the index (no scale)",
                           over=True),
    "sort": Signature("normalize", "the row's elements in ascending order along the index", over=True),
    "sum": Signature("reduce", "the sum along the index", over=True),
    "mean": Signature("reduce", "the mean along the index", over=True),
    "max": Signature("reduce", "the maximum along the index", over=True),
    "logsumexp": Signature("reduce", "log(sum(exp(x))) along the index", over=True),
    "causal": Signature("mask", "-inf where the key position T is after the query position S", names=2),
    # the frequency base theta is optional (validation accepts 0 numbers or 1): 10000 as RoFormer's and LLaMA's
    "rotary": Signature("rotary", "x's last index rotated in pairs (its halves) by angles of the position "
                        "along the index, theta ** (-2i / H) a position", names=1, numbers=1),
    "dropout": Signature("dropout", "zero with probability rate, else x / (1 - rate)", numbers=1),
    "scale": Signature("affine", "x * a, a the number (a constant scale)", numbers=1),
    "shift": Signature("affine", "x + b, b the number (a constant shift)", numbers=1),
    "embed": Signature("embed", "the rows of the table (first index) at the token ids", tensors=2),
    "cross_entropy": Signature("loss", "mean over tokens of logsumexp(logits) - logits[target]", tensors=2),
    "route": Signature("route", "0/1 mask: each token (in order of S) to a free slot C of its top k along E",
                       names=2, numbers=1, over=True),
    "route_by_choice": Signature("route", "0/1 mask: route's, the slots taken choice by choice (all first "
                                 "choices, in order of S, before any second one)", names=2, numbers=1, over=True),
    # `causal` is an optional flag (an index-name argument): validation accepts 0 names or that one
    # a second (query, key) pair, `attention(Q, K, V, Qr, Kr over T)`, is optional: validation accepts 5 tensors
    "attention": Signature("attention", "softmax(Q·K / sqrt(H) over T) · V, blockwise (online softmax); "
                           "with Qr, Kr: softmax((Q·K + Qr·Kr) / sqrt(H + J) over T) · V",
                           tensors=3, over=True),
    "dispatch": Signature("dispatch", "each token's row (in order of S) to a free slot C of its top k along E",
                          tensors=2, names=2, numbers=1, over=True),
    "combine": Signature("combine", "each token's top k expert outputs along E, weighted by its gates, summed",
                         tensors=2, names=2, numbers=1, over=True),
    "collect": Signature("combine", "each token's top k expert outputs along E, summed (unweighted: the "
                         "experts weighed their rows)", tensors=2, names=2, numbers=1, over=True),
}

# The functions that route tokens to experts' slots (a capacity index C, new or read): route's
# mask, and the index-based dispatch and combine.
ROUTINGS = frozenset({"route", "route_by_choice", "dispatch", "combine", "collect"})
# the index-based ones (the family of shardc.ops.dispatch)
INDEXED = frozenset({"dispatch", "combine", "collect"})

ELEMENTWISE = frozenset(name for name, sig in FUNCTIONS.items() if sig.kind == "elementwise")

# each domain of a map defined on part of the reals (:attr:`Signature.domain`): how it is written, and whether
# values (an array, elementwise) lie in it; a NaN lies in none
DOMAINS: dict[str, tuple[str, Callable[[Any], Any]]] = {"positive": ("x > 0", lambda x: x > 0),
                                                        "nonzero": ("x != 0", lambda x: (x < 0) | (x > 0))}

# Linear maps, whose gradient is the map itself applied to the cotangent (identity's the cotangent, negative's
# its negation): the backward reads no argument (XLA would drop any move that made one, so the plan must not
# make it either).
PASS_THROUGH = frozenset({"identity", "negative"})


def signature(name: str) -> Signature:
    """The signature of a known function (KeyError for an unknown one)."""
    return FUNCTIONS[name]


def is_known(name: str) -> bool:
    """Whether ``name`` is a function shardc can lower."""
    return name in FUNCTIONS


def is_elementwise(name: str) -> bool:
    """Whether ``name`` applies to each element alone (so its result keeps the argument's sharding)."""
    return name in ELEMENTWISE


# Token ids are int32 whatever the spec's dtype: the lowered module feeds them so, and plan,
# cost and memory count their bytes so (:func:`shardc.spec.walk.nbytes_of`).
ID_DTYPE = "int32"
ID_BYTES = 4
MASK_BYTES = 1  # a dropout keep-mask element: one byte (a bool)


def integer_args(name: str) -> tuple[int, ...]:
    """Which tensor arguments hold integer ids (no gradient): embed's and cross_entropy's tokens."""
    kind = FUNCTIONS[name].kind
    return (0,) if kind == "embed" else (1,) if kind == "loss" else ()


def dropout_salt(result: str, k: int) -> int:
    """The salt of the k-th dropout (outermost first) of the statement defining ``result``.

    A dropout's keep-mask is a counter-based hash of each element's global position
    and this salt: one global mask per dropout, drawn alike by every device's block
    of it and by the numpy reference.
    """
    return zlib.crc32(f"{result}/{k}".encode())


def layer_key(key: Any, layer: Any, layers: int, xp: Any) -> Any:
    """The dropout key layer ``layer`` of a stack of ``layers`` draws its masks under, when the
    step's key is ``key``: key * layers + layer in unsigned 32-bit arithmetic (wrapping at 2**32), so
    each (step, layer) has its own key and a one-layer program under key k draws the masks of layer 0
    under key k.  Written over the array module ``xp``: numpy for the reference's integer keys,
    jax.numpy for the lowered pipeline's traced ones, so both draw under the same key."""
    u32 = xp.uint32
    return xp.asarray(key, u32) * xp.asarray(layers, u32) + xp.asarray(layer, u32)


def known_list() -> str:
    """The known names, sorted, comma separated (for error messages)."""
    return ", ".join(sorted(FUNCTIONS))

