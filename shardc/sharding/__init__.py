"""The layout algebra every op family plans with: values and their moves, what they cost, the searches
over them (a reshard, a sharded einsum), and a phase that collects the steps chosen."""
