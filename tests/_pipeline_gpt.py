"""The small GPT the pipeline runtime tests share: its declared step, a state and batch, the
unsharded step's result, the meshes they run on, and the check that a pipelined step computed
the unsharded step's numbers (loss, Adam's moments, parameters: ``numerics``)."""
from __future__ import annotations

import jax
import numpy as np
from numerics import assert_params, assert_scaled

from autopar.models import gpt
from autopar.pipeline import model as PM

CFG = gpt.GPTConfig(vocab=64, seq=8, d_model=32, heads=4, d_ff=64, layers=4, scan=True)
LR = 1e-3
MESH_A = {"stage": 2, "data": 2, "model": 2}
MESH_B = {"stage": 4, "data": 2}


def reference():
    """``(step, state, batch, ref_state, ref_loss)``: the declared GPT step on 8 rows and its
    unsharded result."""
    step, init = PM.gpt_train_step(CFG, LR)
    state, batch = init(jax.random.PRNGKey(0), 8), gpt.make_batch(CFG, 8)
    ref_state, ref_loss = jax.jit(step)(state, batch)
    return step, state, batch, ref_state, ref_loss


def mesh(shape: dict):
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(*shape.values()), tuple(shape))


def same_step(new, loss, ref_state, ref_loss) -> None:
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    adam, ref_adam = new["opt_state"][0], ref_state["opt_state"][0]
    assert_scaled(adam.mu, ref_adam.mu, rel=1e-5)
    assert_scaled(adam.nu, ref_adam.nu, rel=2e-5)
    assert_params(new["params"], ref_state["params"], LR, grads=ref_adam.mu)
