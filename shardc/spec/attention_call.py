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

The result's indices are Q's with the head dim replaced by V's.  Parsing and validation read
this module; the op family (:mod:`shardc.ops.attention`) plans, costs and lowers by it.

>>> r = roles(("B", "S", "G", "R", "H"), ("B", "T", "G", "H"), ("B", "T", "G", "H"), "T")
>>> r.batch, r.queries, r.query, r.head, r.out
(('B', 'G'), ('S', 'R'), 'S', 'H', ('B', 'S', 'G', 'R', 'H'))
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.errors import ShardcError, Span

__all__ = ["CAUSAL", "USAGE", "Roles", "roles"]

CAUSAL = "causal"  # the one flag an attention call takes
USAGE = "O[B, S, N, H] = attention(Q[B, S, N, H], K[B, T, N, H], V[B, T, N, H] over T, causal)"


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
          span: Span | None = None) -> Roles:
    """The roles of Q's, K's and V's indices; a :class:`ShardcError` says what does not fit."""

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
