"""The skeleton of a generated module, around the phase bodies.

Kept apart from :mod:`shardc.lowering.codegen` so the shape of the emitted file
is readable in one place.  What the skeleton holds is particular to a plan: its
mesh, its boundary tables and its per-device functions, as data and lines of
code.  The code that is the same for every plan is ordinary Python, imported by
the module: the helpers its lines call (:mod:`shardc.lowering.runtime`) and its
driver (:mod:`shardc.lowering.driver`).  Everything here is text; nothing
imports jax.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import TYPE_CHECKING

from shardc.ir.plan import Plan, uses_dropout
from shardc.lowering.optimizer import LEARNING_RATE
from shardc.lowering.partition_specs import pspec
from shardc.lowering.row_code import id_inputs
from shardc.ops.masks import KEY
from shardc.planner.zigzag_order import sequence_order

if TYPE_CHECKING:
    from shardc.lowering.codegen import Phase

__all__ = ["render", "comment", "specs", "function", "defined_names", "runtime_names", "LOCALS", "WAITING_COLLECTIVES"]


def _plain(text: str) -> str:
    """User text made safe inside a docstring or comment: printable, no double quote, backslash or newline.

    A file name can hold anything, three double quotes and code after them included;
    mangled so, it can neither end the string nor start a line of code.
    """
    return "".join(c if c.isprintable() and c not in "\"\\" else "?" for c in text)


def comment(text: str) -> str:
    """``# text`` on one line, whatever ``text`` holds."""
    return "# " + _plain(text)


# XLA:CPU runs every emulated device in one process.  A device's thunks that are ready at once are split, half
# of them run on the intra-op pool (xla/backends/cpu/runtime/thunk_executor.cc, SplitReadyQueue), whose workers
# are max(NPROC, else the cores; the devices) (xla/pjrt/utils.cc, DefaultThreadPoolSize), and a collective
# blocks its worker in its rendezvous until every participant has arrived (in_process_communicator.cc); XLA
# orders when a device's collectives start, not where they wait.  DeepSeek-V3's verify (64 devices) aborted so
# twice after XLA's 40 s: all 64 workers waiting, 54 at a send (a collective-permute of every device) and 10 at
# an all-to-all whose partner's all-to-all sat queued behind them.  One device's run takes at most 4 of the
# pool's workers beside its own thread (thunk.h, ExecuteSession::kMaxWorkers; best effort, it may pass it for
# a moment), each of which can wait at a collective (its pipeline's tick has 7 no data path orders,
# benchmarks/collective_width.py): 8 workers a device leave one free for each queued collective.
WAITING_COLLECTIVES = 8

_HEADER = '''\
"""{title}

Lowered by shardc from {filename} (save={save}).  Mesh {mesh_text}: {devices} devices.

    forward(inputs)          -> {results}
    grad(inputs, cotangent)  -> {grads}

Both take and return dicts of global arrays keyed by tensor name (inputs: {inputs};
cotangent: {cotangents}).  An input declared unreduced ``{{U_..}}`` is passed stacked:
its leading dim holds the partial sums over those axes; a result declared so is
returned summed.

``forward`` is a ``jax.custom_vjp``: ``jax.grad`` of a function of its results
runs the planned backward below for the outputs' cotangents; cotangents of
results that a later statement reads, and gradients of inputs declared ``const``
(which the plan does not differentiate), come from JAX's transpose of the forward
program, only when asked for.  Each phase is one ``shard_map``; every line is one
step of the plan, commented with the sharded tensor it makes and its local
(per-device) shape.  The helpers the lines call, and the driver around the phases,
are shardc's own (``shardc.lowering.runtime``, ``shardc.lowering.driver``): this
module runs where jax, numpy and shardc are installed.

On a CPU, emulate the devices with
XLA_FLAGS=--xla_force_host_platform_device_count={devices} set before jax is imported, and
NPROC={nproc} ({waiting} a device, as ``shardc verify`` sets it): XLA's CPU intra-op pool then has
more workers than the devices' collectives can hold waiting at once; with fewer (the cores, by
default) the collectives can take every worker and wedge the pool.
On several hosts, call ``jax.distributed.initialize()`` first; the code is unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardc.lowering.driver import Phase, Program
from shardc.lowering.runtime import {runtime}

MESH_AXES = {mesh_dict}  # name -> size, major to minor
MICROBATCH = None  # a pipeline's (batch dim, microbatches): dropout masks run on over the microbatches
'''

_DRIVER = '''

PROGRAM = Program(MESH_AXES, Phase(forward_local, FORWARD_IN, FORWARD_OUT),
                  Phase(backward_local, BACKWARD_IN, BACKWARD_OUT), RESULTS, STACKED, STACKED_INPUTS, KEYED,
                  COTANGENTS, GRADS, ZIGZAG, CHUNKS{host})
programs, run_forward, run_backward = PROGRAM.programs, PROGRAM.run_forward, PROGRAM.run_backward
forward, grad = PROGRAM.forward, PROGRAM.grad
'''


# the modules of the helpers a lowered module calls, in the order its import line names them: runtime.py's
# own, then those it imports from runtime_experts.py (so a lowered module imports them all from runtime.py)
_RUNTIME = ("runtime.py", "runtime_experts.py")


def runtime_names() -> tuple[str, ...]:
    """The public functions of :mod:`shardc.lowering.runtime`, its own and its experts' helpers, read from
    their source (importing them would import jax, which lowering to text does not need)."""
    names: list[str] = []
    for module in _RUNTIME:
        tree = ast.parse(Path(__file__).with_name(module).read_text(encoding="utf-8"))
        names += [node.name for node in tree.body
                  if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")]
    return tuple(names)


def defined_names(source: str) -> frozenset[str]:
    """Every name a module binds at its top level: its imports, assignments, functions and
    classes, and the names bound in its top-level ``if``, ``for``, ``while``, ``with`` and ``try``
    blocks (a ``__main__`` block's are module globals too)."""
    names: set[str] = set()
    pending = list(ast.parse(source).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
            continue
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                pending.append(child)
            elif isinstance(child, ast.expr | ast.withitem | ast.excepthandler):
                names.update(n.id for n in ast.walk(child) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
        if isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return frozenset(names)


def specs(name: str, boundaries: tuple[object, ...]) -> str:
    rows = [f"    {b.key!r}: {pspec(b.ref)},  {comment(str(b.ref))}"  # type: ignore[attr-defined]
            for b in boundaries]
    return f"{name} = {{\n" + "\n".join(rows) + "\n}\n"


# The names the skeleton adds to a phase function's own (the forward's dropout key): a tensor's
# variable never takes one.
LOCALS = (KEY,)


def function(phase: Phase, keyed: bool = False) -> str:
    params = ", ".join([b.var for b in phase.inputs] + [LOCALS[0]] * keyed)
    lines = [f"def {phase.name}_local({params}):",
             f'    """The {phase.name} on one device: local blocks in, local blocks out."""']
    for b in phase.inputs:
        if b.stacked:
            lines.append(f"    {b.var} = {b.var}[0]  # this device's partial sum of " + _plain(str(b.ref)))
    lines += ["    " + line for line in phase.body]
    outs = [f"{b.var}[None]" if b.stacked else b.var for b in phase.outputs]
    lines.append("    return (" + ", ".join(outs) + ("," if len(outs) == 1 else "") + ")")
    return "\n".join(lines) + "\n"


def render(plan: Plan, title: str, mesh: tuple[tuple[str, int], ...], demo: dict[str, int], forward: Phase,
           backward: Phase, results: tuple[str, ...], cotangents: dict[str, str], grads: dict[str, str],
           optimizer: tuple[str, Phase] | None = None, offload: str = "none") -> str:
    """The whole module text (``optimizer``: ZeRO-1/2's line and its optimizer phase; ``offload``: what
    the host's memory holds, :data:`shardc.costmodel.offload.OFFLOADS`)."""
    devices = 1
    for _, size in mesh:
        devices *= size
    spec = plan.spec
    text = _HEADER.format(
        title=_plain(title or "A sharded einsum chain, lowered to JAX shard_map."),
        filename=_plain(spec.filename or "<spec>"), save=_plain(plan.save),
        mesh_text=_plain(", ".join(f"{n}={s}" for n, s in mesh)), devices=devices,
        nproc=WAITING_COLLECTIVES * devices, waiting=WAITING_COLLECTIVES,
        results=_plain(", ".join(results)), grads=_plain(", ".join(grads.values())),
        inputs=_plain(", ".join(b.key for b in forward.inputs)), cotangents=_plain(", ".join(cotangents)),
        mesh_dict="{" + ", ".join(f"{n!r}: {s}" for n, s in mesh) + "}",
        runtime="(" + ", ".join(runtime_names()) + ")")
    text += "\n\n# ---- forward " + "-" * 60 + "\n\n" + specs("FORWARD_IN", forward.inputs)
    text += specs("FORWARD_OUT", forward.outputs)
    text += f"RESULTS = {tuple(results)!r}  # forward() returns these; the rest are residuals\n"
    stacked = sorted(b.key for b in forward.outputs if b.stacked)
    text += f"STACKED = frozenset({stacked!r})  # unreduced values: leading dim = partial sums\n"
    stacked_in = {b.key: b.ref.unreduced for b in forward.inputs if b.stacked}
    text += f"STACKED_INPUTS = {stacked_in!r}  # inputs given as partial sums over these axes\n"
    keyed = uses_dropout(plan.forward)
    text += f"KEYED = {keyed!r}  # the forward takes a dropout key (forward(inputs, key))\n\n\n"
    text += function(forward, keyed)
    text += "\n\n# ---- backward " + "-" * 59 + "\n\n" + specs("BACKWARD_IN", backward.inputs)
    text += specs("BACKWARD_OUT", backward.outputs)
    text += f"COTANGENTS = {cotangents!r}  # an output's gradient name -> the output\n"
    text += f"GRADS = {grads!r}  # tensor -> its gradient\n"
    text += _zigzag(plan, mesh, forward, backward) + "\n\n"
    text += function(backward)
    text += "\n\n# ---- driver " + "-" * 61 + "\n" + _driver(forward, backward, offload)
    if optimizer is not None:
        text += _optimizer(*optimizer, on_host=offload in ("optimizer", "both"))
    return text + _demo(plan, forward, demo)


def _driver(forward: Phase, backward: Phase, offload: str) -> str:
    """The program, and under ``--offload activations`` the residuals its forward leaves in the host's memory:
    every forward output the backward reads, as MaxText's ``*_offloaded`` remat policies hold them."""
    if offload not in ("activations", "both"):
        return _DRIVER.format(host="")
    read = {b.key for b in backward.inputs}
    host = sorted(b.key for b in forward.outputs if b.key in read)
    return ("\n" + f"HOST = frozenset({host!r})  # residuals the forward leaves in the host's memory "
            "(pinned_host), copied back for the backward\n" + _DRIVER.format(host=", host=HOST"))


def _zigzag(plan: Plan, mesh: tuple[tuple[str, int], ...], forward: Phase, backward: Phase) -> str:
    """``ZIGZAG`` (each array entering or leaving a phase -> its axes in zig-zag order) and ``CHUNKS``
    (their chunk count): the sequence held in the order of the ring's balanced chunks across the plan
    (:mod:`shardc.planner.zigzag_order`); none where the plan holds no such order."""
    order = sequence_order(plan, dict(mesh))
    if order is None:
        return "ZIGZAG: dict[str, tuple[int, ...]] = {}\nCHUNKS = 0  # the sequence is held in its own order\n"
    dims, chunks = order
    held = {b.key: tuple(i + b.stacked for i, d in enumerate(b.ref.dims) if d.name in dims)
            for phase in (forward, backward) for b in (*phase.inputs, *phase.outputs)}
    held = {key: axes for key, axes in held.items() if axes}
    return (f"ZIGZAG = {held!r}  # arrays whose sequence axes each phase takes in zig-zag chunk order\n"
            f"CHUNKS = {chunks}  # chunks along them: device i of the ring holds chunks i and {chunks - 1} - i\n")


def _demo(plan: Plan, forward: Phase, demo: dict[str, int]) -> str:
    """Small sizes and a ``__main__`` that runs the module on them, when every input dim has one."""
    dims = sorted({d.name for b in forward.inputs for d in b.ref.dims})
    if not all(d in demo for d in dims):
        return ""
    inputs = {b.key for b in forward.inputs}
    ids = {name: vocab for name, vocab in id_inputs(plan.spec).items() if name in inputs}
    text = "\n\nDIMS = {" + ", ".join(f"{d!r}: {demo[d]}" for d in dims) + "}  # small, for a demo run\n"
    text += "INPUT_DIMS = {" + ", ".join(
        f"{b.key!r}: {tuple(d.name for d in b.ref.dims)!r}" for b in forward.inputs) + "}\n"
    text += f"ID_INPUTS = {ids!r}  # token-id inputs -> their vocabulary dim\n"
    return text + '\n\nif __name__ == "__main__":\n    PROGRAM.demo(DIMS, INPUT_DIMS, ID_INPUTS)\n'


def _optimizer(zero: str, phase: Phase, on_host: bool = False) -> str:
    """The optimizer section (:mod:`shardc.lowering.optimizer`): its tables, its function, its program
    (``on_host``: run on the host, its arguments and results in the host's memory, as ZeRO-Offload runs it)."""
    text = "\n\n# ---- optimizer " + "-" * 58 + "\n"
    text += comment(f"{_plain(zero)}: the optimizer phase of the ZeRO plan (forward and grad above run the spec "
                    "without the zero line)") + "\n\n"
    text += specs("OPTIMIZER_IN", phase.inputs) + specs("OPTIMIZER_OUT", phase.outputs)
    text += f"LEARNING_RATE = {LEARNING_RATE!r}  # the lowered update is plain SGD: W - LEARNING_RATE * dW\n\n\n"
    text += function(phase)
    where = (", on_host=True)  " + comment("--offload optimizer: gradients to the host, the update on its CPU")
             if on_host else ")")
    return text + ("\n\noptimizer_program, optimizer_step = PROGRAM.optimizer(Phase(optimizer_local, OPTIMIZER_IN, "
                   f"OPTIMIZER_OUT){where}\n")
