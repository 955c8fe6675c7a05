"""Zero-bubble pipelines: a layer's backward split into its input and weight halves
(``autopar.pipeline.split``), the ZB-H1 schedule, its run on the MPMD runtime and its choice by
the planner."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _pipeline_gpt import CFG, LR, MESH_A, MESH_B, reference, same_step
from _pipeline_gpt import mesh as _mesh
from numerics import assert_scaled

import autopar
from autopar.errors import AutoparError
from autopar.models import gpt
from autopar.pipeline import model as PM
from autopar.pipeline import mpmd
from autopar.pipeline import planning as PL
from autopar.pipeline import runtime as R
from autopar.pipeline import schedules as S
from autopar.pipeline import split as SP


@pytest.fixture(scope="module")
def setup():
    return reference()


# ---- the split --------------------------------------------------------------------------------
def _equinox_layer():
    eqx = pytest.importorskip("equinox")

    class Block(eqx.Module):         # a pre-norm residual MLP, as Equinox's docs write modules
        norm: eqx.nn.LayerNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, d, key):
            k1, k2 = jax.random.split(key)
            self.norm = eqx.nn.LayerNorm(d)
            self.up, self.down = eqx.nn.Linear(d, 4 * d, key=k1), eqx.nn.Linear(4 * d, d, key=k2)

        def __call__(self, x):
            return x + self.down(jax.nn.gelu(self.up(self.norm(x))))

    block = Block(16, jax.random.PRNGKey(3))
    params, static = eqx.partition(block, eqx.is_array)

    def layer(p, h):
        return jax.vmap(jax.vmap(eqx.combine(p, static)))(h)

    return layer, params, (4, 8, 16)


def _nnx_layer():
    from flax import nnx

    class Block(nnx.Module):         # attention and an MLP, as the Flax NNX docs build them
        def __init__(self, d, rngs):
            self.ln = nnx.LayerNorm(d, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=d, decode=False,
                                               rngs=rngs)
            self.fc = nnx.Linear(d, 2 * d, rngs=rngs)
            self.out = nnx.Linear(2 * d, d, rngs=rngs)

        def __call__(self, x):
            x = x + self.attn(self.ln(x))
            return x + self.out(nnx.relu(self.fc(x)))

    graphdef, params = nnx.split(Block(16, nnx.Rngs(0)))

    def layer(p, h):
        return nnx.merge(graphdef, p)(h)

    return layer, params, (4, 8, 16)


def _remat_layer():
    layer, params, shape = _equinox_layer()
    return jax.checkpoint(layer), params, shape


@pytest.mark.parametrize("make", [_equinox_layer, _nnx_layer, _remat_layer],
                         ids=["equinox", "nnx", "remat"])
def test_the_halves_are_the_layers_vjp(make):
    """Forward, input half then weight half give exactly what ``jax.vjp`` gives, jitted, on
    layers written with Equinox and Flax NNX (this project's GPT layer: the runtime's tests),
    and on a remat'd one (the split opens the remat); the halves' FLOPs add up to the
    backward's (nothing recomputed twice, nothing lost) and the weight half has some of them;
    the frontier holds no parameter."""
    layer, p, shape = make()
    h = jax.random.normal(jax.random.PRNGKey(1), shape)
    dy = jax.random.normal(jax.random.PRNGKey(2), shape)
    sp = SP.split_layer(layer, p, h)

    @jax.jit
    def halves(p, h, dy):
        y, saved = sp.forward(p, h)
        dh, front = sp.input_grad(p, saved, dy)
        return y, dh, sp.weight_grad(p, front)

    y, dh, dp = halves(p, h, dy)
    ry, vjp = jax.vjp(layer, p, h)
    rdp, rdh = vjp(dy)
    np.testing.assert_allclose(y, ry, rtol=1e-6, atol=1e-6)
    assert_scaled(dh, rdh, rel=1e-6)
    # a key bias's gradient is zero in exact arithmetic (softmax ignores a shift): rounding
    # noise on the scale of the step's largest gradient, not its own
    top = max(float(jnp.abs(g).max()) for g in jax.tree_util.tree_leaves(rdp))
    assert_scaled(dp, rdp, rel=1e-6, atol=1e-6 * top)
    backward = jax.make_jaxpr(lambda p, h, dy: jax.vjp(layer, p, h)[1](dy))(p, h, dy)
    forward = jax.make_jaxpr(layer)(p, h)
    whole = SP._flops(backward.jaxpr.eqns) - SP._flops(forward.jaxpr.eqns)
    assert sp.flops[1] + sp.flops[2] == pytest.approx(whole)
    assert 0.1 < sp.weight_fraction < 0.5
    weights = {(a.shape, a.dtype) for a in jax.tree_util.tree_leaves(p) if a.ndim == 2}
    assert not weights & {(f.shape, f.dtype) for f in sp.frontier}


# ---- the schedule -----------------------------------------------------------------------------
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (3, 7), (8, 32)])
def test_zb_h1_timeline(p, m):
    """Equal F, B and W, free hops: ZB-H1 takes 3 M + P - 1 (its bubble (P - 1)(t_F + t_B -
    t_W)), 1F1B with the backward whole 3 (M + P - 1); each stage runs every action once, a
    ``W`` after its ``B``, and stage ``s`` defers ``s`` weight gradients."""
    sch = S.build("zb_h1", p, 1, m)
    unit = S.price_async(sch, lambda a: 1.0)
    assert unit.makespan_s == pytest.approx(3 * m + p - 1)
    whole = S.price_async(S.build("1f1b", p, 1, m), lambda a: 1.0 if a.kind == "F" else 2.0)
    assert whole.makespan_s == pytest.approx(3 * (m + p - 1))
    assert unit.bubble_fraction < whole.bubble_fraction
    for s, order in enumerate(S.orders("zb_h1", p, 1, m)):
        assert sorted((a.kind, a.mb) for a in order) == sorted(
            (k, i) for k in "FBW" for i in range(m))
        first_w = next(i for i, a in enumerate(order) if a.kind == "W")
        assert sum(a.kind == "B" for a in order[:first_w]) == min(s, m - 1) + 1
        for i, a in enumerate(order):
            if a.kind == "W":
                assert S.Action("B", a.mb, a.chunk) in order[:i]
    assert S.frontiers_async(unit, p) == tuple(min(s, m - 1) + 1 for s in range(p))
    assert S.frontiers_async(whole, p) == (0,) * p


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zb_v_places_its_chunks_in_a_v(p):
    """Chunk ``k`` on stage ``k``, then back up: stage ``s`` holds chunks ``s`` and
    ``2 P - 1 - s``, so the turn (chunks ``P - 1``, ``P``) and both ends share a stage; the
    interleaved schedules keep ``k % P``."""
    sch = S.build("ZB-V", p, 2, 2 * p)
    assert sch.name == "zb_v"
    assert [sch.stage_of(k) for k in range(2 * p)] == [*range(p), *range(p - 1, -1, -1)]
    assert all(sch.chunks_on(s) == (s, 2 * p - 1 - s) for s in range(p))
    assert S.placement("1f1b", p, 2) == tuple(k % p for k in range(2 * p))


@pytest.mark.parametrize("p,m", [(2, 1), (2, 3), (2, 4), (3, 2), (3, 7), (4, 4), (4, 8),
                                 (4, 16), (5, 9), (8, 12), (8, 32)])
def test_zb_v_runs_every_action_once_after_its_inputs(p, m):
    """Each stage's order holds ``F``, ``B`` and ``W`` of every microbatch for its two chunks
    once, ``W`` after its ``B``; run asynchronously with uneven action times every action
    starts after what it reads ended, and the lockstep ticks (``build``) finish too."""
    sch = S.build("zb_v", p, 2, m)
    for s, order in enumerate(S.orders("zb_v", p, 2, m)):
        assert sorted((a.kind, a.mb, a.chunk) for a in order) == sorted(
            (k, i, c) for k in "FBW" for i in range(m) for c in (s, 2 * p - 1 - s))
        for i, a in enumerate(order):
            if a.kind == "W":
                assert S.Action("B", a.mb, a.chunk) in order[:i]
    times = {"F": 1.0, "B": 1.7, "W": 0.6}
    tl = S.price_async(sch, lambda a: times[a.kind] * (1 + 0.1 * (a.chunk % 3)))
    span = {a: (s, t0, t1) for s, t0, t1, a in tl.spans}
    assert len(span) == 3 * m * 2 * p
    for a, (s, t0, _) in span.items():
        assert s == sch.stage_of(a.chunk)
        for d in S._deps(a, sch.chunks):
            assert span[d][2] <= t0 + 1e-12, (a, d)
    assert len(sch.when()) == 3 * m * 2 * p


@pytest.mark.parametrize("p,m", [(2, 3), (2, 8), (4, 7), (4, 16), (8, 15), (8, 32)])
def test_zb_v_bubble_at_equal_times(p, m):
    """Equal ``F``, ``B`` and ``W`` chunk times, free hops, ``M >= 2 P - 1``: the step takes
    ``6 M + P - 1`` (a stage idles only while the first forward goes down the V, which no
    schedule avoids), half ZB-H1's idle at the same stage times; every stage holds ``2 P``
    chunk inputs at its peak and stage ``s`` up to ``2 s + 1`` frontiers."""
    sch = S.build("zb_v", p, 2, m)
    tl = S.price_async(sch, lambda a: 1.0)
    assert tl.makespan_s == pytest.approx(6 * m + p - 1)
    assert tl.bubble_fraction == pytest.approx(S.ideal_bubble("zb_v", p, 2, m))
    h1 = S.price_async(S.build("zb_h1", p, 1, m), lambda a: 2.0)     # a stage's whole share
    assert h1.makespan_s - 6 * m == pytest.approx(2 * (p - 1))
    assert tl.bubble_fraction < h1.bubble_fraction
    assert S.in_flight(sch) == (2 * p,) * p
    assert S.frontiers_async(tl, p) == tuple(2 * s + 1 for s in range(p))


def test_zb_v_refuses_what_it_cannot_be():
    with pytest.raises(AutoparError, match="needs virtual_stages=2, not 1"):
        S.build("zb_v", 4, 1, 8)
    with pytest.raises(AutoparError, match="needs stages >= 2"):
        S.build("zb_v", 1, 2, 8)
    with pytest.raises(AutoparError, match="unknown; use one of.*zb_v"):
        S.build("zb_w", 2, 2, 4)


def test_split_schedules_are_refused_where_they_cannot_run(setup):
    step, state, batch, *_ = setup
    model = PM.staged_model_of(step)
    with pytest.raises(AutoparError, match="use virtual_stages=1"):
        S.build("zb_h1", 2, 2, 4)
    with pytest.raises(AutoparError, match="lockstep runtime's ticks do not run"):
        R.build_step(model, _mesh(MESH_A), S.build("zb_h1", 2, 1, 4))
    with pytest.raises(AutoparError, match="MPMD runtime only.*lockstep runtime does not"):
        autopar.plan(step, state, batch, mesh=MESH_A,
                     pipeline={"schedule": "zb_h1", "runtime": "lockstep"})


# ---- the runtime (SGD gradients exact: test_pipeline_mpmd) -------------------------------------
def test_a_zb_h1_plan_runs_round_trips_and_predicts_its_peak(setup):
    """Pinned on {stage: 2, data: 2, model: 2} (the tensor axis inside each stage), the plan
    records the schedule, survives JSON, runs under ``autoparallel`` with the unsharded step's
    numbers (loss, Adam's moments, parameters), and its predicted peak (the stash, inboxes and
    the frontiers held from each B to its W) matches the peak measured one action at a time."""
    step, state, batch, ref_state, ref_loss = setup
    plan = autopar.plan(step, state, batch, mesh=MESH_A, hardware="cpu",
                        pipeline={"schedule": "zb_h1", "microbatches": 4})
    pp = plan.pipeline
    assert (pp.schedule, pp.runtime) == ("zb_h1", "mpmd")
    back = autopar.Plan.from_json(plan.to_json())
    assert back.pipeline == pp and json.loads(plan.to_json())["pipeline"]["schedule"] == "zb_h1"
    run = autopar.autoparallel(step, mesh=_mesh(MESH_A), plan=back)
    new, loss = run(state, batch)
    same_step(new, loss, ref_state, ref_loss)
    measured = PL.executable(plan, step, _mesh(MESH_A)).measure_peak(state, batch)
    ratio = max(pp.stage_memory_bytes) / measured
    print(f"zb_h1 predicted/measured peak {ratio:.3f}")
    assert 0.8 <= ratio <= 1.2, ratio


@pytest.mark.parametrize("shape,layers", [(MESH_A, 4), (MESH_B, 8)], ids=["2x2x2", "4x2"])
def test_zb_v_on_mpmd_equals_unsharded(shape, layers):
    """ZB-V on the MPMD runtime (each chunk's layers copied to the stage of its V, split
    backwards, the last chunk on stage 0) computes the unsharded step's loss, Adam moments and
    parameters, and hands the state back in the lockstep runtime's layout."""
    cfg = dataclasses.replace(CFG, layers=layers)
    step, init = PM.gpt_train_step(cfg, LR)
    state, batch = init(jax.random.PRNGKey(0), 8), gpt.make_batch(cfg, 8)
    ref_state, ref_loss = jax.jit(step)(state, batch)
    run = mpmd.build_step(PM.staged_model_of(step), _mesh(shape),
                          S.build("zb_v", shape["stage"], 2, 4))
    new, loss = run(state, batch)
    same_step(new, loss, ref_state, ref_loss)
    assert new["params"]["layers"]["mlp"]["fc1"]["kernel"].sharding.spec[0] == "stage"


def test_a_zb_v_plan_runs_round_trips_and_predicts_its_peak(setup):
    """Pinned on {stage: 2, data: 2, model: 2}, ``zb_v`` plans two chunks per stage in a V on
    the MPMD runtime, survives JSON, runs with the unsharded step's numbers, and its predicted
    peak (stash, inboxes, frontiers and the chunks' copied layers) is within 20% of the
    measured one."""
    step, state, batch, ref_state, ref_loss = setup
    plan = autopar.plan(step, state, batch, mesh=MESH_A, hardware="cpu",
                        pipeline={"schedule": "ZB-V", "microbatches": 4})
    pp = plan.pipeline
    assert (pp.schedule, pp.virtual_stages, pp.runtime) == ("zb_v", 2, "mpmd")
    assert pp.chunk_stages() == (0, 1, 1, 0)
    back = autopar.Plan.from_json(plan.to_json())
    assert back.pipeline == pp
    new, loss = autopar.autoparallel(step, mesh=_mesh(MESH_A), plan=back)(state, batch)
    same_step(new, loss, ref_state, ref_loss)
    measured = PL.executable(plan, step, _mesh(MESH_A)).measure_peak(state, batch)
    ratio = max(pp.stage_memory_bytes) / measured
    print(f"zb_v predicted/measured peak {ratio:.3f}")
    assert 0.8 <= ratio <= 1.2, ratio


def test_zb_v_is_refused_where_it_cannot_run(setup):
    step, state, batch, *_ = setup
    model = PM.staged_model_of(step)
    with pytest.raises(AutoparError, match="lockstep runtime's ticks do not run"):
        R.build_step(model, _mesh(MESH_A), S.build("zb_v", 2, 2, 4))
    with pytest.raises(AutoparError, match="MPMD runtime only.*lockstep runtime does not"):
        autopar.plan(step, state, batch, mesh=MESH_A,
                     pipeline={"schedule": "zb_v", "runtime": "lockstep"})
    with pytest.raises(AutoparError, match="layers do not split into stages x virtual_stages = 8"):
        mpmd.build_step(model, _mesh(MESH_B), S.build("zb_v", 4, 2, 4))
    with pytest.raises(AutoparError, match="4 layers do not split into 8; use a stage count"):
        autopar.plan(step, state, batch, mesh=MESH_B, pipeline={"schedule": "zb_v"})
    with pytest.raises(AutoparError, match="needs virtual_stages=2, not 4"):
        autopar.plan(step, state, batch, mesh=MESH_A,
                     pipeline={"schedule": "zb_v", "virtual_stages": 4})


# ---- the planner ------------------------------------------------------------------------------
def test_planner_trades_zb_h1s_frontiers_for_its_bubble():
    """On H100s with layers of real size the planner picks ZB-H1 over 1F1B on the MPMD runtime
    (a smaller bubble, a faster step), paying the frontiers in memory; under a budget between
    the two peaks it keeps 1F1B."""
    cfg = gpt.GPTConfig(vocab=32000, seq=1024, d_model=2048, heads=16, d_ff=8192, layers=8,
                        scan=True)
    step, init = PM.gpt_train_step(cfg, LR)
    state = jax.eval_shape(lambda: init(jax.random.PRNGKey(0), 32))
    batch = jax.eval_shape(lambda: gpt.make_batch(cfg, 32))
    zb = autopar.plan(step, state, batch, mesh=MESH_B, hardware="h100",
                      pipeline={"microbatches": 16, "runtime": "mpmd"}).pipeline
    one = autopar.plan(step, state, batch, mesh=MESH_B, hardware="h100",
                       pipeline={"microbatches": 16, "schedule": "1f1b"}).pipeline
    assert zb.schedule == "zb_h1", zb.why
    assert one.runtime == "mpmd"
    assert zb.step_time_s < one.step_time_s and zb.bubble_fraction < one.bubble_fraction
    assert max(zb.stage_memory_bytes) > max(one.stage_memory_bytes)
    budget = (max(zb.stage_memory_bytes) + max(one.stage_memory_bytes)) / 2
    lean = autopar.plan(step, state, batch, mesh=MESH_B, hardware="h100", memory_budget=budget,
                        pipeline={"microbatches": 16, "runtime": "mpmd"}).pipeline
    assert lean.schedule != "zb_h1" and max(lean.stage_memory_bytes) <= budget


def _h100_plan(vocab: int, **pins):
    cfg = gpt.GPTConfig(vocab=vocab, seq=1024, d_model=2048, heads=16, d_ff=8192, layers=8,
                        scan=True)
    step, init = PM.gpt_train_step(cfg, LR)
    state = jax.eval_shape(lambda: init(jax.random.PRNGKey(0), 32))
    batch = jax.eval_shape(lambda: gpt.make_batch(cfg, 32))
    return autopar.plan(step, state, batch, mesh=MESH_B, hardware="h100",
                        pipeline={"microbatches": 16, **pins}).pipeline


def test_planner_picks_zb_v_where_it_is_predicted_faster():
    """Searched on the MPMD runtime over four H100 stages, ZB-V is offered beside the others.
    With a head of 8000 words it is chosen: half ZB-H1's bubble, the step faster. With 32000
    the V's stage 0, which runs both the embedding and the head, is the slowest stage, and
    ZB-H1 (the head on the last stage) stays ahead: the search weighs it, not a rule."""
    small = _h100_plan(8000, runtime="mpmd")
    h1 = _h100_plan(8000, schedule="zb_h1")
    assert (small.schedule, small.virtual_stages) == ("zb_v", 2), small.why
    assert small.step_time_s < h1.step_time_s and small.bubble_fraction < h1.bubble_fraction
    big = _h100_plan(32000, runtime="mpmd")
    assert big.schedule == "zb_h1" and "zb_v V=2" in big.why, big.why
    v = _h100_plan(32000, schedule="zb_v")
    assert v.stage_time_s[0] == max(v.stage_time_s) > big.stage_time_s[0]


def test_unsplittable_layers_leave_zb_out():
    """A layer whose backward the split cannot trace gives no split costs, and the split
    schedules are then not run on either runtime."""
    costs = PL.Costs(layer_f=1.0, layer_b=2.0, embed_f=0, embed_b=0, head_f=0, head_b=0,
                     layer_peak_bytes=0, act_bytes=1.0, solve_s=0)
    sch = S.build("zb_h1", 2, 1, 4)
    assert not PL.runs_on("mpmd", sch, 4, costs) and not PL.runs_on("lockstep", sch, 4, costs)
    assert PL.runs_on("mpmd", sch, 4, dataclasses.replace(costs, weight_fraction=0.3))
    assert PL.layer_halves(PM.gpt_staged(CFG), {"bad": jnp.zeros(3)}, jnp.zeros((2, 8, 32))) \
        is None
