"""The fixed parts of a generated module, around the two phase bodies.

Kept apart from :mod:`shardc.lowering.codegen` so the shape of the emitted file
is readable in one place.  Everything here is text; nothing imports jax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardc.lowering.optimizer import OPTIMIZER_GLOBALS, optimizer_text
from shardc.lowering.partition_specs import pspec
from shardc.lowering.route import HELPER as ROUTE_HELPER
from shardc.lowering.route import uses_route
from shardc.lowering.rows import HELPERS, id_inputs, uses_helpers
from shardc.spec.functions import ID_DTYPE

if TYPE_CHECKING:
    from shardc.lowering.codegen import Phase
    from shardc.planner.ir import Plan

__all__ = ["render", "render_optimizer", "comment", "specs", "function", "GLOBALS"]

# Every module-level name of a generated module (tests check the list is complete): a
# tensor's variable never takes one of these, so no phase function shadows what it reads (the
# forward's `dropout_key` parameter is listed too).
GLOBALS = ("annotations", "functools", "math", "jax", "jnp", "SymbolicZero", "AxisType", "NamedSharding",
           "P", "MESH_AXES", "make_mesh", "shard_slice", "gather_dims", "FORWARD_IN", "FORWARD_OUT", "RESULTS",
           "STACKED", "KEYED", "dropout_key", "MICROBATCH",
           "STACKED_INPUTS", "forward_local", "BACKWARD_IN", "BACKWARD_OUT", "COTANGENTS", "GRADS",
           "backward_local", "programs", "_put", "run_forward", "run_backward", "_results", "forward",
           "_forward_fwd", "_forward_bwd", "_plus", "grad", "DIMS", "INPUT_DIMS", "main", "inputs",
           "cotangent", "positions", "causal_mask", "keep_mask", "_vocab_rows", "vocab_lookup", "vocab_scatter",
           "vocab_pick", "vocab_ce_grad", "ID_INPUTS", *OPTIMIZER_GLOBALS)


def _plain(text: str) -> str:
    """User text made safe inside a docstring or comment: printable, no double quote, backslash or newline.

    A file name can hold anything, three double quotes and code after them included;
    mangled so, it can neither end the string nor start a line of code.
    """
    return "".join(c if c.isprintable() and c not in "\"\\" else "?" for c in text)


def comment(text: str) -> str:
    """``# text`` on one line, whatever ``text`` holds."""
    return "# " + _plain(text)


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
(per-device) shape.

On a CPU, emulate the devices with
XLA_FLAGS=--xla_force_host_platform_device_count={devices} set before jax is imported.
On several hosts, call ``jax.distributed.initialize()`` first; the code is unchanged.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = {mesh_dict}  # name -> size, major to minor
'''

_HELPERS = '''

def make_mesh() -> jax.sharding.Mesh:
    """The device mesh (Auto axes: jit reshards arguments that arrive laid out otherwise)."""
    shape, names = tuple(MESH_AXES.values()), tuple(MESH_AXES)
    needed = math.prod(shape)
    if jax.device_count() < needed:
        raise RuntimeError(
            f"the mesh needs {{needed}} devices but jax sees {{jax.device_count()}}; on a CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={{needed}} before jax is imported")
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def shard_slice(x, axes, dim):
    """This device's block of ``x`` along ``dim`` over mesh ``axes``: free, no communication."""
    size = x.shape[dim] // jax.lax.axis_size(axes)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axes) * size, size, axis=dim)


def gather_dims(x, groups):
    """One AllGather of several dims: ``groups`` pairs each dim with the axes it loses
    (major to minor).  The blocks arrive in a new leading dim over all the axes at once
    and are laid out locally: each dim's gathered axes go just before it, then merge in."""
    axes = tuple(a for _, names in groups for a in names)
    sizes = [jax.lax.axis_size(a) for a in axes]
    y = jax.lax.all_gather(x, axes, axis=0, tiled=False, to='invarying').reshape(*sizes, *x.shape)
    lead, k = {{}}, 0
    for d, names in groups:
        lead[d] = list(range(k, k + len(names)))
        k += len(names)
    order, shape = [], []
    for d in range(x.ndim):
        order += lead.get(d, []) + [len(axes) + d]
        shape.append(math.prod(sizes[i] for i in lead.get(d, [])) * x.shape[d])
    return jnp.transpose(y, order).reshape(shape)


def positions(x, dim, axes):
    """The global positions of this device's block of ``x`` along ``dim`` (sharded over ``axes``),
    shaped to broadcast against ``x``."""
    n = x.shape[dim]
    start = jax.lax.axis_index(axes) * n if axes else 0
    return (start + jnp.arange(n)).reshape([n if d == dim else 1 for d in range(x.ndim)])


def causal_mask(x, query, key, fill=-jnp.inf):
    """``fill`` where the key's global position is after the query's; ``query`` and ``key`` are
    (dim, axes sharding it): each device offsets its block's positions by its index along them."""
    return jnp.where(positions(x, *key) > positions(x, *query), fill, x)


MICROBATCH = None  # a pipeline's (batch dim, microbatches): its positions run on over the microbatches


def keep_mask(x, salt, rate, dims, order, key=0, index=()):
    """Dropout's keep-mask for this device's block of ``x``: murmur3's 32-bit finaliser of each
    element's global position (dims taken in ``order``; ``dims`` gives each dim's axes, ``index``
    its name) plus ``salt`` and the dropout ``key`` (forward's argument: another key, other masks),
    kept where it is at least ``rate`` * 2**32.  Every device draws its block of one global mask.
    In a pipeline ``key`` is (key, microbatch j): the batch dim's positions are j's slice of the
    whole batch's, so a microbatch draws its slice of the whole batch's mask."""
    key, micro = key if isinstance(key, tuple) else (key, 0)
    h = jnp.zeros(x.shape, jnp.uint32)
    for d in order:
        total = x.shape[d] * (jax.lax.axis_size(dims[d]) if dims[d] else 1)
        pos = positions(x, d, dims[d])
        if MICROBATCH is not None and index[d] == MICROBATCH[0]:
            pos, total = pos + micro * total, total * MICROBATCH[1]
        h = h * jnp.uint32(total) + pos.astype(jnp.uint32)
    h = h + jnp.uint32(salt) + jnp.asarray(key, jnp.uint32) * jnp.uint32(0x9E3779B9)
    for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        h = (h ^ (h >> shift)) * jnp.uint32(factor)
    h = h ^ (h >> 16)
    return h >= jnp.uint32(min(int(rate * 2**32), 2**32 - 1))
'''

_DRIVER = '''

@functools.cache
def programs():
    """The mesh and each phase as ``jit(shard_map(...))``, compiled on first call."""
    mesh = make_mesh()
    fwd = jax.jit(jax.shard_map(forward_local, mesh=mesh, in_specs=tuple(FORWARD_IN.values()) + (P(),) * KEYED,
                                out_specs=tuple(FORWARD_OUT.values())))
    bwd = jax.jit(jax.shard_map(backward_local, mesh=mesh, in_specs=tuple(BACKWARD_IN.values()),
                                out_specs=tuple(BACKWARD_OUT.values())))
    return mesh, fwd, bwd


def _put(x, spec, mesh):
    """A global array laid out as ``spec`` (host arrays are placed piece by piece,
    which also works when the mesh spans several processes)."""
    sharding = NamedSharding(mesh, spec)
    if isinstance(x, jax.Array):
        if not isinstance(x, jax.core.Tracer) and x.sharding.is_equivalent_to(sharding, x.ndim):
            return x  # already laid out: no dispatch (the forward's outputs feed the backward so)
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def run_forward(inputs, key=0):
    """Every forward value leaving the shard_map: results and residuals (stacked when unreduced);
    ``key`` draws the dropout masks (a uint32; one per step gives each step its own masks)."""
    mesh, fwd, _ = programs()
    args = [_put(inputs[name], spec, mesh) for name, spec in FORWARD_IN.items()]
    args += [jnp.asarray(key, jnp.uint32)] * KEYED
    return dict(zip(FORWARD_OUT, fwd(*args)))


def run_backward(inputs, saved, cotangent):
    """The planned backward from the inputs, the forward's values and the cotangents."""
    mesh, _, bwd = programs()
    pool = {{**inputs, **saved, **cotangent}}
    args = [_put(pool[key], spec, mesh) for key, spec in BACKWARD_IN.items()]
    return dict(zip(BACKWARD_OUT, bwd(*args)))


def _results(saved):
    # partial sums travel stacked; a result declared unreduced is returned summed
    return {{key: saved[key].sum(axis=0) if key in STACKED else saved[key] for key in RESULTS}}


@jax.custom_vjp
def forward(inputs, key=0):
    """Every statement's result, as global arrays keyed by tensor name (``key``: the dropout key)."""
    return _results(run_forward(inputs, key))


def _forward_fwd(inputs, key=0):
    values = {{name: x.value for name, x in inputs.items()}}
    key = getattr(key, "value", key)
    # residuals must be arrays: which inputs want a gradient travels as pytree structure
    wanted = {{name: () for name, x in inputs.items() if x.perturbed}}
    saved = run_forward(values, key)
    return _results(saved), (values, saved, wanted, key)


def _forward_bwd(residuals, cotangent):
    """The planned backward for the outputs' cotangents, into every input not declared const.

    By linearity the rest is added from JAX's own transpose of the forward program
    (not planned, not costed): cotangents of results a later statement reads, and
    gradients of const inputs, should they be asked for.  Neither runs unless needed.
    """
    inputs, saved, wanted, key = residuals
    results = _results(saved)
    given = {{out: c for out, c in cotangent.items() if not isinstance(c, SymbolicZero)}}
    outs = {{name: given.get(out, jnp.zeros_like(results[out])) for name, out in COTANGENTS.items()}}
    planned = run_backward(inputs, saved, outs) if set(given) & set(COTANGENTS.values()) else {{}}
    grads = {{name: planned.get(GRADS[name]) if name in GRADS else None for name in inputs}}
    inner = {{out: c for out, c in given.items() if out not in COTANGENTS.values()}}
    unplanned = [name for name in wanted if name not in GRADS]
    if inner or unplanned:
        _, transpose = jax.vjp(lambda i: _results(run_forward(i, key)), inputs)
        if inner:
            (extra,) = transpose({{out: inner.get(out, jnp.zeros_like(r)) for out, r in results.items()}})
            grads = {{name: extra[name] if g is None else _plus(g, extra[name]) for name, g in grads.items()}}
        if unplanned:
            (full,) = transpose({{out: given.get(out, jnp.zeros_like(r)) for out, r in results.items()}})
            grads.update({{name: full[name] for name in unplanned}})
    for name in STACKED_INPUTS:  # a sum's gradient is the same for each of its partial sums
        if grads.get(name) is not None and grads[name].shape != inputs[name].shape:
            grads[name] = jnp.broadcast_to(grads[name], inputs[name].shape)
    return ({{name: grads[name] if name in wanted else None for name in inputs}}, None)


def _plus(a, b):
    if not isinstance(a, jax.core.Tracer) and not isinstance(b, jax.core.Tracer):
        b = jax.device_put(b, a.sharding)  # eagerly, the two may sit on different devices
    return a + b


forward.defvjp(_forward_fwd, _forward_bwd, symbolic_zeros=True)


def grad(inputs, cotangent, key=0):
    """The planned gradients (keyed as GRADS names them) of every input not declared const;
    ``cotangent`` keyed by the outputs' gradient names (COTANGENTS) or by the outputs."""
    cot = {{name: cotangent[name] if name in cotangent else cotangent[out]
           for name, out in COTANGENTS.items()}}
    return run_backward(inputs, run_forward(inputs, key), cot)
'''

_MAIN = '''

if __name__ == "__main__":
    import numpy as np

    rng = np.random.default_rng(0)
    lead = {{name: [math.prod(MESH_AXES[a] for a in axes)] for name, axes in STACKED_INPUTS.items()}}
    inputs = {{name: rng.standard_normal(lead.get(name, []) + [DIMS[d] for d in dims], dtype=np.float32)
              for name, dims in INPUT_DIMS.items()}}
    outputs = forward(inputs)
    cotangent = {{name: np.ones(outputs[out].shape, np.float32) for name, out in COTANGENTS.items()}}
    for name, value in {{**outputs, **grad(inputs, cotangent)}}.items():
        print(f"{{name:>12}} {{value.shape}} {{value.sharding.spec}}")
'''


def specs(name: str, boundaries: tuple[object, ...]) -> str:
    rows = [f"    {b.key!r}: {pspec(b.ref)},  {comment(str(b.ref))}"  # type: ignore[attr-defined]
            for b in boundaries]
    return f"{name} = {{\n" + "\n".join(rows) + "\n}\n"


def function(phase: Phase, keyed: bool = False) -> str:
    params = ", ".join([b.var for b in phase.inputs] + ["dropout_key"] * keyed)
    lines = [f"def {phase.name}_local({params}):",
             f'    """The {phase.name} on one device: local blocks in, local blocks out."""']
    for b in phase.inputs:
        if b.stacked:
            lines.append(f"    {b.var} = {b.var}[0]  # this device's partial sum of " + _plain(str(b.ref)))
    lines += ["    " + line for line in phase.body]
    outs = [f"{b.var}[None]" if b.stacked else b.var for b in phase.outputs]
    lines.append("    return (" + ", ".join(outs) + ("," if len(outs) == 1 else "") + ")")
    return "\n".join(lines) + "\n"


def render(plan: Plan, title: str, mesh: tuple[tuple[str, int], ...], sizes: dict[str, int] | None,
           demo: dict[str, int], forward: Phase, backward: Phase, results: tuple[str, ...],
           cotangents: dict[str, str], grads: dict[str, str], extra: str = "") -> str:
    """The whole module text (``extra``: a section before the driver, e.g. the optimizer phase)."""
    devices = 1
    for _, size in mesh:
        devices *= size
    spec = plan.spec
    text = _HEADER.format(
        title=_plain(title or "A sharded einsum chain, lowered to JAX shard_map."),
        filename=_plain(spec.filename or "<spec>"), save=_plain(plan.save),
        mesh_text=_plain(", ".join(f"{n}={s}" for n, s in mesh)), devices=devices,
        results=_plain(", ".join(results)), grads=_plain(", ".join(grads.values())),
        inputs=_plain(", ".join(b.key for b in forward.inputs)), cotangents=_plain(", ".join(cotangents)),
        mesh_dict="{" + ", ".join(f"{n!r}: {s}" for n, s in mesh) + "}")
    text += _HELPERS.format()
    if uses_helpers(plan.forward + plan.backward):
        text += HELPERS
    if uses_route(plan.forward):
        text += ROUTE_HELPER
    text += "\n\n# ---- forward " + "-" * 60 + "\n\n" + specs("FORWARD_IN", forward.inputs)
    text += specs("FORWARD_OUT", forward.outputs)
    text += f"RESULTS = {tuple(results)!r}  # forward() returns these; the rest are residuals\n"
    stacked = sorted(b.key for b in forward.outputs if b.stacked)
    text += f"STACKED = frozenset({stacked!r})  # unreduced values: leading dim = partial sums\n"
    stacked_in = {b.key: b.ref.unreduced for b in forward.inputs if b.stacked}
    text += f"STACKED_INPUTS = {stacked_in!r}  # inputs given as partial sums over these axes\n"
    keyed = any((s.fn or "").startswith("dropout_mask") for s in plan.forward)
    text += f"KEYED = {keyed!r}  # the forward takes a dropout key (forward(inputs, key))\n\n\n"
    text += function(forward, keyed)
    text += "\n\n# ---- backward " + "-" * 59 + "\n\n" + specs("BACKWARD_IN", backward.inputs)
    text += specs("BACKWARD_OUT", backward.outputs)
    text += f"COTANGENTS = {cotangents!r}  # an output's gradient name -> the output\n"
    text += f"GRADS = {grads!r}  # tensor -> its gradient\n\n\n"
    text += function(backward) + extra
    text += "\n\n# ---- driver " + "-" * 61 + "\n" + _DRIVER.format()
    dims = sorted({d.name for b in forward.inputs for d in b.ref.dims})
    if all(d in demo for d in dims):
        text += "\n\nDIMS = {" + ", ".join(f"{d!r}: {demo[d]}" for d in dims) + "}  # small, for a demo run\n"
        text += "INPUT_DIMS = {" + ", ".join(
            f"{b.key!r}: {tuple(d.name for d in b.ref.dims)!r}" for b in forward.inputs) + "}\n"
        main = _MAIN.format()
        inputs = {b.key for b in forward.inputs}
        ids = {name: vocab for name, vocab in id_inputs(spec).items() if name in inputs}
        if ids:  # token ids are integers in their vocabulary
            text += f"ID_INPUTS = {ids!r}  # token-id inputs -> their vocabulary dim\n"
            drawn = "    outputs = forward(inputs)\n"
            main = main.replace(drawn, "    inputs.update({name: rng.integers(0, DIMS[v], [DIMS[d] for d in "
                                f"INPUT_DIMS[name]]).astype(np.{ID_DTYPE})\n                   for name, v in "
                                "ID_INPUTS.items()})\n" + drawn)
        text += main
    return text


def render_optimizer(zero: str, phase: Phase) -> str:
    """The optimizer section appended to a module (:mod:`shardc.lowering.optimizer`)."""
    heading = comment(f"{zero}: the optimizer phase of the ZeRO plan (forward and grad above run the spec "
                      "without the zero line)")
    tables = specs("OPTIMIZER_IN", phase.inputs) + specs("OPTIMIZER_OUT", phase.outputs)
    return optimizer_text(heading, tables, function(phase))
