"""Gradients you can trust: names that never take a spec's name, a gradient for every input
not declared ``const``, partial contributions added before they are reduced, and one
normal form for partial-sum axes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardc
from shardc.ir.localops import Add
from shardc.ir.plan import Op, Plan
from shardc.ir.spec import Mesh, MeshAxis
from shardc.names import fresh, gradient_names
from shardc.planner import backward
from shardc.planner.check import check_plan, comm_time
from shardc.planner.plan_text import render_text, to_json
from shardc.testing import specs
from shardc.verification.verify import render_report, verify

CROSS_ATTENTION = """\
mesh X=2, Y=2
dims B=4, T=4, S=8, D=8, E=4
Q[B_X, T, E_Y] = In[B_X, T, D] · Wq[D, E_Y]
K[B_X, S, E_Y] = Mem[B_X, S, D] · Wk[D, E_Y]
Sc[B_X, T, S] = Q[B_X, T, E_Y] · K[B_X, S, E_Y]
"""

SWIGLU = """\
mesh X=2, Y=4
dims B=64, D=32, F=128
G[B_X, F_Y] = X[B_X, D] · Wg[D, F_Y]
U[B_X, F_Y] = X[B_X, D] · Wu[D, F_Y]
A[B_X, F_Y] = silu(G[B_X, F_Y])
H[B_X, F_Y] = A[B_X, F_Y] * U[B_X, F_Y]
Out[B_X, D] = H[B_X, F_Y] · Wd[F_Y, D]
"""


def verified(plan_or_spec: Plan | shardc.Spec) -> None:
    report = verify(plan_or_spec, devices=8)
    assert report.ok, render_report(report)


def made_names(plan: Plan) -> set[str]:
    """Tensors the backward computes (not the forward values it gathers again)."""
    return {s.tensor for s in plan.backward if s.op in (Op.EINSUM, Op.ELEMENTWISE)}


# --- the one naming function ------------------------------------------------------------

def test_gradient_names_prefer_the_books_dW() -> None:
    assert gradient_names(["In", "W"], taken=["In", "W"]) == {"In": "dIn", "W": "dW"}
    assert gradient_names(["W", "dW"], taken=["W", "dW"]) == {"W": "d_W", "dW": "ddW"}
    assert gradient_names(["W"], taken=["W", "dW", "d_W", "d_W_2"]) == {"W": "d_W_3"}
    assert fresh("dX_1", {"dX_1", "dX_1_2"}) == "dX_1_3"


NAME_POOL = ("W", "dW", "d_W", "d_W_2", "ddW", "_W", "In", "dIn", "dIn_1", "Out", "dOut", "d_Out", "dd_Out", "d")


@given(st.lists(st.sampled_from(NAME_POOL), min_size=1, unique=True))
def test_gradient_names_never_take_a_name(names: list[str]) -> None:
    grads = gradient_names(names, taken=names)
    assert set(grads) == set(names)
    assert not set(grads.values()) & set(names)
    assert len(set(grads.values())) == len(names)
    assert all(g == f"d{n}" for n, g in grads.items() if f"d{n}" not in names)


# --- issue items 1 and 19: a user's dW or dOut is not a gradient ----------------------------

@pytest.mark.slow
def test_a_tensor_named_dW_beside_a_param_W_is_not_its_gradient() -> None:
    spec = shardc.parse("mesh X=2\ndims B=8, D=4, F=6\nOut[B_X, F] = In[B_X, D] · dW[D, F]\n"
                        "T[B_X, F] = In[B_X, D] · W[D, F]\n")
    plan = shardc.plan(spec)
    assert plan.grad_name("W") == "d_W" and plan.grad_name("dW") == "ddW"
    assert [g.name for g in plan.grads] == ["dIn", "ddW", "d_W"]
    # the user's dW is read (it is an operand of Out), never made
    assert "dW" not in made_names(plan) and any("dW" in {o.name for o in s.operands} for s in plan.backward)
    assert check_plan(plan) == []
    assert "d_W is the gradient of W (dW is a tensor of the spec)" in render_text(plan)
    assert to_json(plan)["gradient_names"]["W"] == "d_W"
    verified(plan)


@pytest.mark.slow
def test_an_input_named_dOut_beside_an_output_Out_is_not_its_cotangent() -> None:
    spec = shardc.parse("mesh X=2\ndims B=8, D=4, F=6\nOut[B_X, F] = dOut[B_X, D] · W[D, F]\n")
    plan = shardc.plan(spec)
    assert [c.name for c in plan.cotangents] == ["d_Out"]
    dw = next(s for s in plan.backward if s.tensor == "dW" and s.op is Op.EINSUM)
    assert [o.name for o in dw.operands] == ["dOut", "d_Out"]  # was dOut · dOut
    verified(plan)


@pytest.mark.slow
def test_jax_grad_through_a_module_with_an_input_named_dOut() -> None:
    """The lowered custom_vjp pools inputs and cotangents by name: dOut must stay the input."""
    import jax
    import jax.numpy as jnp

    lowered = shardc.lower(shardc.parse("mesh X=2\ndims B=8, D=4, F=6\nOut[B_X, F] = dOut[B_X, D] · W[D, F]\n"))
    inputs = {k: jnp.asarray(v) for k, v in lowered.random_inputs().items()}
    got = jax.grad(lambda i: jnp.sum(jnp.sin(lowered.forward(i)["Out"])))(inputs)
    want = jax.grad(lambda i: jnp.sum(jnp.sin(jnp.einsum("bd,df->bf", i["dOut"], i["W"]))))(inputs)
    for name in ("dOut", "W"):
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), rtol=2e-4, atol=1e-5)


def test_part_names_avoid_the_specs_names() -> None:
    """In is read twice, so its gradient has two parts; the spec already has a tensor dIn_1."""
    spec = shardc.parse("mesh X=2\nA[B_X, F] = In[B_X, D] · W[D, F]\nC[B_X, F] = In[B_X, D] · dIn_1[D, F]\n")
    plan = shardc.plan(spec)
    user = {i.name for i in plan.tensors}
    assert not (made_names(plan) - {g.name for g in plan.grads}) & user
    assert "dIn_1_2" in made_names(plan) and check_plan(plan) == []


# --- issue item 14: every input but the const ones -----------------------------------------

@pytest.mark.slow
def test_a_second_activation_input_gets_its_gradient() -> None:
    """Cross attention: the keys come from another tensor (Mem), which needs a gradient too."""
    plan = shardc.plan(shardc.parse(CROSS_ATTENTION))
    assert [g.name for g in plan.grads] == ["dIn", "dWq", "dMem", "dWk"]
    verified(plan)


@pytest.mark.slow
def test_a_const_input_gets_no_gradient() -> None:
    plan = shardc.plan(shardc.parse("const Mem\n" + CROSS_ATTENTION))
    assert [g.name for g in plan.grads] == ["dIn", "dWq", "dWk"]
    assert all(s.tensor != "dMem" for s in plan.backward)
    verified(plan)


def test_const_excludes_a_default_param() -> None:
    plan = shardc.plan(shardc.parse("mesh X=2\nconst Wmask\nOut[B_X, F] = In[B_X, D] · Wmask[D, F]\n"))
    assert [i.role for i in plan.tensors if i.name == "Wmask"] == ["input"]
    assert [g.name for g in plan.grads] == ["dIn"]


@pytest.mark.slow
def test_verify_fails_on_a_gradient_the_plan_lacks() -> None:
    """A plan that drops a non-const input's gradient is a mismatch, not silently unchecked."""
    plan = shardc.plan(shardc.parse(CROSS_ATTENTION))
    fewer = dataclasses.replace(plan, grads=tuple(g for g in plan.grads if g.name != "dMem"))
    report = verify(fewer, devices=8)
    assert [(r.tensor, r.ok) for r in report.values if r.tensor == "dMem"] == [("dMem", False)]


@pytest.mark.slow
def test_jax_grad_of_a_const_input_is_still_right() -> None:
    """The plan does not differentiate Mem; asked for, JAX's transpose gives its gradient."""
    import jax
    import jax.numpy as jnp

    lowered = shardc.lower(shardc.parse("const Mem\n" + CROSS_ATTENTION))
    inputs = {k: jnp.asarray(v) for k, v in lowered.random_inputs().items()}

    def reference(i):  # type: ignore[no-untyped-def]
        q = jnp.einsum("btd,de->bte", i["In"], i["Wq"])
        k = jnp.einsum("bsd,de->bse", i["Mem"], i["Wk"])
        return jnp.sum(jnp.einsum("bte,bse->bts", q, k) ** 2)

    got = jax.grad(lambda i: jnp.sum(lowered.forward(i)["Sc"] ** 2))(inputs)
    want = jax.grad(reference)(inputs)
    for name in ("In", "Wq", "Mem", "Wk"):
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), rtol=2e-4, atol=1e-4)


# --- issue item 8: a sum of partial sums stays partial ------------------------------------------

@pytest.mark.slow
def test_swiglu_reduces_dX_once() -> None:
    """dX = dG · Wg + dU · Wu: both parts are partial over Y; add them, then one AllReduce."""
    plan = shardc.plan(shardc.parse(SWIGLU))
    reductions = [s for s in plan.backward if s.op in (Op.ALL_REDUCE, Op.REDUCE_SCATTER) and "Y" in s.axes]
    assert [(s.tensor, s.axes) for s in reductions] == [("dX", ("Y",))]
    add = next(s for s in plan.backward if isinstance(s.fn, Add))
    assert add.dst.unreduced == ("Y",) and all(o.unreduced == ("Y",) for o in add.operands)
    assert check_plan(plan) == []
    verified(plan)


@pytest.mark.slow
def test_contributions_made_differently_are_summed_by_kind() -> None:
    """Two partial parts of dX are added and reduced once; a third, already reduced, joins after."""
    spec = shardc.parse("mesh X=2, Y=2\ndims B=8, D=8, F=8\nG[B_X, F_Y] = X[B_X, D] · Wg[D, F_Y]\n"
                        "U[B_X, F_Y] = X[B_X, D] · Wu[D, F_Y]\nZ[B_X, D] = X[B_X, D] * S[D]\n"
                        "H[B_X, F_Y] = G[B_X, F_Y] * U[B_X, F_Y]\nP[B_X, D] = H[B_X, F_Y] · Wd[F_Y, D]\n"
                        "Out[B_X, D] = P[B_X, D] * Z[B_X, D]\n")
    plan = shardc.plan(spec)
    reduced = [s.tensor for s in plan.backward if s.op is Op.ALL_REDUCE and s.tensor.startswith("dX")]
    assert reduced == ["dX_sum"]
    verified(plan)


@pytest.mark.parametrize("save", ["none", "all"])
def test_swiglu_without_sizes_reduces_once(save: str) -> None:
    spec = shardc.parse("\n".join(line for line in SWIGLU.splitlines() if not line.startswith("dims")))
    plan = shardc.plan(spec, save=save)
    assert [s.tensor for s in plan.backward if s.op is Op.ALL_REDUCE and "Y" in s.axes] == ["dX"]
    assert check_plan(plan) == []


@settings(max_examples=30, deadline=None)
@given(specs(mesh=Mesh((MeshAxis("X", 2), MeshAxis("Y", 2))), max_statements=4, dims=True, chains=False))
def test_adding_before_moving_never_costs_more(spec: shardc.Spec) -> None:
    """Against the old backward (each contribution moved to the primal's sharding, then added)."""
    new = shardc.plan(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backward._Backward, "_local_result", lambda self, dst, operands, target: target)
        old = shardc.plan(spec)
    assert comm_time(new) <= comm_time(old) * (1 + 1e-9) + 1e-15
    assert check_plan(new) == []


# --- one sharded-value type: {U_YX} is {U_XY} from the parser on ---------------------------

@pytest.mark.parametrize("written", ["YX", "XY"])
def test_partial_sums_written_in_any_order_plan_and_lower_alike(written: str) -> None:
    """Once `{U_YX}` planned wrongly (the lowering found no step making the declared result)."""
    from shardc.lowering.codegen import generate

    spec = shardc.parse(f"mesh X=2, Y=2, Z=2\nOut[B_Z, F]{{U_{written}}} = In[B, D] * W[D, F]\n")
    plan = shardc.plan(spec)
    assert plan.tensor("Out").ref.unreduced == ("X", "Y") and check_plan(plan) == []
    sizes = {"B": 4, "D": 4, "F": 4, "X": 2, "Y": 2, "Z": 2}
    module = generate(plan, (("X", 2), ("Y", 2), ("Z", 2)), sizes)
    assert "Out[B_Z, F]{U_XY}" in module.source
