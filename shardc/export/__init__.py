"""``shardc export``: a plan's shardings in the forms other tools read.

:mod:`shardc.export.jax_export` writes a readable JAX module (a mesh, the ``PartitionSpec`` of every
declared tensor and gradient, and the ``out_sharding`` of each einsum explicit sharding mode would not
infer); :mod:`shardc.export.logical` writes MaxText's ``custom_mesh_and_rule`` YAML and flax's
``logical_axis_rules``.  Neither imports jax: the text is made from the plan alone.
"""
