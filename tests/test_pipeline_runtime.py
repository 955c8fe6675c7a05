"""The pipelined step computes what the unpipelined step computes, on 8 CPU devices."""
import dataclasses

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from numerics import assert_params, assert_scaled

from autopar.errors import AutoparError
from autopar.models import adamw_step, gpt
from autopar.pipeline import model as PM
from autopar.pipeline import runtime as R
from autopar.pipeline import schedules as S

CFG = gpt.GPTConfig(vocab=64, seq=8, d_model=32, heads=4, d_ff=64, layers=4, scan=True)
LR = 1e-3


def _setup(cfg, seed: int):
    step, init = PM.gpt_train_step(cfg, LR)
    state, batch = init(jax.random.PRNGKey(seed), 8), gpt.make_batch(cfg, 8)
    ref_state, ref_loss = jax.jit(step)(state, batch)
    return PM.staged_model_of(step), state, batch, ref_state, ref_loss


@pytest.fixture(scope="module")
def setup():
    return _setup(CFG, 0)


def _mesh(shape: dict):
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(*shape.values()), tuple(shape))


MESH_A = {"stage": 2, "data": 2, "model": 2}
MESH_B = {"stage": 4, "data": 2}


def _check_step(out, ref_state, ref_loss):
    new, loss = out
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    # Adam's first moment is 0.1 x the gradient and its second 0.001 x its square: the
    # gradients, checked tightly.
    adam, ref_adam = new["opt_state"][0], ref_state["opt_state"][0]
    assert_scaled(adam.mu, ref_adam.mu, rel=1e-5)
    assert_scaled(adam.nu, ref_adam.nu, rel=2e-5)
    # Adam's update is about lr x sign(g): near-zero gradients turn rounding into lr-sized
    # differences, so parameters are checked to a fraction of lr (a missing or wrong-signed
    # update is off by lr or 2 lr); test_sgd_update_is_exact checks them tightly.
    assert_params(new["params"], ref_state["params"], LR, grads=ref_state["opt_state"][0].mu)
    return new


@pytest.mark.parametrize("shape,name,virtual", [
    (MESH_A, "gpipe", 1), (MESH_A, "1f1b", 1), (MESH_A, "1f1b", 2), (MESH_A, "gpipe", 2),
    (MESH_B, "gpipe", 1), (MESH_B, "eager_1f1b", 1)])
def test_step_equals_unsharded(setup, shape, name, virtual):
    model, state, batch, ref_state, ref_loss = setup
    step = R.build_step(model, _mesh(shape), S.build(name, shape["stage"], virtual, 4))
    new = _check_step(step(state, batch), ref_state, ref_loss)
    sharding = new["params"]["layers"]["mlp"]["fc1"]["kernel"].sharding
    assert sharding.spec[0] == "stage"


CFG6 = dataclasses.replace(CFG, layers=6)


@pytest.fixture(scope="module")
def setup6():
    return _setup(CFG6, 1)


@pytest.mark.parametrize("shape,name,virtual,ranges", [
    (MESH_A, "1f1b", 1, ((0, 3), (3, 4))),
    (MESH_B, "gpipe", 1, ((0, 2), (2, 3), (3, 5), (5, 6))),
    (MESH_A, "1f1b", 2, ((0, 2), (2, 3), (3, 5), (5, 6)))])
def test_unequal_layer_ranges_equal_unsharded(setup, setup6, shape, name, virtual, ranges):
    """Chunks padded to the longest: padding slots run as the identity, get no gradient and
    never reach the optimizer (a padded layer that ran or was updated would change the loss or
    the layers' Adam moments)."""
    model, state, batch, ref_state, ref_loss = setup if ranges[-1][1] == 4 else setup6
    step = R.build_step(model, _mesh(shape), S.build(name, shape["stage"], virtual, 4),
                        ranges=ranges)
    _check_step(step(state, batch), ref_state, ref_loss)


def test_grads_and_sgd_update_are_exact(setup):
    model, state, batch, _, _ = setup
    sgd = dataclasses.replace(model, tx=optax.sgd(0.5))
    mesh = _mesh(MESH_A)
    step = R.build_step(sgd, mesh, S.build("1f1b", 2, 1, 4))
    st, _ = step.in_shardings_of(state, batch)
    assert st["params"]["layers"]["attn"]["qkv"]["kernel"].spec == P("stage", None, None, "model",
                                                                  None)    # (L, D, 3, H, Dh)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(model.loss))(state["params"], batch)
    compiled = jax.jit(step.loss_and_grads).lower(state["params"], batch).compile()
    assert "collective-permute" in compiled.as_text()          # one program, stages talk p2p
    loss, grads = compiled(state["params"], batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert_scaled(grads, ref_grads, rel=1e-5)
    st = {"params": state["params"], "opt_state": sgd.tx.init(state["params"])}
    ref_new, _ = jax.jit(adamw_step(model.loss, sgd.tx))(st, batch)
    new, _ = step(st, batch)
    # 2e-6 of a leaf's largest parameter: a few float32 ulps, the SGD step of gradients that
    # agree to 1e-5 (one element of one leaf lands at 1.15e-6 when LLVM runs at -O0)
    assert_scaled(new["params"], ref_new["params"], rel=2e-6)


def test_the_staged_model_is_the_model(setup):
    model, state, batch, _, ref_loss = setup
    np.testing.assert_allclose(float(model.loss(state["params"], batch)), float(ref_loss),
                               rtol=1e-6)


@pytest.mark.parametrize("shape,sch,fix,ranges", [
    ({"pipe": 2, "data": 4}, ("1f1b", 2, 1, 4), "name one of", None),
    ({"stage": 4, "data": 2}, ("1f1b", 2, 1, 4), "use stages=4", None),
    ({"stage": 4, "data": 2}, ("1f1b", 4, 2, 4), "divides 4", None),
    ({"stage": 2, "data": 4}, ("1f1b", 2, 1, 4), "contiguous layer ranges", ((0, 3), (2, 4))),
    ({"stage": 2, "data": 4}, ("1f1b", 2, 2, 4), "one per chunk", ((0, 3), (3, 4))),
])
def test_bad_pipeline_options(setup, shape, sch, fix, ranges):
    with pytest.raises(AutoparError, match=fix):
        R.build_step(setup[0], _mesh(shape), S.build(*sch), ranges=ranges)


def test_steps_without_layers_are_refused():
    step, _ = gpt.make_train_step(CFG)
    with pytest.raises(AutoparError, match="gpt_train_step"):
        PM.staged_model_of(step)


def test_data_parallel_gradients_are_reduced_once_per_step(setup):
    """Data axes are manual in the stage shard_map: no all-reduce runs inside the tick loop, and
    after it each gradient is all-reduced once, the layers' over the data axis (groups of 4),
    the embedding's and head's with the loss over stage x data (groups of 8)."""
    from autopar import hlo

    model, state, batch, _, _ = setup
    step = R.build_step(model, _mesh({"stage": 2, "data": 4}), S.build("1f1b", 2, 1, 2))
    text = step.jitted(state, batch).lower(state, batch).compile().as_text()
    reduced = [c for c in hlo.collectives(hlo.parse(text)) if c.kind == "all-reduce"]
    layers, rest = model.split(state["params"])
    assert [c for c in reduced if c.count != 1] == []          # nothing inside the loop
    sizes = sorted(c.group_size for c in reduced)
    assert sizes == [4] * len(jax.tree_util.tree_leaves(layers)) + [8] * (
        len(jax.tree_util.tree_leaves(rest)) + 1)


def test_microbatches_must_split_over_the_data_shards(setup):
    model, state, batch, _, _ = setup
    step = R.build_step(model, _mesh({"stage": 2, "data": 4}), S.build("1f1b", 2, 1, 4))
    with pytest.raises(AutoparError, match=r"batch\['targets'\] has 8 rows.*multiple of 16"):
        jax.eval_shape(step.loss_and_grads, state["params"], batch)


def test_a_training_loop_traces_the_step_once(setup):
    model, state, batch, _, _ = setup
    traces = []

    def embed(rest, b):
        traces.append(1)            # runs only while jax traces the step
        return model.embed(rest, b)

    counted = dataclasses.replace(model, embed=embed)
    step = R.build_step(counted, _mesh({"stage": 2, "data": 4}), S.build("gpipe", 2, 1, 2))
    state, _ = step(state, batch)
    first = len(traces)
    step(state, batch)
    assert first > 0 and len(traces) == first
    # One jitted function per signature, built once: its dispatch cache serves every call.
    assert step.jitted(state, batch) is step.jitted(state, batch)
