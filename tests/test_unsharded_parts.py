"""The unsharded program a pipelined verify measures its bound with: the reference's parts in jax, each
compiled apart, once for a block's layers (DeepSeek-V3's 32 layers traced as one program took most of
verify's compile time), its values those of numpy's reference, dropout's masks each layer's own."""

from __future__ import annotations

import numpy as np
import pytest

import shardc
from shardc.lowering.pipeline_lowering import lower_pipeline
from shardc.verification.pipeline_verify import _Compiled, draw_cotangent, draw_inputs, reference, unsharded

pytestmark = pytest.mark.slow  # compiles each part's jax program

SPEC = """\
mesh P=2 pipeline, X=2
dims B=8, D=4, F=8
layers 4
microbatches 2
param W_in, W_out
H[B_X, F] = {hidden}
Out[B_X, D] = In[B_X, D] + H[B_X, F] · W_out[F, D_X]
"""


@pytest.mark.parametrize(("hidden", "programs"), [("gelu(In[B_X, D] · W_in[D_X, F])", 2),
                                                  ("dropout(gelu(In[B_X, D] · W_in[D_X, F]), 0.5)", 8)])
def test_a_blocks_layers_share_one_program_unless_each_draws_its_own_masks(hidden: str, programs: int) -> None:
    import jax
    import jax.numpy as jnp

    lowered = lower_pipeline(shardc.plan(shardc.parse(SPEC.format(hidden=hidden))), microbatches=2)
    inputs = draw_inputs(lowered, 0, 3)
    cotangent = draw_cotangent(lowered, inputs, 0)
    parts = _Compiled(bool(lowered.namespace.KEYED))
    with jax.enable_x64(True):
        got_out, got_grads = reference(lowered, inputs, cotangent, 3, parts, jnp.float64)
        again = unsharded(lowered, inputs, cotangent, 3, jnp.float64)
    assert len(parts.programs) == programs  # forward and backward: of the block, or of each layer's key
    want_out, want_grads = reference(lowered, inputs, cotangent, 3)
    for got, same, want in ((got_out, again[0], want_out), (got_grads, again[1], want_grads)):
        assert got.keys() == want.keys()
        for name, value in want.items():
            np.testing.assert_allclose(np.asarray(got[name]), value, rtol=1e-12, atol=1e-12)
            np.testing.assert_array_equal(np.asarray(same[name]), np.asarray(got[name]))
