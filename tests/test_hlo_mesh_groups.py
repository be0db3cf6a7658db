"""Replica groups read from compiled programs match the devices their collectives really combine.

Each program is a ``jax.jit`` reshard on the 8 emulated CPU devices (conftest) whose compiled HLO spells
its groups by mesh axes.  The mesh puts the devices in a shuffled order, so a mesh position (what HLO's
device ids name: the executable's device assignment) is not the device's own id.  Every input block
holds 2**position; a device's result then says which positions its collective combined, and in which order.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from shardc.verification.hlo import collectives, parse_replica_groups

pytestmark = pytest.mark.slow

SHUFFLED = [5, 2, 7, 0, 3, 6, 1, 4]


def _run(shape: tuple[int, ...], names: tuple[str, ...], inspec: tuple[Any, ...], outspec: tuple[Any, ...],
         reduce: bool) -> tuple[str, dict[int, list[float]]]:
    """The compiled text, and each mesh position's result."""
    import jax
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices())[SHUFFLED].reshape(shape), names, axis_types=(AxisType.Auto,) * len(shape))
    position = {d.id: p for p, d in enumerate(mesh.devices.flat)}
    sharding = NamedSharding(mesh, P(*inspec))
    dims = tuple(int(np.prod([mesh.shape[n] for n in ((s,) if isinstance(s, str) else s)])) for s in inspec)
    values = np.zeros(dims, np.float32)  # one element per device
    for device, index in sharding.devices_indices_map(dims).items():
        values[index] = 2.0 ** position[device.id]
    f = jax.jit((lambda x: x.sum(1, keepdims=True)) if reduce else (lambda x: x * 1),
                out_shardings=NamedSharding(mesh, P(*outspec)))
    x = jax.device_put(values, sharding)
    text = f.lower(x).compile().as_text()
    held = {position[s.device.id]: np.asarray(s.data).ravel().tolist() for s in f(x).addressable_shards}
    return text, held


CASES = {  # mesh, input and output specs, reduce (else gather), the form XLA prints, the axes
    "gather over a of 4x2": ((4, 2), ("a", "b"), ("a", "b"), (None, "b"), False, "mesh[", ("a",)),
    "gather over (c, a) of 2x1x4": ((2, 1, 4), ("a", "b", "c"), (("c", "a"), "b"), (None, "b"), False,
                                    "device_ids=(", ("c", "a")),
    "sum over (a, c) of 2x2x2": ((2, 2, 2), ("a", "b", "c"), ("b", ("a", "c")), ("b", None), True,
                                 "device_ids=(", ("a", "c")),
}


@pytest.mark.parametrize("case", CASES)
def test_mesh_spelled_groups_are_the_devices_each_collective_combines(case: str) -> None:
    shape, names, inspec, outspec, reduce, form, axes = CASES[case]
    text, held = _run(shape, names, inspec, outspec, reduce)
    (line,) = [ln for ln in text.splitlines() if "replica_groups=" in ln]
    assert "replica_groups=mesh[" in line and form in line, line
    groups = parse_replica_groups(line, 8)
    assert sorted(p for g in groups for p in g) == list(range(8))
    for group in groups:
        gathered = [2.0 ** p for p in group]
        for p in group:  # a sum says who took part; a gather says who, and in what order
            assert held[p] == ([sum(gathered)] if reduce else gathered), (p, group)
    (found,) = collectives(text, tuple(zip(names, shape, strict=True)))
    assert found.axes == axes
