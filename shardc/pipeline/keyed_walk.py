"""The walk of a fixed order of one-op groups (gpipe, 1f1b, interleaved, zb-h1) without walking it.

:func:`~shardc.pipeline.order_walk.walk` advances each device until it waits on another's op, a few
microseconds an op in dicts of tuples: the hot spot of a layouts search, which walks each pair of stages and
microbatches it meets (1F1B over 48 stages and 1536 microbatches: 147,456 ops, half a second).  What a walk
gives the timeline is an order in which every op comes after the ops it reads and after its device's
previous op, and for each op the steps that made its inputs; the timeline then gives each op
max(its device free, each input's end plus its send) plus its time, from those values alone, so any such
order gives every op the very floats of the walk's own order, at every timing and send (the runs are the
same ops, listed in another order; :class:`~shardc.pipeline.simulation.Simulation` reads them sorted, or
per device).

Here that order is found by integer keys, one an op, rising along each device's order and above the keys of
the ops it reads: the ops sorted by key (then device) are such an order.  Once the pipeline is full, 1F1B
repeats on every stage one forward and one backward a microbatch, so its keys have a closed form from that
period (stage s's F of microbatch j at 2j + s, its B at 2j + 2p - 1 - s: an F's unit-time start in the steady
state, the B's coming back up the stages), and so do GPipe's, ZB-H1's (a period of three, F, B and a W
lagging s microbatches) and the interleaved order's (1F1B's over each device's virtual microbatches);
:func:`_guess` writes them.  Each is checked against every constraint at once by a whole-array pass
(:func:`_settle`), which would raise a key that falls short; where keys do not settle within their budget (a
deadlocked order) the caller walks the orders in full, which says why.
"""

from __future__ import annotations

from array import array

import numpy as np

from shardc.pipeline.fixed_orders import KINDS, order_columns
from shardc.pipeline.order_walk import Ones
from shardc.pipeline.simulation import chunks_of, device_of, operations

__all__ = ["keyed_walk", "settle_passes"]


def settle_passes(p: int) -> int:
    """Whole-array passes allowed to raise the guessed keys to every constraint, then the full walk: a pass
    costs about a 200th of the full walk's time; the closed forms hold, so one pass checks them, and a guess
    from each op's place alone would need about p (a stage a pass, down the forwards and back up)."""
    return 2 * p + 16


def keyed_walk(schedule: str, p: int, m: int, virtual: int) -> Ones | None:
    """The walk of ``schedule``'s fixed orders (:func:`~shardc.pipeline.fixed_orders.order_columns`) as
    :class:`Ones`, in key order (see the module docstring); None where the keys do not settle."""
    n = chunks_of(schedule, virtual) * p
    columns = [order_columns(schedule, s, p, m, virtual) for s in range(p)]
    if len({len(kinds) for kinds, _, _ in columns}) != 1:  # the devices' orders stacked need one length
        return None
    kind, j, c = (np.stack([col[i] for col in columns]).astype(np.int64) for i in range(3))
    at = np.full(len(KINDS) * n * m, -1)  # each op's place in the stacked orders, by its identity
    at[((kind * n + c) * m + j).ravel()] = np.arange(kind.size)
    deps = _inputs(kind, j, c, n, m)
    reads = [np.where(dep >= 0, at[np.maximum(dep, 0)], -1) for dep in deps]
    if np.count_nonzero(at >= 0) != operations(schedule, p, m, virtual) or any(
            np.any((dep >= 0) & (pos < 0)) for dep, pos in zip(deps, reads, strict=True)):
        return None  # an op run twice, or not run, or read and not run: the full walk says so
    keys = _settle(_guess(schedule, kind, j, c, p, m), reads, settle_passes(p))
    if keys is None:
        return None
    device = np.repeat(np.arange(p), kind.shape[1])
    order = np.lexsort((device, keys.ravel()))
    step = np.empty_like(order)
    step[order] = np.arange(order.size)
    home = np.array([device_of(schedule, chunk, p) for chunk in range(n)])
    made = [_made(step, pos.ravel()[order], dep.ravel()[order], device[order], home, n, m)
            for dep, pos in zip(deps, reads, strict=True)]
    letters = np.frombuffer(KINDS.encode(), np.uint8)[kind.ravel()[order]]
    return Ones(_ints(device[order]), letters.tobytes().decode(), _ints(j.ravel()[order]), _ints(c.ravel()[order]),
                *made[0], *made[1])


def _inputs(kind: np.ndarray, j: np.ndarray, c: np.ndarray, n: int, m: int) -> list[np.ndarray]:
    """The identities ((kind * n + chunk) * m + microbatch) of the two ops each op reads, -1 none: those of
    :func:`~shardc.pipeline.greedy.op_inputs` over chunks 0 to n - 1, in its order (F reads the previous
    chunk's F; B its own F, then the next chunk's B; W its B)."""
    first = np.where(kind == 0, np.where(c > 0, (c - 1) * m + j, -1),
                     np.where(kind == 1, c * m + j, (n + c) * m + j))
    second = np.where((kind == 1) & (c < n - 1), (n + c + 1) * m + j, -1)
    return [first, second]


def _guess(schedule: str, kind: np.ndarray, j: np.ndarray, c: np.ndarray, p: int, m: int) -> np.ndarray:
    """Each op's key from its schedule's period (see the module docstring)."""
    if schedule == "1f1b":  # the steady period: an F and a B a microbatch, the B back up the stages
        return np.where(kind == 0, 2 * j + c, 2 * j + 2 * p - 1 - c)
    if schedule == "gpipe":  # every forward, then the backwards from the last stage back
        return np.where(kind == 0, j + c, m + 2 * (p - 1) + j - c)
    if schedule == "zb-h1":  # 1F1B's period of two until stage c's W start, c microbatches on; then of three
        return np.select([kind == 0, kind == 1], [np.maximum(2 * j + c, 3 * j - (p - 1) + c),
                                                  np.maximum(2 * j + 2 * p - 1 - c, 3 * j + 2 * p - 1 - 2 * c)],
                         3 * j + c + 2 * p)
    # interleaved: 1F1B's period over each device's virtual microbatches (k: the op's place among its kind's on
    # the device), the stages 2 apart so that a microbatch's F wrapping from device p - 1's chunk to device 0's
    # next (p virtual microbatches back), and its B wrapping the other way, still rise
    k = np.where(kind == 0, np.cumsum(kind == 0, axis=1), np.cumsum(kind == 1, axis=1)) - 1
    stage, virtual = np.arange(kind.shape[0])[:, None], kind.shape[1] // (2 * m)
    return np.where(kind == 0, 2 * k + 2 * stage, 2 * k + 4 * (p - 1) + 2 * (virtual - 1) * p + 1 - 2 * stage)


def _settle(keys: np.ndarray, reads: list[np.ndarray], passes: int) -> np.ndarray | None:
    """``keys`` raised until each is above the keys of the ops it reads and of its device's previous op
    (``keys[d, i]``: device d's i-th op; ``reads``: positions in ``keys.ravel()``, -1 none); None where
    ``passes`` leave one short (a cycle, a deadlocked order, never settles)."""
    place = np.arange(keys.shape[1])
    for _ in range(passes):
        flat = keys.ravel()
        need = keys
        for pos in reads:
            need = np.maximum(need, np.where(pos >= 0, flat[np.maximum(pos, 0)] + 1, 0))
        settled = np.maximum.accumulate(need - place, axis=1) + place  # and above the device's previous op
        if np.array_equal(settled, keys):
            return keys
        keys = settled
    return None


def _made(step: np.ndarray, pos: np.ndarray, dep: np.ndarray, device: np.ndarray, home: np.ndarray,
          n: int, m: int) -> tuple[array[int], array[int]]:
    """One read column of :class:`Ones`, its ops in step order: the step that made the input (-1: none) and
    how it comes (a :data:`~shardc.pipeline.order_walk.Step`'s: 0 on the device, else 2 a B's gradient, 1 an F's)."""
    there = dep >= 0
    crossed = there & (home[np.where(there, dep // m % n, 0)] != device)
    how = np.where(crossed, np.where(dep // (n * m) == 1, 2, 1), 0)
    return _ints(np.where(there, step[np.maximum(pos, 0)], -1)), array("b", how.astype(np.int8).tobytes())


def _ints(values: np.ndarray) -> array[int]:
    return array("i", values.astype(np.int32).tobytes())
