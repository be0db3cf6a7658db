"""Reading collectives out of compiled HLO text."""

from __future__ import annotations

import pytest

from shardc.ir.plan import Op
from shardc.verification.hlo import collectives, group_axes, parse_replica_groups

MESH = (("X", 2), ("Y", 2), ("Z", 2))


def test_listed_and_iota_replica_groups() -> None:
    assert parse_replica_groups("replica_groups={{0,1},{2,3}}, x", 4) == [[0, 1], [2, 3]]
    assert parse_replica_groups("replica_groups=[2,4]<=[8], x", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)", 8)[0] == [0, 4]


# Lines as jax 0.10's XLA prints them for jax.jit programs with NamedShardings on 8 CPU devices: the
# mesh is XLA's own (axes named axis_0.., size-1 axes kept or dropped), its positions map to the
# executable's device ids through device_ids, and a group is the devices differing only in the listed axes.
MESH_LINES = {
    "mesh['axis_0'=4,'axis_1'=2] {'axis_1'}": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "mesh['axis_0'=4,'axis_1'=2] {'axis_0'}": [[0, 2, 4, 6], [1, 3, 5, 7]],
    # ids [[0,2,4,6],[1,3,5,7]] over a (2,1,4) mesh: axis_2 steps by 2, axis_0 by 1
    "mesh['axis_0'=2,'axis_1'=1,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_2'}": [[0, 2, 4, 6], [1, 3, 5, 7]],
    "mesh['axis_0'=2,'axis_1'=1,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_0'}": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "mesh['axis_0'=2,'axis_1'=1,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_1'}": [[d] for d in
                                                                                  (0, 2, 4, 6, 1, 3, 5, 7)],
    # positions (a, c, b) of a 2x2x2 spec mesh (a, b, c): axis_1 is (a, c), so b stays fixed in a group
    "mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_1'}": [[0, 1, 4, 5], [2, 3, 6, 7]],
    "mesh['axis_0'=8,'axis_1'=1], device_ids=([2,4]T(1,0)) {'axis_0'}": [[0, 4, 1, 5, 2, 6, 3, 7]],
    "mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}": [list(range(8))],
    "mesh['axis_0'=2,'axis_1'=4] {'axis_1','axis_0'}": [[0, 4, 1, 5, 2, 6, 3, 7]],
    "mesh['x'=8] {}": [[d] for d in range(8)],
    # sub-axes 'x':(pre)size: x read as [pre, size, rest], the group over the middle part
    "mesh['x'=8] {'x':(2)4}": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "mesh['x'=8] {'x':(1)2}": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "mesh['x'=8] {'x':(4)2,'x':(1)2}": [[0, 4, 1, 5], [2, 6, 3, 7]],
    "mesh['x'=4,'y'=2], device_ids=(3,1,0,2,7,5,4,6) {'x':(2)2,'y'}": [[3, 1, 0, 2], [7, 5, 4, 6]],
    # the spelling of XLA's earlier printer (openxla/xla replica_group_test.cc)
    "@mesh<ooo=10>(devices=[10]8,3,7,5,4,2,6,0,1,9) {ooo:(5)2}": [[8, 3], [7, 5], [4, 2], [6, 0], [1, 9]],
    "@mesh<u=2,v=2>(devices=[2,2]<=[2,2]T(1,0)) {u}": [[0, 1], [2, 3]],
}


@pytest.mark.parametrize("groups", MESH_LINES)
def test_mesh_axes_replica_groups(groups: str) -> None:
    line = f"  %ar = f32[8]{{0}} all-reduce(%p), channel_id=1, replica_groups={groups}, use_global_device_ids=true"
    assert parse_replica_groups(line, 10 if "ooo" in line else 8) == MESH_LINES[groups]


@pytest.mark.parametrize("groups", [
    "mesh['x'=8] {'y'}",  # an axis the mesh lacks
    "mesh['x'=8] {'x':(3)2}",  # a sub-axis that does not tile x
    "mesh['x'=8] {'x','x'}",
    "mesh['x'=8] {'x','x':(1)2}",  # the whole of x and a part of it
    "mesh['x'=4], device_ids=(0,1,1,2) {'x'}",  # not a permutation
    "mesh['x'=4], device_ids=(what) {'x'}",
])
def test_mesh_axes_groups_that_cannot_be_read_are_an_error_not_every_device(groups: str) -> None:
    with pytest.raises(ValueError):
        parse_replica_groups(f"all-reduce(%p), replica_groups={groups}, to_apply=%add", 8)


def test_a_collective_over_one_axis_of_a_mesh_spelled_by_axes_is_over_that_axis() -> None:
    mesh = (("data", 4), ("model", 2))
    text = "\n".join([
        "  %ag = f32[2,8]{0,1} all-gather(%p), channel_id=1, "
        "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}, dimensions={1}",
        "  %ar = f32[1,8,16]{2,1,0} all-reduce(%f), channel_id=8, replica_groups=mesh['axis_0'=2,'axis_1'=1,"
        "'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_0'}, use_global_device_ids=true, to_apply=%add",
        "  %rs = f32[1,8]{1,0} reduce-scatter(%g), channel_id=9, "
        "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}, to_apply=%add"])
    found = collectives(text, mesh)
    assert [(c.kind, c.axes, c.elements) for c in found] == [
        (Op.ALL_GATHER, ("model",), 16), (Op.ALL_REDUCE, ("model",), 128), (Op.REDUCE_SCATTER, ("data",), 32)]


def test_axes_come_out_major_to_minor_along_the_group() -> None:
    assert group_axes([0, 2, 4, 6], MESH) == ("X", "Y")
    assert group_axes([0, 4, 2, 6], MESH) == ("Y", "X")
    assert group_axes([0, 1], MESH) == ("Z",)


def test_volumes_are_unsharded_bytes_over_the_group() -> None:
    text = """
  %ag = f32[16,4]{1,0} all-gather(%p), replica_groups={{0,2,4,6},{1,3,5,7}}, dimensions={0}
  %rs = f32[2,4]{0,1} reduce-scatter(%d), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={1}
  %a2a = (f32[4,1]{1,0}, f32[4,1]{1,0}) all-to-all(%a, %b), replica_groups={{0,1},{2,3},{4,5},{6,7}}
  %ar = f32[8,2]{1,0} all-reduce(%f), replica_groups=[4,2]<=[8], to_apply=%sum
"""
    found = collectives(text, MESH)
    assert [(c.kind, c.axes, c.elements) for c in found] == [
        (Op.ALL_GATHER, ("X", "Y"), 64), (Op.REDUCE_SCATTER, ("Z",), 16),
        (Op.ALL_TO_ALL, ("Z",), 16), (Op.ALL_REDUCE, ("Z",), 16)]
    assert found[0].bytes(2) == 128
