"""The totals of one phase of a plan (forward, backward, ZeRO's optimizer) or of its whole step, on a chip.

Each figure sums the phase's rows (:class:`~shardc.step_cost.StepCost`, one a step), each counted as often
as it runs (its layers, :func:`shardc.layer_counts.runs`; a pipelined stage's microbatches):

* ``compute_s``: per-device einsum FLOPs over the rate the chip reaches on them
  (:meth:`Hardware.matmul_seconds`); ``memory_s``: the memory-bound steps' HBM bytes
  over the HBM bandwidth, after fusion (:func:`shardc.fusion.memory_traffic`).
* ``comm_s``: the collectives' times (bandwidth term, bounded below by latency),
  split into ``critical_s`` and ``ahead_s`` (``Step.ahead``: weight gathers and
  weight-gradient reductions can be issued off the critical path; gradient
  reductions bucketed, :func:`shardc.phase_time.comm_split`).
* ``step_s``: ``max(compute + memory, ahead - ends) + ends + critical`` a phase, ``ends`` the
  collectives issued ahead that no compute hides, once a phase (``exposed_ends_s``: the gathers its
  first step waits on, the reductions after its last, :mod:`shardc.phase_ends`), forward plus
  backward (plus ZeRO's optimizer phase and the update) for the step
  (:mod:`shardc.timing`; the planner minimises exactly this figure); under the book's
  model (``model="book"``) ``max(compute, comm)`` a phase.  ``exposed_comm_s`` is
  the step less its compute and memory-bound time: the communication nothing hides.
  ``step_ahead_only_s`` is the same rule with no buckets.
* ``bound``: ``"communication"`` iff comm_s > compute_s + memory_s; under ``--offload``, ``"host"`` where
  the host link's copies outlast the compute they run beside (the forward's copies out, the backward's
  in), or the step holds host time nothing hides (:attr:`~shardc.costmodel.offload.Offload.host_bound`;
  a pipeline's stages each by their own copies); ``shardc layouts`` gives each row this verdict.
* ``mfu``: model FLOPs (the einsums once, recomputed ones not counted, as PaLM
  counts them) / (devices * C * step_s); ``hfu`` counts the recomputed FLOPs too, and of a causal
  attention kernel only the blocks it runs, where MFU counts its whole S x T
  (:data:`MFU_ATTENTION_CONVENTION`): so HFU can be below MFU, and the report says why (:attr:`PhaseCost.below_mfu`).
  With ``mfu=0.4``, ``step_at_mfu_s`` = model FLOPs / (devices * C * 0.4), the
  book's estimate.  ``tokens_per_s_per_chip``: the step's tokens (the model
  input's dims no param has) over step_s and the devices.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property

from shardc.costmodel.formulas import PhaseFormula
from shardc.hardware import Hardware
from shardc.layer_counts import runs
from shardc.overlap import gathered_before
from shardc.phase_time import (
    bound_of,
    comm_split,
    deferred_dcn,
    phase_seconds,
    phase_time,
    seconds_at_mfu,
    step_seconds,
)
from shardc.stage_phases import reductions_exposed
from shardc.step_cost import StepCost

__all__ = ["PhaseCost", "MFU_ATTENTION_CONVENTION"]

# How MFU's model FLOPs count a causal (or windowed) attention: its whole S x T scores, as PaLM's MFU counts them
# (Chowdhery et al. 2022, appendix B: 6N + 12 L H Q T a token), torchtitan's (get_num_flop_per_token: "we follow the
# convention and do not account for sparsity in causal attention") and MaxText's
# (calculate_tflops_training_per_device: causality not discounted); HFU's hardware FLOPs count the blocks the kernel
# runs, its unmasked half (a window's band: shardc.ops.attention).  Both right by their definitions.
MFU_ATTENTION_CONVENTION = "whole"


@dataclass(frozen=True)
class PhaseCost:
    """The totals of one phase (or of the step), for all layers."""

    name: str
    rows: tuple[StepCost, ...]
    layers: int
    devices: int
    hardware: Hardware
    # its formulas, built when first read (:attr:`formula`): a layout search's rows read only the numbers
    formula_of: Callable[[], PhaseFormula] = field(compare=False, repr=False)
    mfu_assumed: float | None = None
    parts: tuple[PhaseCost, ...] = ()  # the step: its phases, which run one after the other
    update_s: float = 0.0  # the step: the optimizer's update, after its phases
    tokens: float = 0.0  # the step: tokens a step processes (all devices)
    dtype: str = "bf16"
    repeats: int = 1  # a pipelined stage: its rows are one microbatch's, run this many times
    more_layers: tuple[int, ...] = ()  # the later `layers` blocks' counts (layer_counts.block_counts)
    offload_s: float = 0.0  # the step: host copies its phases' compute does not hide (shardc.costmodel.offload)
    host: bool = False  # --offload: the phase's host copies (or the host's update) outlast the compute beside them
    ends_s: float = 0.0  # the ahead collectives at the phase's ends no compute hides (timing.phase_ends)
    # a pipelined stage's optimizer phase: its first ``reduced`` rows are the gradient reductions run once a step,
    # under the last microbatch's backward of ``under_s`` (timing.reductions_exposed, as plan_time weighs them)
    reduced: int = 0
    under_s: float = 0.0
    # the optimizer phase under `param_gather overlapped`: its all-gathers run beside the next step's first forward
    # of this many seconds (shardc.overlap.gathered_before); None: after the step, exposed
    gather_under_s: float | None = None

    @cached_property
    def formula(self) -> PhaseFormula:
        """The phase's figures as formulas of the dims and mesh sizes (:func:`shardc.costmodel.formulas.phase_formula`),
        built on first read."""
        return self.formula_of()

    def _sum(self, attr: str, only: bool | None = None) -> float:
        if self.parts:  # the step: each phase counts its own rows (a pipelined stage's M times)
            return math.fsum(p._sum(attr, only) for p in self.parts)
        rows = [r for r in self.rows if only is None or (r.is_collective and r.ahead is only)]
        return math.fsum(getattr(r, attr) * self._count(r) for r in rows)

    def _count(self, row: StepCost) -> int:
        return runs(row.once, row.block, (self.layers, *self.more_layers)) * self.repeats

    @property
    def compute_flops(self) -> float:
        """Per-device einsum FLOPs (recomputed ones too: what the chip runs)."""
        return self._sum("flops")

    @property
    def model_flops(self) -> float:
        """FLOPs of the whole einsums, all devices, each once: recomputed ones not counted (MFU's)."""
        if self.parts:
            return math.fsum(p.model_flops for p in self.parts)
        return math.fsum(r.model_flops * self._count(r) for r in self.rows if not r.recomputed)

    @property
    def hardware_flops(self) -> float:
        """FLOPs all devices run, recomputed ones counted again (HFU's): the einsums whole, a causal
        attention kernel's unmasked half."""
        return self._sum("hardware_flops")

    @property
    def compute_s(self) -> float:
        """Compute time: the einsums at the rate the chip reaches."""
        return self._sum("compute_s")

    @property
    def memory_bytes(self) -> float:
        """HBM bytes of the memory-bound steps, after fusion."""
        return self._sum("memory_bytes")

    @property
    def memory_s(self) -> float:
        """Memory-bound time: the steps that are not einsums nor collectives, and the update."""
        return self._sum("memory_s") + self.update_s

    @property
    def comm_bytes(self) -> float:
        """Weighted volume (AllReduce x2, AllToAll x1/4)."""
        return self._sum("weighted")

    @property
    def comm_s(self) -> float:
        """Collective time: the ahead ones bucketed, the others each bounded below by its latency."""
        if self.parts:
            return math.fsum(p.comm_s for p in self.parts)
        return math.fsum(self._split())

    @property
    def comm_bandwidth_s(self) -> float:
        """Collective time, bandwidth terms only (what the formulas give)."""
        return self._sum("bandwidth_s")

    def _split(self) -> tuple[float, float]:
        return comm_split(((r, self._count(r)) for r in self.rows), self.hardware)

    @property
    def critical_s(self) -> float:
        """Collectives on the critical path: the next op waits for them."""
        if self.parts:
            return math.fsum(p.critical_s for p in self.parts)
        return self._split()[1]

    @property
    def grad_reduce_dcn_s(self) -> float:
        """Of :attr:`critical_s`, the gradient reductions' DCN phase, run once the backward is done (``grad_reduce
        after-backward over dcn``: PaLM's cross-pod transfer; :func:`shardc.phase_time.deferred_dcn`)."""
        if self.parts:
            return math.fsum(p.grad_reduce_dcn_s for p in self.parts)
        return deferred_dcn([(r, self._count(r)) for r in self.rows], self.hardware)

    @property
    def ahead_s(self) -> float:
        """Collectives that can be issued ahead (gradient reductions bucketed)."""
        if self.parts:
            return math.fsum(p.ahead_s for p in self.parts)
        return self._split()[0]

    @property
    def bound(self) -> str:
        return bound_of(self.compute_s + self.memory_s, self.comm_s, self.host)

    @property
    def step_s(self) -> float:
        if self.gather_under_s is not None:
            alone = replace(self, gather_under_s=None).step_s
            return gathered_before(self.gather_under_s, alone, self.hardware.overlap_share, True)
        if self.parts:
            return step_seconds(*(p.step_s for p in self.parts), self.update_s, self.offload_s)
        if self.reduced:
            counted = [(r, self._count(r)) for r in self.rows]
            once = phase_time(counted[:self.reduced], self.hardware)
            rest = phase_time(counted[self.reduced:], self.hardware, self.ends_s)
            return reductions_exposed(once, self.under_s, self.hardware) + rest.seconds
        ahead, critical = self._split()
        return phase_seconds(self.compute_s + self.memory_s, ahead, critical, self.hardware.book,
                             self.hardware.overlap_share, self.ends_s)

    @property
    def exposed_ends_s(self) -> float:
        """Of the collectives issued ahead, those at the phase's ends, which no compute hides (the gathers
        its first step waits on, the reductions after its last: :func:`shardc.phase_time.phase_ends`)."""
        if self.parts:
            return math.fsum(p.exposed_ends_s for p in self.parts)
        return min(self.ends_s, self.ahead_s) if not self.hardware.book else 0.0

    @property
    def exposed_comm_s(self) -> float:
        """The communication compute does not hide: the step less its compute and memory-bound time."""
        if self.parts:
            return math.fsum(p.exposed_comm_s for p in self.parts)
        return max(0.0, self.step_s - self.compute_s - self.memory_s)

    @property
    def step_ahead_only_s(self) -> float:
        if self.parts:
            return step_seconds(*(p.step_ahead_only_s for p in self.parts), self.update_s, self.offload_s)
        return max(self.compute_s + self.memory_s, self._sum("comm_s", only=True)) + self._sum("comm_s", only=False)

    def _utilisation(self, flops: float) -> float:
        peak = self.devices * self.hardware.peak(self.dtype) * self.step_s
        return flops / peak if peak else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOPs (no recompute) over the devices' peak for the step."""
        return self._utilisation(self.model_flops)

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation: the FLOPs the chip runs, recomputation counted."""
        return self._utilisation(self.hardware_flops)

    @property
    def below_mfu(self) -> str | None:
        """Why HFU is below MFU, where it is (else None): only a causal or windowed attention kernel runs fewer
        FLOPs than the model FLOPs count (:data:`MFU_ATTENTION_CONVENTION`), and a reader seeing HFU < MFU sees
        a bug otherwise."""
        if self.hardware_flops >= self.model_flops * (1 - 1e-12):  # sums of the same rows, rounded apart
            return None
        return ("HFU below MFU: the model FLOPs count causal attention whole (PaLM's appendix B convention, "
                "torchtitan's and MaxText's); the causal kernel runs its unmasked half (a window's band), "
                "which HFU counts")

    @property
    def tokens_per_s_per_chip(self) -> float:
        return self.tokens / (self.step_s * self.devices) if self.step_s and self.devices else 0.0

    @property
    def step_at_mfu_s(self) -> float | None:
        if self.mfu_assumed is None:
            return None
        return seconds_at_mfu(self.model_flops, self.devices, self.hardware.peak(self.dtype), self.mfu_assumed)

    def exprs(self) -> dict[str, str]:
        return self.formula.exprs()

    def to_json(self, rows: bool = True) -> dict[str, object]:
        data: dict[str, object] = {
            "comm_bytes": self.comm_bytes, "comm_s": self.comm_s,
            "comm_bandwidth_s": self.comm_bandwidth_s, "critical_s": self.critical_s,
            "ahead_s": self.ahead_s, "compute_flops": self.compute_flops,
            "model_flops": self.model_flops, "hardware_flops": self.hardware_flops, "compute_s": self.compute_s,
            "memory_bytes": self.memory_bytes, "memory_s": self.memory_s, "update_s": self.update_s,
            "offload_s": self.offload_s,
            "step_s": self.step_s, "exposed_comm_s": self.exposed_comm_s, "exposed_ends_s": self.exposed_ends_s,
            "step_ahead_only_s": self.step_ahead_only_s, "bound": self.bound, "mfu": self.mfu,
            "mfu_peak_dtype": self.dtype, "mfu_attention_convention": MFU_ATTENTION_CONVENTION, "hfu": self.hfu,
            "tokens": self.tokens, "tokens_per_s_per_chip": self.tokens_per_s_per_chip,
            "step_at_mfu_s": self.step_at_mfu_s,
        }
        if self.hardware.reduces_dcn_after_backward:
            data["grad_reduce_dcn_s"] = self.grad_reduce_dcn_s
        data.update(self.exprs())
        if rows:
            data["rows"] = [r.to_json() for r in self.rows]
        return data
