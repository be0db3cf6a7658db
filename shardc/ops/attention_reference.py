"""The attention family on whole arrays: the independent reference ``verify`` compares with, and its bounds.

``softmax(Q·K / sqrt(H) over T) · V`` computed directly (causal: masked as the causal mask is, its sliding
window too), the S x T scores held (the reference may hold
them; the kernel never does).  With a second (query, key) pair, Multi-head Latent Attention's decoupled
rotary part (DeepSeek-V2, arXiv 2405.04434, section 2.1.3), every score gains ``Qr·Kr`` and the scale is
that of the concatenated head, ``1 / sqrt(H + J)``, as the implementations that concatenate ``[Qn, Qr]``
and ``[Kn, Kr]`` compute it.  The gradients are in closed form: ``dS = P * (dP - rowsum(dP * P))``, then
each pair's query and key from dS, as a matmul's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shardc.ops.masks import in_window
from shardc.ops.reductions_reference import grad_magnitude as softmax_grad_magnitude
from shardc.ops.reductions_reference import magnitude as softmax_magnitude
from shardc.ops.registry import Arrays, Site
from shardc.spec.attention_call import CAUSAL, Roles, roles

__all__ = ["attention_forward", "attention_vjp", "site_roles", "forward", "vjp", "magnitude", "grad_magnitude"]

Array = Any
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _words(r: Roles) -> tuple[str, dict[str, str]]:
    """(the key's letter, each operand's letters by name: q, k, v, rows, out, and qr, kr where given)."""
    names = list(dict.fromkeys(i for indices in r.operands for i in indices))
    letters = {n: _LETTERS[j] for j, n in enumerate(names)}
    word = {name: "".join(letters[i] for i in indices)
            for name, indices in (("q", r.q), ("k", r.k), ("v", r.v), ("rows", r.rows), ("out", r.out),
                                  ("qr", r.qr), ("kr", r.kr))}
    return letters[r.key], word


def _pairs(r: Roles) -> tuple[tuple[int, int, str, str], ...]:
    """Each (query, key) pair whose product is a term of the scores: (query's position among the operands,
    key's, their names in :func:`_words`)."""
    return ((0, 1, "q", "k"), *(((3, 4, "qr", "kr"),) if r.qr else ()))


def _scale(r: Roles, xs: Arrays) -> float:
    """1 / sqrt of the head dims contracted: H, or H + J with the second pair."""
    return 1 / math.sqrt(sum(xs[a].shape[-1] for a, _, _, _ in _pairs(r)))


def _probabilities(r: Roles, causal: bool, xs: Arrays, xp: Any, window: int | None = None) -> tuple[Array, Array]:
    """(the scores, -inf where masked (causal, within ``window`` keys where given); their softmax along T, the
    last axis)."""
    t, w = _words(r)
    s = sum(xp.einsum(f"{w[a]},{w[b]}->{w['rows']}{t}", xs[i], xs[j]) for i, j, a, b in _pairs(r)) * _scale(r, xs)
    if causal:
        s = xp.where(_masked(r, s.shape, window, xp), -np.inf, s)
    z = xp.exp(s - xp.max(s, axis=-1, keepdims=True))
    return s, z / xp.sum(z, axis=-1, keepdims=True)


def _masked(r: Roles, shape: tuple[int, ...], window: int | None, xp: Any) -> Array:
    """Where the key position (the last axis) is after the query position, or out of its sliding window
    (:func:`shardc.ops.masks.in_window`, the causal mask's definition): positions compared in ``xp``, so
    that jax.numpy traces an iota and a comparison, not a constant of the scores' size."""
    d = r.rows.index(r.query)
    qpos = xp.arange(shape[d]).reshape([-1 if j == d else 1 for j in range(len(shape))])
    return ~in_window(qpos, xp.arange(shape[-1]), window)


def attention_forward(r: Roles, causal: bool, q: Array, k: Array, v: Array, xp: Any, *pair: Array,
                      window: int | None = None) -> Array:
    """The output on whole arrays (Q, K, V, and ``pair``: Qr, Kr where the call has them), in
    :attr:`Roles.out`'s order; ``window``: the causal mask's sliding window."""
    xs = (q, k, v, *pair)
    t, w = _words(r)
    _, p = _probabilities(r, causal, xs, xp, window)
    return xp.einsum(f"{w['rows']}{t},{w['v']}->{w['out']}", p, xs[2])


def attention_vjp(r: Roles, causal: bool, q: Array, k: Array, v: Array, d: Array, xp: Any,
                  *pair: Array, window: int | None = None) -> tuple[Array, ...]:
    """The gradients (dQ, dK, dV, and dQr, dKr with the second ``pair``) for the cotangent ``d``."""
    xs = (q, k, v, *pair)
    t, w = _words(r)
    rows = w["rows"]
    _, p = _probabilities(r, causal, xs, xp, window)
    dp = xp.einsum(f"{w['out']},{w['v']}->{rows}{t}", d, xs[2])
    ds = p * (dp - xp.sum(dp * p, axis=-1, keepdims=True)) * _scale(r, xs)
    grads: list[Array] = [None] * len(xs)
    for i, j, a, b in _pairs(r):
        grads[i] = xp.einsum(f"{rows}{t},{w[b]}->{w[a]}", ds, xs[j])
        grads[j] = xp.einsum(f"{rows}{t},{w[a]}->{w[b]}", ds, xs[i])
    grads[2] = xp.einsum(f"{rows}{t},{w['out']}->{w['v']}", p, d)
    return tuple(grads)


def site_roles(site: Site) -> Roles:
    """The roles of a call site's operands."""
    q, k, v, *pair = site.labels
    return roles(q, k, v, site.func.over, site.func.span, *pair)


def _causal(site: Site) -> bool:
    return CAUSAL in site.func.names


def forward(site: Site, xs: Arrays, xp: Any) -> Array:
    return attention_forward(site_roles(site), _causal(site), *xs[:3], xp, *xs[3:], window=site.func.window)


def vjp(site: Site, xs: Arrays, d: Array, xp: Any) -> tuple[Array | None, ...]:
    return attention_vjp(site_roles(site), _causal(site), *xs[:3], d, xp, *xs[3:], window=site.func.window)


def _score_bounds(site: Site, xs: Arrays, mags: Arrays) -> tuple[Roles, Array, Array, Array]:
    """(roles, the scores, their magnitudes (masked: 0), the softmax's magnitudes) for verify's bounds."""
    r = site_roles(site)
    t, w = _words(r)
    s, _ = _probabilities(r, _causal(site), xs, np, site.func.window)
    mag_s = sum(np.einsum(f"{w[a]},{w[b]}->{w['rows']}{t}", mags[i], mags[j]) for i, j, a, b in _pairs(r)) \
        * _scale(r, xs)
    if _causal(site):
        mag_s = np.where(np.isinf(s), 0.0, mag_s)
    return r, s, mag_s, softmax_magnitude("softmax", s, mag_s, -1)


def magnitude(site: Site, xs: Arrays, mags: Arrays, y: Array) -> Array:
    """The softmax's bound times |V|, plus the probabilities times V's magnitudes."""
    r, s, _, mag_p = _score_bounds(site, xs, mags)
    t, w = _words(r)
    p = np.exp(s - np.max(s, axis=-1, keepdims=True))
    p = p / np.sum(p, axis=-1, keepdims=True)
    spec = f"{w['rows']}{t},{w['v']}->{w['out']}"
    return np.einsum(spec, mag_p, np.abs(xs[2])) + np.einsum(spec, p, mags[2])


def grad_magnitude(site: Site, xs: Arrays, mags: Arrays, d: Array) -> tuple[Array | None, ...]:
    """Each gradient's matmuls over magnitudes, through the softmax's gradient bound."""
    r, s, mag_s, mag_p = _score_bounds(site, xs, mags)
    t, w = _words(r)
    rows = w["rows"]
    mag_dp = np.einsum(f"{w['out']},{w['v']}->{rows}{t}", np.abs(d), mags[2])
    mag_ds = softmax_grad_magnitude("softmax", s, mag_s, mag_dp, -1) * _scale(r, xs)
    grads: list[Array] = [None] * len(xs)
    for i, j, a, b in _pairs(r):
        grads[i] = np.einsum(f"{rows}{t},{w[b]}->{w[a]}", mag_ds, mags[j])
        grads[j] = np.einsum(f"{rows}{t},{w[a]}->{w[b]}", mag_ds, mags[i])
    grads[2] = np.einsum(f"{rows}{t},{w['out']}->{w['v']}", mag_p, np.abs(d))
    return tuple(grads)
