"""megatron_3d: tensor x pipeline x data by hand, through the pipeline codegen and compare."""
import jax
import numpy as np
import pytest
from numerics import assert_params, assert_scaled

import autopar
from autopar import strategies
from autopar.errors import AutoparError
from autopar.models import gpt
from autopar.pipeline import model as PM
from autopar.pipeline import planning as PL

CFG = gpt.GPTConfig(vocab=64, seq=8, d_model=32, heads=4, d_ff=64, layers=4, scan=True)
MESH = {"stage": 2, "data": 2, "model": 2}
LR = 1e-3


@pytest.fixture(scope="module")
def setup():
    step, init = PM.gpt_train_step(CFG, LR)
    state, batch = init(jax.random.PRNGKey(0), 8), gpt.make_batch(CFG, 8)
    plan = strategies.get("megatron_3d").plan(step, state, batch, mesh=MESH, hardware="cpu")
    return step, state, batch, plan


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), tuple(MESH))


def test_megatron_3d_pins_megatrons_recipe(setup):
    _, _, _, plan = setup
    pp = plan.pipeline
    # One row per data shard per microbatch (8 rows, 2 data shards), 1F1B, equal stages.
    assert (pp.stages, pp.microbatches, pp.schedule, pp.virtual_stages) == (2, 4, "1f1b", 1)
    assert pp.layer_ranges == ((0, 2), (2, 4)) and plan.strategy == "megatron_3d"
    spec = plan.spec_of("params']['layers']['attn']['qkv']['kernel")     # (L, D, 3, H, Dh)
    assert tuple(spec) == ("stage", None, None, "model")
    # Megatron-LM's vocabulary-parallel embedding and output layer
    assert tuple(plan.spec_of("params']['wte']['embedding")) == ("model",)
    assert tuple(plan.spec_of("params']['lm_head']['kernel")) == (None, "model")
    assert 0 < pp.bubble_fraction < 1 and len(pp.stage_memory_bytes) == 2


def test_megatron_3d_step_equals_unsharded(setup):
    step, state, batch, plan = setup
    ref_state, ref_loss = jax.jit(step)(state, batch)
    new, loss = PL.executable(plan, step, _mesh())(state, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    # After one step from zero, Adam's first moment is exactly 0.1 x the gradient: the gradients,
    # checked tightly without compiling the step twice.
    adam, ref_adam = new["opt_state"][0], ref_state["opt_state"][0]
    assert_scaled(adam.mu, ref_adam.mu, rel=1e-5)
    assert_scaled(adam.nu, ref_adam.nu, rel=2e-5)
    # Adam's update is about lr x sign(g): checked to a fraction of lr (see test_pipeline_runtime).
    assert_params(new["params"], ref_state["params"], LR, grads=ref_state["opt_state"][0].mu)


def test_compare_shows_bubble_and_stage_memory(setup):
    step, state, batch, _ = setup
    cmp = autopar.compare(step, state, batch, mesh=MESH, hardware="cpu",
                          strategies=("megatron_3d",), runs=1, progress=False,
                          time_limit_s=5.0)
    row = cmp["megatron_3d"]
    assert row.ok, row.error
    assert row.plan.pipeline is not None and row.measured_step_s is not None
    assert row.measured_peak_bytes is not None and row.predicted_peak_bytes is not None
    text = str(cmp)
    assert "1f1b M=4 V=1, bubble" in text and "stage peaks" in text


def test_megatron_3d_bad_inputs(setup):
    step, state, batch, _ = setup
    with pytest.raises(AutoparError, match="lacks"):
        strategies.get("megatron_3d").plan(step, state, batch, mesh={"data": 4, "model": 2})
    with pytest.raises(AutoparError, match="pins its own pipeline"):
        autopar.plan(step, state, batch, mesh=MESH, strategy="megatron_3d", pipeline="auto")
    with pytest.raises(AutoparError, match="got 1 arguments"):
        autopar.plan(step, state, mesh=MESH, strategy="megatron_3d")
    with pytest.raises(AutoparError, match="takes stage_axis"):
        strategies.get("megatron_3d", model_axis="x")


def test_megatron_3d_is_a_strategy_like_any_other(setup):
    """``autopar.plan(strategy="megatron_3d")`` gives the strategy's own plan, and
    ``autoparallel(strategy=...)`` plans and runs it on the first call with the unsharded step's
    numbers (it used to refuse and send the user to another call)."""
    step, state, batch, own = setup
    plan = autopar.plan(step, state, batch, mesh=MESH, hardware="cpu", strategy="megatron_3d")
    assert plan.strategy == "megatron_3d" and plan.pipeline == own.pipeline
    assert plan.input_specs == own.input_specs
    run = autopar.autoparallel(step, mesh=_mesh(), hardware="cpu",
                               strategy=strategies.get("megatron_3d", microbatches=2))
    new, loss = run(state, batch)
    assert run.plan.pipeline.microbatches == 2 and run.plan.strategy == "megatron_3d"
    ref_state, ref_loss = jax.jit(step)(state, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert_params(new["params"], ref_state["params"], LR, grads=ref_state["opt_state"][0].mu)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_megatron_3d_finds_the_vocabulary_to_split(dtype):
    """The embedding table's rows are read off the staged model's embedding, through the cast
    a bfloat16 model makes of its float32 table (missed, the table stayed whole)."""
    import dataclasses

    from autopar.pipeline.megatron_3d import stage_layouts

    cfg = dataclasses.replace(CFG, vocab=96, dtype=getattr(jax.numpy, dtype))
    step, init = PM.gpt_train_step(cfg)
    state = jax.eval_shape(lambda: init(jax.random.PRNGKey(0), 8))
    batch = jax.eval_shape(lambda: gpt.make_batch(cfg, 8))
    assert stage_layouts(PM.staged_model_of(step), state["params"], batch).vocabulary == 96
