"""The row statistics of each reduction over an index (see :mod:`shardc.planner.rows`).

Kept apart, importing only the local operations, so the graph builder can name them.
"""

from __future__ import annotations

from shardc.ir.localops import Row

__all__ = ["STATS", "BACKWARD_STATS", "VJP", "APPLY", "stat_names"]

# Per function, the statistics the forward all-reduces when I is sharded (name suffix, combiner).
STATS: dict[str, tuple[tuple[str, str], ...]] = {
    "softmax": (("max", "max"), ("sum", "sum")),
    "logsumexp": (("max", "max"), ("sum", "sum")),
    "rmsnorm": (("ms", "sum"),),
    "layernorm": (("mean", "sum"), ("var", "sum")),  # two passes: mean, then mean((x - mean)**2)
    "max": (("max", "max"),),
    "sum": (),
    "mean": (),
}
# Per function, how many row sums its backward all-reduces when I is sharded.
# (A norm makes its statistics again from its input first: rmsnorm 1 + 1, layernorm 2 + 2.)
BACKWARD_STATS = {"softmax": 1, "rmsnorm": 2, "layernorm": 4, "logsumexp": 0, "max": 0, "sum": 0, "mean": 0}
# Per function, the local map of its gradient in closed form (softmax's when its index is whole).
VJP = {"softmax": Row.SOFTMAX_VJP, "logsumexp": Row.LOGSUMEXP_VJP, "max": Row.MAX_VJP, "sum": Row.SUM_VJP,
       "mean": Row.MEAN_VJP, "rmsnorm": Row.RMSNORM_VJP, "layernorm": Row.LAYERNORM_VJP}
# Per norm, the local map that finishes it from its input and its statistics.
APPLY = {"rmsnorm": Row.RMSNORM_APPLY, "layernorm": Row.LAYERNORM_APPLY}


def stat_names(func: str, result: str) -> tuple[str, ...]:
    """The names the forward statistics of ``func`` take (before making them unique); ``max`` is its own."""
    return () if func == "max" else tuple(f"{result}_{suffix}" for suffix, _ in STATS[func])
