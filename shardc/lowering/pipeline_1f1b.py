"""The 1F1B lowering: the simulated 1F1B order as a tick table, forward and backward in one program.

With unit times (T_F = T_B = 1, free sends) the 1F1B simulation
(:mod:`shardc.pipeline.schedules`) puts each op at a whole tick, and each device runs
at most one op a tick: ``F_TABLE[t][s]`` is the microbatch whose forward stage s runs at
tick t (-1: none), ``B_TABLE[t][s]`` the same for backwards.  The program is a
``fori_loop`` of 2(m+p-1) ticks (one compiled body, so it compiles fast); each tick every
device runs its stage forward and backward masked by the tables (SPMD: one program for
all), keeps each microbatch's residuals until its backward, and sends with
``jax.lax.ppermute`` its activation down and its cotangent up (the receiver keeps what
the tables say was really sent).  So the compiled HLO has one collective-permute each
way, in a while loop of 2(m+p-1) iterations.  The backward is
the stage plan's own (``_layer_bwd``), called directly: no autodiff over the ticks.
"""

from __future__ import annotations

from shardc.pipeline.schedules import Timing, simulate

__all__ = ["tick_tables", "SECTION"]


def tick_tables(stages: int, microbatches: int) -> tuple[list[list[int]], list[list[int]]]:
    """(F_TABLE, B_TABLE): the microbatch each stage runs forward / backward at each tick, or -1."""
    sim = simulate("1f1b", stages, microbatches, Timing(1.0, 1.0))
    ticks = int(round(sim.makespan))
    tables = {k: [[-1] * stages for _ in range(ticks)] for k in "FB"}
    for op in sim.ops:
        tables[op.kind][int(round(op.start))][op.device] = op.microbatch
    return tables["F"], tables["B"]


SECTION = '''

# ---- pipeline: 1F1B over {axis} ----------------------------------------------
# The simulated 1F1B order (unit times) as tables: at tick t stage s runs the forward of microbatch
# F_TABLE[t][s] and the backward of B_TABLE[t][s] (-1: none).  Forward and backward are one program.

F_TABLE = {f_table!r}
B_TABLE = {b_table!r}
TICKS_1F1B = len(F_TABLE)  # 2 (MICROBATCHES + STAGES - 1)
BACK = [(s + 1, s) for s in range(STAGES - 1)]


def _stage_fwd(x, params, key, stage, j):
    kept = []
    for k in range(LAYERS // STAGES):
        x, residuals = _layer_fwd(x, tuple(w[k] for w in params), layer_key(key, stage, k, j))
        kept.append(residuals)
    return x, kept


def _stage_bwd(kept, g):
    grads = [None] * len(kept)
    for k in reversed(range(len(kept))):
        g, grads[k] = _layer_bwd(kept[k], g)
    return g, tuple(jnp.stack([d[i] for d in grads]) for i in range(len(PARAMS)))


def one_f_one_b_local(key, xs, d_outs, *params):
    """1F1B on one device: outputs, d(microbatches) and d(params) of this stage (``key``: dropout's)."""
    stage = jax.lax.axis_index(PIPELINE_AXIS)
    xs, d_outs = xs[0], d_outs[0]
    ftab, btab = jnp.asarray(F_TABLE), jnp.asarray(B_TABLE)
    shapes = jax.eval_shape(_stage_fwd, xs[0], params, key, stage, 0)[1]
    kept = jax.tree.map(lambda a: jnp.zeros((MICROBATCHES,) + a.shape, a.dtype), shapes)
    zeros = jnp.zeros_like(xs)

    def tick(t, carry):
        kept, acts, cots, outs, dxs, dparams = carry
        jf, jb = ftab[t, stage], btab[t, stage]
        jf0, jb0 = jnp.maximum(jf, 0), jnp.maximum(jb, 0)
        y, res = _stage_fwd(jnp.where(stage == 0, xs[jf0], acts[jf0]), params, key, stage, jf0)
        kept = jax.tree.map(lambda buf, r: jnp.where(jf >= 0, buf.at[jf0].set(r), buf), kept, res)
        outs = jnp.where((jf >= 0) & (stage == STAGES - 1), outs.at[jf0].set(y), outs)
        g = jnp.where(stage == STAGES - 1, d_outs[jb0], cots[jb0])
        dx, dw = _stage_bwd(jax.tree.map(lambda buf: buf[jb0], kept), g)
        dparams = tuple(jnp.where(jb >= 0, a + b, a) for a, b in zip(dparams, dw))
        dxs = jnp.where((jb >= 0) & (stage == 0), dxs.at[jb0].set(dx), dxs)
        # Every tick sends both ways (SPMD: one program); a receiver keeps what was really sent.
        got = jax.lax.ppermute(y, PIPELINE_AXIS, SENDS)
        sent = ftab[t, jnp.maximum(stage - 1, 0)]  # the microbatch the stage above ran
        acts = jnp.where((stage > 0) & (sent >= 0), acts.at[jnp.maximum(sent, 0)].set(got), acts)
        got = jax.lax.ppermute(dx, PIPELINE_AXIS, BACK)
        sent = btab[t, jnp.minimum(stage + 1, STAGES - 1)]
        cots = jnp.where((stage < STAGES - 1) & (sent >= 0), cots.at[jnp.maximum(sent, 0)].set(got), cots)
        return kept, acts, cots, outs, dxs, dparams

    init = (kept, zeros, zeros, zeros, zeros, tuple(jnp.zeros_like(w) for w in params))
    _, _, _, outs, dxs, dparams = jax.lax.fori_loop(0, len(F_TABLE), tick, init)
    return (outs[None], dxs[None], *dparams)


@functools.cache
def one_f_one_b_program():
    """The mesh and the 1F1B step, ``(key, xs, d_outs, *params) -> (outs, d_xs, *d_params)``."""
    mesh = make_pipeline_mesh()
    step = jax.shard_map(one_f_one_b_local, mesh=mesh, in_specs=(*PIPE_IN[:2], PIPE_OUT, *PIPE_IN[2:]),
                         out_specs=(PIPE_OUT, *PIPE_IN[1:]), check_vma=False)
    return mesh, jax.jit(step)
'''
