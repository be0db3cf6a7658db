"""Closed forms of each schedule's bubble and in-flight activations (the simulation checks them).

Two definitions of the bubble, which differ: idle time over the *ideal* time (one
device's work, m microbatches through its stage, the form 1F1B's (p-1)/m takes) and
idle time over the *total* step (GPipe's (p-1)/(m+p-1)); one gives the other,
total = ideal / (1 + ideal).  With T_F, T_B, T_W a microbatch's forward, input-
gradient and weight-gradient time through one stage (B and W together for the
schedules that do not split them):

* gpipe, 1f1b: idle (p-1)(T_F+T_B+T_W): (p-1)/m of ideal, (p-1)/(m+p-1) of total.
* interleaved V: chunks are 1/V of a stage, so (p-1)/(V m) of ideal.
* zb-h1 (Qi et al. 2023): idle (p-1)(T_F+T_B-T_W) while T_W <= min(T_F, T_B), (p-1)/(3m)
  of ideal when the three times are equal (the paper's assumption).  A longer W cannot fill
  more: the last stage still waits (p-1) T_F for its first forward, and the first (p-1) T_B
  for its last input gradient, so the idle time is (p-1) max(T_F+T_B-T_W, T_F, T_B), printed
  in the times (the simulation gives exactly this for m >= p, whatever the times).
* zbv (Qi et al. 2024): only the fill of half-stage forwards, (p-1) T_F / 2: (p-1)/(6m)
  of ideal, about 0 for m >> p, at twice the point-to-point traffic (2(p-1) sends a
  microbatch, down the V and back, against p-1).
* dualpipev (its DualPipeV): the same over DualPipe's 2p ranks of half-stage chunks, (p-1)(F&B + B
  - 3W) in the chunks' times; p + 1/2 stage-microbatches in flight (2p + 1 chunks), one copy of
  the parameters.
* dualpipe (DeepSeek-AI 2024; the deepseek-ai/DualPipe README's table): (p/2-1)(F&B + B - 3W)
  in the README's notation, B a whole backward (T_B + T_W here) and F&B an overlapped
  forward-backward pair (:func:`~shardc.pipeline.schedules.paired_seconds`); against 1F1B's
  (p-1)(F+B) and ZB-H1's (p-1)(F+B-2W).  The simulation of the repository's order gives
  exactly this when T_F = T_B, T_W <= T_F, the pair saves nothing (F&B = F + B) and sends are
  free; otherwise it differs (a longer W cannot fill more, as for zb-h1, and with a pair
  shorter than F + B each device runs its own number of pairs, so each idles its own time).

In flight on the first stage (activations kept for the backward, in microbatches of a
whole stage): gpipe m; 1f1b, zb-h1 and zbv min(p, m); interleaved p times the
activation factor 1 + (p-1)/(p V) (Narayanan et al. 2021); dualpipe p + 1 on every device
(the README's table; with twice the parameters, each device holding two stages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardc.pipeline.dualpipe import TWO_WAY
from shardc.pipeline.schedules import Timing, chunks_of, device_of, paired_seconds

__all__ = ["Bubble", "bubble", "inflight", "held", "activation_factor", "sends_per_microbatch", "EXACT",
           "microbatches_for"]

# Schedules whose closed form holds for any times; zbv's assumes T_F = T_B = T_W and free sends.
EXACT = frozenset({"gpipe", "1f1b", "interleaved", "zb-h1"})


@dataclass(frozen=True)
class Bubble:
    idle_s: float
    ideal_s: float
    formula: str  # the closed form over the ideal time, in p, m, V

    @property
    def of_ideal(self) -> float:
        return self.idle_s / self.ideal_s if self.ideal_s else 0.0

    @property
    def of_total(self) -> float:
        total = self.idle_s + self.ideal_s
        return self.idle_s / total if total else 0.0


def bubble(schedule: str, p: int, m: int, timing: Timing, virtual: int = 1) -> Bubble:
    """The closed-form idle time of a device under ``schedule`` (sends free)."""
    f, b, w = timing.forward, timing.backward, timing.weight
    ideal = m * timing.total
    if schedule in ("gpipe", "1f1b"):
        return Bubble((p - 1) * (f + b + w), ideal, "(p-1)/m")
    if schedule == "interleaved":
        return Bubble((p - 1) * (f + b + w) / virtual, ideal, "(p-1)/(V*m)")
    if schedule == "zb-h1":
        return Bubble((p - 1) * max(f + b - w, f, b), ideal, "(p-1)*max(T_F+T_B-T_W, T_F, T_B)/(m*(T_F+T_B+T_W))")
    if schedule == "zbv":
        return Bubble((p - 1) * f / 2, ideal, "(p-1)/(6*m)")
    if schedule == "dualpipe":  # the README's F&B, B (whole) and W, over the device's work m(T_F+T_B+T_W)
        whole = b + w
        return Bubble((p / 2 - 1) * (paired_seconds(timing, timing) + whole - 3 * w), ideal,
                      "(p/2-1)*(T_F&B+T_B-2*T_W)/(m*(T_F+T_B+T_W))")
    if schedule == "dualpipev":  # the same over DualPipe's 2p ranks, its chunks half a stage here
        half = Timing(f / 2, b / 2, w / 2, phases=None if timing.phases is None else timing.phases.scaled(0.5))
        return Bubble((p - 1) * (paired_seconds(half, half) + (b + w) / 2 - 3 * w / 2), ideal,
                      "(p-1)*(T_F&B+T_B-2*T_W)/(2*m*(T_F+T_B+T_W))")
    raise ValueError(schedule)


def microbatches_for(schedule: str, p: int, timing: Timing, target: float, virtual: int = 1) -> int:
    """The fewest microbatches whose closed-form bubble is at most ``target`` of the ideal time.

    The idle time does not grow with m and the ideal time is m x one microbatch's work, so the
    bubble is (idle / work) / m: m >= idle / (target x work).  A schedule with no idle time
    (zb-h1 when T_W >= T_F + T_B) meets any target from one microbatch on.
    """
    one = bubble(schedule, p, 1, timing, virtual)
    if one.idle_s <= 0 or one.ideal_s <= 0:
        return 1
    need = max(1, math.ceil(one.idle_s / (target * one.ideal_s) - 1e-9))
    # the bubble at exactly the target (1f1b's (p-1)/m at m = (p-1)/target) meets it: a rounding error of
    # the times' sums must not ask for one microbatch more
    return need if bubble(schedule, p, need, timing, virtual).of_ideal <= target * (1 + 1e-9) else need + 1


def activation_factor(schedule: str, p: int, virtual: int = 1) -> float:
    """The interleaved schedule's extra activations, 1 + (p-1)/(p V); 1 for every other schedule."""
    return 1 + (p - 1) / (p * virtual) if schedule == "interleaved" else 1.0


def inflight(schedule: str, p: int, m: int) -> float:
    """Microbatches whose activations the first stage holds at once (before the activation factor)."""
    if schedule == "dualpipe":  # m >= 2p: p + 1 stage-microbatches on every device
        return p + 1
    if schedule == "dualpipev":  # DualPipe's 2p + 1 chunks of half a stage
        return p + 0.5
    return m if schedule == "gpipe" else min(p, m)


def held(schedule: str, p: int, m: int, virtual: int = 1) -> float:
    """Activations the first stage holds at its peak, in microbatches of a stage: in-flight x factor, <= m."""
    return min(inflight(schedule, p, m) * activation_factor(schedule, p, virtual), float(m))


def sends_per_microbatch(schedule: str, p: int, virtual: int = 1) -> int:
    """Stage boundaries a microbatch's activation crosses forward (its cotangent crosses them back).

    p - 1; interleaved p V - 1; zbv 2(p - 1), down the V and back (the turn stays on device p-1);
    dualpipe p - 1, each microbatch one way through the stages.
    """
    if schedule in TWO_WAY:
        return p - 1
    n = chunks_of(schedule, virtual) * p
    return sum(device_of(schedule, c, p) != device_of(schedule, c + 1, p) for c in range(n - 1))
