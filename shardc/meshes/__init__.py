"""The layout search: which mesh axis sizes, for this model, on these chips (``shardc layouts``).

:func:`search_layouts` enumerates the sizes of a spec's mesh axes whose product is the
chip count (:mod:`shardc.meshes.factor`), plans and costs each (:mod:`shardc.meshes.rank`,
with ``shardc plan`` and ``shardc cost``'s own passes) and ranks them.  No jax.
"""

from __future__ import annotations

from shardc.meshes.factor import MAX_CHIPS, candidates, factorisations
from shardc.meshes.rank import RULE, Layout, Options, Skipped
from shardc.meshes.search import LayoutSearch, search_layouts

__all__ = ["MAX_CHIPS", "RULE", "Layout", "LayoutSearch", "Options", "Skipped", "candidates", "factorisations",
           "search_layouts"]
