"""Property tests of the cost model over the book's examples at random sizes, and the CLI's JSON."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from fractions import Fraction
from functools import cache
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import shardc
from shardc.costmodel.formulas import evaluate
from shardc.hardware import get_hardware
from shardc.ir.plan import Plan
from tests.test_cli import shardc_cli

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NAMES = ["dp", "fsdp", "tp", "fsdp_tp", "dp_dcn"]


@cache
def plan_of(name: str) -> Plan:  # under the book's model: the plans whose formulas these properties read
    path = EXAMPLES / f"{name}.shard"
    return shardc.plan(shardc.parse(path.read_text(encoding="utf-8"), str(path)), model="book")


sizes = st.fixed_dictionaries({
    "B": st.integers(10, 22).map(lambda k: 2 ** k),
    "D": st.integers(9, 14).map(lambda k: 2 ** k),
    "F": st.integers(10, 16).map(lambda k: 2 ** k),
})


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(NAMES), sizes, st.sampled_from([2.0, 4.0]))
def test_more_bandwidth_divides_each_bandwidth_term(name: str, dims: dict[str, int], k: float) -> None:
    hw = get_hardware("tpu-v5p")
    base = shardc.cost(plan_of(name), hardware=hw, sizes=dims)
    fast = shardc.cost(plan_of(name), hardware=hw.scaled(bandwidth=k), sizes=dims)
    for a, b in zip(base.step.rows, fast.step.rows, strict=True):
        assert b.bandwidth_s == pytest.approx(a.bandwidth_s / k)
        assert b.compute_s == pytest.approx(a.compute_s)


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(NAMES), sizes, st.sampled_from(["B", "D", "F"]))
def test_times_are_monotone_in_bytes_and_flops(name: str, dims: dict[str, int], grow: str) -> None:
    small = shardc.cost(plan_of(name), sizes=dims)
    large = shardc.cost(plan_of(name), sizes=dims | {grow: dims[grow] * 2})
    for a, b in zip(small.step.rows, large.step.rows, strict=True):
        assert b.volume >= a.volume and b.flops >= a.flops
        assert b.bandwidth_s >= a.bandwidth_s and b.compute_s >= a.compute_s
    for phase in ("forward", "backward", "step"):
        p, q = getattr(small, phase), getattr(large, phase)
        assert q.comm_bytes >= p.comm_bytes and q.compute_s >= p.compute_s and q.comm_s >= p.comm_s


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(NAMES), sizes, st.sampled_from(["tpu-v5p", "tpu-v5e", "h100"]))
def test_formulas_evaluate_to_the_numbers(name: str, dims: dict[str, int], chip: str) -> None:
    # the formulas divide exactly (B/X); the numbers pad a dim its devices do not divide, as XLA does
    devices = math.prod(a.size for a in plan_of(name).spec.mesh.axes)
    assume(all(size % devices == 0 for size in dims.values()))
    report = shardc.cost(plan_of(name), hardware=chip, sizes=dims, model="book")  # the formulas are the book's
    hw = report.hardware
    values = {k: float(v) for k, v in report.sizes.items()} | {"C": hw.flops, "W_ici": hw.w_ici,
                                                               "W_dcn": hw.w_dcn}
    for phase in (report.forward, report.backward, report.step):
        f = phase.formula
        assert evaluate(f.comm_bytes, values) == pytest.approx(phase.comm_bytes)
        assert evaluate(f.flops, values) == pytest.approx(phase.compute_flops)
        assert evaluate(f.compute_s, values) == pytest.approx(phase.compute_s)
        assert evaluate(f.comm_s, values) == pytest.approx(phase.comm_bandwidth_s)


run = shardc_cli  # each command in-process: what it prints is the point, not a fresh interpreter


def test_cost_json_has_the_issue_fields() -> None:
    out = run("cost", str(EXAMPLES / "fsdp_tp.shard"), "--json", "--mfu", "0.4")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    for phase in ("forward", "backward", "step"):
        for key in ("comm_bytes", "comm_bytes_expr", "comm_s", "compute_flops", "compute_s", "step_s",
                    "bound", "critical_s", "ahead_s", "step_ahead_only_s", "mfu", "step_at_mfu_s"):
            assert key in data[phase], (phase, key)
        assert data[phase]["bound"] in ("compute", "communication")
    assert {"total_bytes", "fits"} <= set(data["memory"])
    assert data["thresholds"] and all(isinstance(t, str) for t in data["thresholds"])


def test_cost_hardware_file_set_and_layers(tmp_path: Path) -> None:
    chip, full = tmp_path / "chip.toml", tmp_path / "full.toml"
    for path, link in ((chip, "4.5e10"), (full, "9e10")):  # no torus: each axis one ring
        path.write_text(f'name = "{path.stem}-v5p"\nflops = 4.59e14\nici_bandwidth = {link}\nhbm_bytes = 96e9\n'
                        'dcn_bandwidth = 6.25e9\n', encoding="utf-8")
    base = json.loads(run("cost", str(EXAMPLES / "dp.shard"), "--json", "--hardware-file", str(full)).stdout)
    half = json.loads(run("cost", str(EXAMPLES / "dp.shard"), "--json", "--hardware-file", str(chip)).stdout)
    assert half["backward"]["comm_bandwidth_s"] == pytest.approx(2 * base["backward"]["comm_bandwidth_s"])
    forty = json.loads(run("cost", str(EXAMPLES / "dp.shard"), "--json", "--set", "L=40", "--hardware-file",
                           str(full)).stdout)
    assert forty["layers"] == 40
    assert forty["step"]["compute_s"] == pytest.approx(40 * base["step"]["compute_s"])


def test_cost_sweep_and_user_errors() -> None:
    out = run("cost", str(EXAMPLES / "dp.shard"), "--sweep", "B=1e3:1e7")
    assert out.returncode == 0, out.stderr
    assert "B" in out.stdout and "compute" in out.stdout.lower()
    bad = run("cost", str(EXAMPLES / "dp.shard"), "--hardware", "tpu-v99")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    listing = run("hardware")
    assert all(n in listing.stdout for n in ("tpu-v4p", "tpu-v5e", "tpu-v5p", "tpu-v6e", "h100", "h200"))


def test_sweep_plot_compares_strategies(tmp_path: Path) -> None:
    """--plot draws compute and communication per step for each file, as the book's figures do."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    out = run("cost", str(EXAMPLES / "fsdp.shard"), "--with", str(EXAMPLES / "dp.shard"),
              "--sweep", "B=1e3:1e7", "--points", "5", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _gather_rows(dims: str) -> list:  # type: ignore[type-arg]
    from dataclasses import replace

    spec = shardc.parse(f"mesh X=4, Y=4\ndims {dims}\nOut[B, D] = In[B_XY, D]\n")
    report = shardc.cost(shardc.plan(spec, hardware=replace(get_hardware("tpu-v5p"), book=True)))
    return [r for r in report.forward.rows if r.is_collective]


def test_a_two_axis_collective_gets_twice_the_bandwidth_and_small_ones_pay_latency() -> None:
    hw = get_hardware("tpu-v5p")  # under the book's assumptions: each axis one wrapped ring
    (big,) = _gather_rows("B=1048576, D=8192")
    assert big.axes == ("X", "Y") or big.axes == ("Y", "X")
    assert big.bandwidth_s == pytest.approx(big.volume / (2 * hw.w_ici))  # n_axes = 2
    assert big.comm_s == big.bandwidth_s  # large: bandwidth-bound
    (small,) = _gather_rows("B=16, D=8")
    assert small.latency_s == pytest.approx(4 * hw.hop_latency)  # ceil(4/2) hops on each ring
    assert small.comm_s == small.latency_s > small.bandwidth_s


# the data sheets: (bf16 FLOPs/s, ICI one-way per link, HBM bytes, DCN/InfiniBand per chip or None)
DESIGN_PRESETS = {
    "tpu-v3": (1.23e14, 1e11, 32 * 2**30, None),
    "tpu-v4p": (2.75e14, 4.5e10, 32e9, None), "tpu-v5e": (1.97e14, 4.5e10, 16e9, 3.125e9),
    "tpu-v5p": (4.59e14, 9e10, 96e9, 6.25e9), "tpu-v6e": (9.2e14, 9e10, 32e9, 1.25e10),
    "h100": (9.89e14, 4.5e11, 80e9, 5e10), "h200": (9.89e14, 4.5e11, 141e9, 5e10),
    "a100": (3.12e14, 3e11, 80e9, 2.5e10), "h800": (9.89e14, 2e11, 80e9, 5e10), "b200": (2.25e15, 9e11, 180e9, 5e10),
}


@pytest.mark.parametrize("name", sorted(DESIGN_PRESETS))
def test_presets_have_the_data_sheet_figures(name: str) -> None:
    from shardc.hardware import get_hardware

    hw = get_hardware(name)
    flops, link, hbm, dcn = DESIGN_PRESETS[name]
    assert (hw.flops, hw.ici_bandwidth, hw.hbm_bytes) == (flops, link, hbm)
    assert dcn is None or hw.dcn_bandwidth == dcn
    assert (hw.ici_domain == 8) == (not name.startswith("tpu"))  # 8 GPUs a node over NVLink
    if name == "tpu-v5p":
        assert round(hw.intensity_ici) == 2550


def test_the_spec_hardware_line_picks_the_chip() -> None:
    text = "mesh X=8\ndims B=4096, D=1024, F=512\nhardware h100\nOut[B_X, F] = In[B_X, D] · W[D, F]\n"
    p = shardc.plan(shardc.parse(text))
    assert shardc.cost(p).hardware.name == "h100"
    assert shardc.cost(p, hardware="tpu-v5e").hardware.name == "tpu-v5e"  # an explicit chip wins
    assert shardc.cost(shardc.plan(shardc.parse(text.replace("hardware h100\n", "")))).hardware.name == "tpu-v5p"


# The formulas are symengine expressions; printing (formulas.text) and cancelling (thresholds.cancelled) are
# the two thin adapters around it, checked here against numbers.

NAMES_POLY = ("B", "D", "F", "X", "Y")
POINT = {"B": 3, "D": 5, "F": 7, "X": 11, "Y": 13}  # distinct primes: unequal formulas differ here


@st.composite
def polys(draw: st.DrawFn, max_terms: int = 3) -> object:
    from fractions import Fraction

    from shardc.costmodel.formulas import ZERO, number, symbol

    total = ZERO
    for _ in range(draw(st.integers(1, max_terms))):
        coeff = draw(st.fractions(min_value=-8, max_value=8, max_denominator=4).filter(lambda c: c != 0))
        term = number(Fraction(coeff))
        for name in NAMES_POLY:
            if draw(st.booleans()):
                term *= symbol(name) ** draw(st.integers(-2, 2))
        total += term
    return total


def at_point(text: str) -> Fraction:
    """A printed formula's exact value at POINT, read back by Python's own parser (no CAS)."""
    exact = re.sub(r"\d+", lambda m: f"Q({m.group()})", text)  # integer literals as Fractions: 1/2 stays exact
    values = {"Q": Fraction, **{n: Fraction(v) for n, v in POINT.items()}}
    return Fraction(eval(exact, {"__builtins__": {}}, values))  # the text is a formula we printed


@settings(max_examples=30, deadline=None)
@given(polys(), polys())
def test_printed_formulas_read_back_as_the_same_numbers(a: object, b: object) -> None:
    from shardc.costmodel.formulas import evaluate, text

    for result in (a + b, a * b):  # type: ignore[operator]
        printed = text(result)
        assert "**(-" not in printed and "(1/" not in printed, printed  # the book's fractions, not symengine's
        assert at_point(printed) == at_point(str(result)), (a, b, printed)
        assert evaluate(result, POINT) == pytest.approx(float(at_point(printed)))


@settings(max_examples=30, deadline=None)
@given(polys(), polys())
def test_cancelled_is_the_same_function_in_lowest_terms(a: object, b: object) -> None:
    import math

    import symengine as se

    from shardc.costmodel.formulas import text
    from shardc.costmodel.thresholds import cancelled

    if b == 0:
        return
    reduced = cancelled(a / b)  # type: ignore[operator]
    assert at_point(text(reduced)) == at_point(str(a)) / at_point(str(b)), text(reduced)
    num, den = (se.expand(s) for s in reduced.as_numer_denom())
    for side in (num, den):  # polynomials: no negative power left
        terms = side.args if side.is_Add else (side,)
        assert all(p > 0 for t in terms for k, p in t.as_powers_dict().items() if not k.is_Number), side
    if num != 0:  # no common symbol of every term left on both sides, no common integer factor
        common = [set.intersection(*({k for k in t.as_powers_dict() if not k.is_Number}
                                     for t in (s.args if s.is_Add else (s,)))) for s in (num, den)]
        assert not common[0] & common[1], text(reduced)
        ints = [int(t if t.is_Number else next(iter(t.as_coefficients_dict().values())))
                for s in (num, den) for t in (s.args if s.is_Add else (s,))]
        assert math.gcd(*ints) == 1, text(reduced)


def test_formulas_print_as_the_book_writes() -> None:
    from shardc.costmodel.formulas import number, symbol, text
    from shardc.costmodel.thresholds import cancelled

    b, d, f, x, y = (symbol(n) for n in NAMES_POLY)
    assert text(4 * b * d / x + 2 * d * f / y) == "4*B*D/X + 2*D*F/Y"
    assert text(f - 2550 * y) == "F - 2550*Y"
    assert text(2 * d * f + number(Fraction(5, 2)) * d * y) == "2*D*F + 5*D*Y/2"
    assert text(1 / x) == "1/X" and text(symbol("C") / (3 * symbol("W_ici"))) == "C/(3*W_ici)"
    assert text(cancelled(2 * b * d * f / (x * y) / (2 * d * f / y + 4 * b * d / x))) == "B*F/(2*B*Y + F*X)"
    assert text(cancelled(-2550 * f / (2550 * y - f))) == "2550*F/(F - 2550*Y)"  # the denominator's sign fixed
    assert text(cancelled(b * (d + f) / (2 * x * (d + f)))) == "B/(2*X)"  # equal sums cancel
    three_halves = cancelled(3 * b * f / (2 * b * y + 2 * f * x))
    assert at_point(text(three_halves)) == Fraction(3 * 3 * 7, 2 * (3 * 13 + 7 * 11))


def test_threshold_of_a_phase_without_flops() -> None:
    # issue 9 item 2: a phase that only moves data is communication-bound at any size (no AttributeError)
    from shardc.costmodel.formulas import ZERO, PhaseFormula, number, symbol
    from shardc.costmodel.thresholds import derive

    moves = PhaseFormula(ZERO, ZERO, 4 * symbol("B"), 4 * symbol("B"), ZERO)
    [threshold] = derive("forward", moves, get_hardware("tpu-v5p"), frozenset({"X"}), {"B": ()}, {"B": 8})
    assert threshold.holds is False and "communication-bound at any size" in threshold.sentence
    constant = PhaseFormula(number(2), number(2), number(4), number(4), ZERO)
    [threshold] = derive("step", constant, get_hardware("tpu-v5p"), frozenset({"X"}), {}, None)
    assert "0.5 FLOPs a byte at any size" in threshold.sentence and threshold.holds is None


def test_plan_imports_no_computer_algebra_and_cost_only_symengine() -> None:
    # plan: no CAS at all; cost: symengine (imported on first use), never sympy (slow to import) nor jax
    code = ("import sys, shardc; p = shardc.plan(shardc.parse(open(sys.argv[1]).read())); "
            "seen = lambda: [m in sys.modules for m in ('symengine', 'sympy', 'jax')]; print(*seen()); "
            "shardc.cost(p).render(); print(*seen())")
    out = subprocess.run([sys.executable, "-c", code, str(EXAMPLES / "fsdp_tp.shard")], capture_output=True,
                         text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["False False False", "True False False"], out.stdout


def test_solved_threshold_below_a_negative_bound_always_holds() -> None:
    # a held-out run (StarCoder's forward) printed "T > <negative> (never: ...)" for a phase that is compute-bound
    # at every T: above a bound <= 0 the condition always holds; a negative slope turns the side to "<"
    from shardc.costmodel.formulas import ZERO, PhaseFormula, symbol
    from shardc.costmodel.thresholds import derive

    b, f = symbol("B"), symbol("F")
    hw = get_hardware("tpu-v5p")  # C/W_ici = 2550 there
    rising = PhaseFormula(b * f, b * f, f + b, f + b, ZERO)  # B*F/(B + F) > 2550 iff B > 2550*F/(F - 2550)
    steady = PhaseFormula(3000 * b + f * f, b, f + b, f + b, ZERO)  # iff 450*B > 2550*F - F^2, at F > 2550 always
    [always] = derive("forward", steady, hw, frozenset({"X"}), {"B": ()}, {"B": 8, "F": 10**4})
    assert ", i.e. B > " in always.sentence and "(always: the bound is not positive)" in always.sentence
    [above] = derive("forward", rising, hw, frozenset({"X"}), {"B": ()}, {"B": 8, "F": 10**5})
    assert ", i.e. B > " in above.sentence and "never" not in above.sentence and "always" not in above.sentence
    falling = PhaseFormula(f * f, f * f, f + b, f + b, ZERO)  # F^2/(B + F) > 2550 iff B < F^2/2550 - F
    [below] = derive("forward", falling, hw, frozenset({"X"}), {"B": ()}, {"B": 8, "F": 10**5})
    assert ", i.e. B < " in below.sentence
    [never] = derive("forward", falling, hw, frozenset({"X"}), {"B": ()}, {"B": 8, "F": 100})
    assert ", i.e. B < " in never.sentence and "(never: the bound is not positive)" in never.sentence
