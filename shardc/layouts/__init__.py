"""The layout search: which mesh axis sizes, for this model, on these chips (``shardc layouts``).

:func:`search_layouts` enumerates the sizes of a spec's mesh axes whose product is the
chip count (:mod:`shardc.layouts.factor`), plans and costs each (:mod:`shardc.layouts.rank`,
with ``shardc plan`` and ``shardc cost``'s own passes) and ranks them.  No jax.
"""

from __future__ import annotations

from shardc.layouts.factor import MAX_CHIPS, candidates, factorisations
from shardc.layouts.layout_search import LayoutSearch, search_layouts
from shardc.layouts.rank import RULE, Layout, Options, Skipped

__all__ = ["MAX_CHIPS", "RULE", "Layout", "LayoutSearch", "Options", "Skipped", "candidates", "factorisations",
           "search_layouts"]
