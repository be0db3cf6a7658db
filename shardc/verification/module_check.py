"""``shardc verify --module``: a lowered module given by the user, run as verify runs its own.

The module (one ``shardc lower -o`` wrote, perhaps edited by hand) replaces the one
verify lowers for itself; everything else is the same: the plan, the sizes, the
inputs, the numpy reference, the bounds and the HLO matching.  verify's own lowering
at the same sizes supplies what the module must agree with: its boundary tables
(``FORWARD_IN`` and the rest name the plan's tensors and layouts) and the names of its
entry points.  The module's code is mesh-generic (local shapes come from
``jax.lax.axis_size``), so a module written at the spec's mesh runs at verify's
shrunk one: ``MESH_AXES`` is resized in place before the first compilation.  The one
share a module's code fixes is a route's capacity per token (C/S at the sizes it was written
for), so under ``--module`` a route's C and S run at a small multiple of that share
(:func:`module_sizes`).

A module that does not load, lacks an entry point, was written for another plan, or
raises while it runs fails the check: :class:`ModuleRejected`, a :class:`ShardcError`
that the command reports with exit status 1.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from shardc.errors import ShardcError, clip
from shardc.files import read_text
from shardc.ir.plan import Plan
from shardc.lowering.load import load_module
from shardc.ops.registry import of_call
from shardc.spec.walk import calls
from shardc.verification.route_load import shards, tied

if TYPE_CHECKING:
    from shardc.lowering.api import Lowered

__all__ = ["ModuleRejected", "given_source", "module_sizes", "use_module", "load_given", "same_table", "running",
           "LOWER_FIX"]

LOWER_FIX = "write the module with `shardc lower FILE -o MOD.py` for this spec and edit that"
# what verify calls on every module, and on a ZeRO-1/2 module's optimizer phase
_ENTRY_POINTS = ("forward", "grad", "programs")
_OPTIMIZER_ENTRY_POINTS = ("optimizer_step", "optimizer_program")
# the tables that name the plan's tensors, layouts and gradients: equal to verify's own module's
_TABLES = ("FORWARD_IN", "FORWARD_OUT", "BACKWARD_IN", "BACKWARD_OUT", "RESULTS", "STACKED", "STACKED_INPUTS",
           "KEYED", "COTANGENTS", "GRADS")
_OPTIMIZER_TABLES = ("OPTIMIZER_IN",)
_MAX_CAPACITY = 64  # a capacity the module's share gives verify's sizes, at most: verify fills it with tokens


class ModuleRejected(ShardcError):
    """The given module cannot be verified as the plan's: a failed check (exit status 1)."""

    exit_code = 1


def given_source(module: str | os.PathLike[str]) -> tuple[str, str]:
    """The module's text and a label for messages: ``module`` is a path (a PathLike, or a one-line
    string naming a ``.py`` or an existing file), else the module's text itself."""
    if not isinstance(module, str):
        return read_text(os.fspath(module), what="module"), os.fspath(module)
    if "\n" not in module and (module.endswith(".py") or os.path.exists(module)):
        return read_text(module, what="module"), module
    return module, "the given module"


def module_sizes(plan: Plan, small: dict[str, int]) -> dict[str, int]:
    """The sizes a lowered module's code ties together, at a small multiple of the spec's share: each
    route's capacity C and token count S (and the indices renames tie to S).

    ``route_topk(..., capacity=...)`` writes the capacity as C/S of the tokens it is given (every other
    size is a shape the module reads at run time), so the module runs with C and S in that ratio: the
    least multiple of it that their shardings divide and that gives verify's small capacity, or an
    error when that multiple is too large to run small; the experts few enough that tokens overflow
    the capacity, so that dropping them is checked.
    """
    dims, out = dict(plan.spec.dims), {}
    for call in (c for s in plan.spec.statements for c in calls(s.expr)):
        family = of_call(call.func)
        cap = family.capacity(call) if family is not None else None
        if cap is None:
            continue
        order, slots = cap.tokens, cap.slots
        if order not in dims or slots not in dims:
            continue
        share = math.gcd(dims[slots], dims[order])
        num, den = dims[slots] // share, dims[order] // share
        step = math.lcm(1, *(n // math.gcd(n, d) for n, d in ((shards(plan, small, slots), num),
                                                            (shards(plan, small, order), den))))
        times = step * math.ceil(math.ceil(2 / num) / step)  # 2 slots at least, as verify's own sizes
        if num * times > max(_MAX_CAPACITY, small.get(slots, 0)):
            raise ShardcError(f"the module's route capacity {slots}={dims[slots]} of {order}={dims[order]} tokens "
                              f"(the spec's share) needs {slots}={num * times} at least, too large for verify's "
                              "small sizes",
                              fix=f"lower and verify at a small capacity, both with --set {slots}=... and "
                                  f"--set {order}=...")
        out[slots] = num * times
        out.update(dict.fromkeys(tied(plan.spec, order) & set(dims), den * times))
        out.update(_overflowing_experts(plan, small, cap.experts, cap.picks, num, den))
    return out


def _overflowing_experts(plan: Plan, small: dict[str, int], experts: str, k: int, num: int, den: int) \
        -> dict[str, int]:
    """The expert count at which the tokens overflow the module's capacity: S*k/E choices an expert on
    average against C slots (C/S = ``num``/``den``) needs E <= k*den/num; the largest such count of k
    experts or more that the plan's shardings of E divide and verify's own sizes allow (none: as is)."""
    blocks = shards(plan, small, experts)
    most = min(k * den // num, small.get(experts, k * den // num))
    fits = [e for e in range(most, k - 1, -1) if e % blocks == 0]
    return {experts: fits[0]} if fits and experts in small else {}


def use_module(lowered: Lowered, source: str, label: str) -> tuple[Lowered, list[str]]:
    """``lowered`` running ``source`` instead of its own module, and the notes for the report."""
    namespace = load_given(source, label)
    expected = lowered.namespace
    optimizer = lowered.module.optimizer is not None
    missing = [n for n in _ENTRY_POINTS + _OPTIMIZER_ENTRY_POINTS * optimizer
               if not callable(getattr(namespace, n, None))]
    missing += [n for n in ("MESH_AXES", *_TABLES, *_OPTIMIZER_TABLES * optimizer) if not hasattr(namespace, n)]
    if missing:
        raise ModuleRejected(f"{label} lacks {', '.join(missing)}: verify runs a module as `shardc lower` writes it",
                             fix=LOWER_FIX)
    for table in _TABLES + _OPTIMIZER_TABLES * optimizer:
        got, want = getattr(namespace, table), getattr(expected, table)
        if not same_table(got, want):
            raise ModuleRejected(f"{label} was written for another spec or plan: its {table} is "
                                 f"{clip(repr(got), 240)}, this plan's is {clip(repr(want), 240)}", fix=LOWER_FIX)
    notes = _resize_mesh(namespace, dict(expected.MESH_AXES), label)
    with running(label):
        mesh = dict(namespace.programs()[0].shape)
    if mesh != dict(expected.MESH_AXES):
        raise ModuleRejected(f"{label} runs on the mesh {mesh}, not verify's {dict(expected.MESH_AXES)}: its "
                             "programs() must build the mesh from MESH_AXES", fix=LOWER_FIX)
    module = replace(lowered.module, source=source)
    notes.insert(0, f"the module run is {label}, not verify's own lowering")
    return replace(lowered, module=module, namespace=namespace, _compiled={}), notes


def same_table(got: Any, want: Any) -> bool:
    try:
        return bool(type(got) is type(want) and got == want)
    except Exception:  # a value whose comparison raises is not the plan's
        return False


def load_given(source: str, label: str) -> Any:
    """The module executed; any failure to load is a :class:`ModuleRejected` naming its cause."""
    try:
        return load_module(source, os.path.basename(label))
    except ShardcError:
        raise
    except (Exception, SystemExit) as err:
        line = getattr(err, "lineno", None)
        where = f" (line {line})" if isinstance(line, int) else ""
        raise ModuleRejected(f"{label} does not load{where}: {type(err).__name__}: {_first_line(err)}",
                             fix=LOWER_FIX) from None


def _resize_mesh(namespace: Any, mesh: dict[str, int], label: str) -> list[str]:
    """Run the module on verify's mesh: the same axes, sizes shrunk as verify shrinks the spec's."""
    given = namespace.MESH_AXES
    if not isinstance(given, dict) or list(given) != list(mesh):
        raise ModuleRejected(f"{label} was written for another mesh: its MESH_AXES is {clip(repr(given), 120)}, the "
                             f"spec's axes are {', '.join(mesh)}", fix=LOWER_FIX)
    if given == mesh:
        return []
    text = ", ".join(f"{a}={s}" for a, s in given.items())
    given.update(mesh)  # the dict the module's Program holds: read when it first compiles
    program = getattr(namespace, "PROGRAM", None)
    if program is not None and getattr(program, "mesh_axes", given) is not given:
        program.mesh_axes = dict(mesh)
    return [f"{label} was written for the mesh {text}; it runs at verify's "
            + ", ".join(f"{a}={s}" for a, s in mesh.items())]


@contextmanager
def running(label: str | None) -> Iterator[None]:
    """Errors raised while running a given module (``label``) are the module's: a failed check."""
    if label is None:
        yield
        return
    try:
        yield
    except ShardcError:
        raise
    except Exception as err:
        raise ModuleRejected(f"{label} failed while verify ran it: {type(err).__name__}: {_first_line(err)}",
                             fix="run the module's own demo (`python MOD.py`) to see where") from None


def _first_line(err: BaseException) -> str:
    return clip((str(err).strip().splitlines() or [""])[0], 300)
