"""The fixed device orders of GPipe, 1F1B, interleaved 1F1B and ZB-H1: each device's list of
(kind, microbatch, chunk) ops, run in turn by the simulation (:mod:`shardc.pipeline.schedules`).

DualPipe's and DualPipeV's orders are :mod:`shardc.pipeline.dualpipe`'s; zbv's is found greedily by
the simulation itself.
"""

from __future__ import annotations

from shardc.errors import ShardcError

__all__ = ["fixed_order"]


def fixed_order(schedule: str, s: int, p: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """A device's fixed order of (kind, microbatch, chunk) for gpipe, 1f1b, interleaved and zb-h1."""
    if schedule == "zb-h1":
        return _zb_h1(s, p, m)
    if schedule == "gpipe":
        return [("F", j, s) for j in range(m)] + [("B", j, s) for j in range(m)]
    if schedule == "1f1b":
        forwards = [("F", j, s) for j in range(m)]
        backwards = [("B", j, s) for j in range(m)]
        warmup = min(p - 1 - s, m)
    elif schedule == "interleaved":
        def virtual(k: int, back: bool) -> tuple[int, int]:
            group, r = divmod(k, p * v)
            local = r // p
            return group * p + r % p, (v - 1 - local if back else local) * p + s

        forwards = [("F", *virtual(k, False)) for k in range(m * v)]
        backwards = [("B", *virtual(k, True)) for k in range(m * v)]
        warmup = min(2 * (p - 1 - s) + (v - 1) * p, m * v)
    else:
        raise ShardcError(f"unknown pipeline schedule {schedule!r}", fix="use gpipe, 1f1b, interleaved, zb-h1, zbv")
    order = forwards[:warmup]
    for k in range(len(forwards) - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[len(forwards) - warmup:]


def _zb_h1(s: int, p: int, m: int) -> list[tuple[str, int, int]]:
    """1F1B's order with W split off and stage s's W lagging s microbatches behind its B.

    The lag fills stage s's drain bubbles with weight gradients, and stage s then holds
    (p-1-s) + 1 + s = p microbatches: 1F1B's first-stage peak on every stage, the
    paper's ZB-H1 (Qi et al. 2023, fig. 3).
    """
    warmup = min(p - 1 - s, m)
    order = [("F", j, s) for j in range(warmup)]
    done_w = 0
    for k in range(m):
        if warmup + k < m:
            order.append(("F", warmup + k, s))
        order.append(("B", k, s))
        if k >= s:
            order.append(("W", done_w, s))
            done_w += 1
    return order + [("W", j, s) for j in range(done_w, m)]
