"""The 1F1B program of a pipelined block with its ends (:mod:`shardc.lowering.pipeline_ends`).

The block's 1F1B tick tables (:mod:`shardc.lowering.pipeline_1f1b`) with, in the tick
where the last stage runs microbatch j's forward, the statements after the block on it
(its loss, and at once their backward from the loss's cotangent over M, which the last
stage's backward of j then reads), and, in the tick where stage 0 runs j's backward,
the backward of the statements before the block (their forward run again for its
residuals: an embedding's lookup is cheap).  Every device computes both ends, masked by
its stage index (SPMD: one program).  Still one collective-permute each way, in a while
loop of 2(m+p-1) ticks.
"""

from __future__ import annotations

__all__ = ["SECTION"]

SECTION = '''

# ---- the whole model: 1F1B, the ends on the first and last stage -------------------


def model_1f1b_local(key, d_share, *args):
    """1F1B over the whole model on one device: the microbatches' losses, d(ends' params), d(params);
    ``d_share`` the cotangent of each microbatch's loss (the loss's over M)."""
    stage = jax.lax.axis_index(PIPELINE_AXIS)
    data = {k: x[0] for k, x in zip(DATA, args)}
    ends = {k: w[0] for k, w in zip(ENDS, args[len(DATA):])}
    params = args[len(DATA) + len(ENDS):]
    ftab, btab = jnp.asarray(F_TABLE), jnp.asarray(B_TABLE)
    x_like = jax.eval_shape(lambda: pre_end(*_pre_args(data, ends, 0)))
    x_zero = jnp.zeros(x_like.shape, x_like.dtype)
    shapes = jax.eval_shape(_stage_fwd, x_zero, params, key, stage, 0)[1]
    kept = jax.tree.map(lambda a: jnp.zeros((MICROBATCHES,) + a.shape, a.dtype), shapes)
    zeros = jnp.zeros((MICROBATCHES,) + x_like.shape, x_like.dtype)
    losses = jnp.zeros((MICROBATCHES,), x_like.dtype)
    first, last = stage == 0, stage == STAGES - 1

    def tick(t, carry):
        kept, acts, cots, losses, dends, dparams = carry
        jf, jb = ftab[t, stage], btab[t, stage]
        jf0, jb0 = jnp.maximum(jf, 0), jnp.maximum(jb, 0)
        x0 = pre_end(*_pre_args(data, ends, jf0))
        y, res = _stage_fwd(jnp.where(first, x0, acts[jf0]), params, key, stage, jf0)
        kept = jax.tree.map(lambda buf, r: jnp.where(jf >= 0, buf.at[jf0].set(r), buf), kept, res)
        # The last stage: microbatch jf's loss, and the backward of the statements after the block.
        loss, post_res = post_end_fwd(*_post_args(y, data, ends, jf0))
        d_post = dict(zip(POST_FORWARD_IN, post_end_bwd(post_res, d_share)))
        done = (jf >= 0) & last
        losses = jnp.where(done, losses.at[jf0].set(loss), losses)
        cots = jnp.where(done, cots.at[jf0].set(d_post[BLOCK_OUTPUT]), cots)
        dends = {k: jnp.where(done, g + d_post[k], g) if k in POST_PARAMS else g for k, g in dends.items()}
        dx, dw = _stage_bwd(jax.tree.map(lambda buf: buf[jb0], kept), cots[jb0])
        dparams = tuple(jnp.where(jb >= 0, a + b, a) for a, b in zip(dparams, dw))
        # Stage 0: the backward of the statements before the block, for microbatch jb.
        _, pre_res = pre_end_fwd(*_pre_args(data, ends, jb0))
        d_pre = dict(zip(PRE_FORWARD_IN, pre_end_bwd(pre_res, dx)))
        back = (jb >= 0) & first
        dends = {k: jnp.where(back, g + d_pre[k], g) if k in PRE_PARAMS else g for k, g in dends.items()}
        # Every tick sends both ways (SPMD: one program); a receiver keeps what was really sent.
        got = jax.lax.ppermute(y, PIPELINE_AXIS, SENDS)
        sent = ftab[t, jnp.maximum(stage - 1, 0)]
        acts = jnp.where((stage > 0) & (sent >= 0), acts.at[jnp.maximum(sent, 0)].set(got), acts)
        got = jax.lax.ppermute(dx, PIPELINE_AXIS, BACK)
        sent = btab[t, jnp.minimum(stage + 1, STAGES - 1)]
        cots = jnp.where((stage < STAGES - 1) & (sent >= 0), cots.at[jnp.maximum(sent, 0)].set(got), cots)
        return kept, acts, cots, losses, dends, dparams

    init = (kept, zeros, zeros, losses, {k: jnp.zeros_like(w) for k, w in ends.items()},
            tuple(jnp.zeros_like(w) for w in params))
    _, _, _, losses, dends, dparams = jax.lax.fori_loop(0, len(F_TABLE), tick, init)
    return (losses[None], *[dends[k][None] for k in ENDS], *dparams)


@functools.cache
def model_1f1b_program():
    """The mesh and the 1F1B step, ``(key, d_share, *data, *ends, *params) -> (losses, *d_ends, *d_params)``."""
    mesh = make_pipeline_mesh()
    step = jax.shard_map(model_1f1b_local, mesh=mesh, in_specs=(P(), P(), *MODEL_IN[1:]),
                         out_specs=(MODEL_OUT, *MODEL_IN[1 + len(DATA):]), check_vma=False)
    return mesh, jax.jit(step)
'''
