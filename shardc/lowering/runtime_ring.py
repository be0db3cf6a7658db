"""Ring attention on one device's blocks, and the helpers every blockwise attention kernel shares.

A lowered module calls these through :func:`shardc.lowering.runtime.ring_attention` and
``ring_attention_grads`` inside ``jax.shard_map``.  Each device keeps its block of queries; the blocks of
K and V travel around the ring of the sequence's mesh axes (``jax.lax.ppermute`` to the next device, the
send of the next block issued before this step's block of attention, so the two overlap), and each
step's block folds into the online softmax: the running row max, sum of exponentials and weighted sum
of values (Liu et al. 2023, Ring Attention with Blockwise Transformers).  The backward passes K and V
around again with each block's dK and dV accumulators, which arrive home after n hops.

Causal: the blocks are contiguous (device i holds positions i*c to (i+1)*c - 1), or, ``zigzag``, the
sequence is cut into 2n chunks and device i computes chunks i and 2n - 1 - i (the LLaMA 3 paper's load
balancing), reordered from and back to contiguous blocks by two sends of half a block.  A step skips
the blocks its mask hides: contiguous, a block from a later device; zig-zag, half of every block
(from an earlier device, only its first chunk; from a later one, only for the second chunk of queries).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardc.ir.localops import key_block

__all__ = ["compute_dtype", "varying_zero", "key_block", "ring_forward", "ring_backward", "to_zigzag",
           "from_zigzag", "zigzag_order", "zigzag_positions"]

Array = Any
Axes = Any  # a mesh axis name, or a tuple of them (major to minor)
Subs = tuple[str, str, str, str]  # Q's, K's, V's and O's einsum letters
Mask = tuple[int, Array, Array] | None  # (the query dim, its positions, the keys' positions) or None
Carry = tuple[Array, Array, Array]


def varying_zero(dtype: Any, *xs: Array) -> Array:
    """A zero that varies over every mesh axis any of ``xs`` varies over (inside shard_map): a loop's
    initial carry, and a branch's result, must vary as the other's does."""
    return sum((jnp.ravel(x)[0].astype(dtype) * 0 for x in xs), jnp.zeros((), dtype))


def compute_dtype(x: Array) -> Any:
    """What a kernel computes in: float32 at least (bf16 inputs accumulate in float32, as the kernels
    do), float64 where the module runs in it."""
    return jnp.promote_types(x.dtype, jnp.float32)


# --- the zig-zag order: chunks i and 2n - 1 - i on device i --------------------------------------

def _owners(n: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Where device i's first and second half (chunks 2i and 2i + 1) go in the zig-zag order."""
    def owner(c: int) -> int:
        return c if c < n else 2 * n - 1 - c

    return [(i, owner(2 * i)) for i in range(n)], [(i, owner(2 * i + 1)) for i in range(n)]


def _send(x: Array, axes: Axes, perm: list[tuple[int, int]]) -> Array:
    """``x`` sent by ``perm`` (nothing moves where each device keeps its own: two devices' first halves)."""
    return x if all(s == t for s, t in perm) else jax.lax.ppermute(x, axes, perm)


def to_zigzag(x: Array, dim: int, axes: Axes) -> Array:
    """This device's contiguous block of ``x`` along ``dim`` (over ``axes``) as its zig-zag chunks: of
    chunks d and 2n - 1 - d, the even one comes from the first halves' send, the odd one from the second's."""
    first, second = jnp.split(x, 2, axis=dim)
    evens, odds = _owners(jax.lax.axis_size(axes))
    a, b = _send(first, axes, evens), _send(second, axes, odds)
    even = jax.lax.axis_index(axes) % 2 == 0
    return jnp.where(even, jnp.concatenate([a, b], dim), jnp.concatenate([b, a], dim))


def from_zigzag(x: Array, dim: int, axes: Axes) -> Array:
    """The inverse of :func:`to_zigzag`: each chunk home to the device whose contiguous block holds it."""
    first, second = jnp.split(x, 2, axis=dim)
    even = jax.lax.axis_index(axes) % 2 == 0
    evens, odds = _owners(jax.lax.axis_size(axes))
    a = _send(jnp.where(even, first, second), axes, [(t, s) for s, t in evens])
    b = _send(jnp.where(even, second, first), axes, [(t, s) for s, t in odds])
    return jnp.concatenate([a, b], dim)


def zigzag_order(x: Any, axes: tuple[int, ...], chunks: int, back: bool = False) -> Any:
    """A global array (numpy's or jax's) with each of ``axes`` in zig-zag order of ``chunks`` chunks (device i
    of the ring holding chunks i and ``chunks`` - 1 - i, contiguous), or, ``back``, in its own order again:
    what a context-parallel data loader hands a step, off the device program."""
    for axis in axes:
        length = x.shape[axis] // chunks
        order = [c for i in range(chunks // 2) for c in (i, chunks - 1 - i)]
        index = np.concatenate([np.arange(c * length, (c + 1) * length) for c in order])
        x = x.take(np.argsort(index) if back else index, axis=axis)
    return x


def zigzag_positions(held: Array, length: int, chunks: int) -> Array:
    """The true positions of the elements at positions ``held`` of a sequence of ``length`` held in zig-zag
    order of ``chunks`` chunks (:func:`zigzag_order`: slot 2i holds chunk i, slot 2i + 1 chunk chunks - 1 - i)."""
    c = length // chunks
    slot = held // c
    return jnp.where(slot % 2 == 0, slot // 2, chunks - 1 - slot // 2) * c + held % c


def _positions(length: int, index: Any, n: int, zigzag: bool) -> Array:
    """The global positions of device ``index``'s block of ``length`` along the ring (1-D)."""
    if not zigzag:
        return index * length + jnp.arange(length)
    c = length // 2
    return jnp.concatenate([index * c + jnp.arange(c), (2 * n - 1 - index) * c + jnp.arange(c)])


def _shift(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


# --- one block of keys folded into the rows --------------------------------------------------------

def _scores(q: Array, kb: Array, subs: Subs, key: str, mask: Mask, start: Any) -> Array:
    """``Q·K / sqrt(H)`` for a sub-block of keys (from ``start``), -inf where the mask hides a key."""
    qs, ks, _, _ = subs
    s = jnp.einsum(f"{qs},{ks}->{qs[:-1]}{key}", q, kb) / math.sqrt(q.shape[-1])
    if mask is None:
        return s
    dim, qpos, kpos = mask
    kp = jax.lax.dynamic_slice_in_dim(kpos, start, kb.shape[ks.index(key)])
    return jnp.where(kp > qpos.reshape([-1 if d == dim else 1 for d in range(s.ndim)]), -jnp.inf, s)


def _fold(carry: Carry, q: Array, k: Array, v: Array, subs: Subs, key: str, mask: Mask) -> Carry:
    """The running (row max, sum of exponentials, weighted sum of values) updated with the keys of ``k``
    and ``v``, a sub-block at a time (a row all of whose keys are hidden so far keeps its -inf max)."""
    qs, ks, vs, _ = subs
    kt, vt = ks.index(key), vs.index(key)
    b = key_block(k.shape[kt])

    def body(j: Any, carry: Carry) -> Carry:
        m, total, acc = carry
        kb, vb = (jax.lax.dynamic_slice_in_dim(x, j * b, b, axis) for x, axis in ((k, kt), (v, vt)))
        s = _scores(q, kb, subs, key, mask, j * b)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0)
        p = jnp.exp(s - safe[..., None])
        scale = jnp.exp(m - safe)
        pv = jnp.einsum(f"{qs[:-1]}{key},{vs}->{qs[:-1]}{vs[-1]}", p, vb)
        return m_new, total * scale + jnp.sum(p, axis=-1), acc * scale[..., None] + pv

    return jax.lax.fori_loop(0, k.shape[kt] // b, body, carry)  # type: ignore[no-any-return]


def _grads(q: Array, k: Array, v: Array, do: Array, lse: Array, delta: Array, subs: Subs, key: str,
           mask: Mask) -> tuple[Array, Array, Array]:
    """(dQ, dK, dV) of the rows of ``q`` against the keys of ``k`` and ``v``: FlashAttention's backward,
    each sub-block's probabilities made again from the row logsumexp."""
    qs, ks, vs, os = subs
    kt, vt = ks.index(key), vs.index(key)
    b, rows, scale = key_block(k.shape[kt]), qs[:-1], 1 / math.sqrt(q.shape[-1])

    def body(j: Any, carry: Carry) -> Carry:
        dq, dk, dv = carry
        kb, vb = (jax.lax.dynamic_slice_in_dim(x, j * b, b, axis) for x, axis in ((k, kt), (v, vt)))
        p = jnp.exp(_scores(q, kb, subs, key, mask, j * b) - lse[..., None])
        dp = jnp.einsum(f"{os},{vs}->{rows}{key}", do, vb)
        ds = p * (dp - delta[..., None]) * scale
        return (dq + jnp.einsum(f"{rows}{key},{ks}->{qs}", ds, kb),
                jax.lax.dynamic_update_slice_in_dim(dk, jnp.einsum(f"{rows}{key},{qs}->{ks}", ds, q), j * b, kt),
                jax.lax.dynamic_update_slice_in_dim(dv, jnp.einsum(f"{rows}{key},{os}->{vs}", p, do), j * b, vt))

    zero = varying_zero(q.dtype, q, k, v, do, lse)
    init = (jnp.zeros_like(q) + zero, jnp.zeros_like(k) + zero, jnp.zeros_like(v) + zero)
    return jax.lax.fori_loop(0, k.shape[kt] // b, body, init)  # type: ignore[no-any-return]


def _identity(x: Any) -> Any:
    return x


def _halves(x: Array, dim: int) -> tuple[Array, Array]:
    return jax.lax.split(x, (x.shape[dim] // 2,) * 2, axis=dim)  # type: ignore[return-value]


# --- a ring step: the block of keys from device ``src`` -------------------------------------------

class _Step:
    """What a ring step needs to know of its block: the causal mask's dims and positions, and which part
    of the block it computes (the rest its mask hides)."""

    def __init__(self, q: Array, k: Array, subs: Subs, key: str, query: str | None, ring: Axes, zigzag: bool):
        qs, ks, _, _ = subs
        self.n, self.me = jax.lax.axis_size(ring), jax.lax.axis_index(ring)
        self.causal, self.zigzag = query is not None, zigzag
        self.qd = qs.index(query) if query is not None else 0
        self.kt, self.lq, self.lk = ks.index(key), 0, 0
        if query is not None:
            self.lq, self.lk = q.shape[self.qd], k.shape[ks.index(key)]

    def mask(self, src: Any) -> Mask:
        return (self.qd, _positions(self.lq, self.me, self.n, self.zigzag),
                _positions(self.lk, src, self.n, self.zigzag))

    def run(self, j: int, src: Any, whole: Callable[[Mask], Any], early: Callable[[], Any],
            late: Callable[[], Any], skip: Callable[[], Any]) -> Any:
        """``whole`` the block (masked on the diagonal step 0, unmasked where nothing is hidden); causal
        after step 0: contiguous, the block from an earlier device whole, a later one's ``skip``ped;
        zig-zag, ``early`` (every row, the block's first chunk) from an earlier device, ``late`` (the
        second chunk of rows, every key) from a later one."""
        if not self.causal:
            return whole(None)
        if j == 0:
            return whole(self.mask(src))
        if not self.zigzag:
            return jax.lax.cond(src < self.me, lambda: whole(None), skip)
        return jax.lax.cond(src < self.me, early, late)


def ring_forward(q: Array, k: Array, v: Array, subs: Subs, key: str, query: tuple[str, Axes] | None,
                 ring: Axes, zigzag: bool, held: bool = False) -> tuple[Array, Array]:
    """(the output, the row logsumexp) of ``softmax(Q·K / sqrt(H) over T) · V`` with K and V around the
    ring over ``ring``: n steps, each sending the block it holds to the next device while it folds it in;
    ``held``: the blocks come (and go) in zig-zag order already, not reordered here."""
    qs, ks, vs, os = subs
    dtype, wide = q.dtype, compute_dtype(q)
    letter = query[0] if query is not None else None
    if zigzag and not held:
        assert letter is not None
        q, k, v = to_zigzag(q, qs.index(letter), ring), to_zigzag(k, ks.index(key), ring), to_zigzag(v, vs.index(key),
                                                                                                      ring)
    step = _Step(q, k, subs, key, letter, ring, zigzag)
    qw = q.astype(wide)
    zero = varying_zero(wide, q, k, v)
    carry: Carry = (jnp.full(q.shape[:-1], -jnp.inf, wide) + zero, jnp.zeros(q.shape[:-1], wide) + zero,
                    jnp.zeros(q.shape[:-1] + (v.shape[-1],), wide) + zero)
    for j in range(step.n):
        sent = jax.lax.ppermute((k, v), ring, _shift(step.n)) if j < step.n - 1 else (k, v)
        src = (step.me - j) % step.n
        kw, vw = k.astype(wide), v.astype(wide)
        first = (_halves(kw, step.kt)[0], _halves(vw, vs.index(key))[0])
        carry = step.run(j, src, partial(_fold, carry, qw, kw, vw, subs, key),
                         partial(_fold, carry, qw, *first, subs, key, None),
                         partial(_late_fold, carry, qw, kw, vw, subs, key, step.qd), partial(_identity, carry))
        k, v = sent
    m, total, acc = carry
    out = jnp.einsum(f"{qs[:-1]}{vs[-1]}->{os}", acc / total[..., None])
    lse = m + jnp.log(total)
    if zigzag and not held:
        assert letter is not None
        out, lse = from_zigzag(out, os.index(letter), ring), from_zigzag(lse, step.qd, ring)
    return out.astype(dtype), lse


def _late_fold(carry: Carry, q: Array, k: Array, v: Array, subs: Subs, key: str, dim: int) -> Carry:
    """The carry with its second half of rows (the later chunk of queries) folded with every key."""
    heads = [_halves(x, dim) for x in carry]
    late = _fold(tuple(h[1] for h in heads), _halves(q, dim)[1], k, v, subs, key, None)  # type: ignore[arg-type]
    return tuple(jnp.concatenate([h[0], x], dim) for h, x in zip(heads, late, strict=True))  # type: ignore[return-value]


def ring_backward(q: Array, k: Array, v: Array, o: Array, lse: Array, do: Array, subs: Subs, key: str,
                  query: tuple[str, Axes] | None, ring: Axes, zigzag: bool,
                  held: bool = False) -> tuple[Array, Array, Array]:
    """(dQ, dK, dV) of :func:`ring_forward`: K and V around the ring again, each block's dK and dV
    accumulator with it (this device's part added, then sent on), home after n hops, so dK and dV leave
    whole over the ring's axes; ``held`` as there."""
    qs, ks, vs, os = subs
    dtypes, wide = (q.dtype, k.dtype, v.dtype), compute_dtype(q)
    letter = query[0] if query is not None else None
    kt, vt = ks.index(key), vs.index(key)
    if zigzag and not held:
        assert letter is not None
        qd, od = qs.index(letter), os.index(letter)
        q, k, v = to_zigzag(q, qd, ring), to_zigzag(k, kt, ring), to_zigzag(v, vt, ring)
        o, lse, do = to_zigzag(o, od, ring), to_zigzag(lse, qd, ring), to_zigzag(do, od, ring)
    step = _Step(q, k, subs, key, letter, ring, zigzag)
    qw, ow, lw, dw = (x.astype(wide) for x in (q, o, lse, do))
    delta = jnp.einsum(f"{os},{os}->{qs[:-1]}", dw, ow)  # rowsum(dO * O)
    zero = varying_zero(wide, q, k, v, o, lse, do)
    dq = jnp.zeros(q.shape, wide) + zero
    blocks: tuple[Array, Array] = (k, v)
    arrived: tuple[Array, Array] | None = None  # the accumulators of the block held, from the device before
    for j in range(step.n):
        sent = jax.lax.ppermute(blocks, ring, _shift(step.n)) if j < step.n - 1 else blocks
        src = (step.me - j) % step.n
        kw, vw = blocks[0].astype(wide), blocks[1].astype(wide)
        parts = step.run(j, src, partial(_grads, qw, kw, vw, dw, lw, delta, subs, key),
                         partial(_early_grads, qw, kw, vw, dw, lw, delta, subs, key, step.kt, vt),
                         partial(_late_grads, qw, kw, vw, dw, lw, delta, subs, key, step.qd,
                                 os.index(letter) if letter else 0),
                         partial(_identity, (qw * 0, kw * 0, vw * 0)))
        dq = dq + parts[0]
        acc = (parts[1], parts[2]) if arrived is None else (arrived[0] + parts[1], arrived[1] + parts[2])
        arrived = jax.lax.ppermute(acc, ring, _shift(step.n))  # on with its block; the last hop is home
        blocks = sent
    assert arrived is not None
    dk, dv = arrived
    if zigzag and not held:
        assert letter is not None
        dq, dk, dv = from_zigzag(dq, qs.index(letter), ring), from_zigzag(dk, kt, ring), from_zigzag(dv, vt, ring)
    return tuple(g.astype(t) for g, t in zip((dq, dk, dv), dtypes, strict=True))  # type: ignore[return-value]


def _early_grads(q: Array, k: Array, v: Array, do: Array, lse: Array, delta: Array, subs: Subs, key: str,
                 kt: int, vt: int) -> tuple[Array, Array, Array]:
    """Every row against the block's first chunk of keys; the second chunk's dK and dV are 0."""
    dq, dk, dv = _grads(q, _halves(k, kt)[0], _halves(v, vt)[0], do, lse, delta, subs, key, None)
    return dq, jnp.concatenate([dk, dk * 0], kt), jnp.concatenate([dv, dv * 0], vt)


def _late_grads(q: Array, k: Array, v: Array, do: Array, lse: Array, delta: Array, subs: Subs, key: str,
                qd: int, od: int) -> tuple[Array, Array, Array]:
    """The second chunk of rows against every key of the block; the first chunk's dQ is 0."""
    dq, dk, dv = _grads(_halves(q, qd)[1], k, v, _halves(do, od)[1], _halves(lse, qd)[1], _halves(delta, qd)[1],
                        subs, key, None)
    return jnp.concatenate([dq * 0, dq], qd), dk, dv
