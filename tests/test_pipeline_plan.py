"""autopar.plan(..., pipeline=...): the record, its JSON, the search, the errors, and the run."""
import dataclasses
import functools
import json
import operator

import jax
import numpy as np
import pytest
from numerics import assert_params, assert_scaled

import autopar
import cost_models
import ir
from autopar import hlo
from autopar.errors import AutoparError, PlanError
from autopar.models import gpt
from autopar.pipeline import model as PM
from autopar.pipeline import planning as PL
from autopar.pipeline import schedules as S

CFG = gpt.GPTConfig(vocab=64, seq=8, d_model=32, heads=4, d_ff=64, layers=4, scan=True)
MESH = {"stage": 2, "data": 2, "model": 2}


@pytest.fixture(scope="module")
def gpt_step():
    step, init = PM.gpt_train_step(CFG)
    return step, init(jax.random.PRNGKey(0), 8), gpt.make_batch(CFG, 8)


@pytest.fixture(scope="module")
def pinned(gpt_step):
    step, state, batch = gpt_step
    return autopar.plan(step, state, batch, mesh={"stage": 4, "data": 2}, hardware="cpu",
                        pipeline={"schedule": "1f1b", "microbatches": 4, "virtual_stages": 1})


def test_pinned_plan_records_the_pipeline(pinned):
    pp = pinned.pipeline
    assert (pp.axis, pp.stages, pp.microbatches, pp.schedule, pp.virtual_stages) == (
        "stage", 4, 4, "1f1b", 1)
    assert pp.layer_ranges == ((0, 1), (1, 2), (2, 3), (3, 4))
    assert pp.in_flight == (4, 3, 2, 1)
    assert len(pp.stage_time_s) == len(pp.stage_memory_bytes) == 4
    assert 0 < pp.bubble_fraction < 1 and pp.step_time_s > max(pp.stage_time_s)
    assert pinned.strategy == "pipeline" and "1f1b" in pinned.summary()
    assert pinned.spec_of("params']['layers']['mlp']['fc1']['kernel")[0] == "stage"


def test_pipeline_plan_json_round_trip(pinned):
    back = autopar.Plan.from_json(pinned.to_json())
    assert back.pipeline == pinned.pipeline
    d = json.loads(pinned.to_json())
    d["pipeline"]["axis"] = "pipe"
    with pytest.raises(PlanError, match="pipeline.axis 'pipe'"):
        autopar.Plan.from_json(json.dumps(d))
    with pytest.raises(AutoparError, match="declares its layers"):
        autopar.autoparallel(lambda s, b: s, mesh={"stage": 4, "data": 2}, plan=back)(1, 2)
    d = json.loads(pinned.to_json())
    d["pipeline"]["stage_time_s"] = [1.0]
    with pytest.raises(PlanError, match=r"pipeline.stage_time_s has 1 entries where 4 were"):
        autopar.Plan.from_json(json.dumps(d))
    d = json.loads(pinned.to_json())
    d["pipeline"]["bubble_fraction"] = float("inf")      # json writes Infinity and reads it back
    with pytest.raises(PlanError, match="pipeline.bubble_fraction must be a finite number"):
        autopar.Plan.from_json(json.dumps(d))


def test_autoparallel_runs_a_pipelined_plan(gpt_step, pinned):
    """``@autoparallel(pipeline=...)`` plans once per signature and runs the pipelined step; a
    saved pipelined plan runs through ``plan=`` alike (``planning.executable``). Both equal the
    unsharded step; the stacked layers live on their stages."""
    step, state, batch = gpt_step
    ref_state, ref_loss = jax.jit(step)(state, batch)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("stage", "data"))
    auto = autopar.autoparallel(step, mesh=mesh, hardware="cpu",
                                pipeline={"schedule": "1f1b", "microbatches": 4})
    saved = autopar.autoparallel(step, mesh=mesh, plan=autopar.Plan.from_json(pinned.to_json()))
    for run in (auto, saved):
        new, loss = run(state, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
        _same_update(new, ref_state)
        assert run.plan.pipeline.schedule == "1f1b" and run.plan.pipeline.stages == 4
        layout = new["params"]["layers"]["attn"]["qkv"]["kernel"].sharding.spec
        assert tuple(layout)[:1] == ("stage",)
    first = auto.plan
    auto(state, batch)
    assert auto.plan is first          # same signature: planned once


def test_a_stage_places_the_parameter_layouts_its_costs_priced(gpt_step):
    """With a tensor axis, the ILP's parameter layouts inside a stage are recorded in
    ``plan.pipeline``, are the plan's input layouts (parameters and Adam moments) and what the
    pipelined step places, not the model's Megatron ``tensor_dims``; the predicted stage peak
    is XLA's within 10% and the run equals the unsharded step."""
    step, state, batch = gpt_step
    plan = autopar.plan(step, state, batch, mesh=MESH, hardware="cpu",       # one program
                        pipeline={"schedule": "1f1b", "microbatches": 2, "runtime": "lockstep"})
    pp = plan.pipeline
    assert {p for p, _ in pp.layer_layouts} == {
        "/".join(k.key for k in path) for path, _ in
        jax.tree_util.tree_leaves_with_path(state["params"]["layers"])}
    sm = PM.staged_model_of(step)

    def megatron(name, layout):
        d = PM.tensor_dim(sm.tensor_dims, name.split("/"))
        return tuple(("model",) if k == d else () for k in range(len(layout)))

    # at this width the ILP keeps the 32-wide layer's kernels whole, where Megatron splits them
    differ = [(n, v) for n, v in pp.layer_layouts if v != megatron(n, v)]
    assert differ, pp.layer_layouts
    layouts = dict(zip(plan.input_paths, plan.input_shardings))
    for name, layout in pp.layer_layouts:      # the stacked layers: stage axis, then the layout
        keys = "".join(f"['{k}']" for k in name.split("/"))
        for tree in ("['params']", "['opt_state'][0].mu"):
            assert layouts[f"[0]{tree}['layers']{keys}"] == (("stage",), *layout)

    ref_state, ref_loss = jax.jit(step)(state, batch)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), tuple(MESH))
    run = PL.executable(plan, step, mesh)          # what autoparallel(plan=plan) runs
    st, bt = run.in_shardings_of(state, batch)
    placed = jax.device_put(state, st), jax.device_put(batch, bt)
    compiled = run.jitted(*placed).lower(*placed).compile()
    new, loss = compiled(*placed)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    _same_update(new, ref_state)
    # a plan written before the layouts were recorded runs the Megatron layouts it ran then
    written = json.loads(plan.to_json())
    del written["pipeline"]["layer_layouts"], written["pipeline"]["rest_layouts"]
    old = autopar.Plan.from_json(json.dumps(written))
    megatron_placed = PL.executable(old, step, mesh).in_shardings_of(state, batch)[0]
    for name, layout in differ:
        leaf = functools.reduce(operator.getitem, ["params", "layers", *name.split("/")],
                                megatron_placed)
        spec = tuple(leaf.spec) + (None,) * (1 + len(layout) - len(tuple(leaf.spec)))
        assert spec == ("stage", *("model" if d else None for d in megatron(name, layout)))
    for name, layout in differ:
        leaf = functools.reduce(operator.getitem, ["layers", *name.split("/")], new["params"])
        spec = tuple(leaf.sharding.spec)
        assert spec + (None,) * (1 + len(layout) - len(spec)) == (
            "stage", *(d[0] if d else None for d in layout)), name
    # the predicted peak of a stage, in these layouts, against XLA's (0.955 here; 1.028 for a
    # 128-wide model of 4 layers, where the ILP splits the layers Megatron-style)
    measured = hlo.memory(compiled)["peak"]
    assert abs(max(pp.stage_memory_bytes) / measured - 1) <= 0.10


def test_pinned_sub_plans_take_the_given_parameter_layouts(gpt_step):
    """``ArgLayouts`` pins a sub-plan's parameters and leaves its activations to the ILP: the
    forward action's plan takes the layouts the backward's plan chose."""
    step, state, batch = gpt_step
    sm = PM.staged_model_of(step)
    layers, rest = sm.split(state["params"])
    layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), layers)
    x = jax.ShapeDtypeStruct((2, CFG.seq, CFG.d_model), np.float32)
    want = tuple((p, (("model",), ()) if p == "mlp/fc1/kernel" else tuple(() for _ in v))
                 for p, v in PL.arg_layouts(PL._sub_plan(sm.layer, (layer, x), {"model": 2},
                                                         "cpu", 2.0)))
    got = PL._sub_plan(sm.layer, (layer, x), {"model": 2}, "cpu", 2.0,
                       strategy=PL.ArgLayouts(want))
    assert PL.arg_layouts(got) == want


def test_stage_sub_plans_feed_nothing_from_the_host():
    """A stage's parameters are the runtime's state and its activations come from the previous
    stage, so no sub-plan pays the host link for them: a layer's forward is priced below its
    backward, which recomputes it (fed from the host, GPT-76B's forward layer cost 11.2 ms
    against its backward's 3.1). A plain plan of the same forward still pays for its inputs."""
    from autopar.api import plan_graph
    from autopar.planner.problem import HOST_LINK_BYTES_PER_S

    cfg = gpt.GPTConfig(vocab=50304, seq=1024, d_model=4096, heads=32, d_ff=16384, layers=2,
                        scan=True)
    step, init = PM.gpt_train_step(cfg)
    sm = PM.staged_model_of(step)
    params = jax.eval_shape(lambda: init(jax.random.PRNGKey(0), 1))["params"]
    batch = jax.eval_shape(lambda: gpt.make_batch(cfg, 2))
    costs = PL.stage_costs(sm, params, batch, 1, {"stage": 2, "model": 8}, "stage", "h100", 2.0)
    assert costs.layer_f < costs.layer_b / 2 and costs.head_f < costs.head_b
    layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params["layers"])
    x = jax.ShapeDtypeStruct((1, cfg.seq, cfg.d_model), np.float32)
    graph = ir.trace(sm.layer, layer, x)
    pin = PL.ArgLayouts(costs.layer_layouts)
    fed, resident = (plan_graph(graph, {"model": 8}, hardware="h100", strategy=pin,
                                deterministic=True, time_limit_s=2.0, host_inputs=h)
                     for h in (True, False))
    per_device = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((layer, x))) / 8
    feed_s = fed.cost.comm_s - resident.cost.comm_s
    assert per_device / HOST_LINK_BYTES_PER_S <= feed_s <= 2 * per_device / HOST_LINK_BYTES_PER_S


def _same_update(new, ref) -> None:
    """Adam's first moment is 0.1 x the gradient: the gradients agree to rounding, relative to
    each leaf's scale (elementwise, a near-zero element summed in another order was 6.4e-5 off
    relative: a fresh clone's CI failed on it). The parameters agree to a fraction of lr where
    the gradient stands clear of rounding noise (``numerics``)."""
    assert_scaled(new["opt_state"][0].mu, ref["opt_state"][0].mu, rel=1e-5)
    assert_params(new["params"], ref["params"], 1e-3, grads=ref["opt_state"][0].mu)


def test_auto_picks_the_fastest_that_fits(gpt_step):
    step, state, batch = gpt_step
    plan = autopar.plan(step, state, batch, mesh=MESH, hardware="cpu", pipeline="auto")
    pp = plan.pipeline
    assert pp.why.startswith("chose ") and "\n  vs " in pp.why
    sm = PM.staged_model_of(step)
    hw = cost_models.hardware("cpu")
    pins = PL.parse("auto", MESH, sm, 8)
    costs = {}
    cands = PL.candidates(pins, sm, 8, MESH)
    limit_s = PL.sub_plan_limit_s(30.0, cands)          # what autopar.plan's default gives
    for name, v, m in cands:
        if m not in costs:
            costs[m] = PL.stage_costs(sm, state["params"], batch, 8 // m, MESH, "stage", hw,
                                      limit_s)
        other = PL.price(sm, state["params"], costs[m], MESH, "stage", hw, name, v, m,
                         runtime="mpmd" if name in S.SPLIT else "lockstep")
        assert pp.step_time_s <= other.step_time_s + 1e-12
    # A budget nothing fits: the leanest choice, and the plan says so.
    lean = autopar.plan(step, state, batch, mesh=MESH, hardware="cpu", memory_budget=1,
                        pipeline={"microbatches": 4})
    assert "nothing fits" in lean.pipeline.why


def test_price_follows_the_schedule():
    costs = PL.Costs(layer_f=1.0, layer_b=2.0, embed_f=0, embed_b=0, head_f=0, head_b=0,
                     layer_peak_bytes=0, act_bytes=1.0, solve_s=0)
    sm = PM.gpt_staged(dataclasses.replace(CFG, layers=8))
    params = jax.eval_shape(lambda: PM.gpt_train_step(dataclasses.replace(CFG, layers=8))[1](
        jax.random.PRNGKey(0), 8))["params"]
    # each stage its own device, as the textbook bubble assumes (not the cpu profile's pool)
    hw = dataclasses.replace(cost_models.hardware("cpu"), collective_launch_s=0.0,
                             shared_compute_devices=1)
    sizes = {"stage": 4, "data": 2}
    gp = PL.price(sm, params, costs, sizes, "stage", hw, "gpipe", 1, 8)
    ob = PL.price(sm, params, costs, sizes, "stage", hw, "1f1b", 1, 8)
    il = PL.price(sm, params, costs, sizes, "stage", hw, "1f1b", 2, 8)
    assert gp.bubble_fraction > il.bubble_fraction
    assert gp.bubble_fraction == pytest.approx(3 / 11, rel=0.05)   # hops are nearly free
    assert max(ob.stage_memory_bytes) < max(gp.stage_memory_bytes)
    assert ob.in_flight == S.in_flight(S.build("1f1b", 4, 1, 8))


def _one_ms_layers():
    """(costs, staged model, abstract params, cpu profile, sizes): CFG's GPT on {stage: 2,
    data: 4} with layers of 1 ms forward and 2 ms backward and free ends, each stage on
    devices of its own (the profile's pool off: a tick lasts its slowest stage's work)."""
    costs = PL.Costs(layer_f=1e-3, layer_b=2e-3, embed_f=0, embed_b=0, head_f=0, head_b=0,
                     layer_peak_bytes=0, act_bytes=1e4, solve_s=0)
    sm = PM.gpt_staged(CFG)
    params = jax.eval_shape(lambda: PM.gpt_train_step(CFG)[1](jax.random.PRNGKey(0), 8))[
        "params"]
    hw = dataclasses.replace(cost_models.hardware("cpu"), shared_compute_devices=1)
    return costs, sm, params, hw, {"stage": 2, "data": 4}


def test_price_holds_the_runtime_tick_overhead():
    """The profile's ``pipeline_tick_s`` is paid once per tick of the schedule, on top of the
    carry copies and permute bytes ``tick_overhead_s`` prices; it raises the bubble."""
    costs, sm, params, hw, sizes = _one_ms_layers()
    free = PL.price(sm, params, costs, sizes, "stage",
                    dataclasses.replace(hw, pipeline_tick_s=0.0), "gpipe", 1, 4)
    paid = PL.price(sm, params, costs, sizes, "stage",
                    dataclasses.replace(hw, pipeline_tick_s=1e-3), "gpipe", 1, 4)
    ticks = len(S.build("gpipe", 2, 1, 4).ticks)
    assert paid.step_time_s - free.step_time_s == pytest.approx(1e-3 * ticks)
    assert paid.bubble_fraction > free.bubble_fraction > 0


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_lockstep_ticks_share_the_cpu_pool(name):
    """On the cpu profile the stages' devices share the host (``compute_pool``: 8 devices, one
    a stage on ``{stage: 4}``, a pool worth 8 stages at the priced speed) and one SPMD program
    runs every action of a tick: a tick with ``k`` busy stages lasts their summed work over the
    pool, not the slowest one's time, plus the runtime's overhead per tick. With the pool
    switched off (``shared_compute_devices=1``) it lasts the slowest one's, as on a GPU."""
    costs, sm, params, own_hw, _ = _one_ms_layers()
    hw = cost_models.hardware("cpu")
    sizes, sch = {"stage": 4}, S.build(name, 4, 1, 8)
    assert PL.compute_pool(hw, sizes, "stage") == 8
    ranges = PL.equal_ranges(sm.num_layers, 4)

    def duration(a):
        return 1e-3 if a.kind == "F" else 2e-3

    def loop(hw_):
        return PL.loop_timeline(sm, params, sizes, "stage", hw_, sch, ranges, duration,
                                costs.act_bytes)

    shared, own = loop(hw), loop(own_hw)
    over = shared.overhead_s / len(sch.ticks)
    assert own.overhead_s == pytest.approx(shared.overhead_s)
    for row, tick, alone in zip(sch.ticks, shared.tick_s, own.tick_s):
        work = [sum(map(duration, acts)) for acts in row]
        assert tick == pytest.approx(sum(work) / 8 + over)
        assert alone == pytest.approx(max(work) + over)
    assert any(sum(1 for acts in row if acts) > 1 for row in sch.ticks)
    assert shared.makespan_s - shared.overhead_s == pytest.approx(
        sum(map(duration, (a for row in sch.ticks for acts in row for a in acts))) / 8)


@pytest.mark.parametrize("profile", ["a100", "h100", "h200"])
def test_gpu_profiles_price_the_tick_loop_without_a_pool(profile, monkeypatch):
    """A GPU's devices compute on their own: no pool, a tick its slowest stage's work plus the
    overhead, and every lockstep and MPMD plan bit for bit what it is with the pool switched
    off (``compute_pool`` returning None)."""
    costs, sm, params, _, sizes = _one_ms_layers()
    hw = cost_models.hardware(profile)
    assert hw.shared_compute_devices == 1 and PL.compute_pool(hw, sizes, "stage") is None
    choices = [("1f1b", 1, "lockstep"), ("gpipe", 1, "lockstep"), ("eager_1f1b", 1, "lockstep"),
               ("1f1b", 2, "lockstep"), ("1f1b", 1, "mpmd"), ("gpipe", 1, "mpmd")]
    got = [PL.price(sm, params, costs, sizes, "stage", hw, name, v, 4, runtime=rt)
           for name, v, rt in choices]
    sch = S.build("1f1b", 2, 1, 4)
    loop = PL.loop_timeline(sm, params, sizes, "stage", hw, sch, PL.equal_ranges(
        sm.num_layers, 2), lambda a: 1e-3 if a.kind == "F" else 2e-3, costs.act_bytes)
    over = loop.overhead_s / len(sch.ticks)
    for row, tick in zip(sch.ticks, loop.tick_s):
        assert tick == max(sum(1e-3 if a.kind == "F" else 2e-3 for a in acts)
                           for acts in row) + over
    monkeypatch.setattr(PL, "compute_pool", lambda *args: None)
    assert got == [PL.price(sm, params, costs, sizes, "stage", hw, name, v, 4, runtime=rt)
                   for name, v, rt in choices]


def test_price_charges_padded_slots_to_the_shorter_chunks():
    """Unequal ranges run padded to the longest chunk: on a 3 + 1 split over two stages the
    one-layer stage's busy time holds its own layer plus two padded slots per action
    (``padded_slot_s``: passes over a layer's parameters), while an equal split pays none."""
    costs, sm, params, hw, sizes = _one_ms_layers()
    m = 4
    layer_bytes, _ = PL._param_bytes(sm, params, sizes)
    slot = PL.padded_slot_s(hw, layer_bytes)
    assert slot["B"] == pytest.approx(9 * layer_bytes / hw.hbm_bytes_per_s) and slot["F"] > 0
    n = sm.num_layers
    split = ((0, n - 1), (n - 1, n))
    uneq = PL.price(sm, params, costs, sizes, "stage", hw, "1f1b", 1, m, split)
    pads = n - 2                  # the short chunk's padded slots
    assert uneq.stage_time_s[1] == pytest.approx(
        m * (1e-3 + 2e-3 + pads * (slot["F"] + slot["B"])))
    assert uneq.stage_time_s[0] == pytest.approx(m * (n - 1) * 3e-3)
    even = PL.price(sm, params, costs, sizes, "stage", hw, "1f1b", 1, m)
    assert even.stage_time_s == pytest.approx((m * n / 2 * 3e-3,) * 2)


@pytest.mark.parametrize("pipeline,fix", [
    ({"axis": "pipe"}, "not an axis of the mesh"),
    ({"stages": 3}, "use stages=2"),
    ({"microbatches": 3}, "microbatches dividing"),
    ({"virtual_stages": 3}, "divides 4"),
    ({"schedule": "zigzag"}, "use one of"),
    ({"chunks": 2}, "unknown keys"),
    ({"layer_ranges": "greedy"}, "must be one of"),
    ("fast", "must be 'auto' or a dict"),
])
def test_bad_pipeline_options(gpt_step, pipeline, fix):
    step, state, batch = gpt_step
    with pytest.raises(AutoparError, match=fix):
        autopar.plan(step, state, batch, mesh=MESH, pipeline=pipeline)


def test_a_step_without_layers_cannot_be_pipelined(gpt_step):
    _, state, batch = gpt_step
    plain, _ = gpt.make_train_step(CFG)
    with pytest.raises(AutoparError, match="declares its layers"):
        autopar.plan(plain, state, batch, mesh=MESH, pipeline="auto")
    step, _, _ = gpt_step
    for bad in ({"strategy": "megatron"}, {"donate_argnums": (0,)}):
        with pytest.raises(AutoparError, match="does not combine with"):
            autopar.plan(step, state, batch, mesh=MESH, pipeline="auto", **bad)
    with pytest.raises(AutoparError, match="does not combine with donate_argnums="):
        autopar.autoparallel(step, mesh=MESH, pipeline="auto", donate_argnums=0)


def test_the_search_picks_unequal_ranges_when_they_win():
    """A head as costly as several layers: the layer-range DP's split, which gives the last
    stage fewer layers, is among the candidates, predicts a shorter step than equal chunks and
    is chosen; the chosen plan runs padded and equals the unsharded step. Each stage prices its
    devices as its own (the cpu profile's pool off): on the shared host a tick lasts its
    stages' summed work however the layers are split, so balancing them gains nothing."""
    cfg = dataclasses.replace(CFG, vocab=4096)
    hw = dataclasses.replace(cost_models.hardware("cpu"), shared_compute_devices=1)
    step, init = PM.gpt_train_step(cfg)
    state, batch = init(jax.random.PRNGKey(0), 8), gpt.make_batch(cfg, 8)
    # the lockstep runtime: it runs unequal chunks (padded), the MPMD runtime equal ones only
    pins = {"schedule": "gpipe", "microbatches": 2, "virtual_stages": 1, "runtime": "lockstep"}
    plan = autopar.plan(step, state, batch, mesh={"stage": 2}, hardware=hw, pipeline=pins)
    pp = plan.pipeline
    assert pp.layer_ranges == ((0, 3), (3, 4)), pp.why
    assert "layers 2+2" in pp.why                # the equal chunks were priced and lost
    sm = PM.staged_model_of(step)
    costs = PL.stage_costs(sm, state["params"], batch, 4, {"stage": 2}, "stage", hw,
                           PL.sub_plan_limit_s(30.0, [("gpipe", 1, 2)]))
    equal = PL.price(sm, state["params"], costs, {"stage": 2}, "stage", hw, "gpipe", 1, 2)
    assert pp.step_time_s < equal.step_time_s
    ref_state, ref_loss = jax.jit(step)(state, batch)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("stage",))
    new, loss = autopar.autoparallel(step, mesh=mesh, plan=plan)(state, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(new["params"]), jax.tree.leaves(ref_state["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=5e-5)
