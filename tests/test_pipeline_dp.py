"""The layer-range DP (autopar.pipeline.dp) against brute force and closed forms."""
import dataclasses

import numpy as np
import pytest

from autopar.pipeline import dp


def _additive(layer_s, embed_s=0.0, head_s=0.0, layers=8):
    return lambda i, j: (j - i) * layer_s + embed_s * (i == 0) + head_s * (j == layers)


@pytest.mark.parametrize("seed", range(6))
def test_dp_equals_brute_force_on_random_instances(seed):
    # Non-additive stage times (a random matrix) and per-stage memory: the DP must still find the
    # least F, as Alpa's cap enumeration is exact for any t(i, j).
    rng = np.random.default_rng(seed)
    layers, stages, m = 7, 3, int(rng.integers(1, 9))
    t = rng.uniform(0.5, 3.0, (layers + 1, layers + 1))
    mem = rng.uniform(0.0, 10.0, (stages, layers + 1, layers + 1))
    hops = tuple(rng.uniform(0, 0.2, stages - 1))
    p = dp.build(layers, stages, m, lambda i, j: t[i, j], lambda k, i, j: mem[k, i, j],
                 budget=7.0, hop_s=hops)
    got, want = dp.solve(p), dp.brute_force(p)
    assert (got is None) == (want is None)
    if want is not None:
        assert got.objective_s == pytest.approx(want.objective_s, rel=1e-12)
        assert max(got.memory_bytes) <= 7.0
        assert got.objective_s == pytest.approx(dp.objective(p, got.ranges))


@pytest.mark.parametrize("layers,stages,m", [(8, 4, 8), (12, 3, 4), (96, 8, 32)])
def test_uniform_layers_give_balanced_ranges(layers, stages, m):
    # Closed form: F = (S + M - 1) L / S t_layer, each stage L / S consecutive layers.
    p = dp.build(layers, stages, m, _additive(1.0, layers=layers), lambda k, i, j: 0 * j)
    s = dp.solve(p)
    n = layers // stages
    assert s.ranges == tuple((k * n, (k + 1) * n) for k in range(stages))
    assert s.objective_s == pytest.approx((stages + m - 1) * n)


def test_a_costly_head_moves_layers_off_the_last_stage():
    # 6 layers of 1 s, a head of 2 s on the last stage: 4 + 4 beats 3 + 5.
    p = dp.build(6, 2, 4, _additive(1.0, head_s=2.0, layers=6), lambda k, i, j: 0 * j)
    s = dp.solve(p)
    assert s.ranges == ((0, 4), (4, 6)) and s.stage_s == (4.0, 4.0)
    assert s.objective_s == pytest.approx(8 + 3 * 4)


def test_memory_budget_binds_on_the_stage_holding_most_in_flight():
    # 1F1B: stage k holds S - k microbatches' activations (1 byte per layer each): with a budget
    # of 8 bytes stage 0 (4 in flight) takes at most 2 layers, though balance wants 3.
    layers, stages = 12, 4
    p = dp.build(layers, stages, 8, _additive(1.0, layers=layers),
                 lambda k, i, j: (stages - k) * (j - i), budget=8.0)
    s = dp.solve(p)
    assert s.ranges[0][1] - s.ranges[0][0] <= 2 and s.memory_bytes[0] <= 8.0
    assert s.objective_s == pytest.approx(dp.brute_force(p).objective_s)
    tight = dp.build(layers, stages, 8, _additive(1.0, layers=layers),
                     lambda k, i, j: (stages - k) * (j - i), budget=3.0)
    assert dp.solve(tight) is None and dp.brute_force(tight) is None


def test_allowed_ranges_restrict_the_search():
    # Only equal chunks run: the DP returns them even when unequal ones would be faster.
    layers = 8
    p = dp.build(layers, 2, 4, _additive(1.0, head_s=2.0, layers=layers), lambda k, i, j: 0.0,
                 allowed=dp.equal_lengths(layers, 2))
    assert dp.solve(p).ranges == ((0, 4), (4, 8))
    free = dp.build(layers, 2, 4, _additive(1.0, head_s=2.0, layers=layers), lambda k, i, j: 0 * j)
    assert dp.solve(free).ranges == ((0, 5), (5, 8))
    assert dp.solve(free).objective_s < dp.solve(p).objective_s
    assert dp.solve(dp.build(7, 2, 4, _additive(1.0, layers=7), lambda k, i, j: 0.0,
                             allowed=dp.equal_lengths(7, 2))) is None


def test_hops_add_once():
    p = dp.build(4, 2, 3, _additive(1.0, layers=4), lambda k, i, j: 0.0, hop_s=(0.5,))
    assert dp.solve(p).objective_s == pytest.approx(2 + 2 + 0.5 + 2 * 2)


# ---- the DP inside the pipeline planner -------------------------------------------------------
def _gpt(layers):
    import dataclasses

    import jax

    from autopar.models import gpt
    from autopar.pipeline import model as PM

    cfg = gpt.GPTConfig(vocab=64, seq=8, d_model=32, heads=4, d_ff=64, layers=layers, scan=True)
    step, init = PM.gpt_train_step(dataclasses.replace(cfg))
    return PM.staged_model_of(step), jax.eval_shape(lambda: init(jax.random.PRNGKey(0), 8))


def test_boundaries_pay_the_link_they_cross():
    import dataclasses

    import cost_models
    from autopar.pipeline import planning as PL

    hw = dataclasses.replace(cost_models.hardware("h100"), devices_per_node=4)
    hops = PL.boundary_hops_s({"stage": 4, "data": 2}, "stage", hw, 2**20)
    # Stages 0-1 share node 0 and 2-3 node 1: only the middle boundary crosses nodes.
    assert hops[1] > hops[0] == hops[2] > 0


def test_layer_split_in_the_planner():
    import cost_models
    from autopar.pipeline import planning as PL
    from autopar.pipeline import search

    model, state = _gpt(8)
    # The head costs two layers: the unrestricted DP gives the last stage fewer layers, and
    # the schedule's own lockstep timeline agrees that it is faster; equal=True keeps equal chunks.
    # Each stage on devices of its own (the cpu profile's pool off): on the shared host a tick
    # lasts its stages' summed work however the layers are split, and balancing gains nothing.
    costs = PL.Costs(layer_f=1.0, layer_b=2.0, embed_f=0, embed_b=0, head_f=2.0, head_b=4.0,
                     layer_peak_bytes=0, act_bytes=1.0, solve_s=0)
    hw = dataclasses.replace(cost_models.hardware("cpu"), shared_compute_devices=1)
    sizes = {"stage": 2, "data": 4}
    run = PL.layer_split(model, state["params"], costs, sizes, "stage", hw, "gpipe", 8, 1e12)
    free = PL.layer_split(model, state["params"], costs, sizes, "stage", hw, "gpipe", 8, 1e12,
                          equal=False)
    assert run.ranges == PL.equal_ranges(8, 2) and free.ranges == ((0, 5), (5, 8))
    equal = PL.price(model, state["params"], costs, sizes, "stage", hw, "gpipe", 1, 8)
    moved = PL.price(model, state["params"], costs, sizes, "stage", hw, "gpipe", 1, 8,
                     free.ranges)
    assert moved.step_time_s < equal.step_time_s and moved.layer_ranges == ((0, 5), (5, 8))
    assert moved.stage_memory_bytes[0] > moved.stage_memory_bytes[1]
    choice = search.evaluate(model, state["params"], costs, sizes, hw, 1e12, "gpipe", 1, 8,
                             runtimes=("lockstep",))
    assert choice.plan == equal and choice.unequal == moved
    # with both runtimes the equal chunks' plan is the faster of the two (unequal: lockstep)
    both = search.evaluate(model, state["params"], costs, sizes, hw, 1e12, "gpipe", 1, 8)
    async_ = PL.price(model, state["params"], costs, sizes, "stage", hw, "gpipe", 1, 8,
                      runtime="mpmd")
    assert both.plan == min((equal, async_), key=lambda c: c.step_time_s)
    assert both.unequal == moved


def test_search_meshes_cover_the_devices():
    from autopar.pipeline import search

    shapes = search.meshes(256, 48, 8, tensor=(4, 8))
    assert shapes and all(s["stage"] * s["data"] * s["model"] == 256 for s in shapes)
    assert {s["model"] for s in shapes} == {4, 8} and min(s["stage"] for s in shapes) == 2
    assert max(s["stage"] for s in shapes) <= 48
    assert search.microbatch_counts(64, {"stage": 4, "data": 4}, (1, 2, 4)) == [16, 8, 4]


def test_layers_that_do_not_split_equally_get_the_dps_split():
    import cost_models
    from autopar.pipeline import planning as PL
    from autopar.pipeline import search

    model, state = _gpt(7)
    costs = PL.Costs(layer_f=1.0, layer_b=2.0, embed_f=0, embed_b=0, head_f=0, head_b=0,
                     layer_peak_bytes=0, act_bytes=1.0, solve_s=0)
    hw, sizes = cost_models.hardware("cpu"), {"stage": 2, "data": 4}
    c = search.evaluate(model, state["params"], costs, sizes, hw, 1e12, "gpipe", 1, 4)
    assert c.plan is None and sorted(b - a for a, b in c.unequal.layer_ranges) == [3, 4]
    assert search.best([c], 1e12) is None and search.best([c], 1e12, key=lambda x: x.unequal)
