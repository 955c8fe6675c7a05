"""The step's own ``with_sharding_constraint`` calls (``autopar.planner.constraints``): auto plans
those values' layouts freely and the program runs what it priced (XLA's collectives equal the
plan's); the "user" strategy keeps them as written; ``Plan.constraints`` says which the plan
follows; flax's logical constraints are traced where the caller set a mesh."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numerics
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar.errors import PlanError, ShardingError
from autopar.models import zoo
from autopar.strategies.user import constraints_only
from autopar.verify import verify

LR = 0.1


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


MESH = _mesh()


def _step(params, x):
    """One SGD step of a 2-matrix MLP whose hidden activation the user constrains to
    rows-on-data x features-on-model, and its output's rows to data (features left open)."""
    def loss(p):
        h = jnp.tanh(x @ p["w1"])
        h = jax.lax.with_sharding_constraint(h, NamedSharding(MESH, P("data", "model")))
        y = jax.lax.with_sharding_constraint(h @ p["w2"], NamedSharding(MESH, P("data",
                                                                               P.UNCONSTRAINED)))
        return jnp.mean(y ** 2)
    value, g = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda a, b: a - LR * b, params, g), value


def _args():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    return ({"w1": jax.random.normal(k1, (256, 1024)) * 0.05,
             "w2": jax.random.normal(k2, (1024, 256)) * 0.05},
            jax.random.normal(k3, (64, 256)))


@pytest.fixture(scope="module")
def planned():
    """The step run under auto and under the user's own constraints: ``{name: (step, out)}``."""
    args = _args()
    out = {}
    for name, strategy in (("auto", "auto"), ("user", constraints_only())):
        step = autopar.autoparallel(_step, mesh=MESH, hardware="cpu", strategy=strategy,
                                    time_limit_s=5)
        out[name] = (step, step(*args))
    return out, args


@pytest.mark.parametrize("name", ["auto", "user"])
def test_the_program_runs_the_layouts_the_plan_priced(planned, name):
    """Each plan's collective bytes equal XLA's (before the planner read the constraints, auto's
    plan priced a replicated op where the program kept the user's layout: all-reduce predicted
    256 KiB, measured 4 B), and the step computes the unsharded step's numbers."""
    got, args = planned
    step, out = got[name]
    report = verify(step.plan, step.lower(*args).compile())
    comm = [c for c in report.checks if c.metric.endswith("bytes") and c.metric != "HBM bytes"]
    assert comm and all(c.ok for c in comm), report
    want = jax.jit(_step)(*args)
    numerics.assert_same_step(out[0], want[0], lr=LR, got_loss=out[1], want_loss=want[1])


def test_user_keeps_the_constraints_auto_may_not(planned):
    got, _ = planned
    user, auto = got["user"][0].plan, got["auto"][0].plan
    asked = {c.asked for c in user.constraints}
    assert asked == {"S(data)xS(model)", "S(data)x*"}
    assert all(c.followed for c in user.constraints)
    assert all("test_user_constraints.py" in c.source for c in user.constraints)
    # auto holds its plan against the user's (its start), so it is never predicted slower
    assert auto.cost.step_time_s <= user.cost.step_time_s * (1 + 1e-9)
    assert {c.asked for c in auto.constraints} == asked
    lines = [ln for ln in auto.summary().splitlines() if "sharding constraints" in ln]
    followed = sum(c.followed for c in auto.constraints)
    assert lines == [lines[0]] and f"{followed} of {len(auto.constraints)} followed" in lines[0]
    assert "sharding constraints" in auto._repr_html_()


def test_constraints_round_trip_and_a_damaged_row_is_refused(planned):
    plan = planned[0]["user"][0].plan
    assert autopar.Plan.from_json(plan.to_json()).constraints == plan.constraints
    damaged = plan.to_json().replace('"followed": true', '"followed": false', 1)
    with pytest.raises(PlanError, match=r"constraints\[0\]: followed=False disagrees"):
        autopar.Plan.from_json(damaged)


def test_user_on_a_mesh_without_the_constrained_axis_says_which_line():
    with pytest.raises(ShardingError, match=r"test_user_constraints.py:\d+.*asks for layout "
                                            r"S\(data\)xS\(model\).*has no axis \['model'\]"):
        autopar.plan(_step, *_args(), mesh={"data": 8}, hardware="cpu",
                     strategy=constraints_only(), time_limit_s=2)


def test_flax_logical_constraints_are_traced_under_the_callers_mesh():
    """The linen LM's ``nn.with_logical_constraint`` calls make constraints only under a mesh:
    called inside ``jax.set_mesh``, the user's layout plans them as written; outside, the step
    holds none, as its plain ``jax.jit`` would."""
    cfg = zoo.Config(layers=1, width=32, ff=64, heads=4, batch=8)
    fn, *args = zoo.linen_lm(cfg)
    held = jax.device_put(tuple(args), zoo.linen_user_layout(cfg, MESH))
    with jax.set_mesh(MESH):
        inside = autopar.plan(fn, *held, mesh=MESH, hardware="cpu", strategy="user",
                              time_limit_s=5)
    outside = autopar.plan(fn, *held, mesh=MESH, hardware="cpu", strategy="user", time_limit_s=5)
    assert len(inside.constraints) >= 4 and all(c.followed for c in inside.constraints)
    assert {c.asked for c in inside.constraints} >= {"S(data)xRxR", "S(data)xRxS(model)"}
    assert outside.constraints == ()
    with pytest.raises(PlanError, match=r"made for a step with \d+ sharding constraint\(s\), "
                                        r"this one has 0.*both inside jax.set_mesh"):
        autopar.autoparallel(fn, mesh=MESH, plan=inside)(*held)


def test_a_step_built_from_a_plan_inside_the_mesh_traces_as_the_plan_did():
    """autopar lowers under its own context mesh; the trace still takes the caller's axes, so a
    plan made inside ``jax.set_mesh`` applies to the step lowered there, flax's constraints
    included."""
    cfg = zoo.Config(layers=1, width=32, ff=64, heads=4, batch=8)
    fn, *args = zoo.linen_lm(cfg)
    held = jax.device_put(tuple(args), zoo.linen_user_layout(cfg, MESH))
    with jax.set_mesh(MESH):
        plan = autopar.plan(fn, *held, mesh=MESH, hardware="cpu", time_limit_s=5)
        step = autopar.autoparallel(fn, mesh=MESH, plan=plan)
        step.lower(*held).compile()
        out = step(*held)
    assert plan.constraints and step.plan.constraints == plan.constraints
    want = jax.jit(fn)(*held)
    numerics.assert_same_step(out[0], want[0], lr=cfg.lr, got_loss=out[2], want_loss=want[2],
                              got_mu=out[1][0].mu, want_mu=want[1][0].mu)
