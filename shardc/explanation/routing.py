"""A mixture-of-experts layer's top-k routing, written with one-hot masks, read as the language's ``route``.

GShard (Lepikhin et al. 2020) and Switch (Fedus et al. 2021) route a token to the k largest of its
gates along the experts, and give it the next free slot (of C) of each expert it picked; their
layers, and flax ones written after them, hold the routing as a 0/1 mask ``[G, S, E, C]`` built from
``jax.lax.top_k`` (or ``argmax``), ``jax.nn.one_hot`` and a cumulative count along the tokens, then
contract it with the tokens (the dispatch) and, times the gates, with the experts' outputs (the
combine).  That mask is the language's ``route(Gate[G, S, E], S, C, k over E)`` (``route_by_choice``
where every token's first choice takes its slot before any second one, as flaxformer's top-2 and
GShard's second expert count them) and the gates times it ``Gate * Disp``, as
``examples/moe_layer.shard`` writes them; the contractions are einsums.

The routing's equations are found before the walk: the top-k and what is computed from its results,
the gates and constants alone (its *region*).  The many ways to write the slot count (an exclusive
``cumsum``, flaxformer's ``cumsum(mask) * mask - 1`` and a max over the k choices) are not matched
equation by equation: each value of the region shaped as a mask is run on gates with no ties and
compared with the language's meanings (:func:`shardc.ops.route_code.route_forward`).  What the rest
of the program computes from those that match (a loss of the combine weights) is given back to the
walk; any other value of the region it reads is an error naming the top-k, not a wrong spec.
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex

from shardc.explanation.dim_classes import unwritable
from shardc.explanation.sources import shape_text, source_line
from shardc.ops.route_code import route_forward

__all__ = ["Region", "regions", "Match", "match", "read_routing", "run", "draw", "experts_and_k", "arrays",
           "constants_of"]

_LIMIT = 1 << 24  # the most mask elements the region is evaluated at to check its meaning
_FUNCTIONS = ("route", "route_by_choice")  # the language's routings by one-hot mask, the plainer first


@dataclass
class Region:
    """A top-k's routing in the walked equations ``program``: the equations evaluated to check it
    (``eqns``, in order: those reading the routing, ``members``, with the gates' views, ``views``, and
    the constants they read), those the walk leaves out (``skipped``, by id), and the values of the
    routing the rest of the program reads (``results``, each with an equation reading it)."""

    seed: Any
    gates: Any
    program: list[Any]
    outvars: list[Any]
    eqns: list[Any]
    members: set[int]
    views: set[int]
    moved: set[int] = field(default_factory=set)  # the index-based dispatches' and combines' equations
    pinned: set[Any] = field(default_factory=set)  # the routing's values they read
    skipped: set[int] = field(default_factory=set)
    results: list[Any] = field(default_factory=list)
    readers: dict[Any, Any] = field(default_factory=dict)

    def settle(self) -> None:
        """The equations the walk leaves out (the routing's, the moves', the views only they read) and
        the routing's values the others read."""
        uses: dict[Any, list[Any]] = {}
        for eqn in self.program:
            for v in arrays(eqn):
                uses.setdefault(v, []).append(eqn)
        out = {v for v in self.outvars if not isinstance(v, jex.Literal)}
        self.skipped = self.members | self.moved
        for eqn in reversed(self.eqns):
            if id(eqn) in self.views and not any(v in out or any(id(e) not in self.skipped for e in uses.get(v, []))
                                                 for v in eqn.outvars):
                self.skipped.add(id(eqn))
        made = [v for e in self.eqns if id(e) in self.members for v in e.outvars]
        self.readers = {v: next((e for e in uses.get(v, []) if id(e) not in self.skipped), None) for v in made}
        self.results = [v for v in made if self.readers[v] is not None or v in out]


def _is_seed(eqn: Any) -> bool:
    name = eqn.primitive.name
    return name in ("top_k", "argmax") or (name in ("pjit", "jit") and eqn.params.get("name") in ("argmax", "top_k"))


def arrays(eqn: Any) -> list[Any]:
    return [v for v in eqn.invars if not isinstance(v, jex.Literal)]


def constants_of(eqns: list[Any]) -> set[Any]:
    """The values ``eqns`` make of literals alone (positions, a broadcast scalar)."""
    constants: set[Any] = set()
    for eqn in eqns:
        if all(v in constants for v in arrays(eqn)):
            constants.update(eqn.outvars)
    return constants


def regions(eqns: list[Any], outvars: list[Any]) -> dict[int, Region]:
    """Each top-k's (or argmax's) region among ``eqns``, by the seed equation's id."""
    constants = constants_of(eqns)
    found: dict[int, Region] = {}
    taken: set[int] = set()
    for seed in eqns:
        if _is_seed(seed) and id(seed) not in taken:
            region = _grow(seed, eqns, constants, outvars)
            taken |= region.skipped
            found[id(seed)] = region
    return found


def _grow(seed: Any, eqns: list[Any], constants: set[Any], outvars: list[Any]) -> Region:
    """The seed and what follows it reading its values, the gates' views and constants alone; the views
    and constants those read are evaluated with them."""
    gates = seed.invars[0]
    routed, viewed = set(seed.outvars), {gates}
    members, views = {id(seed)}, set()
    for eqn in eqns[next(k for k, e in enumerate(eqns) if e is seed) + 1:]:
        ins = arrays(eqn)
        if any(v in routed for v in ins) and all(v in routed or v in viewed or v in constants for v in ins):
            members.add(id(eqn))
            routed.update(eqn.outvars)
        elif any(v in viewed for v in ins) and all(v in viewed or v in constants for v in ins):
            views.add(id(eqn))
            viewed.update(eqn.outvars)
    made = {v: e for e in eqns for v in e.outvars}
    wanted = set(members)
    stack = [v for e in eqns if id(e) in members for v in arrays(e)]
    while stack:  # the views and constants the routing reads, and theirs
        eqn = made.get(stack.pop())
        if eqn is not None and id(eqn) not in wanted and (id(eqn) in views or eqn.outvars[0] in constants):
            wanted.add(id(eqn))
            stack += arrays(eqn)
    inside = [e for e in eqns if id(e) in wanted]
    region = Region(seed, gates, eqns, list(outvars), inside, members, views & wanted)
    region.settle()
    return region


def _cut(region: Region, matched: set[Any]) -> None:
    """Give the walk back what the program computes from the routing's masks (a loss of the combine
    weights, ...): the equations making a read value that is no mask, back to the masks they read."""
    made = {v: e for e in region.eqns for v in e.outvars}
    freed: set[int] = set()
    stack = [v for v in region.results if v not in matched]
    while stack:
        v = stack.pop()
        eqn = made.get(v)
        if eqn is None or id(eqn) not in region.members or id(eqn) in freed or v in matched or v in region.pinned:
            continue
        freed.add(id(eqn))
        stack += arrays(eqn)
    if id(region.seed) in freed:
        return  # the top-k's own results are read beyond the masks: the results say which
    region.members -= freed
    region.settle()


@dataclass(frozen=True)
class Match:
    """How each result of a region is the language's routing: ``order`` and ``experts`` the gates'
    token and expert axes, ``k`` the choices, ``capacity`` C; each result's kind ("mask" or
    "weights", the gates times the mask) and the axes of it in the gates' order, then C's."""

    order: int
    experts: int
    k: int
    capacity: int
    kinds: tuple[tuple[Any, str, tuple[int, ...]], ...]
    fn: str = "route"


def experts_and_k(seed: Any) -> tuple[int, int]:
    eqn = seed
    if eqn.primitive.name in ("pjit", "jit"):
        inner = eqn.params["jaxpr"].jaxpr
        eqn = next(e for e in inner.eqns if e.primitive.name in ("top_k", "argmax"))
    ndim = len(eqn.invars[0].aval.shape)
    if eqn.primitive.name == "argmax":
        return int(eqn.params["axes"][0]), 1
    return int(eqn.params.get("axis", ndim - 1)), int(eqn.params["k"])


def run(eqns: list[Any], invars: list[Any], outvars: list[Any], inputs: list[np.ndarray]) -> list[np.ndarray]:
    """The values ``outvars`` of the equations ``eqns`` where ``invars`` are ``inputs`` (run eagerly on the host)."""
    with warnings.catch_warnings():  # a jaxpr made of a program's equations has no debug info of its own
        warnings.simplefilter("ignore", DeprecationWarning)
        jaxpr = jex.Jaxpr([], invars, outvars, eqns)
    try:
        with jax.default_device(jax.devices("cpu")[0]):
            values = jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr, []))(*inputs)
    except (KeyError, TypeError, ValueError) as err:  # it reads a value it does not make (not its own part)
        raise unwritable("the routing reads values of the program other than its gates, so explain cannot run it "
                         f"on its own to check its meaning ({type(err).__name__}: {err})",
                         fix="write the layer's routing with `route`, `dispatch` and `combine` in a .shard "
                             "spec") from None
    return [np.asarray(v, dtype=np.float64) for v in values]


def draw(var: Any, seed: int) -> np.ndarray:
    """Values for ``var`` with no two equal: a random order of 1..n, scaled below 1 (gates with no ties)."""
    shape = tuple(var.aval.shape)
    n = math.prod(shape)
    values = (np.random.default_rng(seed).permutation(n) + 1) / (n + 1)
    return values.reshape(shape).astype(var.aval.dtype)


def match(region: Region) -> Match:
    """The region's meaning as the language's routing, or an error saying how it is not: each value of
    it shaped as a mask is run on gates with no ties, and those that are the mask (or the gates times
    it) are what the rest of the program may read."""
    shape = tuple(region.gates.aval.shape)
    experts, k = experts_and_k(region.seed)
    masks = [v for e in region.eqns if id(e) in region.members for v in e.outvars
             if len(v.aval.shape) == len(shape) + 1 and math.prod(v.aval.shape) <= _LIMIT]
    draws = [draw(region.gates, s) for s in (0, 1)]
    values = [run(region.eqns, [region.gates], masks, [g]) for g in draws] if masks else []
    kinds = {v: _kind(v, [vs[j] for vs in values], draws, experts, k) for j, v in enumerate(masks)}
    matched = {v: kind for v, kind in kinds.items() if kind is not None}
    _cut(region, set(matched))
    if not region.results and not region.moved:
        raise unwritable("the top-k's result is read by nothing the spec language writes")
    for result in region.results:
        if result not in matched:
            raise unwritable(_not_a_mask(region, result, _why(result, shape)))
    found = [(v, matched[v][0], matched[v][1]) for v in region.results]
    orders = {matched[v][2:] for v in region.results}
    if len(orders) > 1:
        raise unwritable("the routing's masks count their slots along different dims or capacities")
    order, capacity, fn = orders.pop() if orders else (-1, 0, "route")
    return Match(order, experts, k, capacity, tuple(found), fn)


def _why(result: Any, shape: tuple[int, ...]) -> str:
    if len(result.aval.shape) != len(shape) + 1:
        return "it is not a mask of the gates' dims and a capacity"
    if math.prod(result.aval.shape) > _LIMIT:
        return (f"a routing mask of more than {_LIMIT} elements, more than explain runs to check that it is the "
                "language's `route` (explain the program at smaller sizes: fewer tokens a group)")
    return ("it is neither the 0/1 mask of the language's `route` (each token to the next free slot of each of "
            "its k experts, tokens in order) or `route_by_choice` (the slots taken choice by choice: every "
            "token's first choice before any second one) nor the gates times it")


def _not_a_mask(region: Region, result: Any, why: str) -> str:
    reader = region.readers.get(result)
    at = f" by `{reader.primitive.name}`" + (f" at {source_line(reader)}" if source_line(reader) else "") \
        if reader is not None else " as the program's result"
    return (f"the routing's value {shape_text(result)} read{at}: {why}; a top-k or an argmax is read as an "
            "MoE router's one-hot routing (GShard, Switch) alone, and any other top-k or argsort makes positions "
            "along a dim, which the language has no tensor for (write such a program's routing with `route`, "
            "`dispatch` and `combine` in a .shard spec)")


def _kind(result: Any, values: list[np.ndarray], draws: list[np.ndarray], experts: int,
          k: int) -> tuple[str, tuple[int, ...], int, int, str] | None:
    """("mask" or "weights", the result's axes in the gates' order then C's, the order axis, C, the
    language's function: ``route``, or ``route_by_choice`` where the slots are taken choice by choice)
    where every draw's value is that routing of its gates, else None."""
    shape = tuple(draws[0].shape)
    rank = len(shape)
    known: dict[tuple[int, int, str], list[np.ndarray]] = {}  # each routing's masks, made once
    for axes, fn in itertools.product(itertools.permutations(range(rank + 1)), _FUNCTIONS[:1 + (k > 1)]):
        if tuple(result.aval.shape[a] for a in axes[:rank]) != shape:
            continue
        capacity = int(result.aval.shape[axes[rank]])
        moved = [np.transpose(v, axes) for v in values]
        for order in (o for o in range(rank) if o != experts):
            if (order, capacity, fn) not in known:
                known[order, capacity, fn] = [route_forward(g.astype(np.float64), order, experts, capacity, k, np,
                                                            by_choice=fn == "route_by_choice") for g in draws]
            masks = known[order, capacity, fn]
            if all(np.array_equal(v, m) for v, m in zip(moved, masks, strict=True)):
                return "mask", axes, order, capacity, fn
            weighted = [m * g.astype(np.float64)[..., None] for m, g in zip(masks, draws, strict=True)]
            if all(np.allclose(v, w, rtol=1e-6, atol=0) for v, w in zip(moved, weighted, strict=True)):
                return "weights", axes, order, capacity, fn
    return None


class _Mask:
    """The routing mask where the program holds only the gates times it: a tensor of the spec of its own."""


def read_routing(reader: Any, region: Region, line: str) -> None:
    """The region's results as the language writes them: ``Disp = route(Gate, S, C, k over E)``, and
    ``Comb = Gate * Disp`` for the gates times the mask."""
    found = match(region)
    if not found.kinds:  # index-based routing alone: its dispatches and combines say it
        return
    gates = reader.tensor(region.gates)
    ids = reader.dims_of(region.gates)
    for d, letter in ((ids[found.order], "S"), (ids[found.experts], "E")):
        reader.hints.setdefault(d, letter)
    made_by = {v: e for e in region.eqns for v in e.outvars}
    mask: Any = None
    mask_slots = -1
    for result, kind, axes in sorted(found.kinds, key=lambda item: item[1] != "mask"):
        dims, at = reader.dims_of(result), source_line(made_by[result]) or line
        for k, a in enumerate(axes[:-1]):
            reader.join(ids[k], dims[a])
        slots = dims[axes[-1]]
        if mask is not None:
            reader.join(mask_slots, slots)
        reader.hints.setdefault(slots, "C")
        if kind == "weights" and mask is not None:
            reader.make(result, "mul", (gates, mask), line=at)
            continue
        made = result if kind == "mask" else _Mask()
        if made is not result:
            reader.dims[made] = [*ids, slots]
        reader.make(made, "route", (gates,), fn=found.fn, over=ids[found.experts], names=(ids[found.order], slots),
                    number=found.k, line=line if made is not result else at)
        mask, mask_slots = made, slots
        if made is not result:
            reader.make(result, "mul", (gates, mask), line=at)
