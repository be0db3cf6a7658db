"""The search context a plan is searched in (:class:`CostContext`), and the caches plans share.

Every candidate plan of one :func:`shardc.planner.planner.plan` searches in one context, and inside
:func:`shared_search` the plans whose contexts are made of the same parts share one.  A pipeline's stage is
searched at a microbatch's sizes with each step charged as often as the stage runs it a training step
(:func:`stage_run_of`), so the search's objective is the one :func:`shardc.timing.plan_time` times the plan by.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import replace

from shardc.hardware import Hardware
from shardc.ir.plan import TensorInfo
from shardc.ir.spec import Spec, TensorRef
from shardc.planner.graph import Graph
from shardc.planner.padding import uneven_dims
from shardc.quantize import fuses_into
from shardc.sharding.layout import CostContext, Value
from shardc.sharding.unit import Placements, without_unit_axes
from shardc.spec.walk import node_limits
from shardc.stage_phases import stage_run

__all__ = ["search_context", "shared_search", "shared_context", "sharing", "stage_run_of", "tensor_infos"]


def stage_run_of(spec: Spec, graph: Graph, outer: Spec | None, hw: Hardware) -> tuple[Spec, int]:
    """The spec whose sizes a stage's search prices, and how many microbatches the stage runs a step
    (:func:`shardc.stage_phases.stage_run`, as :func:`shardc.timing.plan_time` times the plan): ``spec`` at a
    microbatch's sizes.  Each step the search weighs is then charged as often as the program runs it: an
    activation's move and an einsum once a microbatch at its sizes, a weight's reshard once a microbatch too,
    a gradient's reduction once a step (:meth:`CostContext.move_cost`).  Not a pipeline's stage (``outer``
    None): ``spec``, once; nor where a microbatch is smaller than the devices the spec shards its batch
    over (the search never leaves a device without a piece): searched at the whole batch, as before.
    (Searched at the whole batch, a weight's reshard weighs as if it ran once a step; at a microbatch's
    sizes alone, a gradient's reduction as if it ran once a microbatch.)"""
    if outer is None or not spec.dims:
        return spec, 1
    micro, m = stage_run(outer, tensor_infos(graph, dict(graph.declared)), spec.sizes, hw.book)
    sized = replace(spec, dims=tuple((d, micro[d]) for d, _ in spec.dims))
    if any(micro[d] < devices for d, devices in uneven_dims(sized)):
        return spec, 1
    return sized, m


def search_context(spec: Spec, graph: Graph, hw: Hardware, spans: dict[str, int] | None,
                   units: tuple[tuple[str, ...], ...] | None = None, places: Placements | None = None,
                   run: tuple[Spec, int] | None = None) -> CostContext:
    """The search's context; ``run``: a pipeline's stage, the spec at a microbatch's sizes and the
    microbatches (:func:`stage_run_of`)."""
    grads = frozenset(graph.grads[p] for p in graph.params)
    sized, repeats = run if run is not None else (spec, 1)
    return CostContext(without_unit_axes(spec.mesh), spec.dtype, sized.sizes if spec.dims else None,
                       graph.params | grads, hardware=hw, spans=spans, topology=spec.topology,
                       padded=frozenset(d for d, _ in uneven_dims(sized)), units=units, places=places,
                       element_bytes=graph.element_bytes, gathered=graph.gathered_bytes,
                       gather_axes=frozenset(spec.zero.axes if spec.zero is not None else ()),
                       routings=node_limits(spec),
                       precision=graph.precision(spec.dtype), repeats=repeats,
                       accumulated=grads if repeats > 1 else frozenset(), held=_held(graph),
                       fusible=fuses_into if hw.fuses else None)


def _held(graph: Graph) -> dict[str, Value]:
    """Each param's value as the device holds it, where a ``gemm`` line quantizes GEMMs (a GEMM reading a
    param so quantizes nothing: :mod:`shardc.quantize`)."""
    return {p: Value.of(graph.declared[p]) for p in graph.params} if graph.gemms else {}


# the search caches shared inside shared_search(): the key of what a context is made of -> (chip, context)
_SHARED: ContextVar[dict[tuple[object, ...], tuple[Hardware, CostContext]] | None] = ContextVar("shared_search",
                                                                                                default=None)


def sharing() -> bool:
    """Whether plans made now share their search caches (inside :func:`shared_search`)."""
    return _SHARED.get() is not None


@contextmanager
def shared_search() -> Iterator[None]:
    """Plans made inside share their search caches (a :class:`CostContext`: moves, reshard searches,
    einsum solutions) with the plans before them whose context is made of the same mesh, sizes, chip,
    tensors and spans, as the candidate plans of one :func:`shardc.planner.planner.plan` share one:
    ``shardc layouts`` plans a layout under several recompute policies and ZeRO lines."""
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def shared_context(spec: Spec, graph: Graph, hw: Hardware, spans: dict[str, int] | None,
                   units: tuple[tuple[str, ...], ...] | None, places: Placements | None,
                   run: tuple[Spec, int]) -> CostContext:
    """:func:`search_context`, or inside :func:`shared_search` the one made before of the same parts."""
    shared = _SHARED.get()
    if shared is None:
        return search_context(spec, graph, hw, spans, units, places, run)
    key = (str(without_unit_axes(spec.mesh)), spec.dtype, tuple(run[0].sizes.items()) if spec.dims else None, run[1],
           graph.params, tuple(sorted(graph.grads.items())), tuple(sorted((spans or {}).items())), spec.topology,
           tuple(uneven_dims(run[0])), units, repr(places), tuple(sorted(graph.element_bytes.items())),
           tuple(sorted(graph.gathered_bytes.items())), spec.zero.axes if spec.zero is not None else (),
           tuple(sorted(node_limits(spec).items())), tuple(sorted(graph.dtypes.items())),
           tuple(sorted(graph.gemms.items())), tuple(sorted(_held(graph).items())))
    hit = shared.get(key)
    if hit is None or hit[0] != hw:  # an equal chip: chip_for makes a new one where the spec sets its fusion
        hit = shared[key] = (hw, search_context(spec, graph, hw, spans, units, places, run))
    hit[1].explored = 0  # the budget counts one plan's search
    return hit[1]


def tensor_infos(graph: Graph, declared: dict[str, TensorRef]) -> tuple[TensorInfo, ...]:
    """Each declared tensor with its role (param, input, activation), as the plan lists them."""
    infos = []
    for name, ref in declared.items():
        role = "param" if name in graph.params else "input" if name in graph.inputs else "activation"
        infos.append(TensorInfo(name, ref, role, name in graph.outputs))
    return tuple(infos)
