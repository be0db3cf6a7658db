"""``shardc explain``: a user's jitted jax program read as a spec, its collectives beside shardc's plan.

Unlike parse, plan and cost, this front end imports jax at module level: it reads jax's own programs.
"""
