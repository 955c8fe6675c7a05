"""The layer-range DP (autopar.pipeline.dp) against brute force and closed forms."""
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
