"""The fixed device orders of GPipe, 1F1B, interleaved 1F1B and ZB-H1: each device's list of
(kind, microbatch, chunk) ops, run in turn by the simulation (:mod:`shardc.pipeline.schedules`).

Each order is built as columns (:func:`order_columns`: the kinds' codes, microbatches and chunks, numpy
arrays), which the closed-form walk reads whole (:mod:`shardc.pipeline.keyed_walk`) and
:func:`fixed_order` turns into the ops' tuples.  DualPipe's and DualPipeV's orders are
:mod:`shardc.pipeline.dualpipe`'s; zbv's is found greedily by the simulation itself.
"""

from __future__ import annotations

import numpy as np

from shardc.errors import ShardcError

__all__ = ["KINDS", "Columns", "fixed_order", "order_columns"]

KINDS = "FBW"  # an op kind's code in the columns is its index here
Columns = tuple[np.ndarray, np.ndarray, np.ndarray]  # each op's kind code, microbatch and chunk, in the order


def fixed_order(schedule: str, s: int, p: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """A device's fixed order of (kind, microbatch, chunk) for gpipe, 1f1b, interleaved and zb-h1."""
    kinds, js, cs = order_columns(schedule, s, p, m, v)
    return list(zip([KINDS[k] for k in kinds.tolist()], js.tolist(), cs.tolist(), strict=True))


def order_columns(schedule: str, s: int, p: int, m: int, v: int) -> Columns:
    """Device ``s``'s fixed order as columns (:data:`Columns`)."""
    if schedule == "zb-h1":
        return _zb_h1(s, p, m)
    if schedule == "gpipe":
        j = np.arange(m)
        return np.repeat(np.array([0, 1], np.int8), m), np.concatenate([j, j]), np.full(2 * m, s)
    if schedule == "1f1b":
        j = np.arange(m)
        forwards, backwards = (j, np.full(m, s)), (j, np.full(m, s))
        warmup = min(p - 1 - s, m)
    elif schedule == "interleaved":
        group, r = np.divmod(np.arange(m * v), p * v)
        local, j = r // p, group * p + r % p
        forwards, backwards = (j, local * p + s), (j, (v - 1 - local) * p + s)
        warmup = min(2 * (p - 1 - s) + (v - 1) * p, m * v)
    else:
        raise ShardcError(f"unknown pipeline schedule {schedule!r}", fix="use gpipe, 1f1b, interleaved, zb-h1, zbv")
    return _one_forward_one_backward(forwards, backwards, warmup)


def _one_forward_one_backward(forwards: tuple[np.ndarray, np.ndarray], backwards: tuple[np.ndarray, np.ndarray],
                              warmup: int) -> Columns:
    """``warmup`` forwards, then one forward and one backward in turn, then the backwards left."""
    n = len(forwards[0])
    kinds = np.concatenate([np.zeros(warmup, np.int8), np.tile(np.array([0, 1], np.int8), n - warmup),
                            np.ones(warmup, np.int8)])
    columns = [np.concatenate([f[:warmup], np.stack([f[warmup:], b[:n - warmup]], axis=1).ravel(), b[n - warmup:]])
               for f, b in zip(forwards, backwards, strict=True)]
    return kinds, columns[0], columns[1]


def _zb_h1(s: int, p: int, m: int) -> Columns:
    """1F1B's order with W split off and stage s's W lagging s microbatches behind its B.

    The lag fills stage s's drain bubbles with weight gradients, and stage s then holds
    (p-1-s) + 1 + s = p microbatches: 1F1B's first-stage peak on every stage, the
    paper's ZB-H1 (Qi et al. 2023, fig. 3).
    """
    warmup = min(p - 1 - s, m)
    k = np.arange(m)
    # each k: the forward warmup + k (where there is one), the backward k, the weight gradient k - s (from k = s)
    kinds = np.tile(np.array([0, 1, 2], np.int8), m)
    js = np.stack([warmup + k, k, k - s], axis=1).ravel()
    kept = np.stack([warmup + k < m, np.ones(m, bool), k >= s], axis=1).ravel()
    late = np.arange(max(0, m - s), m)  # the weight gradients left after the last backward
    return (np.concatenate([np.zeros(warmup, np.int8), kinds[kept], np.full(len(late), 2, np.int8)]),
            np.concatenate([np.arange(warmup), js[kept], late]), np.full(warmup + int(kept.sum()) + len(late), s))
