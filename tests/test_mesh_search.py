"""The mesh's shape as a planner decision (``autopar.mesh_search``): ``mesh=`` a device count, a
list of devices or a dict with open axes; every shape planned, the fastest that fits chosen."""
from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.errors import AutoparError, PlanError, ShardingError
from autopar.mesh_search import OpenMesh, open_mesh
from autopar.models import zoo

TINY = zoo.Config(layers=1, width=32, ff=64, heads=4, batch=8)


def _shapes(mesh, n=None, per_node=8):
    om = open_mesh(mesh) if n is None else OpenMesh(tuple((a, None) for a in mesh), n)
    return [tuple(s.items()) for s in om.shapes(per_node)]


def test_shapes_are_every_factorisation_within_a_node():
    """64 devices, 8 a node: the model axis (every axis after the first) stays inside a node."""
    assert _shapes(("data", "model"), 64) == [
        (("data", 64), ("model", 1)), (("data", 32), ("model", 2)),
        (("data", 16), ("model", 4)), (("data", 8), ("model", 8))]
    assert len(_shapes(("data", "model"), 8)) == 4                 # 8x1 4x2 2x4 1x8
    assert _shapes({"data": 2, "model": None}) == [(("data", 2), ("model", 4))]
    three = _shapes(("data", "expert", "model"), 16, per_node=4)   # the last axis in a node
    assert {m for *_, (_, m) in three} == {1, 2, 4} and len(three) == 12
    staged = open_mesh(8, ("stage", "data", "model")).shapes(8, {"stage": 2})
    assert {s["stage"] for s in staged} == {2, 4, 8} and len(staged) == 6


@functools.cache
def _searched():
    fn, *args = zoo.nnx_lm(TINY, abstract=True)
    return fn, args, autopar.plan(fn, *args, mesh=8, time_limit_s=8)


def test_plan_chooses_the_fastest_shape_and_says_which_it_tried():
    _, _, plan = _searched()
    cands = plan.mesh_candidates
    assert len(cands) == 4 and all(c.step_time_s is not None for c in cands)
    assert dict(plan.mesh) == dict(cands[0].mesh)
    assert plan.cost.step_time_s == cands[0].step_time_s == min(c.step_time_s for c in cands)
    assert sorted(c.mesh for c in cands) == sorted(_shapes(8))
    text = plan.summary()
    assert "mesh chosen among 4 shapes" in text and "<- chosen" in text
    again = autopar.Plan.from_json(plan.to_json())
    assert again.mesh_candidates == cands


def test_a_count_opens_an_expert_axis_for_a_mixture_of_experts():
    """A step with stacked expert weights gets {data, expert, model} shapes from a count (the
    expert-parallel degree is searched with the others); the dense LM above gets no expert
    axis."""
    from autopar.models import moe

    fn, state, batch = moe.abstract(moe.MoEConfig(layers=1), 8)
    plan = autopar.plan(fn, state, batch, mesh=2, hardware="h100", time_limit_s=2)
    tried = sorted(c.mesh for c in plan.mesh_candidates)
    assert tried == sorted(_shapes(("data", "expert", "model"), 2))
    assert any(dict(m)["expert"] > 1 for m in tried) and "expert" in dict(plan.mesh)
    assert all("expert" not in dict(c.mesh) for c in _searched()[2].mesh_candidates)


def test_a_tampered_candidate_is_refused():
    _, _, plan = _searched()
    d = json.loads(plan.to_json())
    d["mesh_candidates"][1]["error"] = "made up"       # a step time and an error at once
    with pytest.raises(PlanError, match="mesh_candidates"):
        autopar.Plan.from_json(json.dumps(d))


def _mlp_step():
    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    def step(p, x, y):
        value, g = jax.value_and_grad(loss)(p, x, y)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), value

    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    p = {"w1": jax.random.normal(k1, (64, 256)) * 0.1, "w2": jax.random.normal(k2, (256, 64)) * 0.1}
    x = jax.random.normal(k3, (32, 64))
    return step, p, x, jnp.ones((32, 64))


@pytest.mark.parametrize("form", ["count", "devices", "open-dict"])
def test_autoparallel_runs_on_the_shape_it_chose(form):
    """The step plans every shape on its first call, runs on the chosen one with the unsharded
    step's numbers, and keeps that mesh."""
    step, p, x, y = _mlp_step()
    mesh = {"count": 8, "devices": list(jax.devices()),
            "open-dict": {"data": None, "model": None}}[form]
    run = autopar.autoparallel(step, mesh=mesh, time_limit_s=8)
    (new, value), (ref, ref_value) = run(p, x, y), jax.jit(step)(p, x, y)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-6)
    for k in ref:
        np.testing.assert_allclose(np.asarray(new[k]), np.asarray(ref[k]), rtol=1e-5, atol=1e-6)
    chosen = dict(run.plan.mesh)
    assert len(run.plan.mesh_candidates) == 4
    assert dict(zip(run.mesh.axis_names, run.mesh.devices.shape)) == chosen
    run(new, x, y)                                         # the second call keeps the mesh
    assert dict(zip(run.mesh.axis_names, run.mesh.devices.shape)) == chosen


def test_open_meshes_that_cannot_be_decided_say_so():
    step, p, x, y = _mlp_step()
    with pytest.raises(ShardingError, match="integer >= 1"):
        autopar.plan(step, p, x, y, mesh=0)
    with pytest.raises(ShardingError, match="do not divide"):
        autopar.plan(step, p, x, y, mesh={"data": 3, "model": None})
    with pytest.raises(ShardingError, match="repeats"):
        autopar.plan(step, p, x, y, mesh=[jax.devices()[0]] * 2)
    with pytest.raises(AutoparError, match="fixed shape"):
        autopar.compare(step, p, x, y, mesh=8, measure=False, progress=False)
    with pytest.raises(ShardingError, match="committed"):
        autopar.plan(step, p, x, y, mesh=8, strategy="user")


def test_the_notebook_view_lists_the_shapes():
    _, _, plan = _searched()
    view = plan._repr_html_()
    assert "mesh chosen among 4 shapes" in view and view.count("<li>") >= 4


def test_a_pipelined_plan_chooses_its_stage_count_too():
    """``pipeline="auto"`` with ``mesh=8``: every {stage >= 2, data, model} shape is planned by the
    pipeline planner; a shape with more stages than layers says why it has no plan; the
    decorated step runs the chosen plan, on the chosen mesh, with the unsharded step's numbers."""
    from numerics import assert_params

    from autopar.models import gpt
    from autopar.pipeline import model as PM

    cfg = gpt.GPTConfig(vocab=64, seq=8, d_model=32, heads=4, d_ff=64, layers=4, scan=True)
    step, init = PM.gpt_train_step(cfg, 1e-3)
    state, batch = init(jax.random.PRNGKey(0), 8), gpt.make_batch(cfg, 8)
    run = autopar.autoparallel(step, mesh=8, hardware="cpu", pipeline="auto", time_limit_s=20)
    new, loss = run(state, batch)
    plan, cands = run.plan, run.plan.mesh_candidates
    assert len(cands) == 6 and plan.pipeline is not None
    assert dict(plan.mesh) == dict(cands[0].mesh) and dict(plan.mesh)["stage"] >= 2
    assert dict(zip(run.mesh.axis_names, run.mesh.devices.shape)) == dict(plan.mesh)
    failed = [c for c in cands if c.step_time_s is None]
    assert [dict(c.mesh)["stage"] for c in failed] == [8] and "8 stages" in failed[0].error
    ref, ref_loss = jax.jit(step)(state, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert_params(new["params"], ref["params"], 1e-3, grads=ref["opt_state"][0].mu)
