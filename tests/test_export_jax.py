"""What jax makes of ``shardc export --to jax``: shardings of a compiled program, explicit mode's einsums.

The spec's unsharded math (shardc.lowering.reference, in jax.numpy: independent of the plan) is jitted
with the exported shardings on 8 emulated CPU devices (conftest), the mesh shrunk as ``shardc verify``
shrinks it; the compiled program must take and give exactly those shardings, and where the plan's
collectives are what any partitioner must do (Megatron's MLP: one AllReduce each way; data parallelism:
the weight gradient's AllReduce) XLA's are the plan's.  Explicit mode: each einsum of the plan, traced
on operands of the plan's shardings, gives the plan's result sharding by inference or through the
exported ``out_sharding``, and the export lists it exactly when inference would not.
"""

from __future__ import annotations

import string
import types
from collections import Counter
from typing import Any

import pytest

import shardc
from shardc.export.jax_export import declared, jax_module, out_shardings
from shardc.ir.plan import Op, Plan, Step, unfused
from shardc.ir.spec import TensorRef
from shardc.lowering import reference
from shardc.lowering.load import load_module
from shardc.lowering.sizes import small_sizes
from shardc.verification.hlo import collectives
from tests.test_export import ROOT

pytestmark = pytest.mark.slow

MLP = ("mesh Y=4\ndims B=8, D=16, F=32\nparam W1, W2\n"
       "H[B, F_Y] = X[B, D] · W1[D, F_Y]\nO[B, D] = H[B, F_Y] · W2[F_Y, D]\n")
DP = "mesh X=8\ndims B=64, D=16, F=32\nparam W\nOut[B_X, F] = In[B_X, D] · W[D, F]\n"


def _setup(text: str) -> tuple[Plan, types.ModuleType, dict[str, int], Any]:
    plan = shardc.plan(shardc.parse(text, filename="spec.shard"))
    module = load_module(jax_module(plan), "exported")
    sizes = small_sizes(plan, 8)
    mesh_sizes = {a: sizes[a] for a in plan.spec.mesh.names}
    return plan, module, sizes, mesh_sizes


def _struct(ref: TensorRef, sizes: dict[str, int], sharding: Any = None) -> Any:
    import jax
    import jax.numpy as jnp

    return jax.ShapeDtypeStruct(tuple(sizes[d.name] for d in ref.dims), jnp.float32, sharding=sharding)


def _compiled(plan: Plan, module: types.ModuleType, sizes: dict[str, int], mesh_sizes: dict[str, int]) -> Any:
    """Forward and backward of the reference, jitted with the exported shardings and compiled."""
    import jax
    import jax.numpy as jnp

    mesh = module.make_mesh(mesh_sizes, explicit=False)
    shard, grad = module.named(module.SHARDINGS, mesh), module.named(module.GRAD_SHARDINGS, mesh)
    leaves = [ref for role, ref in declared(plan) if role in ("input", "param")]
    outs = [ref for role, ref in declared(plan) if role == "output"]
    names = [r.name for r in leaves]
    wanted = [plan.primal(g.name) for g in plan.grads]

    def fwd(*args: Any) -> tuple[Any, ...]:
        values = reference.forward(plan.spec, dict(zip(names, args, strict=True)), jnp)
        return tuple(values[o.name] for o in outs)

    def bwd(*args: Any) -> tuple[Any, ...]:
        inputs = dict(zip(names, args[:len(names)], strict=True))
        cot = dict(zip([o.name for o in outs], args[len(names):], strict=True))
        grads = reference.backward(plan.spec, inputs, cot, jnp)
        return tuple(grads[n] for n in wanted)

    ins = [shard[n] for n in names]
    out_sh = [shard[o.name] for o in outs]
    structs = [_struct(r, sizes) for r in leaves]
    forward = jax.jit(fwd, in_shardings=ins, out_shardings=tuple(out_sh)).lower(*structs).compile()
    backward = jax.jit(bwd, in_shardings=ins + out_sh, out_shardings=tuple(grad[g.name] for g in plan.grads)).lower(
        *structs, *[_struct(o, sizes) for o in outs]).compile()
    return forward, backward, ins, out_sh, [grad[g.name] for g in plan.grads]


def _kinds(found: list[Any]) -> Counter[tuple[Any, tuple[str, ...]]]:
    return Counter((c.kind, c.axes) for c in found)


def _plan_kinds(steps: tuple[Step, ...]) -> Counter[tuple[Any, tuple[str, ...]]]:
    return Counter((s.op, s.axes) for s in steps if s.is_collective)


@pytest.mark.parametrize("name", ["mlp", "dp", "fsdp_tp"])
def test_the_compiled_program_takes_and_gives_the_exported_shardings(name: str) -> None:
    text = {"mlp": MLP, "dp": DP}.get(name) or (ROOT / "examples" / f"{name}.shard").read_text(encoding="utf-8")
    plan, module, sizes, mesh_sizes = _setup(text)
    forward, backward, ins, outs, grads = _compiled(plan, module, sizes, mesh_sizes)
    for got, want in zip(forward.input_shardings[0], ins, strict=True):
        assert got.is_equivalent_to(want, len(want.spec)), (got, want)
    for got, want in zip(forward.output_shardings, outs, strict=True):
        assert got.is_equivalent_to(want, len(want.spec)), (got, want)
    for got, want in zip(backward.output_shardings, grads, strict=True):
        assert got.is_equivalent_to(want, len(want.spec)), (got, want)
    mesh = tuple(mesh_sizes.items())
    if text in (MLP, DP):  # the collectives every partitioner must make, and the plan makes
        assert _kinds(collectives(forward.as_text(), mesh)) == _plan_kinds(plan.forward)
        assert _kinds(collectives(backward.as_text(), mesh)) == _plan_kinds(plan.backward)
        assert sum(_plan_kinds(plan.backward).values()) == 1  # one AllReduce: the test is not vacuous


def _einsum(step: Step, mesh: Any, sizes: dict[str, int], out_sharding: Any = None) -> Any:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    letters = dict(zip(dict.fromkeys(i for r in (*step.operands, step.dst) for i in r.indices),
                       string.ascii_letters, strict=False))
    equation = ",".join("".join(letters[i] for i in r.indices) for r in step.operands)
    equation += "->" + "".join(letters[i] for i in step.dst.indices)
    structs = [_struct(r, sizes, NamedSharding(mesh, P(*[d.axes or None for d in r.dims]))) for r in step.operands]
    with jax.set_mesh(mesh):
        return jax.eval_shape(lambda *a: jnp.einsum(equation, *a, out_sharding=out_sharding), *structs)


def _same(result: Any, ref: TensorRef) -> bool:
    """The traced result's sharding is the plan's: each dim's axes, and the partial sums."""
    spec = result.sharding.spec
    entries = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec.partitions]
    entries += [()] * (len(ref.dims) - len(entries))
    return tuple(entries) == ref.layout and set(spec.unreduced) == set(ref.unreduced)


@pytest.mark.parametrize("example", ["fsdp_tp", "gpt_layer_tp"])
def test_explicit_mode_gets_the_plans_einsum_shardings(example: str) -> None:
    plan, module, sizes, mesh_sizes = _setup((ROOT / "examples" / f"{example}.shard").read_text(encoding="utf-8"))
    mesh = module.make_mesh(mesh_sizes)
    # a collective matmul as its einsum and its collective, as explicit mode runs it (and the export reads it)
    tables = ((plan.forward, module.OUT_SHARDINGS), (plan.backward, module.BACKWARD_OUT_SHARDINGS))
    phases = [([part for s in steps for part in unfused(s)], table) for steps, table in tables]
    listed = {id(s): key for steps, table in phases for key, s in out_shardings(steps) if key in table}
    checked = 0
    for phase, table in phases:
        for step in phase:
            if step.op is not Op.EINSUM or any(o.unreduced for o in step.operands):
                continue
            checked += 1
            if id(step) not in listed:
                assert _same(_einsum(step, mesh, sizes), step.dst), step
                continue
            assert _same(_einsum(step, mesh, sizes, table[listed[id(step)]]), step.dst), step
            try:
                inferred = _einsum(step, mesh, sizes)
            except Exception:  # noqa: BLE001 - jax refuses to infer a sharded contraction's result
                continue
            assert not _same(inferred, step.dst), step
    assert checked >= 6 and listed
