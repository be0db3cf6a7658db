"""A lowered module's programs and its functions over global arrays, as ordinary Python.

The module ``shardc lower`` writes holds what is particular to a plan: the mesh,
each phase's boundary ``PartitionSpec`` tables and its per-device function (one
line a step).  :class:`Program` is the rest, the same for every plan: it puts the
per-device functions under ``jit(shard_map(...))`` and gives ``forward`` (a
``jax.custom_vjp`` whose backward is the planned one), ``grad`` and the
optimizer step, keyed by tensor name.  Values cross a phase boundary as global
arrays laid out as planned; a value unreduced over axes ``U`` travels stacked (a
leading dim sharded over ``U`` holding each device's partial sum).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.experimental.compute_on import compute_on
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardc.lowering.runtime import make_mesh
from shardc.lowering.runtime_ring import zigzag_order

__all__ = ["Phase", "Program", "put"]

Arrays = dict[str, Any]
HOST = "pinned_host"  # the host's memory a device copies to and from by DMA (page-locked)


@dataclass(frozen=True)
class Phase:
    """One phase of a module: its per-device function and its boundaries (name -> PartitionSpec)."""

    local: Callable[..., tuple[Any, ...]]
    inputs: dict[str, P]
    outputs: dict[str, P]


def put(x: Any, spec: P, mesh: jax.sharding.Mesh, memory_kind: str | None = None) -> Any:
    """A global array laid out as ``spec`` (host arrays are placed piece by piece, which also
    works when the mesh spans several processes), in the devices' memory or ``memory_kind``'s (an
    array the forward left in the host's memory comes back to the devices so)."""
    sharding = NamedSharding(mesh, spec, memory_kind=memory_kind)
    if isinstance(x, jax.Array):
        if not isinstance(x, jax.core.Tracer) and x.sharding.is_equivalent_to(sharding, x.ndim):
            return x  # already laid out: no dispatch (the forward's outputs feed the backward so)
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def _plus(a: Any, b: Any) -> Any:
    if not isinstance(a, jax.core.Tracer) and not isinstance(b, jax.core.Tracer):
        b = jax.device_put(b, a.sharding)  # eagerly, the two may sit on different devices
    return a + b


@dataclass
class Program:
    """The forward and backward phases of a plan on the mesh ``mesh_axes`` (name -> size).

    ``results``: what ``forward`` returns (the rest of the forward's outputs are residuals);
    ``stacked``: unreduced forward outputs; ``stacked_inputs``: inputs given as partial sums
    (name -> axes); ``keyed``: whether the forward takes a dropout key; ``cotangents``: an
    output's gradient name -> the output; ``grads``: tensor -> its gradient's name; ``zigzag``: the
    arrays whose sequence axes the phases hold in the zig-zag order of ``chunks`` chunks (name -> axes,
    :mod:`shardc.planner.zigzag_order`), which each phase permutes them into as they enter and back as
    they leave, as a data loader hands a context-parallel step its tokens.  ``host``: the residuals the
    forward program leaves in the host's memory (``memory_kind='pinned_host'``, ``--offload activations``),
    which the backward's arguments bring back to the devices.
    """

    mesh_axes: dict[str, int]
    forward_phase: Phase
    backward_phase: Phase
    results: tuple[str, ...]
    stacked: frozenset[str]
    stacked_inputs: dict[str, tuple[str, ...]]
    keyed: bool
    cotangents: dict[str, str]
    grads: dict[str, str]
    zigzag: dict[str, tuple[int, ...]] = field(default_factory=dict)
    chunks: int = 0
    host: frozenset[str] = frozenset()
    forward: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        forward = jax.custom_vjp(self._forward)
        forward.defvjp(self._forward_fwd, self._forward_bwd, symbolic_zeros=True)
        self.forward = forward

    @functools.cached_property
    def _compiled(self) -> tuple[jax.sharding.Mesh, Any, Any]:
        mesh = make_mesh(self.mesh_axes)
        f, b = self.forward_phase, self.backward_phase
        body = jax.shard_map(f.local, mesh=mesh, in_specs=tuple(f.inputs.values()) + (P(),) * self.keyed,
                             out_specs=tuple(f.outputs.values()))
        fwd = jax.jit(body) if not self.host else jax.jit(body, out_shardings=tuple(
            NamedSharding(mesh, spec, memory_kind=HOST if name in self.host else None)
            for name, spec in f.outputs.items()))
        bwd = jax.jit(jax.shard_map(b.local, mesh=mesh, in_specs=tuple(b.inputs.values()),
                                    out_specs=tuple(b.outputs.values())))
        return mesh, fwd, bwd

    def programs(self) -> tuple[jax.sharding.Mesh, Any, Any]:
        """The mesh and each phase as ``jit(shard_map(...))``, compiled on first call."""
        return self._compiled

    def run_forward(self, inputs: Arrays, key: Any = 0) -> Arrays:
        """Every forward value leaving the shard_map: results and residuals (stacked when unreduced);
        ``key`` draws the dropout masks (a uint32; one per step gives each step its own masks)."""
        mesh, fwd, _ = self.programs()
        args = [put(self._order(name, inputs[name]), spec, mesh) for name, spec in self.forward_phase.inputs.items()]
        # a key given as a number is laid out as the program declares it (replicated): the program run is then
        # the one compiled for its HLO (Lowered.compiled_text), and the compilation cache answers the second
        args += [put(np.asarray(key, np.uint32), P(), mesh) if isinstance(key, int | np.integer)
                 else jnp.asarray(key, jnp.uint32)] * self.keyed
        return {name: self._order(name, x, back=True) for name, x in zip(self.forward_phase.outputs, fwd(*args),
                                                                          strict=True)}

    def run_backward(self, inputs: Arrays, saved: Arrays, cotangent: Arrays) -> Arrays:
        """The planned backward from the inputs, the forward's values and the cotangents."""
        mesh, _, bwd = self.programs()
        pool = {**inputs, **saved, **cotangent}
        args = [put(self._order(key, pool[key]), spec, mesh) for key, spec in self.backward_phase.inputs.items()]
        return {name: self._order(name, x, back=True) for name, x in zip(self.backward_phase.outputs, bwd(*args),
                                                                          strict=True)}

    def _order(self, name: str, x: Any, back: bool = False) -> Any:
        """``x`` with its sequence axes in zig-zag chunk order (device i of the ring holding chunks i and
        2n - 1 - i), or, ``back``, in their own order again; as it is where the plan holds no such order."""
        return zigzag_order(x, self.zigzag.get(name, ()), self.chunks, back)

    def _results(self, saved: Arrays) -> Arrays:
        # partial sums travel stacked; a result declared unreduced is returned summed; one the forward left in
        # the host's memory for the backward is returned from the devices' (the residual stays on the host)
        out = {key: self._on_devices(saved[key]) if key in self.host else saved[key] for key in self.results}
        return {key: x.sum(axis=0) if key in self.stacked else x for key, x in out.items()}

    @staticmethod
    def _on_devices(x: Any) -> Any:
        return jax.device_put(x, x.sharding.with_memory_kind("device"))

    def _forward(self, inputs: Arrays, key: Any = 0) -> Arrays:
        """Every statement's result, as global arrays keyed by tensor name (``key``: the dropout key)."""
        return self._results(self.run_forward(inputs, key))

    def _forward_fwd(self, inputs: Any, key: Any = 0) -> tuple[Arrays, Any]:
        values = {name: x.value for name, x in inputs.items()}
        key = getattr(key, "value", key)
        # residuals must be arrays: which inputs want a gradient travels as pytree structure
        wanted = {name: () for name, x in inputs.items() if x.perturbed}
        saved = self.run_forward(values, key)
        return self._results(saved), (values, saved, wanted, key)

    def _forward_bwd(self, residuals: Any, cotangent: Arrays) -> tuple[Any, None]:
        """The planned backward for the outputs' cotangents, into every input not declared const.

        By linearity the rest is added from JAX's own transpose of the forward program
        (not planned, not costed): cotangents of results a later statement reads, and
        gradients of const inputs, should they be asked for.  Neither runs unless needed.
        """
        inputs, saved, wanted, key = residuals
        results = self._results(saved)
        given = {out: c for out, c in cotangent.items() if not isinstance(c, SymbolicZero)}
        outs = {name: given.get(out, jnp.zeros_like(results[out])) for name, out in self.cotangents.items()}
        planned = self.run_backward(inputs, saved, outs) if set(given) & set(self.cotangents.values()) else {}
        grads = {name: planned.get(self.grads[name]) if name in self.grads else None for name in inputs}
        inner = {out: c for out, c in given.items() if out not in self.cotangents.values()}
        unplanned = [name for name in wanted if name not in self.grads]
        if inner or unplanned:
            _, transpose = jax.vjp(lambda i: self._results(self.run_forward(i, key)), inputs)
            if inner:
                (extra,) = transpose({out: inner.get(out, jnp.zeros_like(r)) for out, r in results.items()})
                grads = {name: extra[name] if g is None else _plus(g, extra[name]) for name, g in grads.items()}
            if unplanned:
                (full,) = transpose({out: given.get(out, jnp.zeros_like(r)) for out, r in results.items()})
                grads.update({name: full[name] for name in unplanned})
        for name in self.stacked_inputs:  # a sum's gradient is the same for each of its partial sums
            g = grads.get(name)
            if g is not None and g.shape != inputs[name].shape:
                grads[name] = jnp.broadcast_to(g, inputs[name].shape)
        return ({name: grads[name] if name in wanted else None for name in inputs}, None)

    def grad(self, inputs: Arrays, cotangent: Arrays, key: Any = 0) -> Arrays:
        """The planned gradients (keyed as ``grads`` names them) of every input not declared const;
        ``cotangent`` keyed by the outputs' gradient names or by the outputs."""
        cot = {name: cotangent[name] if name in cotangent else cotangent[out]
               for name, out in self.cotangents.items()}
        return self.run_backward(inputs, self.run_forward(inputs, key), cot)

    def optimizer(self, phase: Phase, on_host: bool = False) -> tuple[Callable[[], Any],
                                                                      Callable[[Arrays, Arrays], Arrays]]:
        """ZeRO-1/2's optimizer phase on this mesh: its compiled program, and the step that maps the
        params and the gradients as the ZeRO plan's backward leaves them (keyed by gradient name;
        stacked where partial sums) to the updated params.  ``on_host`` (``--offload optimizer``, as
        ZeRO-Offload runs it): the gradients go to the host's memory, the update runs on the host
        (``compute_on('device_host')``) and the updated params stay there until a device reads them."""

        @functools.cache
        def program() -> Any:
            mesh = self.programs()[0]
            body = jax.shard_map(phase.local, mesh=mesh, in_specs=tuple(phase.inputs.values()),
                                 out_specs=tuple(phase.outputs.values()))
            if not on_host:
                return jax.jit(body)
            return jax.jit(compute_on("device_host")(jax.jit(body)),
                           in_shardings=tuple(NamedSharding(mesh, s, memory_kind=HOST) for s in phase.inputs.values()),
                           out_shardings=tuple(NamedSharding(mesh, s, memory_kind=HOST)
                                               for s in phase.outputs.values()))

        def step(params: Arrays, grads: Arrays) -> Arrays:
            mesh, pool = self.programs()[0], {**params, **grads}
            args = [put(pool[key], spec, mesh, HOST if on_host else None) for key, spec in phase.inputs.items()]
            return dict(zip(phase.outputs, program()(*args), strict=True))

        return program, step

    def demo(self, dims: dict[str, int], input_dims: dict[str, tuple[str, ...]], ids: dict[str, str]) -> None:
        """Run forward and grad on random inputs of small ``dims`` (token ids in their vocabulary)
        and print each value's shape and layout."""
        rng = np.random.default_rng(0)
        lead = {name: [math.prod(self.mesh_axes[a] for a in axes)] for name, axes in self.stacked_inputs.items()}
        inputs = {name: rng.standard_normal(lead.get(name, []) + [dims[d] for d in names], dtype=np.float32)
                  for name, names in input_dims.items()}
        inputs.update({name: rng.integers(0, dims[v], [dims[d] for d in input_dims[name]]).astype(np.int32)
                       for name, v in ids.items()})
        outputs = self.forward(inputs)
        cotangent = {name: np.ones(outputs[out].shape, np.float32) for name, out in self.cotangents.items()}
        for name, value in {**outputs, **self.grad(inputs, cotangent)}.items():
            print(f"{name:>12} {value.shape} {value.sharding.spec}")
