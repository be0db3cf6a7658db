"""`gemm f8` lowered: each GEMM reads its operands cast to FP8 (forward, Dgrad and Wgrad), the reference
rounds them alike, and verify checks what runs."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

import shardc
from shardc.lowering.api import lower

SPEC = """\
mesh X=2, Y=2
dims B=64, D=256, F=512
gemm f8
param W1, W2
H[B_X, F_Y] = relu(I[B_X, D] · W1[D, F_Y])
O[B_X, D] = H[B_X, F_Y] · W2[F_Y, D]
Loss[] = cross_entropy(O[B_X, D], Tok[B_X])
"""

FP8 = re.compile(r"new_dtype=float8_e4m3fn")


def test_each_gemm_operand_is_cast_to_fp8_in_the_module_and_its_jaxpr() -> None:
    import jax

    low = lower(shardc.parse(SPEC), sizes={"B": 4, "D": 8, "F": 8})
    einsums = [line for line in low.source.splitlines() if "jnp.einsum(" in line]
    assert len(einsums) == 6 and all(line.count("gemm_input(") == 2 for line in einsums)
    inputs, cotangents = low.random_inputs(), low.random_cotangents()
    forward = str(jax.make_jaxpr(lambda x: low.forward(x))(inputs))
    backward = str(jax.make_jaxpr(lambda x, c: low.grad(x, c))(inputs, cotangents))
    assert len(FP8.findall(forward)) == 4  # 2 GEMMs x 2 operands
    assert len(FP8.findall(backward)) == 4 + 8  # grad runs the forward, then Dgrad and Wgrad of each GEMM
    plain = lower(shardc.parse(SPEC.replace("gemm f8\n", "")), sizes={"B": 4, "D": 8, "F": 8})
    assert "gemm_input(" not in plain.source.split("def ", 1)[1]


def test_a_bf16_exception_keeps_its_gemms_uncast_in_a_bf16_module() -> None:
    low = lower(shardc.parse(SPEC.replace("gemm f8\n", "gemm f8\ngemm bf16 O\n")), sizes={"B": 4, "D": 8, "F": 8})
    casts = [line.count("float8_e4m3fn") for line in low.source.splitlines() if "jnp.einsum(" in line]
    assert sorted(casts) == [0, 0, 0, 2, 2, 2]  # O's forward, Dgrad, Wgrad read bfloat16 (a no-op cast)


@pytest.mark.slow
def test_verify_checks_the_fp8_casts_it_runs() -> None:
    """The reference rounds each GEMM's operands as the module does, so the module verifies within the
    compute type's tolerance; a module without the casts errs by the FP8 rounding, and fails."""
    from shardc.verification.verify import render_report, verify

    spec = shardc.parse(SPEC)
    report = verify(spec)
    assert report.ok and any("gemm f8" in note for note in report.notes), render_report(report)
    source = lower(spec, sizes=report.sizes).source
    uncast = re.sub(r"gemm_input\((\w+), 'float8_e4m3fn'\)", r"\1", source)
    assert uncast != source
    assert not verify(spec, module=uncast).ok


def test_a_gemm_operand_keeps_e4m3s_mantissa_and_small_ones_its_subnormal_grid() -> None:
    """Each element is rounded to E4M3's 3 mantissa bits at a power-of-two scale of its own, none below
    2**-11: far past E4M3's range (448) it does not overflow to NaN; under 2**-17 it lies on E4M3's
    subnormal grid at that scale (2**-20 apart), as a tile scaled to its largest element flushes it."""
    import numpy as np

    from shardc.lowering.reference import SCALE_FLOOR, gemm_rounded

    x = np.array([0.0, 1.0, 1.0625, 1.1875, -3.3, 1e6, 2.0**-12 * 1.0625, 3e-7, 3e-9, -7e-30])
    got = gemm_rounded(x, "float8_e4m3fn")
    assert got[0] == 0 and got[1] == 1 and got[2] == 1.0 and got[3] == 1.25  # ties to even, steps of 1/8
    assert np.all(np.isfinite(got))
    normal = np.abs(x) >= 2.0 ** (SCALE_FLOOR - 6)
    assert np.all(np.abs(got - x)[normal] <= np.abs(x[normal]) / 16)
    mantissa, _ = np.frexp(got[normal])
    assert np.all((mantissa * 16) % 1 == 0)  # 4 significant bits: the implicit one and E4M3's 3
    grid = 2.0 ** (SCALE_FLOOR - 9)
    assert np.all(got[~normal] % grid == 0) and np.all(np.abs(got - x)[~normal] <= grid / 2)
    assert got[-1] == 0 and got[-2] == 0 and gemm_rounded(x, None) is x


@pytest.mark.slow  # jax compiles each rounding
def test_the_references_rounding_is_the_modules_cast_bit_for_bit() -> None:
    """The reference rounds on the float's bits (reference_rounded), the module casts to FP8 at a scale of each
    element's own (gemm_rounded): the same values, in numpy and in jax, float64 and float32, across 24
    decades, at ties to even between two 3-bit mantissas, on E4M3's subnormal grid and at its edge."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from shardc.lowering.reference import gemm_rounded, reference_rounded

    rng = np.random.default_rng(0)
    mantissas, exponents = rng.integers(0, 8, 4000), rng.integers(-30, 30, 4000)
    values = [rng.standard_normal(20000) * 10.0 ** rng.uniform(-12, 12, 20000),
              ((8 + mantissas) + 0.5) / 8 * 2.0 ** exponents * rng.choice([-1, 1], 4000),  # ties
              rng.integers(-2**20, 2**20, 4000) * 2.0**-24,  # around the subnormal grid and its edge
              np.array([0.0, -0.0, 2.0**-17, 2.0**-17 * 0.999, 2.0**-21, 3 * 2.0**-21, 5 * 2.0**-21, 1e-40, 3e38])]
    with jax.enable_x64(True):
        for dtype in (np.float64, np.float32):
            for value in values:
                x = value.astype(dtype)
                want = gemm_rounded(x, "float8_e4m3fn")
                assert np.array_equal(reference_rounded(x, "float8_e4m3fn"), want)
                assert np.array_equal(np.asarray(reference_rounded(jnp.asarray(x), "float8_e4m3fn", jnp)), want)


@pytest.mark.slow
def test_verify_passes_with_a_value_cached_in_fp8() -> None:
    """`dtype f8 H` beside `gemm f8`: H's gradient is BF16 (the spec's), the inputs rounded as declared, and
    the memory check compiles H as a float (it read every one-byte value as a dropout mask, a bool whose
    gradient JAX refuses)."""
    from shardc.verification.verify import render_report, verify

    spec = shardc.parse(SPEC.replace("gemm f8\n", "gemm f8\ndtype f8 H\n"))
    report = verify(spec)
    assert report.ok, render_report(report)


def test_verify_rounds_an_fp8_outputs_cotangent_to_the_storage_type() -> None:
    """A cotangent is of its output's gradient's type: an f8 output's is BF16 (the spec's), so verify rounds
    it to bfloat16, not to E4M3, as it rounds the f8 output's value."""
    import numpy as np

    from shardc.verification.verify import _rounded

    spec = shardc.parse(SPEC.replace("gemm f8\n", "gemm f8\ndtype f8 H\n"))
    x = np.array([1.0 + 2.0**-6, 3.3])
    assert list(_rounded(x, spec, np.dtype(np.float64), "H")) == [1.0, 3.25]  # E4M3: 3 mantissa bits
    assert list(_rounded(x, spec, np.dtype(np.float64), "H", gradient=True)) == [1.0 + 2.0**-6, 3.296875]


def test_the_memory_check_counts_the_casts_the_module_makes() -> None:
    """At verify's float width each GEMM operand is cast in its own type: XLA's CPU backend makes the weights'
    casts first, alive together from the forward's start (W1's and W2's, 32 kB each at 16x verify's sizes:
    its buffer assignment's 64 kB of the forward's 65.5 kB of temporaries), I's and H's in the buffer of O,
    an AllReduce's output made after them; without them shardc counted 16.4 kB.  The backward's cotangents
    die into their casts, no buffer beside their own."""
    from shardc.costmodel.phase_memory import phase_memory
    from shardc.verification.memory_check import XLA_CPU

    sizes = {"X": 2, "Y": 2, "B": 64, "D": 128, "F": 128}
    forward, backward = phase_memory(shardc.plan(shardc.parse(SPEC)), sizes, 4, XLA_CPU)
    plain = phase_memory(shardc.plan(shardc.parse(SPEC.replace("gemm f8\n", ""))), sizes, 4, XLA_CPU)[1]
    assert forward.temporaries == 65536
    assert backward.argument_copies - plain.argument_copies == 4 * (32 * 64 + 64 * 128 + 32 * 128 + 128 * 64)
    # XLA's backward heap: dW1's and dW2's partial products (kept to their combined AllReduce) and I's cast;
    # dO's cast and then dH_t1 sit in the buffer of dI's AllReduce output, dH_t1 not in dH's (heap.outside_outputs)
    assert backward.temporaries == 4 * (128 * 64 + 64 * 128 + 32 * 128) == 81920


def test_an_operand_the_module_and_the_reference_compute_across_an_e4m3_tie_straddles_it() -> None:
    """2.125 lies on the tie between E4M3's 2.0 and 2.25: the module's float32 2.125 rounds to even, 2.0, the
    reference's 2.1250003618 up, 2.25, a whole step apart (the f32 recheck then judges the rows after it with the
    GEMMs unrounded, shardc.verification.gemm_flips); a value off any tie, or an operand of no f8 GEMM, does not."""
    import numpy as np

    from shardc.verification.gemm_flips import downstream, straddles

    spec = shardc.parse(SPEC)
    ref = np.full((4, 8), 2.1250003618, dtype=np.float64)
    assert straddles(spec, {"H": np.full((4, 8), 2.125, np.float32)}, {"H": ref}) == {"H": 32}
    assert straddles(spec, {"H": np.full((4, 8), 2.1250002, np.float32)}, {"H": ref}) == {}
    assert straddles(spec, {"H": np.full((4, 8), 2.0, np.float32)}, {"H": ref}) == {}  # a wrong value is not near
    assert straddles(replace(spec, gemm=None), {"H": np.full((4, 8), 2.125, np.float32)}, {"H": ref}) == {}
    assert downstream(spec, {"H"}) == {"H", "O", "Loss"}


@pytest.mark.slow  # two tiny modules compiled
def test_the_unrounded_module_runs_its_gemms_on_their_operands_as_they_are() -> None:
    import numpy as np

    from shardc.verification.gemm_flips import unrounded

    low = lower(shardc.parse(SPEC), sizes={"B": 4, "D": 8, "F": 8})
    inputs = low.random_inputs()
    exact = np.maximum(np.asarray(inputs["I"]) @ np.asarray(inputs["W1"]), 0.0)
    plain = unrounded(low)
    assert plain.plan.spec.gemm is None and not plain.plan.spec.gemm_lines()
    assert np.allclose(np.asarray(plain.forward(inputs)["H"]), exact, rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(low.forward(inputs)["H"]), exact, rtol=1e-3, atol=1e-3)  # the module's rounds
