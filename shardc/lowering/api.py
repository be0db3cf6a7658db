"""``shardc.lower``: a plan as a generated module, and the same module in-process.

The in-process functions are the generated source itself, executed as a
module, so what runs here is exactly what ``shardc lower`` writes.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardc.costmodel.offload import OFFLOADS
from shardc.errors import ShardcError
from shardc.ir.plan import Plan
from shardc.ir.spec import Spec, TensorRef
from shardc.lowering.codegen import Boundary, Module, generate
from shardc.lowering.load import check_devices, load_module, lowered_mesh, lowered_sizes
from shardc.lowering.pipeline_lowering import lower_pipeline
from shardc.lowering.replan import unlowered_optimizer
from shardc.lowering.row_code import id_inputs
from shardc.planner.check import require_sound
from shardc.planner.planner import plan as make_plan
from shardc.spec.functions import ID_DTYPE
from shardc.spec.walk import domain_reads

__all__ = ["Lowered", "lower", "module_source", "check_lowered_offload", "drawn_in"]


def drawn_in(domain: str, z: np.ndarray) -> np.ndarray:
    """A standard normal draw ``z`` moved into a map's domain (:attr:`~shardc.spec.functions.Signature.domain`),
    each value at least 0.5 from its edge 0: ``log``'s, ``sqrt``'s and ``rsqrt``'s ``|z| + 0.5`` (their values
    and derivatives of unit size, not NaN, nor the infinities a value near 0 makes of rsqrt's derivative), and
    ``reciprocal``'s the same with z's sign.  Every real (""): ``z`` itself."""
    if domain == "positive":
        return np.abs(z) + 0.5
    if domain == "nonzero":
        return np.where(z < 0, -1.0, 1.0) * (np.abs(z) + 0.5)
    return z


@dataclass
class Lowered:
    """A lowered plan: ``.source`` is the module text, ``.forward``/``.grad`` run it."""

    plan: Plan
    module: Module
    namespace: types.ModuleType
    sizes: dict[str, int] | None
    zero: Plan | None = None  # the ZeRO-1/2 plan whose optimizer phase ``optimizer_step`` runs
    offload: str = "none"  # what the host's memory holds (check_lowered_offload)
    _compiled: dict[tuple[str, str], Any] = field(default_factory=dict, repr=False)

    @property
    def source(self) -> str:
        return self.module.source

    @property
    def mesh(self) -> Any:
        return self.namespace.programs()[0]

    def forward(self, inputs: dict[str, Any], key: int = 0) -> dict[str, Any]:
        """Every statement's result (global arrays keyed by tensor name); ``key`` draws the dropout masks."""
        return dict(self.namespace.forward(inputs, key))

    def grad(self, inputs: dict[str, Any], cotangent: dict[str, Any], key: int = 0) -> dict[str, Any]:
        """The gradient of each input not declared ``const`` (keyed ``plan.grad_name(x)``, ``dX``),
        from the outputs' cotangents (keyed by their gradient names, ``dOut``), under dropout ``key``."""
        return dict(self.namespace.grad(inputs, cotangent, key))

    def optimizer_step(self, params: dict[str, Any], grads: dict[str, Any]) -> dict[str, Any]:
        """ZeRO-1/2's optimizer phase: the updated params, from the params and the gradients as the
        ZeRO plan's backward leaves them (keyed by gradient name; stacked where partial sums)."""
        if self.module.optimizer is None:
            raise ShardcError("this plan has no optimizer phase", fix="add `zero 1 over X` or `zero 2 over X`")
        return dict(self.namespace.optimizer_step(params, grads))

    def global_shape(self, ref: TensorRef) -> tuple[int, ...]:
        """The global array of a value: stacked partial sums lead when it is unreduced."""
        if ref.dims and (self.sizes is None or any(d.name not in self.sizes for d in ref.dims)):
            raise ShardcError(f"no size for every dim of {ref}", fix="pass sizes= or add a dims line")
        sizes = self.sizes or {}
        lead = [int(np.prod([sizes[a] for a in ref.unreduced]))] if ref.unreduced else []
        return tuple(lead + [sizes[d.name] for d in ref.dims])

    def random_inputs(self, seed: int = 0, dtype: Any = np.float32) -> dict[str, np.ndarray]:
        """Standard normal inputs; token ids (embed's, cross_entropy's) uniform ID_DTYPE in their vocabulary; an
        input a map defined on part of the reals reads (``log(X)``'s X) drawn there (:func:`drawn_in`)."""
        rng = np.random.default_rng(seed)
        ids, domains = id_inputs(self.plan.spec), domain_reads(self.plan.spec)
        sizes = self.sizes or {}
        return {b.key: rng.integers(0, sizes[ids[b.key]], self.global_shape(b.ref)).astype(ID_DTYPE)
                if b.key in ids else drawn_in(domains.get(b.key, ""), rng.standard_normal(self.global_shape(b.ref)))
                .astype(dtype) for b in self.module.forward.inputs}

    def random_cotangents(self, seed: int = 1, dtype: Any = np.float32) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {c.name: rng.standard_normal(self.global_shape(c)).astype(dtype)
                for c in self.plan.cotangents}

    def compiled_text(self, phase: str, dtype: Any = np.float32) -> str:
        """The compiled HLO of one phase's ``jit(shard_map)``, arguments laid out as planned."""
        key = (phase, np.dtype(dtype).name)
        if key not in self._compiled:
            import jax
            from jax.sharding import NamedSharding

            mesh, fwd, bwd = self.namespace.programs()
            program, boundaries = (fwd, self.module.forward.inputs) if phase == "forward" else (
                bwd, self.module.backward.inputs)
            if phase == "optimizer" and self.module.optimizer is not None:
                program, boundaries = self.namespace.optimizer_program(), self.module.optimizer.inputs
            ids = id_inputs(self.plan.spec)
            host = phase == "optimizer" and self.offload in ("optimizer", "both")  # its arguments on the host
            kind = "pinned_host" if host else None
            args = [jax.ShapeDtypeStruct(self.global_shape(b.ref), ID_DTYPE if b.ref.name in ids else dtype,
                                         sharding=NamedSharding(mesh, _spec(self, b), memory_kind=kind))
                    for b in boundaries]
            if phase == "forward" and self.namespace.KEYED:  # the dropout key, replicated
                from jax.sharding import PartitionSpec

                args.append(jax.ShapeDtypeStruct((), np.uint32, sharding=NamedSharding(mesh, PartitionSpec())))
            self._compiled[key] = program.lower(*args).compile().as_text()
        return str(self._compiled[key])


def _spec(lowered: Lowered, boundary: Boundary) -> Any:
    optimizer = lowered.module.optimizer
    if optimizer is not None and boundary in optimizer.inputs:
        return lowered.namespace.OPTIMIZER_IN[boundary.key]
    table = lowered.namespace.FORWARD_IN if boundary in lowered.module.forward.inputs else (
        lowered.namespace.BACKWARD_IN)
    return table[boundary.key]


def module_source(plan: Plan, offload: str = "none") -> tuple[str, str | None]:
    """The module text ``shardc lower`` writes, and a note when the spec's sizes cannot run (``offload``:
    what the host's memory holds, :func:`check_lowered_offload`).

    The module is shape-generic: its shard_maps run at any sizes the shardings divide.  When
    the spec's own dims do not divide (XLA's partitioner would pad; shard_map does not), it is
    written without them (symbolic local shapes in the comments) and the note says so.
    """
    check_lowered_offload(plan, offload)
    if plan.spec.mesh.pipeline_axis is not None:  # its schedule over the stage axis
        return lower_pipeline(plan, load=False).source, None
    zero = plan if plan.optimizer else None
    plan, _ = unlowered_optimizer(plan)  # ZeRO-1/2: forward and grad without the zero line
    mesh = lowered_mesh(plan, None)
    try:
        return generate(plan, mesh, lowered_sizes(zero or plan, None, mesh), zero=zero, offload=offload).source, None
    except ShardcError as err:
        if "not divisible" not in err.message:
            raise
        note = (f"note: {err.message}; the module is written without the spec's sizes and runs at "
                "sizes that divide (its demo picks some)")
        return generate(plan, mesh, None, zero=zero, offload=offload).source, note


def lower(plan_or_spec: Plan | Spec, sizes: dict[str, int] | None = None, save: str = "default",
          offload: str = "none", **options: Any) -> Lowered:
    """Lower a plan (or a spec, planned with ``save``) to a module and load it in-process.

    A ZeRO-1/2 plan's forward and grad run the spec without its ``zero`` line (a true gradient
    for ``jax.grad``), and its optimizer phase is ``.optimizer_step`` (:mod:`shardc.lowering.optimizer`).
    A spec is planned as written, as ``shardc plan`` plans it; ``sizes`` (dims and mesh
    axes) only set the sizes the module runs at, never the plan.  The plan checker runs
    first: a broken plan raises :class:`~shardc.errors.InternalError`.  ``offload`` places what
    ``shardc cost --offload`` moves in the host's memory (:func:`check_lowered_offload`).
    """
    plan = plan_or_spec if isinstance(plan_or_spec, Plan) else _plan(plan_or_spec, save, options)
    require_sound(plan)
    check_lowered_offload(plan, offload)
    zero = plan if plan.optimizer else None
    plan, _ = unlowered_optimizer(plan)  # ZeRO-1/2: forward and grad without the zero line
    mesh = lowered_mesh(plan, sizes)
    full = lowered_sizes(zero or plan, sizes, mesh)
    module = generate(plan, mesh, full, zero=zero, offload=offload)
    check_devices(mesh)
    namespace = load_module(module.source, plan.spec.filename or "spec")
    return Lowered(plan, module, namespace, full, zero, offload)


def check_lowered_offload(plan: Plan, offload: str) -> None:
    """What the lowered module can place in the host's memory: the forward's residuals (``activations``:
    its program's outputs in ``pinned_host``, copied back for the backward) and a ZeRO-1/2 plan's optimizer
    phase (``optimizer``: its arguments and results in ``pinned_host``, run on the host, as ZeRO-Offload
    does); a pipelined program places nothing there."""
    if offload not in OFFLOADS:
        raise ShardcError(f"unknown offload {offload!r}", fix="use one of " + ", ".join(OFFLOADS))
    if offload != "none" and plan.spec.mesh.pipeline_axis is not None:
        raise ShardcError(f"--offload {offload}: the pipelined program is lowered without host offload",
                          fix="`shardc cost --offload` costs it a stage at a time; lower it without --offload")
    if offload in ("optimizer", "both") and not plan.optimizer:
        raise ShardcError(f"--offload {offload}: the lowered module updates the params only for a ZeRO-1/2 plan",
                          fix="add `zero 2 over X` (ZeRO-Offload partitions the state as ZeRO-2 does), or "
                              "--offload activations")


def _plan(spec: Spec, save: str, options: dict[str, Any]) -> Plan:
    return make_plan(spec, save=save, **options)
