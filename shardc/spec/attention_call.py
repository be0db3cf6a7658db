"""What each index of an ``attention(Q, K, V over T[, causal])`` call is, read from the indices.

``O[B, S, N, H] = attention(Q[B, S, N, H], K[B, T, N, H], V[B, T, N, H] over T, causal)`` is
``softmax(Q·K / sqrt(H) over T) · V`` computed blockwise with an online softmax (Dao et al.
2022, FlashAttention): the S x T scores are never held.  The roles follow from where each
index appears:

- the key index T (``over``): in K and V, not in Q;
- the head dim H: the last index of Q and of K (contracted in Q·K, as ``jax.nn.dot_product_attention``
  lays them out: ``[..., H]`` last);
- the value head dim: the last index of V, the last of the result;
- the batch indices (B, the heads N or key/value groups G): K's others, each in Q and V too;
- the query indices: Q's others (S, and a group's query heads R: grouped-query attention,
  ``Q[B, S, G, R, H]`` with ``K[B, T, G, H]``; multi-query: ``K[B, T, H]``).  With ``causal``,
  the query position is the first of them (S in ``Q[B, S, N, H]`` and ``Q[B, S, G, R, H]``), masked
  where the key position T is after it, by global position.

A second (query, key) pair adds a term to every score, ``Q·K + Qr·Kr``, as Multi-head Latent
Attention's decoupled rotary part does (DeepSeek-V2, arXiv 2405.04434, section 2.1.3):
``attention(Qn[B, S, N, H], Kn[B, T, N, H], V[B, T, N, H], Qr[B, S, N, J], Kr[B, T, J] over T, causal)``
is ``softmax((Qn·Kn + Qr·Kr) / sqrt(H + J) over T) · V``, the scale of the concatenated head
``[Qn, Qr]`` (H + J wide) that the implementations run, each head's key ``[Kn, Kr]`` with ``Kr``
broadcast over the heads.  Qr has Q's indices with the rotary head dim J last; Kr has the key T,
J last, and batch or head indices of K's (fewer: a key shared by the heads it lacks).

The result's indices are Q's with the head dim replaced by V's.  Parsing and validation read
this module; the op family (:mod:`shardc.ops.attention`) plans, costs and lowers by it.

>>> r = roles(("B", "S", "G", "R", "H"), ("B", "T", "G", "H"), ("B", "T", "G", "H"), "T")
>>> r.batch, r.queries, r.query, r.head, r.out
(('B', 'G'), ('S', 'R'), 'S', 'H', ('B', 'S', 'G', 'R', 'H'))
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.errors import ShardcError, Span

__all__ = ["CAUSAL", "USAGE", "ROPE_USAGE", "Roles", "roles"]

CAUSAL = "causal"  # the one flag an attention call takes
USAGE = "O[B, S, N, H] = attention(Q[B, S, N, H], K[B, T, N, H], V[B, T, N, H] over T, causal)"
ROPE_USAGE = ("O[B, S, N, H] = attention(Qn[B, S, N, H], Kn[B, T, N, H], V[B, T, N, H], Qr[B, S, N, J], Kr[B, T, J] "
              "over T, causal)")


@dataclass(frozen=True)
class Roles:
    """The indices of one attention call by role (see the module's docstring)."""

    q: tuple[str, ...]
    k: tuple[str, ...]
    v: tuple[str, ...]
    key: str  # T
    head: str  # Q's and K's last: contracted in Q·K
    value_head: str  # V's last: the result's last
    batch: tuple[str, ...]  # in Q, K and V, in K's order
    queries: tuple[str, ...]  # Q's own, in Q's order
    qr: tuple[str, ...] = ()  # the second pair's query, Q's indices with the rotary head dim last (none: ())
    kr: tuple[str, ...] = ()  # its key: T, some of K's batch indices, the rotary head dim last

    @property
    def operands(self) -> tuple[tuple[str, ...], ...]:
        """The indices of the call's tensors in order: Q, K, V, and Qr, Kr where given."""
        return (self.q, self.k, self.v, *((self.qr, self.kr) if self.qr else ()))

    @property
    def rope_head(self) -> str | None:
        """The second pair's head dim J, contracted in Qr·Kr (None without the pair)."""
        return self.qr[-1] if self.qr else None

    @property
    def query(self) -> str:
        """The query position a causal mask compares with the key position: the first query index."""
        return self.queries[0]

    @property
    def out(self) -> tuple[str, ...]:
        """The result's indices: Q's, its head dim replaced by V's."""
        return (*self.q[:-1], self.value_head)

    @property
    def rows(self) -> tuple[str, ...]:
        """The indices of the row logsumexp the forward keeps: Q's less the head dim."""
        return self.q[:-1]


def roles(q: tuple[str, ...], k: tuple[str, ...], v: tuple[str, ...], over: str | None,
          span: Span | None = None, *pair: tuple[str, ...]) -> Roles:
    """The roles of Q's, K's and V's indices (and the second pair's, Qr's and Kr's, where given); a
    :class:`ShardcError` says what does not fit."""
    r = _roles(q, k, v, over, span)
    return _with_pair(r, pair, span) if pair else r


def _with_pair(r: Roles, pair: tuple[tuple[str, ...], ...], span: Span | None) -> Roles:
    """``r`` with the second (query, key) pair: Qr is Q with its head dim replaced by one of its own (J),
    Kr is T, batch or head indices of K's, and J last."""

    def fail(what: str) -> ShardcError:
        return ShardcError(f"attention: {what}", span, fix=f"write it as {ROPE_USAGE}")

    if len(pair) != 2:
        raise fail("a second pair is a query and a key (Qr, Kr)")
    qr, kr = pair
    if len(qr) < 2 or len(kr) < 2 or qr[-1] != kr[-1]:
        raise fail("Qr and Kr end with the same head dim (J), contracted in Qr·Kr")
    rope = qr[-1]
    if rope in (*r.q, *r.k, *r.v):
        raise fail(f"the second pair's head dim {rope} is an index of Q, K or V")
    if qr[:-1] != r.q[:-1]:
        raise fail(f"Qr's indices are Q's with its head dim {r.head} replaced ({', '.join((*r.q[:-1], rope))})")
    if r.key not in kr:
        raise fail(f"Kr runs along the key index {r.key}")
    extra = [i for i in kr[:-1] if i not in (*r.batch, r.key)]
    if extra:
        raise fail(f"Kr's index {extra[0]} is not one of K's batch or head indices")
    return Roles(r.q, r.k, r.v, r.key, r.head, r.value_head, r.batch, r.queries, qr, kr)


def _roles(q: tuple[str, ...], k: tuple[str, ...], v: tuple[str, ...], over: str | None,
           span: Span | None) -> Roles:

    def fail(what: str) -> ShardcError:
        return ShardcError(f"attention: {what}", span, fix=f"write it as {USAGE}")

    if over is None or over not in k or over not in v:
        raise fail(f"the key index {over} must be an index of K ({', '.join(k)}) and V ({', '.join(v)})")
    if over in q:
        raise fail(f"the key index {over} is an index of Q; the queries run along another index (S)")
    if len(q) < 2 or len(k) < 2 or len(v) < 2 or q[-1] != k[-1] or k[-1] == over:
        raise fail("Q and K end with the same head dim (H), contracted in Q·K")
    head, value_head = q[-1], v[-1]
    if value_head == over:
        raise fail("V ends with its head dim, not the key index")
    batch = tuple(i for i in k if i not in (over, head))
    missing = [i for i in batch if i not in q or i not in v]
    if missing:
        raise fail(f"K's index {missing[0]} must be in Q and V too (a batch or head index)")
    extra = [i for i in v if i not in (*batch, over, value_head)]
    if extra:
        raise fail(f"V's index {extra[0]} is not one of K's")
    if value_head in q[:-1]:
        raise fail(f"V's head dim {value_head} is also one of Q's other indices")
    queries = tuple(i for i in q[:-1] if i not in batch)
    if not queries:
        raise fail("Q has no query index (S) of its own")
    return Roles(q, k, v, over, head, value_head, batch, queries)
