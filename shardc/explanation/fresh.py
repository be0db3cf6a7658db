"""A jaxpr walked a second time, given variables of its own; a tensor of the spec with none (:class:`Made`); the calls
read as their body (:data:`CALLS`).

jax traces a jitted function once per shapes and reuses the jaxpr: ``inner(inner(x, w1), w2)`` holds
one inner jaxpr in both calls.  The reader keys its dims, names and statements by variable, so the
second walk would read the first call's dims (its weight's as the second's); a copy with new
variables (the same equations, avals, params and source lines) is read as a call of its own.
"""

from __future__ import annotations

from typing import Any

from jax.extend import core as jex

__all__ = ["CALLS", "Made", "Walked"]

# calls read as their body; remat2 is jax.checkpoint's (it changes what the backward keeps, not the forward)
CALLS = {"pjit", "jit", "closed_call", "core_call", "remat", "remat2", "checkpoint", "custom_jvp_call",
         "custom_vjp_call", "custom_vjp_call_jaxpr"}


class Made:
    """A tensor of the spec with no jaxpr variable of its own: a renamed copy of one the program reads
    twice along one dim, a reduction's partial result over the first of several dims, a layer's carry, a
    training loss's scale where jax dropped the forward's (:mod:`shardc.explanation.training`)."""


class Walked:
    """The jaxprs read so far; :meth:`once` gives each later one a copy with new variables."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.kept: list[Any] = []  # the jaxprs seen, alive, so no id is reused

    def once(self, jaxpr: Any) -> Any:
        if id(jaxpr) not in self.seen:
            self.seen.add(id(jaxpr))
            self.kept.append(jaxpr)
            return jaxpr
        new: dict[Any, Any] = {}

        def var(v: Any) -> Any:
            if isinstance(v, jex.Literal):
                return v
            if v not in new:
                new[v] = jex.Var(v.aval)
            return new[v]

        eqns = [e.replace(invars=[var(v) for v in e.invars], outvars=[var(v) for v in e.outvars])
                for e in jaxpr.eqns]
        return jaxpr.replace(constvars=[var(v) for v in jaxpr.constvars], invars=[var(v) for v in jaxpr.invars],
                             outvars=[var(v) for v in jaxpr.outvars], eqns=eqns)
