"""The MPMD pipeline runtime (``autopar.pipeline.mpmd``): each stage its own programs, issued
asynchronously; the asynchronous timeline that prices it; the planner's choice between it and the
lockstep runtime."""
import dataclasses
import json

import jax
import numpy as np
import optax
import pytest
from _pipeline_gpt import LR, MESH_A, MESH_B, reference, same_step
from _pipeline_gpt import mesh as _mesh
from numerics import assert_scaled

import autopar
import cost_models
from autopar.errors import AutoparError, PlanError
from autopar.models import adamw_step, gpt
from autopar.pipeline import model as PM
from autopar.pipeline import mpmd
from autopar.pipeline import planning as PL
from autopar.pipeline import runtime as R
from autopar.pipeline import schedules as S


@pytest.fixture(scope="module")
def setup():
    return reference()


# ---- the asynchronous timeline ----------------------------------------------------------------
@pytest.mark.parametrize("name,p,m", [("1f1b", 4, 8), ("gpipe", 4, 8), ("1f1b", 8, 32),
                                      ("eager_1f1b", 4, 8), ("1f1b", 2, 1)])
def test_async_timeline_is_the_textbook_one(name, p, m):
    """Equal stages, t_B = 2 t_F, free hops: every schedule takes (M + P - 1)(t_F + t_B), the
    bubble (P - 1) / (M + P - 1); the lockstep ticks of plain 1F1B do not (their hops idle)."""
    sch = S.build(name, p, 1, m)
    t = S.price_async(sch, lambda a: 1.0 if a.kind == "F" else 2.0)
    assert t.makespan_s == pytest.approx((m + p - 1) * 3.0)
    assert t.bubble_fraction == pytest.approx(S.ideal_bubble(name, p, 1, m))
    if name == "1f1b" and p >= 4:
        lock = S.price(sch, lambda a: 1.0 if a.kind == "F" else 2.0)
        assert lock.bubble_fraction > t.bubble_fraction + 0.1


def test_async_timeline_pays_hops_on_its_critical_path_and_issue_time():
    """A hop delays the first microbatch's way down and the last one's way back: 2 (P - 1) hops
    on the makespan of GPipe and eager 1F1B. Plain 1F1B holds too few microbatches to cover a
    round trip's hops in its steady state, so it pays more; an issuing cost longer than the
    actions paces them."""
    def cost(a):
        return 1.0 if a.kind == "F" else 2.0

    for name in ("gpipe", "eager_1f1b", "1f1b"):
        sch = S.build(name, 4, 1, 8)
        base = S.price_async(sch, cost)
        hop = S.price_async(sch, cost, lambda a: 0.25)
        if name == "1f1b":
            assert hop.makespan_s > base.makespan_s + 2 * 3 * 0.25 + 1.0
        else:
            assert hop.makespan_s == pytest.approx(base.makespan_s + 2 * 3 * 0.25)
    slow = S.price_async(sch, lambda a: 1e-3, issue_s=1.0)
    assert slow.makespan_s >= len(S.dispatch_order(sch)) * 1.0


def test_cpu_stages_share_the_host():
    """The cpu profile's devices share the host (``shared_compute_devices``): the planner's
    timelines get a pool of 8 devices over a stage's devices, none on a GPU profile; the MPMD
    timeline of actions far longer than the issuing and hops is then ``price_async``'s over
    that pool."""
    cpu, h100 = cost_models.hardware("cpu"), cost_models.hardware("h100")
    assert PL.compute_pool(cpu, {"stage": 4}, "stage") == 8
    assert PL.compute_pool(cpu, {"stage": 2, "data": 2, "model": 2}, "stage") == 2
    assert PL.compute_pool(h100, {"stage": 4}, "stage") is None
    sch = S.build("1f1b", 4, 1, 8)

    def cost(a):
        return 0.0 if a.kind == "F" and a.chunk == 3 else (1.0 if a.kind == "F" else 2.0)

    shared = PL.mpmd_timeline(sch, {"stage": 4}, "stage", cpu, cost, 1.0)
    own = PL.mpmd_timeline(sch, {"stage": 4}, "stage",
                           dataclasses.replace(cpu, shared_compute_devices=1), cost, 1.0)
    assert shared.makespan_s == pytest.approx(S.price_async(sch, cost, pool=8.0).makespan_s,
                                              rel=1e-2)
    assert own.makespan_s == pytest.approx(S.price_async(sch, cost).makespan_s, rel=1e-2)
    assert shared.makespan_s < own.makespan_s


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_cpu_profile_prices_both_runtimes_on_the_shared_host(setup, name):
    """What ``pipeline="auto"`` compares on the cpu profile: with issuing and the tick's fixed
    cost free, both runtimes are bound by the host's compute, which both timelines share among
    the busy stages, so their predicted steps come out alike (the MPMD one a little shorter:
    its last stage's forward only keeps its input). Priced with the slowest stage's time per
    tick, the lockstep step was 3.7-3.9x the MPMD one here."""
    step, state, batch, *_ = setup
    hw = dataclasses.replace(cost_models.hardware("cpu"), pipeline_issue_s=0.0,
                             pipeline_tick_s=0.0)
    pins = {"schedule": name, "microbatches": 4, "virtual_stages": 1}
    t = {rt: autopar.plan(step, state, batch, mesh={"stage": 4}, hardware=hw,
                          pipeline={**pins, "runtime": rt}).pipeline.step_time_s
         for rt in ("lockstep", "mpmd")}
    assert 0.85 <= t["mpmd"] / t["lockstep"] <= 1.0, t


def test_dispatch_order_keeps_each_stage_order_and_issues_inputs_first():
    sch = S.build("1f1b", 4, 1, 8)
    order = S.dispatch_order(sch)
    per_stage = S.orders("1f1b", 4, 1, 8)
    for s in range(4):
        assert [a for st, a in order if st == s] == per_stage[s]
    seen = set()
    for _, a in order:
        assert all(d in seen for d in S._deps(a, sch.chunks))
        seen.add(a)


def test_async_buffers_count_stash_and_inboxes():
    sch = S.build("1f1b", 4, 1, 8)
    t = S.price_async(sch, lambda a: 1.0 if a.kind == "F" else 2.0)
    held = S.held_async(t, 4, 4)
    # stage s keeps at most P - s chunk inputs, plus what waits in its inboxes
    assert all(h >= f for h, f in zip(held, S.in_flight(sch)))
    assert held[0] > held[-1]


# ---- the runtime ------------------------------------------------------------------------------
# 1F1B on MESH_A: test_mpmd_gradients_and_sgd_update_are_exact; GPIPE on MESH_B: the plan below
@pytest.mark.parametrize("shape,name", [(MESH_B, "eager_1f1b")])
def test_mpmd_step_equals_unsharded(setup, shape, name):
    step, state, batch, ref_state, ref_loss = setup
    run = mpmd.build_step(PM.staged_model_of(step), _mesh(shape),
                          S.build(name, shape["stage"], 1, 4))
    new, loss = run(state, batch)
    same_step(new, loss, ref_state, ref_loss)
    # the state comes back in the lockstep runtime's layout: a second step takes it as it is
    assert new["params"]["layers"]["mlp"]["fc1"]["kernel"].sharding.spec[0] == "stage"
    if shape is MESH_B:
        lock = R.build_step(PM.staged_model_of(step), _mesh(shape),
                            S.build(name, shape["stage"], 1, 4))
        again, lock_again = run(new, batch), lock(new, batch)
        np.testing.assert_allclose(float(again[1]), float(lock_again[1]), rtol=1e-6)


@pytest.mark.parametrize("shape,name", [(MESH_A, "1f1b"), (MESH_B, "zb_h1")])
def test_mpmd_gradients_and_sgd_update_are_exact(setup, shape, name):
    """1F1B, and ZB-H1 with each backward split into its input and weight programs
    (tests/test_pipeline_zero_bubble.py)."""
    step, state, batch, _, _ = setup
    model = dataclasses.replace(PM.staged_model_of(step), tx=optax.sgd(0.5))
    run = mpmd.build_step(model, _mesh(shape), S.build(name, shape["stage"], 1, 4))
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(model.loss))(state["params"], batch)
    st, bt = run.in_shardings_of(state, batch)
    loss, grads = run.loss_and_grads(jax.device_put(state, st)["params"],
                                     jax.device_put(batch, bt))
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert_scaled(grads, ref_grads, rel=1e-5)
    st = {"params": state["params"], "opt_state": model.tx.init(state["params"])}
    ref_new, _ = jax.jit(adamw_step(model.loss, model.tx))(st, batch)
    new, _ = run(st, batch)
    assert_scaled(new["params"], ref_new["params"], rel=2e-6)
    if name == "zb_h1":
        times = run.action_times(state, batch, runs=1)
        assert {k for k, _ in times} == {"F", "B", "W"}


def test_mpmd_refuses_what_it_cannot_run(setup):
    step, *_ = setup
    model = PM.staged_model_of(step)
    with pytest.raises(AutoparError, match="virtual_stages=2.*runtime='lockstep'"):
        mpmd.build_step(model, _mesh(MESH_A), S.build("1f1b", 2, 2, 4))
    with pytest.raises(AutoparError, match="unequal layer ranges"):
        mpmd.build_step(model, _mesh(MESH_A), S.build("1f1b", 2, 1, 4), ranges=((0, 3), (3, 4)))
    with pytest.raises(AutoparError, match="many programs"):
        mpmd.build_step(model, _mesh(MESH_A), S.build("1f1b", 2, 1, 4)).jitted(None, None)


# ---- the planner ------------------------------------------------------------------------------
def test_planner_prices_both_runtimes():
    """Unpinned, both runtimes are priced. On H100s with layers of real size the MPMD runtime's
    1F1B over four stages is predicted faster than the lockstep one (its stages do not wait for
    a tick's slowest stage and its last-stage forward is free), with a smaller bubble, and is
    chosen; on the CPU profile, where issuing an action (0.8 ms) outweighs a tiny layer's work,
    the lockstep runtime is."""
    cfg = gpt.GPTConfig(vocab=32000, seq=1024, d_model=2048, heads=16, d_ff=8192, layers=8,
                        scan=True)
    step, init = PM.gpt_train_step(cfg, LR)
    state = jax.eval_shape(lambda: init(jax.random.PRNGKey(0), 32))
    batch = jax.eval_shape(lambda: gpt.make_batch(cfg, 32))
    pins = {"schedule": "1f1b", "microbatches": 16}
    plan = autopar.plan(step, state, batch, mesh=MESH_B, hardware="h100", pipeline=pins)
    pp = plan.pipeline
    assert pp.runtime == "mpmd", pp.why
    assert "mpmd runtime" in plan.summary() and "(lockstep)" in pp.why
    lock = autopar.plan(step, state, batch, mesh=MESH_B, hardware="h100",
                        pipeline={**pins, "runtime": "lockstep"})
    assert lock.pipeline.runtime == "lockstep"
    assert pp.step_time_s < lock.pipeline.step_time_s
    assert pp.bubble_fraction < lock.pipeline.bubble_fraction


def test_small_cpu_steps_stay_lockstep(setup):
    step, state, batch, *_ = setup
    plan = autopar.plan(step, state, batch, mesh=MESH_B, hardware="cpu",
                        pipeline={"schedule": "1f1b", "microbatches": 4})
    assert plan.pipeline.runtime == "lockstep" and "(mpmd)" in plan.pipeline.why


def test_an_mpmd_plan_runs_and_round_trips(setup):
    """A plan pinned to the MPMD runtime records it, survives JSON (a plan written before the
    field reads as lockstep) and runs under ``autoparallel`` with the unsharded step's
    numbers."""
    step, state, batch, ref_state, ref_loss = setup
    plan = autopar.plan(step, state, batch, mesh=MESH_B, hardware="cpu",
                        pipeline={"schedule": "gpipe", "microbatches": 4, "runtime": "mpmd"})
    pp = plan.pipeline
    assert pp.runtime == "mpmd" and "mpmd runtime" in plan.summary()
    back = autopar.Plan.from_json(plan.to_json())
    assert back.pipeline == pp
    written = json.loads(plan.to_json())
    del written["pipeline"]["runtime"]              # a plan written before: lockstep
    assert autopar.Plan.from_json(json.dumps(written)).pipeline.runtime == "lockstep"
    written["pipeline"]["runtime"] = "async"
    with pytest.raises(PlanError, match="pipeline.runtime must be one of"):
        autopar.Plan.from_json(json.dumps(written))
    run = autopar.autoparallel(step, mesh=_mesh(MESH_B), plan=back)
    new, loss = run(state, batch)
    same_step(new, loss, ref_state, ref_loss)


def test_mpmd_plan_predicts_its_measured_peak(setup):
    """The MPMD plan's predicted peak (state, stash and inboxes from the asynchronous timeline,
    one chunk's backward) against the peak measured by running the step one action at a time
    (the buffers it holds plus each program's XLA temporaries)."""
    step, state, batch, *_ = setup
    plan = autopar.plan(step, state, batch, mesh=MESH_B, hardware="cpu",
                        pipeline={"schedule": "1f1b", "microbatches": 4, "runtime": "mpmd"})
    run = PL.executable(plan, step, _mesh(MESH_B))
    measured = run.measure_peak(state, batch)
    ratio = max(plan.pipeline.stage_memory_bytes) / measured
    print(f"mpmd predicted/measured peak {ratio:.3f}")
    assert 0.8 <= ratio <= 1.2, ratio


def test_runtime_pins(setup):
    step, state, batch, *_ = setup
    with pytest.raises(AutoparError, match="runtime='fast' must be one of"):
        autopar.plan(step, state, batch, mesh=MESH_A, pipeline={"runtime": "fast"})
    with pytest.raises(AutoparError, match="runtime='mpmd' cannot run.*virtual_stages=4"):
        autopar.plan(step, state, batch, mesh=MESH_A,
                     pipeline={"runtime": "mpmd", "virtual_stages": 4})
    with pytest.raises(AutoparError, match="runtime='mpmd' cannot run.*virtual_stages=2.*zb_v"):
        autopar.plan(step, state, batch, mesh=MESH_A,
                     pipeline={"runtime": "mpmd", "virtual_stages": 2, "schedule": "1f1b"})
    # two chunks per stage run on the MPMD runtime in a V only
    v = autopar.plan(step, state, batch, mesh=MESH_A, hardware="cpu",
                     pipeline={"runtime": "mpmd", "virtual_stages": 2}).pipeline
    assert (v.schedule, v.runtime) == ("zb_v", "mpmd")
    hw = cost_models.hardware("cpu")
    assert hw.pipeline_issue_s > 0
