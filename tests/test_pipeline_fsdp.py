"""FSDP inside a pipeline stage (``runtime.build_step(fsdp=True)``, ``pipeline={"fsdp": ...}``):
each layer's parameters and Adam moments sharded over the data axes of its stage, gathered per
layer, gradients reduce-scattered; the same numbers as the unsharded step, and a predicted stage
peak that XLA's memory_analysis() confirms."""
import dataclasses
import json

import jax
import numpy as np
import pytest
from numerics import assert_params, assert_scaled

import autopar
from autopar import hlo
from autopar.errors import AutoparError
from autopar.models import gpt
from autopar.pipeline import model as PM
from autopar.pipeline import planning as PL
from autopar.pipeline import runtime as R
from autopar.pipeline import schedules as S

LR = 1e-3
CFG = gpt.GPTConfig(vocab=64, seq=8, d_model=32, heads=4, d_ff=64, layers=4, scan=True)


def _mesh(shape: dict):
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(*shape.values()), tuple(shape))


@pytest.fixture(scope="module")
def gpt_step():
    step, init = PM.gpt_train_step(CFG, LR)
    state, batch = init(jax.random.PRNGKey(0), 8), gpt.make_batch(CFG, 8)
    return step, state, batch, *jax.jit(step)(state, batch)


@pytest.mark.parametrize("shape,schedule", [({"stage": 2, "data": 2, "model": 2}, "1f1b"),
                                            ({"stage": 4, "data": 2}, "gpipe")])
def test_fsdp_stage_equals_the_unsharded_step(gpt_step, shape, schedule):
    """Loss, Adam's first moment and the updated parameters; the MLP kernel and its moments
    live split over the stage, the data axis (FSDP) and, on the first mesh, the model axis
    (Megatron), and the gradients leave the loop reduce-scattered, not all-reduced. (The
    planner does not choose FSDP beside a tensor split: GSPMD gathers the model split first,
    ``planning._fsdp_choices``; the runtime still computes the same numbers.)"""
    from autopar import hlo

    step, state, batch, ref_state, ref_loss = gpt_step
    run = R.build_step(PM.staged_model_of(step), _mesh(shape), S.build(schedule,
                                                                        shape["stage"], 1, 4),
                       fsdp=True)
    new, loss = run(state, batch)
    want = {"stage", "data", *({"model"} & set(shape))}
    for tree in (new["params"], new["opt_state"][0].mu):
        spec = tree["layers"]["mlp"]["fc1"]["kernel"].sharding.spec
        assert {a for d in spec if d for a in (d if isinstance(d, tuple) else (d,))} == want
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert_scaled(new["opt_state"][0].mu, ref_state["opt_state"][0].mu, rel=1e-5)
    assert_params(new["params"], ref_state["params"], LR, grads=ref_state["opt_state"][0].mu)
    module = hlo.parse(run.jitted(state, batch).lower(state, batch).compile().as_text())
    kinds = {c.kind for c in hlo.collectives(module) if c.count > 1}     # inside the tick loop
    assert {"all-gather", "reduce-scatter"} <= kinds


WIDE = dataclasses.replace(CFG, seq=16, d_model=128, d_ff=512)


@pytest.mark.parametrize("mesh", [{"stage": 2, "data": 4}, {"stage": 4, "data": 2}])
def test_fsdp_plan_predicts_its_stage_peak(mesh):
    """``pipeline={"fsdp": True}`` plans FSDP stages: the predicted peak of the busiest stage is
    within 10% of XLA's memory_analysis() of the step it runs, as the plain plan's is, and the
    saving FSDP predicts is the one measured; the plan says so and its JSON keeps it."""
    step, init = PM.gpt_train_step(WIDE, LR)
    state = jax.eval_shape(lambda: init(jax.random.PRNGKey(0), 16))
    batch = jax.eval_shape(lambda: gpt.make_batch(WIDE, 16))
    peaks = {}
    for fsdp in (False, True):
        plan = autopar.plan(step, state, batch, mesh=mesh, hardware="cpu", pipeline={
            "schedule": "1f1b", "microbatches": 4, "virtual_stages": 1, "fsdp": fsdp,
            "runtime": "lockstep"})        # one program, whose memory XLA reports
        pp = plan.pipeline
        assert pp.fsdp is fsdp and ("FSDP" in pp.summary()) is fsdp
        run = PL.executable(plan, step, _mesh(mesh))
        measured = hlo.memory(run.jitted(state, batch).lower(state, batch).compile())["peak"]
        peaks[fsdp] = max(pp.stage_memory_bytes), measured
        ratio = max(pp.stage_memory_bytes) / measured
        print(f"fsdp={fsdp} mesh={mesh} predicted/measured {ratio:.3f}")
        assert 0.9 <= ratio <= 1.1, (fsdp, ratio)
        back = autopar.Plan.from_json(plan.to_json())
        assert back.pipeline.fsdp is fsdp
        placed = run.in_shardings_of(state, batch)[0]["params"]["layers"]["mlp"]["fc1"]
        spec = plan.spec_of("['params']['layers']['mlp']['fc1']['kernel']")
        assert ("data" in str(spec)) is fsdp and _trim(spec) == _trim(placed["kernel"].spec)
    saved = [peaks[True][k] / peaks[False][k] for k in (0, 1)]    # predicted, measured
    assert saved[1] < 0.8 and abs(saved[0] - saved[1]) < 0.05, saved


def test_fsdp_is_searched_pinned_and_refused_without_data_shards():
    step, init = PM.gpt_train_step(WIDE, LR)
    state = jax.eval_shape(lambda: init(jax.random.PRNGKey(0), 16))
    batch = jax.eval_shape(lambda: gpt.make_batch(WIDE, 16))
    mesh = {"stage": 2, "data": 4}
    auto = autopar.plan(step, state, batch, mesh=mesh, hardware="cpu",
                        pipeline={"schedule": "1f1b", "microbatches": 4, "virtual_stages": 1})
    runners = auto.pipeline.why.splitlines()
    assert any("FSDP" in line for line in runners), runners       # both were priced
    tight = max(auto.pipeline.stage_memory_bytes) * 0.6            # only FSDP fits
    lean = autopar.plan(step, state, batch, mesh=mesh, hardware="cpu", memory_budget=tight,
                        pipeline={"schedule": "1f1b", "microbatches": 4, "virtual_stages": 1})
    assert lean.pipeline.fsdp and max(lean.pipeline.stage_memory_bytes) <= tight
    with pytest.raises(AutoparError, match="fsdp=True needs data shards"):
        autopar.plan(step, state, batch, mesh={"stage": 2, "model": 4}, hardware="cpu",
                     pipeline={"schedule": "1f1b", "microbatches": 4, "fsdp": True})
    tensor = {"stage": 2, "data": 2, "model": 2}     # the ILP splits the MLP over model here
    with pytest.raises(AutoparError, match="fsdp=True with layers split over 'model'.*mlp/fc1"):
        autopar.plan(step, state, batch, mesh=tensor, hardware="cpu",
                     pipeline={"schedule": "1f1b", "microbatches": 4, "fsdp": True})
    split = autopar.plan(step, state, batch, mesh=tensor, hardware="cpu",
                         pipeline={"schedule": "1f1b", "microbatches": 4, "virtual_stages": 1})
    assert not split.pipeline.fsdp and "FSDP" not in split.pipeline.why
    with pytest.raises(AutoparError, match="fsdp='yes'.*must be True"):
        autopar.plan(step, state, batch, mesh=mesh, hardware="cpu", pipeline={"fsdp": "yes"})
    old = json.loads(auto.to_json())
    del old["pipeline"]["fsdp"]                      # a plan written before the field
    assert autopar.Plan.from_json(json.dumps(old)).pipeline.fsdp is False


def _trim(spec) -> tuple:
    dims = list(spec)
    while dims and dims[-1] is None:
        dims.pop()
    return tuple(dims)
