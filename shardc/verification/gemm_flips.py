"""The f32 recheck of a spec whose GEMMs read their operands rounded to f8 (`gemm f8`).

The recheck (:func:`shardc.verification.verify.differential_rows`) bounds a value's error by the
unsharded program's: a right plan only reorders sums.  Under a `gemm f8` line that premise breaks
at one place: an operand the module and the float64 reference compute a few float32 last places
apart (a context-parallel attention merges its blocks in another order) can lie on either side of
an E4M3 rounding tie, so the two read it a whole E4M3 step apart (2**-3 of it), and every value
after it differs by that step's share, which no reordering bound admits.  Such a straddle is a fact
of the two programs' values, not of the plan, so where the module's forward operands straddle a
tie the rows that failed are judged again with every GEMM reading its operands unrounded, in the
module and the reference alike; a module that skipped its rounding straddles nothing (its operands
are the reference's, up to the reordering) and still fails.  Only the forward's operands are looked
at: a backward GEMM's operands (the cotangents) are not values the module returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from shardc.ir.spec import Add, Call, Contract, DType, Expr, Spec
from shardc.lowering.load import load_module
from shardc.lowering.reference import gemm_rounded
from shardc.spec.walk import leaves

if TYPE_CHECKING:
    from shardc.lowering.api import Lowered

__all__ = ["NEAR", "straddles", "downstream", "unrounded"]

# float32 last places within which the module's operand and the reference's are the same value computed in
# two orders (the recheck's own allowance for rounding, power.differential's 64)
NEAR = 64


def straddles(spec: Spec, got: dict[str, Any], ref: dict[str, np.ndarray]) -> dict[str, int]:
    """The forward's f8 GEMM operands (values the module returns) with elements the module computes within
    ``NEAR`` float32 last places of the reference's and yet rounds to another value of the GEMM's type (the two
    straddle a rounding tie), and how many: a wrong value, far from the reference's, straddles nothing."""
    found: dict[str, int] = {}
    for name in sorted(_operands(spec)):
        if name in got and name in ref:
            ours, theirs = np.asarray(got[name], np.float32), np.asarray(ref[name]).astype(np.float32)
            near = np.abs(ours.astype(np.float64) - theirs) <= NEAR * np.finfo(np.float32).eps * np.abs(theirs)
            count = int(np.count_nonzero(near & (gemm_rounded(ours, "float8_e4m3fn")
                                                  != gemm_rounded(theirs, "float8_e4m3fn"))))
            if count:
                found[name] = count
    return found


def downstream(spec: Spec, names: set[str]) -> set[str]:
    """The forward values computed from ``names`` (they among them), in statement order: the rows a straddle
    can move."""
    reached = set(names)
    for statement in spec.statements:
        if any(ref.name in reached for ref in leaves(statement.expr)):
            reached.add(statement.result.name)
    return reached


def _operands(spec: Spec) -> set[str]:
    """The tensors an f8 GEMM reads: the operands of each contraction that sums an index (a GEMM, not an
    elementwise product) in a statement a `gemm f8` line rounds, as the reference rounds them."""
    names: set[str] = set()
    for statement in spec.statements:
        if spec.gemm_of(statement.result.name) is DType.F8:
            kept = {d.name for d in statement.result.dims}
            for contract in _contracts(statement.expr):
                refs = [ref for operand in contract.operands for ref in leaves(operand)]
                if len(refs) > 1 and {d.name for ref in refs for d in ref.dims} - kept:
                    names |= {ref.name for ref in refs}
    return names


def _contracts(expr: Expr) -> Iterator[Contract]:
    if isinstance(expr, Contract):
        yield expr
    children = expr.args if isinstance(expr, Call) else expr.terms if isinstance(expr, Add) else (
        expr.operands if isinstance(expr, Contract) else ())
    for child in children:
        yield from _contracts(child)


def unrounded(lowered: Lowered) -> Lowered:
    """``lowered`` with its GEMMs reading their operands as they are: its module run again from its source
    with ``gemm_input`` the identity, and a spec without `gemm` lines for the reference's statements."""
    namespace = load_module(lowered.source, "unrounded")
    namespace.__dict__["gemm_input"] = lambda x, kind: x  # the module's GEMMs call it by name at trace time
    spec = replace(lowered.plan.spec, gemm=None, gemm_tensors=())
    return replace(lowered, plan=replace(lowered.plan, spec=spec), namespace=namespace, _compiled={})
