"""Node-limited expert routing (``dispatch(..., k over E, M, G)``, DeepSeek-V3's): each token's k experts
from at most M of the G expert groups, its AllToAlls' InfiniBand part bounded by the nodes a token reaches."""

from __future__ import annotations

import numpy as np
import pytest

import shardc
from shardc.collectives import Op, collective_time
from shardc.device_pieces import step_volume
from shardc.errors import ShardcError
from shardc.hardware import PRESETS
from shardc.ir.localops import Dispatch
from shardc.ir.plan import Plan
from shardc.ops.dispatch_code import whole_forward, whole_vjp
from shardc.ops.route_code import route_forward
from shardc.planner.check import check_plan
from shardc.topology import resolve_links
from shardc.verification.verify import render_report, verify

HEAD = "mesh X=2\ndims G=4, S=8, E=8, C=8, D=6, F=5\ndtype f32\nparam W_r, W_1, W_2\n"
ROUTER = "Gate[G_X, S, E] = softmax(X[G_X, S, D] · W_r[D, E] over E)\n"
EXPERTS = ("H[G, E_X, C, F] = relu(In[G, E_X, C, D] · W_1[E_X, D, F])\n"
           "Ex[G, E_X, C, D] = H[G, E_X, C, F] · W_2[E_X, F, D]\n")


def _layer(route: str, head: str = HEAD) -> str:
    return (head + ROUTER + f"In[G, E_X, C, D] = dispatch(Gate[G_X, S, E], X[G_X, S, D], S, C, {route})\n"
            + EXPERTS + f"Out[G_X, S, D] = combine(Gate[G_X, S, E], Ex[G, E_X, C, D], S, C, {route})\n")


def _chosen(gates: np.ndarray, k: int, limit: int, groups: int) -> list[set[int]]:
    """Each token's experts, by the report's rule written out per token: a group's score the sum of its
    k / limit largest gates, the limit best groups (ties: the lower), then the k largest gates in them."""
    per = gates.shape[-1] // groups
    out = []
    for row in gates.reshape(-1, gates.shape[-1]):
        scores = [sum(sorted(row[g * per:(g + 1) * per])[-max(1, k // limit):]) for g in range(groups)]
        best = sorted(range(groups), key=lambda g: (-scores[g], g))[:limit]
        allowed = [e for e in range(len(row)) if e // per in best]
        out.append(set(sorted(allowed, key=lambda e: (-row[e], e))[:k]))
    return out


@pytest.mark.parametrize(("k", "limit", "groups"), [(2, 1, 4), (4, 2, 4), (3, 2, 2), (2, 2, 8)])
def test_the_mask_routes_each_token_within_its_best_groups(k: int, limit: int, groups: int) -> None:
    gates = np.random.default_rng(k * 10 + limit).normal(size=(3, 6, 8))
    mask = route_forward(gates, 1, 2, 6 * k, k, np, (limit, groups))  # room for every token: nothing dropped
    got = [set(np.flatnonzero(m.sum(axis=-1))) for m in mask.reshape(-1, 8, 6 * k)]
    assert got == _chosen(gates, k, limit, groups)
    unlimited = route_forward(gates, 1, 2, 6 * k, k, np)
    # the limit changes some token's experts, unless it allows every group, or groups of one expert each
    # (the limit best then being the top experts themselves)
    assert np.array_equal(mask, unlimited) == (limit == groups or groups == 8)


def test_the_reference_combines_the_limited_experts_and_passes_gradients_through_them() -> None:
    rng = np.random.default_rng(3)
    gates, x = rng.normal(size=(2, 5, 8)), rng.normal(size=(2, 5, 3))
    moved = whole_forward("dispatch", gates, x, 2, 5, np, nodes=(1, 4))
    back = whole_forward("combine", gates, moved, 2, 5, np, nodes=(1, 4))
    picked = _chosen(gates, 2, 1, 4)
    weights = np.array([[sum(gates[b, s, e] for e in picked[b * 5 + s]) for s in range(5)] for b in range(2)])
    np.testing.assert_allclose(back, weights[..., None] * x, rtol=1e-12)
    d_gates, _ = whole_vjp("combine", gates, moved, np.ones_like(x), 2, 5, np, nodes=(1, 4))
    assert d_gates is not None
    for b, s in np.ndindex(2, 5):
        assert set(np.flatnonzero(d_gates[b, s])) <= picked[b * 5 + s]


def test_the_plan_carries_the_limit_to_its_steps_and_alltoalls() -> None:
    p = shardc.plan(shardc.parse(_layer("2 over E, 1, 4")))
    assert check_plan(p) == []
    assert {str(s.fn) for s in p.forward + p.backward if isinstance(s.fn, Dispatch)} >= {
        "dispatch(S,E,C,2,1of4)", "combine(S,E,C,2,1of4)"}
    moved = [s for s in p.forward + p.backward if s.op is Op.ALL_TO_ALL]
    assert len(moved) == 4 and all(s.routed == (2, 1, 4) for s in moved)


CLUSTER = """mesh Z=16
dims G=64, S=4096, E=64, C=512, D=7168, F=2048
hardware h800
topology 2x8
param W_r, W_1, W_2
"""


def _alltoall_s(p: Plan) -> float:
    report = shardc.cost(p)
    return sum(r.bandwidth_s for phase in (report.forward, report.backward) for r in phase.rows
               if r.op is Op.ALL_TO_ALL)


def _plan_on_cluster(route: str) -> Plan:
    return shardc.plan(shardc.parse(_layer(route, CLUSTER).replace("_X", "_Z")))


def test_the_infiniband_part_is_bounded_by_the_nodes_a_token_reaches() -> None:
    """Z spans 2 nodes of 8 GPUs: unlimited, each of a token's 8 copies crosses InfiniBand with probability
    1/2; limited to one node (of 2 groups), a token's row crosses at most once, a copy with probability
    1/2 / 8, and NVLink forwards every copy to its GPU inside the node."""
    plain, limited = _plan_on_cluster("8 over E"), _plan_on_cluster("8 over E, 1, 2")
    hw = PRESETS["h800"]
    step = next(s for s in limited.forward if s.op is Op.ALL_TO_ALL)
    sizes = dict(limited.spec.sizes or {}) | {"Z": 16}
    volume = step_volume(step, sizes)
    spans = resolve_links(limited.spec.mesh, sizes, hw, limited.spec.topology)[0]
    routed = collective_time(Op.ALL_TO_ALL, volume, ("Z",), limited.spec.mesh, sizes, hw, spans, (8, 1, 2))
    free = collective_time(Op.ALL_TO_ALL, volume, ("Z",), limited.spec.mesh, sizes, hw, spans)
    local = volume / 16  # the piece a GPU sends: its tokens' 8 copies each
    assert free.bandwidth_s == pytest.approx(max(local * 7 / 16 / hw.w_ici, local * 8 / 16 / hw.w_dcn))
    assert routed.bandwidth_s == pytest.approx(max(local * 7 / 8 / hw.w_ici, local / 8 * 1 / 2 / hw.w_dcn))
    assert _alltoall_s(limited) < _alltoall_s(plain)


def test_verify_s_small_sizes_keep_whole_groups_holding_k_experts() -> None:
    from shardc.lowering.sizes import small_sizes

    text = _layer("8 over E, 4, 8").replace("dims G=4, S=8, E=8, C=8, D=6, F=5", "dims G=64, S=4096, E=256, C=128, "
                                            "D=7168, F=2048")
    sizes = small_sizes(shardc.plan(shardc.parse(text)))
    assert sizes["E"] % 8 == 0 and sizes["E"] // 8 * 4 >= 8 and sizes["E"] < 256


@pytest.mark.parametrize(("route", "message"), [
    ("2 over E, 5, 4", "node limit 5 of 4 groups is not a whole number from 1"),
    ("2 over E, 1, 3", "3 groups of the 8 experts along E do not divide them"),
    ("4 over E, 1, 4", "leave fewer than k=4 in 1"),
    ("2 over E, 1", "`dispatch` takes 2 tensors, 2 index names, a number and `over`"),
])
def test_node_limit_errors_point_at_the_call(route: str, message: str) -> None:
    with pytest.raises(ShardcError) as err:
        shardc.plan(shardc.parse(_layer(route)))
    assert message in err.value.message
    assert err.value.span is not None and err.value.span.line == 6


@pytest.mark.slow
def test_the_runtime_helpers_route_as_the_reference() -> None:
    import jax.numpy as jnp

    from shardc.lowering import runtime

    rng = np.random.default_rng(7)
    gates = rng.normal(size=(2, 6, 8)).astype(np.float32)
    x, d = rng.normal(size=(2, 6, 3)).astype(np.float32), rng.normal(size=(2, 6, 3)).astype(np.float32)
    rows = rng.normal(size=(2, 8, 4, 3)).astype(np.float32)
    nodes = {"limit": 2, "groups": 4}
    g, jx, jd, jr = (jnp.asarray(v) for v in (gates, x, d, rows))

    def close(a: object, b: np.ndarray) -> None:
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5)

    close(runtime.expert_dispatch(g, jx, 3, 4, **nodes), whole_forward("dispatch", gates, x, 3, 4, np, nodes=(2, 4)))
    close(runtime.expert_combine(g, jr, 3, 4, **nodes), whole_forward("combine", gates, rows, 3, 4, np, nodes=(2, 4)))
    close(runtime.expert_dispatch_vjp(g, jr, 3, 4, **nodes), whole_vjp("dispatch", gates, x, rows, 3, 4, np,
                                                                       nodes=(2, 4))[1])
    d_gates, d_rows = whole_vjp("combine", gates, rows, d, 3, 4, np, nodes=(2, 4))
    close(runtime.expert_combine_vjp(g, jd, 3, 4, **nodes), d_rows)
    assert d_gates is not None
    close(runtime.expert_gate_vjp(g, jd, jr, 3, 4, **nodes), d_gates)


@pytest.mark.slow
def test_a_node_limited_layer_verifies_values_and_hlo() -> None:
    p = shardc.plan(shardc.parse(_layer("2 over E, 1, 4")))
    report = verify(p)
    assert report.ok, render_report(report)
