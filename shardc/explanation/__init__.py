"""``shardc explain`` (:func:`shardc.explain`): a user's jitted jax program read as a spec, its collectives
beside shardc's plan.  Named apart from the function, as ``lowering`` is from ``lower``: a package named
``explain`` would be bound as ``shardc.explain`` once imported, hiding the function.

Unlike parse, plan and cost, this front end imports jax at module level: it reads jax's own programs.
"""
