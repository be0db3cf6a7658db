"""verify compiles whole programs, never op by op.

Run op by op, jax compiles each distinct operation apart: the unsharded program a loose row is
checked against (the reference's statements in jax.numpy) and the slicing of a pipeline's results
(a microbatch, a stage, a layer's slot) once cost 20 to 100 small compilations a verify, most of its
time.  The unsharded program is now traced and compiled as one program, once a dropout key, and a
pipeline's results are read in host memory.
The counts are the conftest's (compilations and compilation-cache hits): the programs verify asks for.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import shardc
from shardc.verification.verify import Report, render_report, verify

pytestmark = pytest.mark.slow  # every test verifies a spec

ROOT = Path(__file__).resolve().parent.parent
# the norms in bf16: their backward bounds are loose, so every row is checked again in float32
NORMS = """mesh X=2, Y=2
dims B=8, D=16
dtype bf16
N[B_Y, D_X] = rmsnorm(X[B_Y, D_X] over D)
Out[B_Y, D_X] = softmax(N[B_Y, D_X] over D)
L[B_Y, D_X] = layernorm(Z[B_Y, D_X] over D) * G[D_X]
"""


def _verified(text: str, compiles: Callable[[], int]) -> tuple[Report, int]:
    """verify's report of ``text`` and the XLA compilations it made (``compiles``: the conftest's count)."""
    before = compiles()
    report = verify(shardc.parse(text))
    return report, compiles() - before


def test_a_pipelines_verify_compiles_its_programs_not_its_operations(xla_compiles: Callable[[], int]) -> None:
    report, compiles = _verified((ROOT / "examples" / "pipeline_llama.shard").read_text(encoding="utf-8"),
                                 xla_compiles)
    assert report.ok, render_report(report)
    assert compiles <= 8  # 4 in a fresh process; 75 with the unsharded program and the slicing op by op


def test_a_float32_recheck_compiles_the_unsharded_program_once(xla_compiles: Callable[[], int]) -> None:
    report, compiles = _verified(NORMS, xla_compiles)
    assert report.ok, render_report(report)
    assert any(r.phase.endswith(" f32") for r in report.values)  # the recheck ran
    assert compiles <= 12  # 8 in a fresh process; 23 when the unsharded program ran op by op
