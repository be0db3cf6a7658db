"""Where a mesh lies on the chips' links: the slice or cluster (its topology) and each mesh axis's part of it.

A TPU topology is one slice, ``AxBxC`` (v4p, v5p) or ``AxB`` (v5e, v6e); a GPU topology is the
whole cluster, ``NODESxGPUS`` (``48x8``).  Mesh axes are laid on it as JAX lays them:

* On a torus, as ``mesh_utils.create_device_mesh`` (which ``jax.make_mesh`` calls) assigns
  logical axes to physical ones: the last mesh axis first (the most network-intensive), each to
  the largest set of whole physical axes whose product is its size, in index order
  (``_create_device_mesh_for_nd_torus``).  When no set of whole axes fits, JAX splits physical
  axes (``allow_split_physical_axes``); here a mesh axis then takes, in the same order, whole
  remaining axes first and then the part of one it still needs, and the cost notes say so.
* On GPUs, as the devices are numbered: node by node, and the mesh reshaped from them in mesh
  order, so the last mesh axes run inside a node and an axis wider than what is left of a node
  spans nodes too (its ``inner`` GPUs a node, over ``outer`` nodes).  Axes marked ``over dcn``
  cross nodes whole.

Wraparound ("How To Scale Your Model", part 2, TPU networking): a v4p/v5p slice has wraparound
links on every axis only when it is built of full 4x4x4 cubes (the optical switches that close
the rings come with a cube: a 4x4x4 or 4x4x8 has them, a 2x2x4 has none), so here when the slice
has 64 chips or more and the axis is a multiple of 4; a v5e/v6e slice wraps an axis of the full 16
chips only (an 8x16 wraps its longer axis), a v3 slice one of the full 32 (its pod's side; no v3
figure).  A physical axis with wraparound is a ring; without, or a part of one split between mesh
axes that does not reach round it, an open line, which
"typically doubles the time of most throughput-bound comms" (the same chapter): 2(n-1)/n times a
ring's.  A part whose chips lie ``stride`` apart (the major part of a split axis) shares each link
with the other groups: ``stride`` times the time (:attr:`Ring.links`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from shardc.errors import ShardcError, Span
from shardc.hardware import Hardware
from shardc.ir.spec import Mesh, Network

__all__ = ["Shape", "Ring", "AxisLinks", "default_topology", "check_topology", "axis_links", "book_links",
           "resolve_links", "shape_text", "wraps", "CUBE"]

Shape = tuple[int, ...]
CUBE = 4  # the side of the v4p/v5p cube whose optical switches close the rings
_CUBE_CHIPS = CUBE ** 3


@dataclass(frozen=True)
class Ring:
    """One physical axis (or the part of one) a mesh axis covers: its chips, and whether it wraps."""

    chips: float  # whole on a slice; the book's spans give n ** (1/k)
    wrapped: bool = True
    split: bool = False  # a part of a physical axis another mesh axis shares
    axis: int = -1  # the physical axis (0 first in the topology's shape); -1: the book's spans
    stride: int = 1  # chips between neighbours: the part of the axis later mesh axes hold inside

    @property
    def links(self) -> Fraction:
        """What its links count for against a ring: 1, or n / (2(n-1)) for an open line of n chips,
        over the stride.

        A ring's AllGather takes V / W (W both directions of a link); along a line the end chip
        takes in (n-1)/n of V through its one link, one way: 2(n-1)/n times as long, the book's
        "typically doubles" (its 4-chip v5e axis: 560 us against 377 us, 1.5x; 2 chips: 1x).  A part
        whose neighbours are ``stride`` chips apart crosses that many links a hop, and each link
        carries a hop of each of the ``stride`` interleaved groups: ``stride`` times the time.
        """
        if self.chips <= 1:
            return Fraction(0)
        if self.wrapped:
            return Fraction(1, self.stride)
        n = Fraction(self.chips).limit_denominator(1 << 20)
        return n / (2 * (n - 1)) / self.stride

    @property
    def hops(self) -> int:
        """Hops from end to end: ceil(n/2) around a ring, n-1 along a line."""
        chips = round(self.chips, 9)
        if chips <= 1:
            return 0
        return math.ceil(chips / 2) if self.wrapped else math.ceil(chips) - 1


@dataclass(frozen=True)
class AxisLinks:
    """How one mesh axis lies on the links: its rings on a torus, or its part of a GPU node.

    ``gpu``: a GPU's links (its ICI figure is its whole NVLink egress).  ``nodes``: a GPU
    cluster's layout, ``inner`` GPUs of a node over ``outer`` nodes; without it (the book's
    assumptions, or a GPU chip with no topology) the axis is one ring.  ``speed``: the chip's
    W_ici / W_dcn, which says which phase of a collective that spans nodes is the slower.
    ``nvls``: the chip's NVLink SHARP rate over W_ici (:attr:`Hardware.w_nvls`), 0 without it.
    ``torus``: laid on a slice (not the book's spans), so an AllToAll over several physical axes
    takes the torus formula (:mod:`shardc.collectives`).
    """

    rings: tuple[Ring, ...] = ()
    gpu: bool = False
    nodes: bool = False
    inner: int = 1
    outer: int = 1
    speed: float = 1.0
    torus: bool = False
    nvls: float = 0.0

    @property
    def links(self) -> Fraction:
        """Physical axes' worth of links (the book's M_X), open lines at less (:attr:`Ring.links`)."""
        return sum((r.links for r in self.rings), Fraction(0)) or Fraction(1)

    @property
    def split(self) -> bool:
        return any(r.split for r in self.rings)


def shape_text(shape: Shape) -> str:
    return "x".join(str(n) for n in shape)


def default_topology(hw: Hardware, chips: int) -> Shape | None:
    """The chip's usual slice for ``chips`` (the cluster on GPUs); None where the chip has no topology.

    TPU slices are as near a cube (a square) as the count allows, each side a factor of it: 64 v5p
    chips are 4x4x4, 16 are 2x2x4, 128 are 4x4x8 (Cloud TPU's slice shapes); v5e/v6e: 8x16 for 128.
    GPUs: full nodes of ``ici_domain``.
    """
    if hw.book or chips < 1:
        return None
    if hw.ici_domain is not None:
        node = min(chips, hw.ici_domain)
        return (chips // node, node) if chips % node == 0 else None
    if hw.torus_side is None:
        return None
    sides = [1] * max(1, hw.torus_dims)
    for prime in sorted(_primes(chips), reverse=True):
        sides[sides.index(min(sides))] *= prime
    ones = [s for s in sides if s == 1]
    return tuple(sorted(s for s in sides if s > 1)) + tuple(ones)


def _primes(n: int) -> list[int]:
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out + ([n] if n > 1 else [])


def check_topology(shape: Shape, mesh: Mesh, sizes: Mapping[str, int], hw: Hardware,
                   span: Span | None = None, flag: bool = False) -> None:
    """A topology fits the chip and the mesh: a slice of the chip's torus of the ICI axes' chips, or
    a cluster of full nodes of every chip.  ``flag``: given over the spec's line (``--topology``), which the
    error names, having no line to point at."""
    what = f"{'--' if flag else ''}topology {shape_text(shape)}"
    ici = math.prod(sizes.get(a.name, a.size) for a in mesh.axes if a.network is not Network.DCN)
    every = math.prod(sizes.get(a.name, a.size) for a in mesh.axes)
    if hw.ici_domain is not None:
        if len(shape) != 2 or shape[1] > hw.ici_domain or shape[1] != hw.ici_domain and shape[0] != 1:
            raise ShardcError(f"{what}: a cluster of {hw.name} is NODESx{hw.ici_domain} (GPUs a node)", span,
                              fix=f"write e.g. `topology {max(1, every // hw.ici_domain)}x{hw.ici_domain}`")
        if math.prod(shape) != every:
            raise ShardcError(f"{what} has {math.prod(shape)} GPUs, the mesh {every}", span,
                              fix=f"give the cluster of the mesh's {every} GPUs")
        return
    if hw.torus_side is None:
        raise ShardcError(f"{what}: the chip {hw.name} has no torus or nodes to lay the mesh on", span,
                          fix="give torus_side and torus_dims (or ici_domain) in the hardware file, or drop it")
    if not 1 <= len(shape) <= hw.torus_dims:
        raise ShardcError(f"{what}: a {hw.name} slice has at most {hw.torus_dims} axes", span,
                          fix="write e.g. `topology 4x4x4`" if hw.torus_dims == 3 else "write e.g. `topology 16x16`")
    if math.prod(shape) != ici:
        raise ShardcError(f"{what} has {math.prod(shape)} chips, the mesh's ICI axes {ici} "
                          "(a slice holds the ICI axes; `over dcn` axes join slices)", span,
                          fix=f"give a slice of {ici} chips, e.g. "
                              f"`topology {shape_text(default_topology(hw, ici) or (ici,))}`")


def wraps(hw: Hardware, shape: Shape, side: int) -> bool:
    """Whether a physical axis of ``side`` chips of this slice has its wraparound link (see the module)."""
    if hw.torus_dims >= 3:
        return math.prod(shape) >= _CUBE_CHIPS and side % CUBE == 0
    return side == hw.torus_side


def _torus_assignment(shape: Shape, wanted: Sequence[int]) -> list[list[tuple[int, int]]] | None:
    """Per mesh axis, its (physical axis, chips) as ``mesh_utils`` assigns whole axes; None: one needs a split."""
    free = list(shape)
    out: list[list[tuple[int, int]]] = [[] for _ in wanted]
    for k in reversed(range(len(wanted))):
        if wanted[k] == 1:
            continue
        found = next((c for n in range(len(free), 0, -1) for c in itertools.combinations(range(len(free)), n)
                      if math.prod(free[i] for i in c) == wanted[k]), None)
        if found is None:
            return None
        out[k] = [(i, free[i]) for i in found]
        for i in found:
            free[i] = 0
    return out


def _split_assignment(shape: Shape, wanted: Sequence[int]) -> list[list[tuple[int, int]]]:
    """``mesh_utils._create_device_mesh_for_nd_torus_splitting_axes``: last mesh axis first, each takes
    the assignment of its prime factors to physical axes that JAX prefers: the largest product of
    whole physical axes, then the most whole axes, then the most on axes already taken, then the
    largest in reverse lexicographic order."""
    taken = [1] * len(shape)
    out: list[list[tuple[int, int]]] = [[] for _ in wanted]
    for k in reversed(range(len(wanted))):
        options = list(_assignments(shape, taken, wanted[k]))
        if not options:
            raise ShardcError(f"the mesh's axes {list(wanted)} do not lay on the slice {shape_text(shape)}",
                              fix="give mesh axes whose sizes divide the slice's axes")
        best = max(options, key=lambda z: (
            math.prod(n for i, n in enumerate(z) if n == shape[i]),
            sum(1 for i, n in enumerate(z) if n == shape[i] and n > 1),
            math.prod(n for i, n in enumerate(z) if taken[i] > 1), z))
        out[k] = [(i, n) for i, n in enumerate(best) if n > 1]
        taken = [t * n for t, n in zip(taken, best, strict=True)]
    return out


def _assignments(shape: Shape, taken: Sequence[int], size: int) -> set[tuple[int, ...]]:
    """Every spread of ``size``'s prime factors over the physical axes' room left (JAX's enumeration)."""
    factors: dict[int, int] = {}
    for p in _primes(size):
        factors[p] = factors.get(p, 0) + 1
    room = [n // t for n, t in zip(shape, taken, strict=True)]
    per_factor = []
    for p, count in factors.items():
        slots = [i for i, n in enumerate(room) for q in _primes(n) if q == p]
        per_factor.append([(p, c) for c in set(itertools.combinations(slots, count))])
    found = set()
    for choice in itertools.product(*per_factor):
        z = [1] * len(shape)
        for p, axes in choice:
            for i in axes:
                z[i] *= p
        found.add(tuple(z))
    return found


def axis_links(mesh: Mesh, sizes: Mapping[str, int], hw: Hardware, shape: Shape) -> dict[str, AxisLinks]:
    """Each mesh axis's :class:`AxisLinks` on the topology ``shape`` (checked: :func:`check_topology`)."""
    ici = [a for a in mesh.axes if a.network is not Network.DCN]
    wanted = [sizes.get(a.name, a.size) for a in ici]
    speed = hw.w_ici / hw.w_dcn
    if hw.ici_domain is not None:
        node, out = shape[1], {}
        stride = 1
        nvls = (hw.w_nvls or 0.0) / hw.w_ici
        for axis, size in reversed(list(zip(ici, wanted, strict=True))):
            inner = math.gcd(size, node // math.gcd(stride, node)) if stride < node else 1
            out[axis.name] = AxisLinks(gpu=True, nodes=True, inner=inner, outer=size // inner, speed=speed,
                                       nvls=nvls)
            stride *= size
        for axis in mesh.axes:
            if axis.network is Network.DCN:
                out[axis.name] = AxisLinks(gpu=True, nodes=True, outer=sizes.get(axis.name, axis.size), speed=speed)
        return out
    parts = _torus_assignment(shape, wanted) or _split_assignment(shape, wanted)
    return {axis.name: AxisLinks(_rings(hw, shape, parts, k), speed=speed, torus=True) for k, axis in enumerate(ici)}


def _rings(hw: Hardware, shape: Shape, parts: list[list[tuple[int, int]]], k: int) -> tuple[Ring, ...]:
    """Mesh axis ``k``'s rings.  Inside a split physical axis the later mesh axes hold the minor
    (contiguous) part, as ``mesh_utils`` lays the more network-intensive axes; a part wraps when it
    reaches across the whole axis (its chips times its stride) and the axis wraps."""
    out = []
    for i, chips in parts[k]:
        stride = math.prod(n for later in parts[k + 1:] for j, n in later if j == i)
        whole = chips * stride == shape[i]
        out.append(Ring(chips, whole and wraps(hw, shape, shape[i]), chips != shape[i], i, stride))
    return tuple(out)


def book_links(mesh: Mesh, sizes: Mapping[str, int], hw: Hardware,
               spans: Mapping[str, int] | None = None) -> dict[str, AxisLinks]:
    """The book's assumptions: each ICI axis k wrapped rings of n ** (1/k) chips, k = ``spans`` or
    :meth:`Hardware.spans` (ceil(log16 n))."""
    out = {}
    for axis in mesh.axes:
        if axis.network is Network.DCN:
            continue
        n = sizes.get(axis.name, axis.size)
        k = (spans or {}).get(axis.name, hw.spans(n))
        out[axis.name] = AxisLinks(tuple(Ring(n ** (1.0 / k)) for _ in range(k)) if n > 1 else (),
                                   gpu=hw.ici_domain is not None, speed=hw.w_ici / hw.w_dcn)
    return out


def resolve_links(mesh: Mesh, sizes: Mapping[str, int], hw: Hardware, topology: Shape | None = None,
                  spans: Mapping[str, int] | None = None) -> tuple[dict[str, AxisLinks], tuple[str, ...]]:
    """Every mesh axis's links on this chip, and what the cost notes say of them.

    The topology given (the spec's ``topology`` line, ``--topology``), else the chip's usual one
    for the device count (:func:`default_topology`); ``spans`` (``--spans``) override an axis with
    that many wrapped rings.  The book's assumptions (``Hardware.book``) take no usual topology: each
    axis spans ceil(log16 n) torus axes, as :meth:`Hardware.spans` says.  A TPU slice given under them
    sets each axis's M_X by the physical axes it lies on, as the book's chapter-5 example counts X = 16
    on a 4x4x4 slice as M_X = 2.
    """
    if hw.book and (topology is None or hw.ici_domain is not None):
        return book_links(mesh, sizes, hw, spans), ()
    notes: list[str] = []
    ici = math.prod(sizes.get(a.name, a.size) for a in mesh.axes if a.network is not Network.DCN)
    every = math.prod(sizes.get(a.name, a.size) for a in mesh.axes)
    chips = every if hw.ici_domain is not None else ici
    shape = topology
    if shape is not None:
        try:
            check_topology(shape, mesh, sizes, hw)
        except ShardcError as err:
            notes.append(f"{err.message.splitlines()[0]}: costed on the usual one instead")
            shape = None
    if shape is None:
        shape = default_topology(hw, chips)
        if shape is not None:
            what = "cluster" if hw.ici_domain is not None else "slice"
            notes.append(f"topology {shape_text(shape)}: {hw.name}'s usual {what} of {chips} chips "
                         "(`topology` line or --topology to give another)")
    found = book_links(mesh, sizes, hw) if shape is None else axis_links(mesh, sizes, hw, shape)
    for axis, k in (spans or {}).items():  # --spans: the book's k wrapped rings, over the layout
        if axis in found:
            found[axis] = book_links(mesh, sizes, hw, {axis: k})[axis]
    if shape is not None:
        notes += _layout_notes(mesh, sizes, found, shape, spans or {})
    return found, tuple(notes)


def _layout_notes(mesh: Mesh, sizes: Mapping[str, int], found: Mapping[str, AxisLinks], shape: Shape,
                  spans: Mapping[str, int]) -> list[str]:
    out = []
    for axis in mesh.axes:
        n = sizes.get(axis.name, axis.size)
        links = found.get(axis.name)
        if links is None or n == 1:
            continue
        if axis.name in spans:
            out.append(f"mesh axis {axis.name} ({n} chips): --spans {axis.name}={spans[axis.name]}, that many "
                       "wrapped rings (the book's M), over its place on the topology")
            continue
        if links.nodes:
            where = (f"{links.inner} GPU(s) of a node over {links.outer} node(s): NVLink and InfiniBand, "
                     "pipelined" if links.inner > 1 and links.outer > 1 else
                     "inside a node (NVLink)" if links.outer == 1 else f"across {links.outer} nodes (InfiniBand)")
            out.append(f"mesh axis {axis.name} ({n} GPUs) on {shape_text(shape)}: {where}")
            continue
        parts = ", ".join(f"physical axis {r.axis}: {r.chips:g} chips, " +
                          ("part of it, split with another mesh axis" + (f", {r.stride} chips apart" if r.stride > 1
                                                                         else "") +
                           (", wrapped" if r.wrapped else ", an open line") if r.split else
                           "wrapped" if r.wrapped else "an open line (no wraparound)")
                          for r in links.rings if r.chips > 1)
        out.append(f"mesh axis {axis.name} ({n} chips) on {shape_text(shape)}: {parts}; "
                   f"{float(links.links):.3g}x one axis's bandwidth")
    return out
