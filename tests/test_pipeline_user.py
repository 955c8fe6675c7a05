"""The user's own training step pipelined (``autopar.pipeline.user``): ``jax.value_and_grad``
replaced by ``autopar.value_and_grad``, the user's own optax code after it, run by both pipeline
runtimes with the unsharded step's numbers, on a flax linen GPT and transformers' Flax Llama."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from numerics import assert_params, assert_scaled

import autopar
from autopar.errors import AutoparError
from autopar.models import gpt

LR = 1e-3
MESH = {"stage": 2, "data": 2, "model": 2}
CFG = gpt.GPTConfig(vocab=64, seq=8, d_model=32, heads=4, d_ff=64, layers=4, scan=True)


def _xent(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()


def _user_step(scan: bool, tx=None):
    """A flax linen GPT trained the way a user writes it: a loss, value_and_grad, optax."""
    cfg = dataclasses.replace(CFG, scan=scan)
    model = gpt.GPT(cfg)
    tx = tx or optax.adam(LR)

    def loss_fn(params, batch):
        return _xent(model.apply({"params": params}, batch["tokens"]), batch["targets"])

    def step(state, batch):
        loss, grads = autopar.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state}, loss

    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, cfg.seq), jnp.int32))["params"]
    state = {"params": params, "opt_state": tx.init(params)}
    return step, state, gpt.make_batch(cfg, 8), loss_fn


def _adam_of(opt_state):
    return next(s for s in jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState))


def _same(new, loss, ref_state, ref_loss):
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    adam, ref_adam = _adam_of(new["opt_state"]), _adam_of(ref_state["opt_state"])
    assert_scaled(adam.mu, ref_adam.mu, rel=1e-5)
    assert_scaled(adam.nu, ref_adam.nu, rel=2e-5)
    assert_params(new["params"], ref_state["params"], LR, grads=ref_adam.mu)


def _mesh():
    return jax.make_mesh(tuple(MESH.values()), tuple(MESH))


@pytest.mark.parametrize("runtime", ["lockstep"])    # MPMD: the unrolled test below
def test_the_users_scanned_step_pipelines(runtime):
    step, state, batch, _ = _user_step(scan=True)
    ref_state, ref_loss = jax.jit(step)(state, batch)
    run = autopar.autoparallel(step, mesh=_mesh(), pipeline={
        "schedule": "1f1b", "microbatches": 4, "runtime": runtime})
    new, loss = run(state, batch)
    assert run.plan.pipeline.runtime == runtime
    _same(new, loss, ref_state, ref_loss)
    ref2, ref_loss2 = jax.jit(step)(ref_state, batch)
    again, loss2 = run(new, batch)                     # later calls take what it returned
    np.testing.assert_allclose(float(loss2), float(ref_loss2), rtol=1e-5)


def test_transformers_llama_step_takes_its_own_layout_first():
    """transformers' Flax Llama (numbered layers, unrolled) trained as its users write it, with
    a global-norm clip before AdamW: the first call takes the user's layout, the step returns
    the stacked one, and ``unstack_state`` gives the user's layout back with the unsharded
    step's numbers; the clip sees every stage's gradients (MPMD runtime, ZB-H1: Llama's
    layer backward split into its input and weight halves)."""
    pytest.importorskip("transformers", reason="the dev extra installs transformers 4.x")
    from autopar.models import hf

    cfg = hf.tiny("llama", layers=4, width=32)
    model = hf.build("llama", cfg)
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(LR))

    def loss_fn(params, batch):
        return _xent(model(**batch["inputs"], params=params, train=False).logits,
                     batch["labels"])

    def step(state, batch):
        loss, grads = autopar.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state}, loss

    params = model.init_weights(jax.random.PRNGKey(0), model.input_shape)
    state = {"params": params, "opt_state": tx.init(params)}
    batch = hf.make_batch("llama", cfg, 8, seq=8)
    ref_state, ref_loss = jax.jit(step)(state, batch)
    run = autopar.autoparallel(step, mesh=jax.make_mesh((2, 4), ("stage", "data")), pipeline={
        "schedule": "zb_h1", "microbatches": 2})
    new, loss = run(state, batch)
    assert (run.plan.pipeline.runtime, run.plan.pipeline.schedule) == ("mpmd", "zb_h1")
    mine = run.unstack_state(new)
    assert jax.tree_util.tree_structure(mine) == jax.tree_util.tree_structure(ref_state)
    _same(mine, loss, ref_state, ref_loss)


def test_plan_of_the_users_step():
    step, state, batch, _ = _user_step(scan=True)
    step = jax.jit(step)                # a jitted step (which takes no attributes) plans too
    plan = autopar.plan(step, state, batch, mesh=MESH, hardware="cpu",
                        pipeline={"schedule": "gpipe", "microbatches": 2})
    assert plan.pipeline is not None and plan.pipeline.stages == 2
    assert plan.spec_of("['params']['layers']['mlp']['fc1']['kernel']")[0] == "stage"


def test_outside_a_pipeline_it_is_jax_value_and_grad():
    _, state, batch, loss_fn = _user_step(scan=True)
    got = jax.jit(autopar.value_and_grad(loss_fn))(state["params"], batch)
    want = jax.jit(jax.value_and_grad(loss_fn))(state["params"], batch)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
    assert_scaled(got[1], want[1], rel=1e-6)


def test_what_cannot_be_cut_is_refused():
    step, state, batch, loss_fn = _user_step(scan=True)
    with pytest.raises(AutoparError, match="argnums=0, has_aux=False"):
        autopar.value_and_grad(loss_fn, argnums=1)

    def scaled(state, batch):        # differentiates a computed copy of the parameters
        p = jax.tree_util.tree_map(lambda x: x * 1.0, state["params"])
        loss, g = autopar.value_and_grad(loss_fn)(p, batch)
        return {"params": jax.tree_util.tree_map(lambda a, b: a - LR * b, state["params"], g),
                "opt_state": state["opt_state"]}, loss

    with pytest.raises(AutoparError, match=r"state\['params'\], batch\) as the step received"):
        autopar.plan(scaled, state, batch, mesh=MESH, pipeline="auto")

    def twice(state, batch):
        loss, _ = autopar.value_and_grad(loss_fn)(state["params"], batch)
        loss2, g = autopar.value_and_grad(loss_fn)(state["params"], batch)
        return state, loss + loss2

    with pytest.raises(AutoparError, match="calls autopar.value_and_grad 2 times"):
        autopar.plan(twice, state, batch, mesh=MESH, pipeline="auto")

    def nested(state, batch):
        return state, jax.jit(lambda p, b: autopar.value_and_grad(loss_fn)(p, b)[0])(
            state["params"], batch)

    with pytest.raises(AutoparError, match="call it at the step's top level"):
        autopar.plan(nested, state, batch, mesh=MESH, pipeline="auto")

    def plain(state, batch):
        loss, _ = jax.value_and_grad(loss_fn)(state["params"], batch)
        return state, loss

    with pytest.raises(AutoparError, match=r"autopar.value_and_grad\(loss_fn\)"):
        autopar.plan(plain, state, batch, mesh=MESH, pipeline="auto")
