"""Reading collectives out of compiled HLO text."""

from __future__ import annotations

from shardc.ir.plan import Op
from shardc.verification.hlo import collectives, group_axes, parse_replica_groups

MESH = (("X", 2), ("Y", 2), ("Z", 2))


def test_listed_and_iota_replica_groups() -> None:
    assert parse_replica_groups("replica_groups={{0,1},{2,3}}, x", 4) == [[0, 1], [2, 3]]
    assert parse_replica_groups("replica_groups=[2,4]<=[8], x", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)", 8)[0] == [0, 4]


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
