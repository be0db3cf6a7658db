"""``shardc verify --module`` of a pipelined spec: a module ``shardc lower`` wrote, run at verify's sizes.

A pipelined module is data and code: tables that name the plan's tensors, layouts and gradients
(``FORWARD_IN``, ``PARAMS``, ``POST_GRADS``, ...), the sizes of the run it was written for (the
mesh, the layer and microbatch counts, the schedule's tick tables) and the phase functions
(``forward_local``, ``pre_backward_local``, ``reduce_local``, ...), with one call that builds its
pipeline from them.  Verify runs it as it runs its own lowering of the plan:

- its tables must be the plan's: equal to those of verify's own module (every upper-case data
  constant that module defines, but the sizes);
- its sizes must be a run of the spec's schedule: the spec's mesh axes with the stage axis
  ``STAGES`` wide, a whole number of layers a stage, and the tick tables the schedule gives for
  those stages and microbatches (zbv's: the cost's simulation again at the module's ``RUN_SIZES``);
- then its sizes are replaced by verify's small ones and its pipeline is built again from its own
  tables and functions, so what runs, and is judged, is the module's code.

A module edited anywhere but its functions is refused as written for another plan (status 1).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from shardc.errors import ShardcError, clip
from shardc.lowering.pipeline_lowering import TIMED_ORDERS, PipelineLowered, run_ticks, tick_tables, weight_ticks
from shardc.spec.stages import splits
from shardc.verification.module_check import LOWER_FIX, ModuleRejected, load_given, running, same_table

__all__ = ["use_pipeline_module"]

# the sizes of the run a module was written for: verify replaces them with its own
_SIZES = ("MESH_AXES", "PIPE_MESH_AXES", "STAGES", "LAYERS", "MICROBATCHES", "MICROBATCH", "F_TABLE", "B_TABLE",
          "W_TABLE", "DIMS", "STAGE_LAYERS", "BLOCK_LAYERS", "RUN_SIZES")
_BUILT = ("PROGRAM", "PIPELINE")  # what the module builds from its tables
_DATA = (dict, tuple, list, frozenset, set, str, int, float, bool, type(None))
_MOST_TICKS = 1_000_000  # stages x microbatches past which the schedule is not simulated again to check


def use_pipeline_module(lowered: PipelineLowered, source: str, label: str) -> tuple[PipelineLowered, list[str]]:
    """``lowered`` (verify's own, at its sizes) running ``source``'s functions, and the report's notes."""
    namespace = load_given(source, label)
    expected = vars(lowered.namespace)
    tables = [n for n, v in expected.items()
              if n.isupper() and n not in _SIZES + _BUILT and isinstance(v, _DATA)]
    functions = [n for n, v in expected.items() if n.endswith("_local") and callable(v)]
    missing = [n for n in functions if not callable(getattr(namespace, n, None))]
    missing += [n for n in (*_SIZES, *tables) if not hasattr(namespace, n)]
    if missing:
        raise ModuleRejected(f"{label} lacks {', '.join(missing)}: verify runs a module as `shardc lower` writes it",
                             fix=LOWER_FIX)
    for table in tables:
        got, want = getattr(namespace, table), expected[table]
        if not same_table(got, want):
            raise ModuleRejected(f"{label} was written for another spec or plan: its {table} is "
                                 f"{clip(repr(got), 240)}, this plan's is {clip(repr(want), 240)}", fix=LOWER_FIX)
    written = _written_run(namespace, lowered, label)
    _run_at(namespace, lowered.namespace)
    # the builder verify's own module called (package code, which loads jax: not imported here)
    build = getattr(lowered.namespace, "block_pipeline" if lowered.ends is None else "model_pipeline")
    with running(label):
        namespace.PIPELINE = build(vars(namespace))
    notes = [f"the module run is {label}, not verify's own lowering"]
    ran = _describe(lowered.namespace)
    if written != ran:
        notes.append(f"{label} was written for {written}; verify runs it at {ran}")
    return replace(lowered, source=source, namespace=namespace), notes


def _written_run(ns: Any, lowered: PipelineLowered, label: str) -> str:
    """Check that the module's sizes are one run of the spec's schedule; that run, described."""
    axis = lowered.pipeline.axis
    want_axes = list(lowered.namespace.PIPE_MESH_AXES)
    mesh, stages, layers, micro = ns.PIPE_MESH_AXES, ns.STAGES, ns.LAYERS, ns.MICROBATCHES
    wrong = None
    if not isinstance(mesh, dict) or list(mesh) != want_axes or not all(_count(s) for s in mesh.values()):
        wrong = f"its PIPE_MESH_AXES is {clip(repr(mesh), 120)}, the spec's axes are {', '.join(want_axes)}"
    elif ns.MESH_AXES != {a: s for a, s in mesh.items() if a != axis}:
        wrong = f"its MESH_AXES {clip(repr(ns.MESH_AXES), 120)} is not PIPE_MESH_AXES without {axis}"
    elif not (_count(stages) and stages == mesh[axis] and _count(layers) and layers >= stages):
        wrong = f"its STAGES={clip(repr(stages), 40)} and LAYERS={clip(repr(layers), 40)} are not {axis}'s " \
                "stages with a layer each at least"
    elif ns.STAGE_LAYERS is not None and not splits(ns.STAGE_LAYERS, stages, layers):
        wrong = f"its STAGE_LAYERS {clip(repr(ns.STAGE_LAYERS), 80)} are not {layers} layers over {stages} stages"
    elif not (isinstance(ns.BLOCK_LAYERS, tuple) and all(_count(n) for n in ns.BLOCK_LAYERS)
              and sum(ns.BLOCK_LAYERS) == layers
              and len(ns.BLOCK_LAYERS) == len(lowered.namespace.BLOCK_LAYERS)):
        wrong = f"its BLOCK_LAYERS {clip(repr(ns.BLOCK_LAYERS), 80)} are not {layers} layers of the spec's blocks"
    elif not _count(micro) or ns.MICROBATCH != (lowered.namespace.MICROBATCH[0], micro):
        wrong = f"its MICROBATCHES={clip(repr(micro), 40)} and MICROBATCH={clip(repr(ns.MICROBATCH), 60)} disagree"
    elif stages * micro > _MOST_TICKS:
        wrong = f"its {stages} stages x {micro} microbatches are too many to check its tick tables"
    elif not _sizes_of(ns.RUN_SIZES, lowered.namespace.RUN_SIZES):
        wrong = f"its RUN_SIZES {clip(repr(ns.RUN_SIZES), 120)} are not sizes of the spec's dims"
    elif not _ticks_are_a_run(ns, lowered, stages, micro):
        wrong = f"its tick tables are not {lowered.pipeline.schedule.name}'s for {stages} stages and {micro} " \
                "microbatches" + (" at its RUN_SIZES" if lowered.pipeline.schedule.name in TIMED_ORDERS else "")
    if wrong is not None:
        raise ModuleRejected(f"{label} was written for another run: {wrong}", fix=LOWER_FIX)
    return _describe(ns)


def _count(value: Any) -> bool:
    return type(value) is int and value >= 1


def _sizes_of(given: Any, ours: dict[str, int]) -> bool:
    """Whether ``given`` names the dims verify's own module does, each a whole size."""
    return isinstance(given, dict) and list(given) == list(ours) and all(_count(s) for s in given.values())


def _ticks_are_a_run(ns: Any, lowered: PipelineLowered, stages: int, microbatches: int) -> bool:
    """Whether the module's tick tables are its schedule's for those stages and microbatches: a fixed order's
    own; zbv's greedy order the cost's simulation found at the op times of the module's run, simulated again
    here at its ``RUN_SIZES`` (the plan's chip and spans, as ``shardc lower`` simulated it)."""
    schedule = lowered.pipeline.schedule.name
    tables = (ns.F_TABLE, ns.B_TABLE, ns.W_TABLE)
    if schedule in TIMED_ORDERS:
        mesh = tuple(ns.PIPE_MESH_AXES.items())
        try:  # sizes no run could have (a batch the microbatches do not split): not this schedule's run
            ticks = run_ticks(lowered.plan, mesh, dict(ns.RUN_SIZES), ns.LAYERS, microbatches, ns.STAGE_LAYERS,
                              ns.BLOCK_LAYERS)
        except ShardcError:
            return False
        want: tuple[Any, ...] = (ticks.table("F"), ticks.table("B"), ticks.table("W"))
    else:
        want = (*tick_tables(schedule, stages, microbatches, ns.CHUNKS), weight_ticks(schedule, stages, microbatches))
    return tables == tuple(None if table is None else tuple(tuple(row) for row in table) for table in want)


def _run_at(ns: Any, ours: Any) -> None:
    """Give the module verify's sizes; the dict ``MESH_AXES`` in place, as its ``PROGRAM`` holds it."""
    ns.MESH_AXES.clear()
    ns.MESH_AXES.update(ours.MESH_AXES)
    program = getattr(ns, "PROGRAM", None)
    if program is not None and getattr(program, "mesh_axes", ns.MESH_AXES) is not ns.MESH_AXES:
        program.mesh_axes = dict(ours.MESH_AXES)
    for name in _SIZES[1:]:
        setattr(ns, name, getattr(ours, name))


def _describe(ns: Any) -> str:
    mesh = ", ".join(f"{a}={s}" for a, s in ns.PIPE_MESH_AXES.items())
    return f"the mesh {mesh} with {ns.LAYERS} layers and {ns.MICROBATCHES} microbatches"
