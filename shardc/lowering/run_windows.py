"""Sliding windows at the sizes a plan runs at: verify shrinks the sequence, so it shrinks the window with it.

A window is a count of keys (``causal(Sc, S, T, window 4096)``), not a dim: left at 4096 while verify runs T at
a few positions it would mask nothing beyond the causal mask, and the run would not test it.  So, where the
spec declares the key index's size N and the run's is n (:func:`run_window`):

- W < N (the window masks keys in the spec): W * n / N, its share of the keys kept (exact where that is a
  whole number of keys, rounded to the nearest otherwise), kept within 1 .. n - 1 so that it still masks a key;
- W >= N (it spans every key: the causal mask alone, as the planner plans it): unchanged, >= n, still none;
- N not declared: unchanged (no share to keep).

At the spec's own sizes (n = N) every window is as written.  Verify lowers and runs the reference with the same
run windows (:func:`windows_at`), and its report says which it ran (:func:`window_notes`); a module given to
verify keeps the windows it was lowered with (they are in its code), and the report says which went untested.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from shardc.ir.localops import Attention, Causal, CausalVjp
from shardc.ir.plan import Plan, Step
from shardc.ir.spec import Add, Call, Contract, Expr, Spec
from shardc.spec.walk import calls

__all__ = ["run_window", "windows_at", "window_notes"]


def run_window(window: int, key: str, declared: dict[str, int], sizes: dict[str, int]) -> int:
    """The window of ``key``'s keys at the run's sizes (the rule in the module's docstring).

    >>> run_window(4096, "T", {"T": 8192}, {"T": 16}), run_window(4096, "T", {"T": 8192}, {"T": 8192})
    (8, 4096)
    >>> run_window(1, "T", {"T": 8192}, {"T": 16}), run_window(8191, "T", {"T": 8192}, {"T": 16})
    (1, 15)
    >>> run_window(8192, "T", {"T": 8192}, {"T": 16}), run_window(5, "T", {}, {"T": 16})
    (8192, 5)
    """
    spec_keys, run_keys = declared.get(key), sizes.get(key)
    if spec_keys is None or run_keys is None or window >= spec_keys or run_keys == spec_keys:
        return window
    return max(1, min(run_keys - 1, round(window * run_keys / spec_keys)))


def _key(fn: Any) -> str | None:
    """The key index of a windowed call or step (None: it has no window)."""
    if isinstance(fn, Call) and fn.window is not None:
        return fn.over if fn.over is not None else fn.names[1]  # attention(... over T), causal(Sc, S, T)
    if isinstance(fn, Causal | CausalVjp | Attention) and fn.window is not None:
        return fn.key
    return None


Windows = dict[tuple[int, str], int]  # (a window as written, its key index) -> the window as run


def _at(fn: Any, at: Windows) -> int | None:
    """The run window of a windowed call or step (None: it has none)."""
    key = _key(fn)
    return None if key is None else at.get((fn.window, key), fn.window)


def _expr(expr: Expr, at: Windows) -> Expr:
    """The expression with each call's window at the run's sizes."""
    if isinstance(expr, Call):
        args = tuple(_expr(a, at) for a in expr.args)
        return replace(expr, arg=args[0], more=args[1:], window=_at(expr, at))
    if isinstance(expr, Contract):
        return replace(expr, operands=tuple(_expr(o, at) for o in expr.operands))
    if isinstance(expr, Add):
        return replace(expr, terms=tuple(_expr(t, at) for t in expr.terms))
    return expr


def _step(step: Step, at: Windows) -> Step:
    fn = step.fn
    if isinstance(fn, Causal | CausalVjp | Attention) and fn.window is not None:
        return replace(step, fn=replace(fn, window=_at(fn, at)))
    return step


def _steps(steps: tuple[Step, ...], at: Windows) -> tuple[Step, ...]:
    return tuple(_step(s, at) for s in steps)


def _windows(spec: Spec, sizes: dict[str, int]) -> Windows:
    """Each window the spec writes, with its key index -> its run window, where the two differ."""
    found = {(c.window, key): run_window(c.window, key, spec.sizes, sizes) for s in spec.statements
             for c in calls(s.expr) if c.window is not None and (key := _key(c)) is not None}
    return {k: v for k, v in found.items() if v != k[0]}


def windows_at(plan: Plan, sizes: dict[str, int]) -> Plan:
    """The plan with every sliding window, in the spec's calls (the reference's) and the steps (the lowered
    module's), at the run's ``sizes``; the plan itself where none changes."""
    at = _windows(plan.spec, sizes)
    if not at:
        return plan
    spec = replace(plan.spec, statements=tuple(replace(s, expr=_expr(s.expr, at)) for s in plan.spec.statements))
    return replace(plan, spec=spec, forward=_steps(plan.forward, at), backward=_steps(plan.backward, at),
                   optimizer=_steps(plan.optimizer, at), recomputed=_steps(plan.recomputed, at))


def window_notes(plan: Plan, sizes: dict[str, int], given: bool = False) -> list[str]:
    """What verify says of the windows it shrank: each as written and as run; ``given``: a given module runs,
    its windows in its code as it was lowered, so none shrinks and each that then masks nothing says so."""
    at = _windows(plan.spec, sizes)
    if given:
        return [f"window {w} over {key} is the given module's, as lowered: at the run's {sizes[key]} keys it masks "
                "nothing beyond the causal mask, so the window is not tested" for (w, key) in sorted(at)
                if w >= sizes[key]]
    return [f"window {w} over {key} run as window {v} of its {sizes[key]} keys (the window's share of the keys, "
            "as the sequence shrank)" for (w, key), v in sorted(at.items())]
