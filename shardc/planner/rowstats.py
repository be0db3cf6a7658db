"""The row statistics of each reduction over an index (see :mod:`shardc.planner.rows`).

Kept apart, without imports, so the graph builder can name them.
"""

from __future__ import annotations

__all__ = ["STATS", "BACKWARD_STATS", "ROW_FNS", "VOCAB_FNS", "stat_names"]

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
# The local maps the steps use: forward, finishing maps and gradients.
ROW_FNS = frozenset({
    "softmax", "logsumexp", "row_max", "row_dot", "row_sumexp", "row_sum", "row_mean", "row_meansq", "row_meandev",
    "row_meandot",
    "softmax_apply", "lse_apply", "rmsnorm_apply", "layernorm_apply",
    "softmax_vjp", "softmax_vjp_apply", "logsumexp_vjp", "max_vjp", "sum_vjp", "mean_vjp",
    "rmsnorm_vjp", "layernorm_vjp"})


def stat_names(func: str, result: str) -> tuple[str, ...]:
    """The names the forward statistics of ``func`` take (before making them unique); ``max`` is its own."""
    return () if func == "max" else tuple(f"{result}_{suffix}" for suffix, _ in STATS[func])

# The local maps of the vocabulary ops (shardc.planner.vocab).
VOCAB_FNS = frozenset({"embed", "embed_vjp", "vocab_pick", "ce_apply", "ce_vjp"})
