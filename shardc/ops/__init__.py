"""Op families, one module each, registered in :mod:`shardc.ops.registry`.

Adding an op: write one module here that builds a :class:`~shardc.ops.registry.Family`
(its spec functions, its typed local operations, how its forward and backward are
planned, the bytes of what it makes, its JAX emitter and its numpy reference) and
calls :func:`~shardc.ops.registry.register`; import it below; add its tests.  Its
planning rules are written against the layout algebra of :mod:`shardc.sharding` (values, moves,
reshards, a phase), never against the planner, which looks the families up.  Its
functions' signatures are declared in :mod:`shardc.spec.functions`, which parsing reads
without importing anything of planning.
"""

from shardc.ops import (
    affine,
    attention,
    dispatch,
    elementwise,
    masks,
    products,
    reductions,
    rotary,
    route,
    sums,
    vocabulary,
)

__all__ = ["affine", "attention", "dispatch", "elementwise", "masks", "products", "reductions", "rotary", "route",
           "sums", "vocabulary"]
