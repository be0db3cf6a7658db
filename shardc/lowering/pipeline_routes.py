"""Where a pipeline's model chunks sit, and how a tick's results reach the chunk that reads them next.

A device (a stage of the stage axis) holds ``chunks`` model chunks, its chunk c being
virtual stage u (a run of layers, u from 0 to stages x chunks - 1, in model order):

* one chunk a device (GPipe, 1F1B, ZB-H1): u = s; a chain of sends, s to s + 1 and back;
* Megatron-LM's interleaved order: u = c x stages + s, a ring: the last stage's chunk c hands
  on to stage 0's chunk c + 1;
* a V (ZBV, Qi et al. 2024; DualPipeV): chunk 0 of stage s is u = s, chunk 1 is
  u = 2 x stages - 1 - s, so the model runs down the stages and back up: the last stage's chunk
  0 hands on to its own chunk 1 (no send), and the first and the last virtual stage are on stage
  0.  Activations and cotangents each go both ways, a chain down and a chain up.
* two ways (DualPipe, DeepSeek-AI 2024, arXiv 2412.19437 section 3.2.1): the V's places, but
  each chunk a whole model stage, u = s of the first direction (model stage s) and
  u = 2 x stages - 1 - s of the second (model stage stages - 1 - s), so device s holds model
  stages s and stages - 1 - s, each stage on two devices.  A microbatch runs one way only:
  virtual stages 0 .. stages - 1 (down the devices) or stages .. 2 stages - 1 (up them), with
  no turn between the two; each direction's first virtual stage reads the ends' input and its
  last hands on to the ends.  Once a step device s and device stages - 1 - s swap their sums of
  the weights' gradients (one collective-permute), so both copies of a stage get the gradient
  of every microbatch, as the two copies must stay one model.

A tick's sends are SPMD: every device sends what it made on every link, and the receiver keeps
it where the table says the sender ran an op whose result it reads next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["Placement"]


@dataclass(frozen=True)
class Placement:
    """``chunks`` model chunks on each of ``stages`` devices, interleaved (a ring) or in a ``v_shape``;
    ``two_way``: DualPipe's two directions on the V's places, each chunk a whole model stage."""

    stages: int
    chunks: int = 1
    v_shape: bool = False
    two_way: bool = False

    @property
    def model_stages(self) -> int:
        """The runs of layers the model is cut into: the virtual stages, or DualPipe's stages (each held twice)."""
        return self.stages if self.two_way else self.virtual_stages

    def model(self, virtual: int) -> int:
        """The model stage (the run of layers) virtual stage ``virtual`` runs."""
        return virtual % self.stages if self.two_way else virtual

    def starts(self, virtual: Any) -> Any:
        """Whether virtual stage ``virtual`` (traced) reads the ends' input: the first, or either direction's."""
        return virtual % self.stages == 0 if self.two_way else virtual == 0

    def ends(self, virtual: Any) -> Any:
        """Whether virtual stage ``virtual`` (traced) hands on to the ends: the last, or either direction's."""
        n = self.stages if self.two_way else self.virtual_stages
        return virtual % n == n - 1

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def virtual(self, chunk: int, stage: int) -> int:
        """The virtual stage of device ``stage``'s chunk ``chunk``."""
        if self.v_shape:
            return stage if chunk == 0 else 2 * self.stages - 1 - stage
        return chunk * self.stages + stage

    def place(self, virtual: int) -> tuple[int, int]:
        """The device and its chunk that hold ``virtual``."""
        (stage, chunk), = [(s, c) for c in range(self.chunks) for s in range(self.stages)
                           if self.virtual(c, s) == virtual]
        return stage, chunk

    @property
    def last_stage(self) -> int:
        """The device of the last virtual stage (which runs what comes after the block)."""
        return self.place(self.virtual_stages - 1)[0]

    @property
    def end_stages(self) -> tuple[int, ...]:
        """The devices that run the ends: the last virtual stage's, or both of DualPipe's end devices
        (each direction enters at one and leaves at the other)."""
        return (0, self.stages - 1) if self.two_way else (self.last_stage,)

    def table(self) -> Any:
        """Virtual stage by [chunk, stage], for the traced program."""
        return jnp.asarray([[self.virtual(c, s) for s in range(self.stages)] for c in range(self.chunks)])

    def links(self, step: int) -> list[list[tuple[int, int]]]:
        """The collective-permutes a result takes to the next virtual stage (``step`` 1) or the previous
        (-1), each as (source, target) stage pairs."""
        p = self.stages
        down = [(s, s + 1) for s in range(p - 1)]
        up = [(s + 1, s) for s in range(p - 1)]
        if self.v_shape:
            return [down, up]
        if self.chunks > 1:  # the ring: the last stage's chunk c hands on to stage 0's chunk c + 1
            return [down + [(p - 1, 0)]] if step > 0 else [up + [(0, p - 1)]]
        return [down if step > 0 else up]

    def hand_on(self, axis: str, buf: Any, x: Any, row: Any, stage: Any, microbatches: int, step: int,
                slots: Any) -> Any:
        """``buf`` with what this tick's ops of ``row`` (the table's row: each stage's entry, or -1) made,
        ``x`` on each device, received where it is read next: the entry chunk x M + microbatch at its slot
        ``slots[entry]`` of this stage."""
        n, m, virtual = self.virtual_stages, microbatches, self.table()
        to = jnp.asarray([self.place(u) for u in range(n)])

        def target(q: Any) -> tuple[Any, Any]:  # whether stage q's op hands on here, and into which entry
            sent = row[q]
            e = jnp.maximum(sent, 0)
            u = virtual[e // m, q] + step
            ok = (sent >= 0) & (u >= 0) & (u < n)
            if self.two_way:  # a microbatch keeps to its direction: no turn from one to the other
                ok = ok & (u // self.stages == virtual[e // m, q] // self.stages)
            u = jnp.clip(u, 0, n - 1)
            return ok & (to[u, 0] == stage), slots[to[u, 1] * m + e % m]

        for pairs in self.links(step):
            got = jax.lax.ppermute(x, axis, pairs)
            sources = [-1] * self.stages
            for source, dest in pairs:
                sources[dest] = source
            q = jnp.asarray(sources)[stage]
            ok, into = target(jnp.maximum(q, 0))
            buf = jnp.where(ok & (q >= 0), buf.at[into].set(got), buf)
        if self.v_shape and not self.two_way:  # the turn of the V: the last stage hands on to itself
            ok, into = target(stage)
            buf = jnp.where(ok, buf.at[into].set(x), buf)
        return buf

    def sum_copies(self, axis: str, grads: tuple[Any, ...], slots: int) -> tuple[Any, ...]:
        """Each slot's weight gradients (``grads``, each [chunks x slots, ...]) with the other copy's added:
        DualPipe's device s and device stages - 1 - s swap their sums (one collective-permute each), and
        each adds the other's chunk 1 to its chunk 0 and its chunk 0 to its chunk 1 (the same model
        stages).  Other placements hold one copy: unchanged."""
        if not self.two_way:
            return grads
        pairs = [(s, self.stages - 1 - s) for s in range(self.stages)]
        got = jax.lax.ppermute(grads, axis, pairs)
        return tuple(g + jnp.concatenate([o[slots:], o[:slots]]) for g, o in zip(grads, got, strict=True))
