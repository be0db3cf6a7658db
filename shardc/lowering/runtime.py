"""The helpers a lowered module's per-device functions call, as ordinary Python.

A module written by ``shardc lower`` imports these (it runs where jax, numpy and
shardc are installed); they are the same code whatever the plan, so they are kept
here, linted, type-checked and tested like the rest of the package, rather than
pasted into every module as text.  Each runs inside ``jax.shard_map`` on one
device's blocks: ``jax.lax.axis_index`` and ``jax.lax.axis_size`` name the mesh
axes the plan put on a dim.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from shardc.lowering.reference import gemm_rounded
from shardc.lowering.runtime_collective import ring_allgather_einsum, ring_einsum_reducescatter

# the lowered module imports every helper from here (shardc.lowering.template.runtime_names): the experts' too
from shardc.lowering.runtime_experts import (
    expert_combine,
    expert_combine_vjp,
    expert_dispatch,
    expert_dispatch_vjp,
    expert_gate_vjp,
)
from shardc.lowering.runtime_ring import (
    compute_dtype,
    key_block,
    ring_backward,
    ring_forward,
    varying_zero,
    zigzag_positions,
)

__all__ = ["make_mesh", "shard_slice", "gather_dims", "positions", "causal_mask", "rotary", "keep_mask", "vocab_lookup",
           "vocab_scatter", "vocab_pick", "vocab_ce_grad", "route_topk", "attention", "attention_grads",
           "attention_rope", "attention_rope_grads",
           "ring_attention", "ring_attention_grads", "expert_dispatch", "expert_combine", "expert_dispatch_vjp",
           "expert_combine_vjp", "expert_gate_vjp", "allgather_einsum", "einsum_reducescatter", "varying"]

Array = Any
Axes = Any  # a mesh axis name, or a tuple of them (major to minor)
Query = tuple[str, Axes] | tuple[str, Axes, int]  # a causal mask's query letter, its axes, and its sliding window


def gemm_input(x: Array, kind: str) -> Array:
    """A GEMM's operand as the GEMM reads it under ``gemm T`` (``kind`` the array type: ``float8_e4m3fn``):
    cast to T and back to its own type, each element at a power-of-two scale of its own
    (:func:`shardc.lowering.reference.gemm_rounded`; the reference rounds alike, bit for bit).  XLA:CPU runs an FP8
    dot by converting its operands up (its HLO shows the converts), so this is the same product: the FP8
    values, multiplied and summed in the operand's type."""
    return gemm_rounded(x, kind, jnp)


def varying(x: Array, axes: Axes) -> Array:
    """``x`` typed as differing across ``axes`` inside shard_map.  A sum's gradient spread along a dim the
    plan shards holds the same numbers on every device of its axes, yet its layout shards them: the
    ``jax.vjp`` of a map reading it wants its cotangent typed as its primal is (varying over those axes),
    and refuses it otherwise.  A zero made from the axes' indices types it so, whatever it varied over
    before (``jax.lax.pcast(to="varying")`` refuses an axis the value already varies over)."""
    return x + varying_zero(x.dtype, jax.lax.axis_index(axes))


def make_mesh(mesh_axes: dict[str, int]) -> jax.sharding.Mesh:
    """The device mesh (Auto axes: jit reshards arguments that arrive laid out otherwise)."""
    shape, names = tuple(mesh_axes.values()), tuple(mesh_axes)
    needed = math.prod(shape)
    if jax.device_count() < needed:
        raise RuntimeError(
            f"the mesh needs {needed} devices but jax sees {jax.device_count()}; on a CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={needed} before jax is imported")
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def shard_slice(x: Array, axes: Axes, dim: int) -> Array:
    """This device's block of ``x`` along ``dim`` over mesh ``axes``: free, no communication."""
    size = x.shape[dim] // jax.lax.axis_size(axes)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axes) * size, size, axis=dim)


def gather_dims(x: Array, groups: tuple[tuple[int, tuple[str, ...]], ...]) -> Array:
    """One AllGather of several dims: ``groups`` pairs each dim with the axes it loses
    (major to minor).  The blocks arrive in a new leading dim over all the axes at once
    and are laid out locally: each dim's gathered axes go just before it, then merge in."""
    axes = tuple(a for _, names in groups for a in names)
    sizes = [jax.lax.axis_size(a) for a in axes]
    y = jax.lax.all_gather(x, axes, axis=0, tiled=False, to="invarying").reshape(*sizes, *x.shape)
    lead: dict[int, list[int]] = {}
    k = 0
    for d, names in groups:
        lead[d] = list(range(k, k + len(names)))
        k += len(names)
    order, shape = [], []
    for d in range(x.ndim):
        order += lead.get(d, []) + [len(axes) + d]
        shape.append(math.prod(sizes[i] for i in lead.get(d, [])) * x.shape[d])
    return jnp.transpose(y, order).reshape(shape)


def positions(x: Array, dim: int, axes: Axes) -> Array:
    """The global positions of this device's block of ``x`` along ``dim`` (sharded over ``axes``),
    shaped to broadcast against ``x``."""
    n = x.shape[dim]
    start = jax.lax.axis_index(axes) * n if axes else 0
    return (start + jnp.arange(n)).reshape([n if d == dim else 1 for d in range(x.ndim)])


def causal_mask(x: Array, query: tuple[int, Axes], key: tuple[int, Axes], fill: float = -jnp.inf,
                window: int | None = None) -> Array:
    """``fill`` where the key's global position is after the query's, or ``window`` or more before it;
    ``query`` and ``key`` are (dim, axes sharding it): each device offsets its block's positions by its
    index along them."""
    return jnp.where(masked(positions(x, *query), positions(x, *key), window), fill, x)


def rotary(x: Array, position: tuple[int, Axes], head: int, theta: float, inverse: bool = False) -> Array:
    """``x`` rotated by its global positions along ``position`` (dim, axes sharding it: each device offsets its
    block by its index along them), the dim ``head`` whole on the device, in halves (:mod:`shardc.ops.rotary`):
    ``x * cos + rotate_half(x) * sin``, the angles in float32 (x's type where wider: verify's float64 run) and
    cos, sin in x's type as MaxText's ``apply_rotary_embedding`` computes them; ``inverse``: the rotation back
    (sin negated), its gradient."""
    half, wide = x.shape[head] // 2, jnp.promote_types(x.dtype, jnp.float32)
    fraction = 2 * jnp.arange(half, dtype=wide) / x.shape[head]
    rate = (1.0 / theta ** fraction).reshape([half if d == head else 1 for d in range(x.ndim)])
    angle = positions(x, *position).astype(wide) * rate
    cos, sin = jnp.cos(angle).astype(x.dtype), jnp.sin(angle).astype(x.dtype)
    sin = -sin if inverse else sin
    x1, x2 = jnp.split(x, 2, axis=head)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=head)


def masked(qpos: Array, kpos: Array, window: int | None) -> Array:
    """Where a causal mask hides key position t from query position s: t > s, or t <= s - window (a sliding
    window keeps s - W < t <= s, :func:`shardc.ops.masks.in_window`)."""
    return kpos > qpos if window is None else (kpos > qpos) | (kpos <= qpos - window)


def keep_mask(x: Array, salt: int, rate: float, dims: tuple[tuple[str, ...], ...], order: tuple[int, ...],
              key: Any = 0, index: tuple[str, ...] = (), microbatch: tuple[str, int] | None = None) -> Array:
    """Dropout's keep-mask for this device's block of ``x``: murmur3's 32-bit finaliser of each
    element's global position (dims taken in ``order``; ``dims`` gives each dim's axes, ``index``
    its name) plus ``salt`` and the dropout ``key`` (forward's argument: another key, other masks),
    kept where it is at least ``rate`` * 2**32.  Every device draws its block of one global mask.
    In a pipeline ``microbatch`` is (the batch dim, the microbatches) and ``key`` is (key,
    microbatch j): the batch dim's positions are j's slice of the whole batch's, so a microbatch
    draws its slice of the whole batch's mask."""
    key, micro = key if isinstance(key, tuple) else (key, 0)
    h = jnp.zeros(x.shape, jnp.uint32)
    for d in order:
        total = x.shape[d] * (jax.lax.axis_size(dims[d]) if dims[d] else 1)
        pos = positions(x, d, dims[d])
        if microbatch is not None and index[d] == microbatch[0]:
            pos, total = pos + micro * total, total * microbatch[1]
        h = h * jnp.uint32(total) + pos.astype(jnp.uint32)
    h = h + jnp.uint32(salt) + jnp.asarray(key, jnp.uint32) * jnp.uint32(0x9E3779B9)
    for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        h = (h ^ (h >> shift)) * jnp.uint32(factor)
    h = h ^ (h >> 16)
    return h >= jnp.uint32(min(int(rate * 2**32), 2**32 - 1))


# --- vocabulary-parallel ops (Megatron-LM's embedding and cross-entropy) ---------------------

def _vocab_rows(ids: Array, rows: Any, axes: Axes) -> tuple[Array, Array]:
    """Token ids as rows of this device's vocabulary shard, and which of them it holds."""
    local = ids - (jax.lax.axis_index(axes) * rows if axes else 0)
    inside = (local >= 0) & (local < rows)
    return jnp.where(inside, local, 0), inside


def vocab_lookup(table: Array, ids: Array, axes: Axes) -> Array:
    """Megatron's vocab-parallel embedding, locally: rows this shard holds, 0 for the others' ids."""
    local, inside = _vocab_rows(ids, table.shape[0], axes)
    found = jnp.take(table, local, axis=0)
    return jnp.where(inside.reshape(inside.shape + (1,) * (table.ndim - 1)), found, jnp.zeros_like(found))


def vocab_scatter(ids: Array, grads: Array, rows: int, axes: Axes) -> Array:
    """The gradient of this device's vocabulary shard: each token's cotangent row added at its id."""
    local, inside = _vocab_rows(ids, rows, axes)
    tail = grads.shape[ids.ndim:]
    kept = jnp.where(inside.reshape(inside.shape + (1,) * len(tail)), grads, jnp.zeros_like(grads))
    return jnp.zeros((rows, *tail), grads.dtype).at[local.reshape(-1)].add(kept.reshape((-1, *tail)))


def vocab_pick(logits: Array, ids: Array, axis: int, axes: Axes) -> Array:
    """Each token's logit at its target id, from the shard that holds it (0 on the others)."""
    local, inside = _vocab_rows(ids, logits.shape[axis], axes)
    picked = jnp.take_along_axis(logits, jnp.expand_dims(local, axis), axis=axis)
    return jnp.where(inside, jnp.squeeze(picked, axis), jnp.zeros_like(ids, logits.dtype))


def vocab_ce_grad(logits: Array, lse: Array, ids: Array, dloss: Array, axis: int, axes: Axes,
                  token_axes: Axes) -> Array:
    """(softmax - onehot) * dLoss / tokens on this vocabulary shard: no communication."""
    local, inside = _vocab_rows(ids, logits.shape[axis], axes)
    shape = [1] * logits.ndim
    shape[axis] = logits.shape[axis]
    column = jnp.arange(logits.shape[axis]).reshape(shape)
    hot = (jnp.expand_dims(local, axis) == column) & jnp.expand_dims(inside, axis)
    tokens = ids.size * (jax.lax.axis_size(token_axes) if token_axes else 1)
    return (jnp.exp(logits - jnp.expand_dims(lse, axis)) - hot.astype(logits.dtype)) * (dloss / tokens)


# --- routing (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021) ---------------------

def route_topk(gates: Array, k: int, capacity: int, order: int, experts: int, by_choice: bool = False) -> Array:
    """Top-k routing with capacity: the 0/1 mask [..., capacity] (a new last dim) of each token's
    slot at each of its k largest gates along ``experts`` (ties: the lower expert), slots counted
    in token order along ``order`` (``by_choice``: choice by choice, every token's first choice before
    any second one); a token past an expert's capacity is dropped there."""
    x = jnp.moveaxis(gates, (order, experts), (-2, -1))
    _, top = jax.lax.top_k(x, k)
    picks = jax.nn.one_hot(top, x.shape[-1], dtype=jnp.int32)  # [..., S, k, E]
    chosen = jnp.sum(picks, axis=-2)
    if by_choice:  # the choices before this one: all tokens' earlier choices, then earlier tokens' same one
        ranked = jnp.swapaxes(picks, -3, -2)
        flat = jnp.reshape(ranked, (*ranked.shape[:-3], -1, ranked.shape[-1]))
        slot = jnp.sum(jnp.reshape(jnp.cumsum(flat, axis=-2) - flat, ranked.shape) * ranked, axis=-3)
    else:
        slot = jnp.cumsum(chosen, axis=-2) - chosen  # tokens before this one that chose the expert
    mask = chosen[..., None] * jax.nn.one_hot(slot, capacity, dtype=gates.dtype)  # 0 past the capacity
    return jnp.moveaxis(mask, (-3, -2), (order, experts))


# --- attention, blockwise with an online softmax (Dao et al. 2022, FlashAttention) ---------------

def _attention_scores(q: Array, kb: Array, subs: tuple[str, str, str, str], key: str,
                      query: Query | None, start: Any, zigzag: tuple[int, Axes] = (0, ())) -> Array:
    """One block of scores ``Q·K / sqrt(H)`` (the rows' letters, then the key letter), -inf where a causal
    mask hides the key: its global position (``start`` on, T whole on the device) past the query's
    (``query``: S's letter and the axes sharding it, each device's block offset by its index along them), or
    the sliding window (``query``'s third, where given) or more before it (:func:`masked`);
    ``zigzag`` (the keys' length and the mesh axes the order is over): the sequence held in zig-zag order of
    2n chunks, n the devices along those axes (S's in the all-gather form; the axes Ulysses moved off S, its
    queries whole), so the mask compares the true positions of the places held."""
    qs, ks, _, _ = subs
    s = jnp.einsum(f"{qs},{ks}->{qs[:-1]}{key}", q, kb) / math.sqrt(q.shape[-1])
    if query is None:
        return s
    letter, axes, window = query if len(query) == 3 else (*query, None)
    qd = qs.index(letter)
    kpos, qpos = start + jnp.arange(kb.shape[ks.index(key)]), positions(s, qd, axes)
    length, order = zigzag
    if length:
        chunks, shards = 2 * jax.lax.axis_size(order), jax.lax.axis_size(axes) if axes else 1
        kpos, qpos = zigzag_positions(kpos, length, chunks), zigzag_positions(qpos, s.shape[qd] * shards, chunks)
    return jnp.where(masked(qpos, kpos, window), -jnp.inf, s)


_KERNEL: list[tuple[tuple[Any, ...], tuple[Array, ...]]] = []  # the last kernel run: (its arguments, its results)


def _kernel_once(run: Any, *args: Any) -> tuple[Array, ...]:
    """``run(*args)``, or its results when the call just before had the same arguments (the same arrays):
    a plan's steps that are one kernel's results (the output and its logsumexp; dQ, dK and dV) each call
    it, and XLA does not merge the loops, so the kernel runs once for them all."""
    if _KERNEL and _KERNEL[0][0][0] is run and len(_KERNEL[0][0]) == len(args) + 1 and all(
            _same(a, b) for a, b in zip(_KERNEL[0][0][1:], args, strict=True)):
        return _KERNEL[0][1]
    results = run(*args)
    _KERNEL[:] = [((run, *args), results)]
    return results  # type: ignore[no-any-return]


def _same(a: Any, b: Any) -> bool:
    """One jax array (immutable: the same object, the same values), or equal letters and flags."""
    if isinstance(a, jax.Array):
        return a is b
    return isinstance(a, str | tuple | bool | None) and a == b


def attention(q: Array, k: Array, v: Array, subs: tuple[str, str, str, str], key: str,
              query: Query | None = None, zigzag: Axes = ()) -> tuple[Array, Array]:
    """(the output, the row logsumexp in float32 or wider) of ``softmax(Q·K / sqrt(H) over T) · V`` on local blocks:
    a loop over blocks of keys keeping each row's running max, sum of exponentials and weighted sum of
    values, so no S x T array is made.  ``subs`` are Q's, K's, V's and O's einsum letters, ``key`` T's, and
    ``query`` S's with the axes sharding it, for a causal mask (None: none); ``zigzag``: the mesh axes of the
    zig-zag chunks the plan holds the sequence in (the all-gather form: S's, each device's queries its two
    chunks, K and V gathered in that order; Ulysses: those moved onto the heads, the sequence whole)."""
    return _kernel_once(_attention, q, k, v, subs, key, query, zigzag)  # type: ignore[return-value]


def _attention(q: Array, k: Array, v: Array, subs: tuple[str, str, str, str], key: str,
               query: Query | None, zigzag: Axes) -> tuple[Array, Array]:
    qs, ks, vs, os = subs
    dtype, wide = q.dtype, compute_dtype(q)
    q, k, v = (x.astype(wide) for x in (q, k, v))
    kt, vt, n = ks.index(key), vs.index(key), k.shape[ks.index(key)]
    b = key_block(n)
    rows = qs[:-1]
    zero = varying_zero(wide, q, k, v)
    acc0 = jnp.zeros(q.shape[:-1] + (v.shape[-1],), wide) + zero
    init = (jnp.full(q.shape[:-1], -jnp.inf, wide) + zero, jnp.zeros(q.shape[:-1], wide) + zero, acc0)

    def body(j: Any, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        m, total, acc = carry
        kb, vb = (jax.lax.dynamic_slice_in_dim(x, j * b, b, axis) for x, axis in ((k, kt), (v, vt)))
        s = _attention_scores(q, kb, subs, key, query, j * b, (n if zigzag else 0, zigzag))
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        shift = jnp.where(jnp.isneginf(m_new), 0, m_new)  # a row that saw no key yet (its window's after): 0s, no NaN
        p = jnp.exp(s - shift[..., None])
        scale = jnp.exp(m - shift)
        pv = jnp.einsum(f"{rows}{key},{vs}->{rows}{vs[-1]}", p, vb)
        return m_new, total * scale + jnp.sum(p, axis=-1), acc * scale[..., None] + pv

    m, total, acc = jax.lax.fori_loop(0, n // b, body, init)
    out = jnp.einsum(f"{rows}{vs[-1]}->{os}", acc / total[..., None])
    return out.astype(dtype), m + jnp.log(total)


def attention_grads(q: Array, k: Array, v: Array, o: Array, lse: Array, do: Array, subs: tuple[str, str, str, str],
                    key: str, query: Query | None = None,
                    zigzag: Axes = ()) -> tuple[Array, Array, Array]:
    """(dQ, dK, dV) of :func:`attention` from the forward's output and row logsumexp: FlashAttention's
    backward, a loop over blocks of keys that makes each block's probabilities again from the logsumexp.
    dK and dV sum over the query indices this device holds (partial sums where those are sharded)."""
    return _kernel_once(_attention_grads, q, k, v, o, lse, do, subs, key, query, zigzag)  # type: ignore[return-value]


def _attention_grads(q: Array, k: Array, v: Array, o: Array, lse: Array, do: Array, subs: tuple[str, str, str, str],
                     key: str, query: Query | None, zigzag: Axes) -> tuple[Array, Array, Array]:
    qs, ks, vs, os = subs
    dtypes, wide = (q.dtype, k.dtype, v.dtype), compute_dtype(q)
    q, k, v, o, lse, do = (x.astype(wide) for x in (q, k, v, o, lse, do))
    kt, vt, n = ks.index(key), vs.index(key), k.shape[ks.index(key)]
    b = key_block(n)
    rows = qs[:-1]
    delta = jnp.einsum(f"{os},{os}->{rows}", do, o)  # rowsum(dO * O)
    scale = 1 / math.sqrt(q.shape[-1])

    def body(j: Any, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        dq, dk, dv = carry
        kb, vb = (jax.lax.dynamic_slice_in_dim(x, j * b, b, axis) for x, axis in ((k, kt), (v, vt)))
        p = jnp.exp(_attention_scores(q, kb, subs, key, query, j * b, (n if zigzag else 0, zigzag)) - lse[..., None])
        dvb = jnp.einsum(f"{rows}{key},{os}->{vs}", p, do)
        dp = jnp.einsum(f"{os},{vs}->{rows}{key}", do, vb)
        ds = p * (dp - delta[..., None]) * scale
        dq = dq + jnp.einsum(f"{rows}{key},{ks}->{qs}", ds, kb)
        dkb = jnp.einsum(f"{rows}{key},{qs}->{ks}", ds, q)
        return (dq, jax.lax.dynamic_update_slice_in_dim(dk, dkb, j * b, kt),
                jax.lax.dynamic_update_slice_in_dim(dv, dvb, j * b, vt))

    zero = varying_zero(wide, q, k, v, o, lse, do)
    init = (jnp.zeros_like(q) + zero, jnp.zeros_like(k) + zero, jnp.zeros_like(v) + zero)
    grads = jax.lax.fori_loop(0, n // b, body, init)
    return tuple(g.astype(t) for g, t in zip(grads, dtypes, strict=True))  # type: ignore[return-value]


def attention_rope(q: Array, k: Array, v: Array, qr: Array, kr: Array, subs: tuple[str, ...], key: str,
                   query: Query | None = None) -> tuple[Array, Array]:
    """:func:`attention` with a second (query, key) pair whose scores add to Q·K (MLA's decoupled rotary part):
    the kernel run on the concatenated heads ``[Q, Qr]`` and ``[K, Kr]``, Kr broadcast over the heads it
    lacks, so the scale is ``1 / sqrt(H + J)``.  ``subs``: Q's, K's, V's, O's, Qr's and Kr's letters."""
    return _kernel_once(_attention_rope, q, k, v, qr, kr, subs, key, query)  # type: ignore[return-value]


def _attention_rope(q: Array, k: Array, v: Array, qr: Array, kr: Array, subs: tuple[str, ...], key: str,
                    query: Query | None) -> tuple[Array, Array]:
    qs, ks, vs, os = subs[:4]
    qj, kj = _joined(q, k, qr, kr, subs)
    return _attention(qj, kj, v, (qs, ks, vs, os), key, query, ())  # no zig-zag order with a second pair


def attention_rope_grads(q: Array, k: Array, v: Array, qr: Array, kr: Array, o: Array, lse: Array, do: Array,
                         subs: tuple[str, ...], key: str,
                         query: Query | None = None) -> tuple[Array, Array, Array, Array, Array]:
    """(dQ, dK, dV, dQr, dKr) of :func:`attention_rope`: :func:`attention_grads` of the concatenated heads,
    split again, dKr summed over the heads Kr was broadcast to."""
    return _kernel_once(_attention_rope_grads, q, k, v, qr, kr, o, lse, do, subs,  # type: ignore[return-value]
                        key, query)


def _attention_rope_grads(q: Array, k: Array, v: Array, qr: Array, kr: Array, o: Array, lse: Array, do: Array,
                          subs: tuple[str, ...], key: str,
                          query: Query | None) -> tuple[Array, Array, Array, Array, Array]:
    qj, kj = _joined(q, k, qr, kr, subs)
    qs, ks, vs, os = subs[:4]
    dq, dk, dv = _attention_grads(qj, kj, v, o, lse, do, (qs, ks, vs, os), key, query, ())
    h, krs = q.shape[-1], subs[5]
    dkr = jnp.einsum(f"{ks[:-1]}{krs[-1]}->{krs}", dk[..., h:].astype(compute_dtype(kr)))
    return (dq[..., :h].astype(q.dtype), dk[..., :h].astype(k.dtype), dv, dq[..., h:].astype(qr.dtype),
            dkr.astype(kr.dtype))


def _joined(q: Array, k: Array, qr: Array, kr: Array, subs: tuple[str, ...]) -> tuple[Array, Array]:
    """``[Q, Qr]`` and ``[K, Kr]`` along the head dim (their letters Q's and K's), Kr broadcast to K's other
    indices."""
    ks, krs = subs[1], subs[5]
    shape = dict(zip(ks, k.shape, strict=True)) | dict(zip(krs, kr.shape, strict=True))
    wide = jnp.einsum(f"{krs}->{''.join(c for c in ks[:-1] if c in krs)}{krs[-1]}", kr)
    wide = jnp.expand_dims(wide, [j for j, c in enumerate(ks[:-1]) if c not in krs])
    wide = jnp.broadcast_to(wide, tuple(shape[c] for c in ks[:-1]) + (kr.shape[-1],))
    dtype = jnp.result_type(q, qr)
    return (jnp.concatenate([q.astype(dtype), qr.astype(dtype)], axis=-1),
            jnp.concatenate([k.astype(dtype), wide.astype(dtype)], axis=-1))


def ring_attention(q: Array, k: Array, v: Array, subs: tuple[str, str, str, str], key: str,
                   query: Query | None, ring: tuple[str, ...], zigzag: bool,
                   held: bool = False) -> tuple[Array, Array]:
    """:func:`attention` with the keys sharded as the queries over ``ring``: K and V passed around the ring
    (ring attention, :func:`shardc.lowering.runtime_ring.ring_forward`); ``zigzag``: causal blocks balanced
    in chunks i and 2n - 1 - i; ``held``: the blocks held in that order already (not reordered)."""
    return _kernel_once(ring_forward, q, k, v, subs, key, query, ring, zigzag, held)  # type: ignore[return-value]


def ring_attention_grads(q: Array, k: Array, v: Array, o: Array, lse: Array, do: Array,
                         subs: tuple[str, str, str, str], key: str, query: Query | None,
                         ring: tuple[str, ...], zigzag: bool, held: bool = False) -> tuple[Array, Array, Array]:
    """(dQ, dK, dV) of :func:`ring_attention` (:func:`shardc.lowering.runtime_ring.ring_backward`): dK and
    dV whole over the ring's axes."""
    return _kernel_once(ring_backward, q, k, v, o, lse, do, subs, key, query, ring,  # type: ignore[return-value]
                        zigzag, held)


def allgather_einsum(subs: str, xs: tuple[Array, ...], k: int, dim: int, axis: str) -> Array:
    """``jnp.einsum(subs, *xs)`` of operand ``k`` gathered along its dim ``dim`` over ``axis``, as a
    collective matmul (:func:`shardc.lowering.runtime_collective.ring_allgather_einsum`)."""
    return ring_allgather_einsum(subs, xs, k, dim, axis)


def einsum_reducescatter(subs: str, xs: tuple[Array, ...], dim: int, axis: str) -> Array:
    """``jnp.einsum(subs, *xs)`` reduce-scattered along the result's dim ``dim`` over ``axis``, as a
    collective matmul (:func:`shardc.lowering.runtime_collective.ring_einsum_reducescatter`)."""
    return ring_einsum_reducescatter(subs, xs, dim, axis)
