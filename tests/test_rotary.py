"""``rotary(X, T[, theta])``: the rotary position embedding as an op of the language (:mod:`shardc.ops.rotary`):
planned as a map with its head dim whole, its gradient the inverse rotation, its reference RoFormer's rotation
of pairs (here the head dim's halves), fused as a map, refused with a span where it cannot run, and lowered to
the reference's values with the position dim sharded and not."""

from __future__ import annotations

import numpy as np
import pytest

import shardc
from shardc.errors import ShardcError
from shardc.ir.localops import Attention, Rotary
from shardc.ir.plan import Op
from shardc.lowering.reference import backward as ref_backward
from shardc.lowering.reference import forward as ref_forward
from shardc.lowering.sizes import small_sizes
from tests.test_affine import memory_rows

# Q rotated with its positions sharded over X (each device's block offset), then K with them whole
SPEC = """mesh X=2, Y=2
dims B=2, T=8, D=8, N=2, H=8
param Wq, Wo

Q[B, T_X, N_Y, H] = In[B, T_X, D] · Wq[D, N_Y, H]
Qr[B, T_X, N_Y, H] = rotary(Q[B, T_X, N_Y, H], T, 500000)
K[B_X, T, N_Y, H] = Qr[B, T_X, N_Y, H]
Kr[B_X, T, N_Y, H] = rotary(K[B_X, T, N_Y, H], T)
Y[B_X, T, D] = Kr[B_X, T, N_Y, H] · Wo[N_Y, H, D]
"""


@pytest.fixture(scope="module")
def plan() -> shardc.Plan:
    return shardc.plan(shardc.parse(SPEC))


def test_rotary_is_a_map_that_keeps_the_sharding_and_its_gradient_rotates_back(plan: shardc.Plan) -> None:
    maps = [(s.fn, str(s.dst)) for s in plan.forward if isinstance(s.fn, Rotary)]
    assert maps == [(Rotary("T", "H", 500000.0), "Qr[B, T_X, N_Y, H]"), (Rotary("T", "H"), "Kr[B_X, T, N_Y, H]")]
    back = [s for s in plan.backward if isinstance(s.fn, Rotary)]
    assert [s.fn.inverse for s in back if isinstance(s.fn, Rotary)] == [True, True]
    assert all(len(s.operands) == 1 and s.operands[0].name.startswith("d") for s in back)  # no argument read
    assert not {r.name for r in plan.residuals} & {"Q", "K"}  # so none is kept for it


def _rotation(x: np.ndarray, theta: float, sign: float = 1.0) -> np.ndarray:
    """RoFormer's rotation (arXiv 2104.09864, section 3.4.2) written independently: each pair (x[i], x[i + H/2])
    a complex number times e^{i t theta^(-2i/H)}, t the position (axis 1); ``sign`` -1: the rotation back."""
    h = x.shape[-1] // 2
    z = x[..., :h] + 1j * x[..., h:]
    angle = np.arange(x.shape[1])[None, :, None, None] * theta ** (-2.0 * np.arange(h) / (2 * h))
    w = z * np.exp(sign * 1j * angle)
    return np.concatenate([w.real, w.imag], axis=-1)


def test_the_reference_rotates_pairs_and_its_gradient_is_the_inverse_rotation() -> None:
    spec = shardc.parse(SPEC)
    rng = np.random.default_rng(0)
    inputs = {"In": rng.normal(size=(2, 8, 8)), "Wq": rng.normal(size=(8, 2, 8)), "Wo": rng.normal(size=(2, 8, 8))}
    values = ref_forward(spec, inputs)
    q = np.einsum("btd,dnh->btnh", inputs["In"], inputs["Wq"])
    assert np.allclose(values["Qr"], _rotation(q, 500000.0))
    assert np.allclose(values["Kr"], _rotation(_rotation(q, 500000.0), 10000.0))
    # a rotation keeps lengths, and leaves position 0 where it is
    assert np.allclose(np.linalg.norm(values["Qr"], axis=-1), np.linalg.norm(q, axis=-1))
    assert np.allclose(values["Qr"][:, 0], q[:, 0]) and not np.allclose(values["Qr"][:, 1], q[:, 1])
    dy = rng.normal(size=(2, 8, 8))
    grads = ref_backward(spec, inputs, {"Y": dy})
    dkr = np.einsum("btd,nhd->btnh", dy, inputs["Wo"])
    dq = _rotation(_rotation(dkr, 10000.0, -1.0), 500000.0, -1.0)  # each rotation undone, the last first
    assert np.allclose(grads["Wq"], np.einsum("btd,btnh->dnh", inputs["In"], dq))


def test_a_rotary_embedding_fuses_as_any_other_map_in_the_cost_model() -> None:
    """Each rotation costs what `identity` costs in its place (a map whose gradient reads no argument either):
    the same bytes by the same fusion, nothing more."""
    other = SPEC.replace("rotary(Q[B, T_X, N_Y, H], T, 500000)", "identity(Q[B, T_X, N_Y, H])").replace(
        "rotary(K[B_X, T, N_Y, H], T)", "identity(K[B_X, T, N_Y, H])")
    assert memory_rows(SPEC) == memory_rows(other)


def test_a_head_dim_sharded_by_its_producer_is_gathered_for_the_rotation() -> None:
    spec = shardc.parse("""mesh X=2, Y=2
dims B=2, T=8, D=8, N=2, H=8
param Wq, Wo
Q[B, T_X, N, H_Y] = In[B, T_X, D] · Wq[D, N, H_Y]
Y[B, T_X, D] = rotary(Q[B, T_X, N, H_Y], T) · Wo[N, H, D]
""")
    steps = shardc.plan(spec).forward
    k = next(k for k, s in enumerate(steps) if isinstance(s.fn, Rotary))
    assert str(steps[k].dst).endswith("[B, T_X, N, H]") and steps[k - 1].op is Op.ALL_GATHER
    assert str(steps[k - 1].dst) == "Q[B, T_X, N, H]"


@pytest.mark.parametrize(("line", "says"), [
    ("Kr[B_X, T, N, H_Y] = rotary(K[B_X, T, N_Y, H], T)", "H must be whole on a device, not sharded over Y"),
    ("Kr[B_X, T, N_Y, H] = rotary(K[B_X, T, N_Y, H], H)", "H is the rotated head dim"),
    ("Kr[B_X, T, N_Y, H] = rotary(K[B_X, T, N_Y, H], T, -1)", "frequency base of -1"),
    ("Kr[B_X, T, N_Y, H] = rotary(K[B_X, T, N_Y, H])", "`rotary` takes 1 tensor"),
])
def test_a_rotary_embedding_that_cannot_run_is_an_error_at_its_line(line: str, says: str) -> None:
    text = SPEC.replace("Kr[B_X, T, N_Y, H] = rotary(K[B_X, T, N_Y, H], T)", line)
    if "H_Y" in line:  # read as defined
        text = text.replace("Kr[B_X, T, N_Y, H] · Wo[N_Y, H, D]", "Kr[B_X, T, N, H_Y] · Wo[N, H_Y, D]")
    with pytest.raises(ShardcError, match=says) as err:
        shardc.plan(shardc.parse(text))
    assert err.value.span is not None and err.value.span.line == 8, err.value


def test_the_head_dim_is_even_at_verifys_sizes_and_an_odd_one_is_refused() -> None:
    """Its halves are the pairs: verify's small sizes give it an even size (they gave LLaMA's layer H=9)."""
    big = SPEC.replace("dims B=2, T=8, D=8, N=2, H=8", "dims B=256, T=4096, D=8192, N=64, H=128")
    assert small_sizes(shardc.plan(shardc.parse(big)))["H"] % 2 == 0
    with pytest.raises(ShardcError, match="the head dim H=7 is odd") as err:
        shardc.parse(SPEC.replace("H=8", "H=7"))
    assert err.value.span is not None and err.value.span.line == 6


@pytest.mark.slow  # the lowered program compiled and run by XLA: T sharded (Qr) and whole (Kr)
def test_a_spec_with_rotary_embeddings_verifies() -> None:
    from shardc.verification.verify import render_report, verify
    report = verify(shardc.parse(SPEC))
    assert report.ok, render_report(report)


def test_rotated_queries_keep_the_zigzag_ring_reordering_its_blocks() -> None:
    """A rotation reads each token's global position, so a plan with one does not hold the sequence in zig-zag
    order (the ring kernels reorder their blocks), as with a dropout mask (test_zigzag_order.py)."""
    text = ("mesh X=16 over dcn\ndims B=1, S=131072, T=131072, G=8, R=16, H=128\nhardware h100\n"
            "Qr[B, S_X, G, R, H] = rotary(Q[B, S_X, G, R, H], S)\n"
            "O[B, S_X, G, R, H] = attention(Qr[B, S_X, G, R, H], K[B, T_X, G, H], V[B, T_X, G, H] over T, causal)\n")
    kernels = [s.fn for s in shardc.plan(shardc.parse(text)).forward if isinstance(s.fn, Attention)]
    assert kernels and all(fn.zigzag and not fn.held for fn in kernels)
    held = text.replace("rotary(Q[B, S_X, G, R, H], S)", "identity(Q[B, S_X, G, R, H])")
    assert all(s.fn.held for s in shardc.plan(shardc.parse(held)).forward if isinstance(s.fn, Attention))


def test_the_lowered_rotation_computes_its_angles_in_a_float64_run_in_float64() -> None:
    """A pipeline verifies in float64: angles rounded to float32 there moved dX by 1e-7 of its terms against a
    bound of 4e-12 (traced, not compiled: every array of the rotation is float64)."""
    import jax

    from shardc.lowering.runtime import rotary
    with jax.enable_x64(True):
        text = str(jax.make_jaxpr(lambda x: rotary(x, (1, ()), 2, 10000.0))(np.zeros((2, 8, 4))))
    assert "f64[" in text and "f32[" not in text, text
