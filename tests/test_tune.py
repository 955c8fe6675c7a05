"""``autoparallel(tune=...)``: the first call times auto's plan against the runners-up the cost
model cannot tell apart from it, and runs the fastest (``autopar.tune``), with numerics equal to
the unsharded step, its times in ``Plan.tuned``, and bad options refused before planning."""
from __future__ import annotations

import jax
import numerics
import numpy as np
import pytest

import autopar
from autopar import tune
from autopar.errors import AutoparError, PlanError
from autopar.models import zoo

TINY = zoo.Config(layers=1, width=32, ff=64, heads=4, batch=8)
WITHIN = 0.5        # on TINY the user's layout is predicted 1.33x auto's step
# The strategies a tuned step plans beside auto and the user's layout, cut to two here: the
# mechanism is the same for nine, and each costs a plan (and a compile when near).
STARTS = ("dp", "megatron")


@pytest.fixture(autouse=True)
def _two_starts(monkeypatch):
    monkeypatch.setattr(tune, "STARTS", STARTS)


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def _linen(mesh):
    """The linen LM, its arguments committed to the user's own layout (MaxText-style rules)."""
    fn, *args = zoo.linen_lm(TINY)
    return fn, args, jax.device_put(tuple(args), zoo.linen_user_layout(TINY, mesh))


def _fake_times(fastest: str, gain: float):
    """A timer that runs nothing and measures ``fastest`` ``gain`` faster than the rest."""
    seen = []

    def timer(runs, rounds):
        seen.append(list(runs))
        return {n: (1.0 - gain if n == fastest else 1.0) for n in runs}
    return timer, seen


def _check_numerics(fn, args, out):
    want = jax.jit(fn)(*args)
    numerics.assert_same_step(out[0], want[0], lr=TINY.lr, got_loss=out[2], want_loss=want[2],
                              got_mu=out[1][0].mu, want_mu=want[1][0].mu)


@pytest.fixture(scope="module")
def user_won():
    """A tuned step on the linen LM whose timer (fixed, runs nothing) measures the user's own
    layout 10% faster than the rest: lowered from ShapeDtypeStructs first (nothing to time),
    then called with the arrays. ``(step, plan after lower, the timer's calls, arguments,
    the call's outputs)``."""
    mesh = _mesh()
    fn, args, held = _linen(mesh)
    timer, seen = _fake_times("user", 0.10)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tune, "interleaved", timer)
        mp.setattr(tune, "STARTS", STARTS)
        step = autopar.autoparallel(fn, mesh=mesh, hardware="cpu", tune=WITHIN, time_limit_s=5)
        step.lower(*jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                           held))
        lowered = step.plan
        out = step(*held)
    return step, lowered, seen, (fn, args), out


def test_a_tuned_step_runs_the_plan_measured_fastest(user_won):
    """The step runs the user's layout, says so in ``Plan.tuned`` and its summary, saves it
    in its JSON, and computes the unsharded step."""
    step, _, seen, (fn, args), out = user_won
    plan = step.plan
    assert plan.strategy == "user"
    assert plan.tuned[0].strategy == "user" and plan.tuned[0].measured_s == pytest.approx(0.9)
    timed = seen[0]
    assert timed[0] == "auto" and "user" in timed
    rows = {r.strategy: r for r in plan.tuned}
    auto = rows["auto"].step_time_s
    for r in plan.tuned:        # every plan within WITHIN of auto's prediction is timed or
        if r.error.startswith("not timed"):                 # shares a timed program; none past
            assert r.step_time_s > auto * (1 + WITHIN)
        elif r.measured_s is not None:
            assert r.step_time_s <= auto * (1 + WITHIN) + 1e-12
            assert r.strategy in timed or r.same_as in timed
    assert "chosen by timing" in plan.summary()
    _check_numerics(fn, args, out)
    assert autopar.Plan.from_json(plan.to_json()).tuned == plan.tuned


def test_the_users_own_jit_program_is_a_candidate_and_runs_as_jax_jit_would():
    """With committed arguments, the user's layout is also timed as the user's ``jax.jit`` runs
    it (``tune.xla_layouts``: no pins, XLA's propagation lays out the activations); when it is
    measured fastest the step runs it, computing the unsharded step, and its summary says its
    prediction is not of this program."""
    mesh = _mesh()
    fn, args, held = _linen(mesh)
    timer, seen = _fake_times(tune.XLA_LAYOUTS, 0.10)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tune, "interleaved", timer)
        step = autopar.autoparallel(fn, mesh=mesh, hardware="cpu", tune=WITHIN, time_limit_s=5)
        out = step(*held)
    plan = step.plan
    assert tune.XLA_LAYOUTS in seen[0] and plan.strategy == tune.XLA_LAYOUTS
    assert plan.pins == () and "XLA's sharding propagation" in plan.summary()
    user = next(r for r in plan.tuned if r.strategy == "user")
    assert plan.tuned[0].step_time_s == user.step_time_s      # priced as the user's plan
    _check_numerics(fn, args, out)


def test_lowered_without_arrays_then_tuned_at_the_first_call(user_won):
    """``lower`` of abstract arguments cannot time anything: the first call with arrays plans
    again, tuned, so tune= never passes silently."""
    step, lowered, seen, _, _ = user_won
    assert lowered.tuned == () and len(seen) == 1
    assert step.plan.strategy == "user" and step.plan.tuned


def test_auto_is_kept_unless_another_plan_is_measured_clearly_faster():
    gain = 1.0 - tune.MARGIN
    assert tune.pick({"auto": 1.0, "user": gain * 1.001, "dp": 1.2}) == "auto"
    assert tune.pick({"auto": 1.0, "user": gain * 0.999, "dp": 1.2}) == "user"
    assert tune.pick({"auto": 1.0, "user": 1.1}) == "auto"


def test_a_tuned_step_times_for_real_and_matches_the_unsharded_step():
    """No timer fixed (autopar's MLP, every plan within 2x auto's timed): the chosen plan is the
    fastest measured or auto's within the margin, its numerics are the unsharded step's, and a
    later call reuses it (no second tuning)."""
    from autopar.models import mlp

    fn, state, batch = mlp.make(64, 256, 2, 32)
    step = autopar.autoparallel(fn, mesh=_mesh(), hardware="cpu", tune=1.0, time_limit_s=5)
    out = step(state, batch)
    plan = step.plan
    timed = [r for r in plan.tuned if r.measured_s is not None]
    assert len({r.same_as or r.strategy for r in timed}) >= 2, plan.tuned
    chosen = plan.tuned[0]
    auto = next(r for r in timed if r.strategy == "auto")
    fastest = min(r.measured_s for r in timed)
    assert chosen.measured_s == fastest or (
        chosen.strategy == "auto" and fastest > auto.measured_s * (1 - tune.MARGIN))
    want = jax.jit(fn)(state, batch)
    numerics.assert_loss(out[1], want[1])
    numerics.assert_params(out[0]["params"], want[0]["params"], lr=1e-3,
                           grads=want[0]["opt_state"][0].mu)
    step(state, batch)
    assert step.plan is plan


def test_nothing_is_timed_when_no_other_program_is_predicted_near(monkeypatch):
    """autopar's MLP on 2 x 4: every hand-written plan is predicted 1.47x auto's or slower, so
    the step runs auto's plan untimed, and says so."""
    from autopar.models import mlp

    def timer(runs, rounds):
        raise AssertionError(f"timed {list(runs)}")

    monkeypatch.setattr(tune, "interleaved", timer)
    fn, state, batch = mlp.make(64, 256, 2, 32)
    step = autopar.autoparallel(fn, mesh=_mesh(), hardware="cpu", tune=True, time_limit_s=5)
    step(state, batch)
    first = step.plan.tuned[0]
    assert first.strategy == "auto" and first.measured_s is None
    assert "no other program predicted within 25%" in first.error     # the cpu profile's band
    assert all(r.measured_s is None for r in step.plan.tuned)
    assert "no other plan was near enough" in step.plan.summary()


def test_tune_true_times_as_far_as_the_hardware_ranking_was_measured_wrong(monkeypatch):
    """``tune=True`` times the plans within the profile's ``ranking_error`` of auto's (0.25 on
    the cpu profile, from the zoo), at least ``tune.WITHIN``; a fraction given is kept."""
    import dataclasses

    import cost_models

    seen = []

    class Stop(Exception):
        pass

    def spy(*args, within, **kw):
        seen.append(within)
        raise Stop

    monkeypatch.setattr(tune, "candidates", spy)
    cpu = cost_models.hardware("cpu")
    unmeasured = dataclasses.replace(cpu, name="cpu-unranked", ranking_error=0.0)
    x = jax.device_put(np.ones((8, 4), np.float32))
    for hardware, value in ((cpu, True), (unmeasured, True), (cpu, 0.5)):
        step = autopar.autoparallel(lambda x: x * 2, mesh=_mesh(), hardware=hardware, tune=value)
        with pytest.raises(Stop):
            step(x)
    assert seen == [0.25, tune.WITHIN, 0.5]
    with pytest.raises(cost_models.CostModelError, match="ranking_error=-0.1 must be in"):
        dataclasses.replace(cpu, ranking_error=-0.1)


def test_interleaved_rounds_rotate_the_order():
    order = []
    runs = {n: (lambda n=n: order.append(n) or 0.0) for n in "abc"}
    tune.interleaved(runs, 3)
    rounds = [order[k:k + 3] for k in range(0, len(order), 3)]
    assert [r[0] for r in rounds[1:]] == ["b", "c", "a"]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)


@pytest.mark.parametrize("kwargs, match", [
    (dict(tune=True, strategy="dp"), r"strategy='dp' there is one plan"),
    (dict(tune=-0.5), r"tune=-0.5: give True, or a fraction"),
    (dict(tune="yes"), r"tune='yes' \(str\) must be a number"),
    (dict(tune=True, host_local_argnums=(1,)), r"host-local batches are not yet"),
    (dict(tune=True, pipeline="auto"), r"does not combine with tune="),
])
def test_bad_tune_options_are_refused_at_decoration(kwargs, match):
    with pytest.raises(AutoparError, match=match):
        autopar.autoparallel(lambda x: x, mesh={"data": 8}, **kwargs)


def test_tune_with_a_saved_plan_is_refused():
    mesh = _mesh()
    fn, *args = zoo.linen_lm(TINY, abstract=True)
    plan = autopar.plan(fn, *args, mesh=mesh, hardware="cpu", strategy="dp")
    with pytest.raises(AutoparError, match="plan= applies a saved one"):
        autopar.autoparallel(fn, mesh=mesh, plan=plan, tune=True)


def test_a_damaged_tuned_row_is_refused_on_load(user_won):
    import json

    d = json.loads(user_won[0].plan.to_json())
    d["tuned"][0]["error"] = "also an error"
    with pytest.raises(PlanError, match=r"tuned\[0\]: a timed candidate has a measured step or"):
        autopar.Plan.from_json(json.dumps(d))
